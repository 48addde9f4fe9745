"""`lm eval --source tfds`: harness tasks read from prepared TFDS datasets. The datasets are prepared here by TFDS's
own builders (their download replaced by the release files tests/jobs/evals/releases.py writes), so a task scores
exactly as from the release files (each checked against the harness's HF backend in test_harness.py)."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds

from lm import cli
from lm.jobs.evals.run import Request, run
from tests.jobs.evals.test_harness import setup  # noqa: F401  (the module fixture: HF GPT-2, run dir, release files)

TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'winogrande', 'boolq', 'hellaswag')


def prepare(name: str, downloaded, data_dir) -> None:
  """TFDS's builder for `name`, its download and extraction answered with `downloaded`, as ArrayRecord. (Two
  builders are TFDS's legacy ones, registered when imported; SuperGLUE's names TensorFlow's int32 for `idx`, here
  NumPy's, as TensorFlow is not installed.)"""
  import tensorflow_datasets.text.hellaswag
  import tensorflow_datasets.text.winogrande  # noqa: F401
  from tensorflow_datasets.text import super_glue
  with mock.patch.object(tfds.download.DownloadManager, 'download_and_extract', lambda self, urls: downloaded), \
       mock.patch.object(super_glue, 'tf', SimpleNamespace(int32=np.int32)):
    tfds.builder(name, data_dir=str(data_dir)).download_and_prepare(file_format='array_record')


def jsonl(path):
  return [json.loads(line) for line in path.read_text(encoding='utf-8').splitlines()]


def write_jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows), encoding='utf-8')


@pytest.fixture(scope='module')
def prepared(setup, tmp_path_factory):  # noqa: F811
  """A TFDS data dir with the six tasks' datasets, built from the release files (each builder's own layout)."""
  _, _, data = setup
  root = tmp_path_factory.mktemp('tfds')
  out, downloads = root / 'tensorflow_datasets', root / 'downloads'
  # HellaSwag's builder also writes a split per source and domain, none of which may be empty: the rows' source ids
  # and domains cycle through all four (fields the harness's prompt does not read).
  hellaswag = {}
  for split, name in (('train', 'train'), ('validation', 'val'), ('test', 'val')):
    hellaswag[split] = str(downloads / 'hellaswag' / f'{split}.jsonl')
    write_jsonl(Path(hellaswag[split]), [
      {**row, 'source_id': ('activitynet~', 'wikihow_')[i % 2] + row['source_id'],
       'split_type': ('indomain', 'zeroshot')[i // 2 % 2]}
      for i, row in enumerate(jsonl(data / 'hellaswag' / f'hellaswag_{name}.jsonl'))])
  prepare('hellaswag', hellaswag, out)
  piqa = downloads / 'piqa' / 'physicaliqa-train-dev'
  for ours, theirs in (('train', 'train'), ('valid', 'dev')):  # PIQA's release rows carry an id too
    write_jsonl(piqa / f'{theirs}.jsonl', [{'id': f'{theirs}{i}', **row}
                                           for i, row in enumerate(jsonl(data / 'piqa' / f'{ours}.jsonl'))])
    shutil.copy(data / 'piqa' / f'{ours}-labels.lst', piqa / f'{theirs}-labels.lst')
  prepare('piqa', str(piqa.parent), out)
  for level in ('Easy', 'Challenge'):
    prepare(f'ai2_arc/ARC-{level}', str(data / 'arc'), out)
  winogrande = downloads / 'winogrande' / 'winogrande_1.1'
  for theirs, ours in (*((f'train_{size}', 'train_xl') for size in ('xs', 's', 'm', 'l', 'xl')), ('dev', 'dev'),
                       ('test', 'dev')):  # the release's rows carry a question id (qID) too
    rows = jsonl(data / 'winogrande' / 'winogrande_1.1' / f'{ours}.jsonl')
    write_jsonl(winogrande / f'{theirs}.jsonl', [{'qID': f'{theirs}{i}', **row} for i, row in enumerate(rows)])
  prepare('winogrande', str(winogrande.parent), out)
  boolq = downloads / 'boolq' / 'BoolQ'  # SuperGLUE's release of BoolQ: idx and label, no title
  for ours, theirs in (('train', 'train'), ('dev', 'val'), ('dev', 'test')):
    rows = jsonl(data / 'boolq' / f'{ours}.jsonl')
    write_jsonl(boolq / f'{theirs}.jsonl', [{'question': r['question'], 'passage': r['passage'], 'idx': i,
                                             'label': r['answer']} for i, r in enumerate(rows)])
  prepare('super_glue/boolq', str(boolq.parent), out)
  return out


@pytest.mark.long(0.5)
def test_tfds_datasets_score_as_the_release_files(setup, prepared, tmp_path):  # noqa: F811
  """Five tasks give the release files' results, prompt for prompt (TFDS stores a split shuffled, so in another
  order: zero-shot, every document). HellaSwag's TFDS rows keep the context only joined: its prompts are the
  harness's own preprocessing of it."""
  _, run_dir, data = setup
  args = {'tasks': TASKS, 'num_fewshot': 0, 'batch_size': 4}
  tfds_results, _ = run(run_dir, Request(data_dir=str(prepared), source='tfds', **args), out=tmp_path / 'tfds')
  files_results, _ = run(run_dir, Request(data_dir=data, **args), out=tmp_path / 'files')
  ours = json.loads((tmp_path / 'tfds' / 'results.json').read_text())
  theirs = json.loads((tmp_path / 'files' / 'results.json').read_text())
  for task in TASKS[:-1]:
    # the same figures, up to the order of their sums
    assert json.loads(json.dumps(ours['tasks'][task]), parse_float=lambda x: round(float(x), 12)) == \
      json.loads(json.dumps(theirs['tasks'][task]), parse_float=lambda x: round(float(x), 12)), task
    scored = [sorted((repr(s['arguments']), repr(s['resps']), repr(s['target'])) for s in r['samples'][task])
              for r in (tfds_results, files_results)]
    assert scored[0] == scored[1], task
  # HellaSwag: the same documents and endings, the query the harness's own preprocessing of TFDS's joined context.
  from lm_eval.tasks.hellaswag.utils import preprocess
  rows = {row['ctx']: row for row in jsonl(data / 'hellaswag' / 'hellaswag_val.jsonl')}
  got = tfds_results['samples']['hellaswag']
  assert sorted(sample['doc']['ctx'] for sample in got) == sorted(rows)
  for sample in got:
    row = rows[sample['doc']['ctx']]
    assert sample['doc']['ctx_a'] == row['ctx'] and sample['doc']['ctx_b'] == ''
    assert sample['arguments'][0][0].endswith(preprocess(f"{row['activity_label']}: {row['ctx']}"))
    assert [a[1] for a in sample['arguments']] == [' ' + preprocess(e) for e in row['endings']]
    assert sample['target'] == row['label']
  assert {p.split('/')[-2] for p in ours['data_files']} == set(TASKS)  # the converted rows, hashed

def test_a_task_tfds_does_not_hold_or_an_unprepared_dataset_is_one_line(setup, tmp_path, capsys):  # noqa: F811
  _, run_dir, _ = setup
  assert cli.main(['eval', '--model', str(run_dir), '--tasks', 'sciq', '--source', 'tfds',
                   '--data-dir', str(tmp_path)]) != 0
  err = capsys.readouterr().err
  assert "no TFDS dataset is known to hold 'sciq'" in err and '--data-dir' in err and err.count('\n') == 1
  assert cli.main(['eval', '--model', str(run_dir), '--tasks', 'piqa', '--source', 'tfds',
                   '--data-dir', str(tmp_path)]) != 0
  err = capsys.readouterr().err
  assert f'TFDS piqa in --data-dir {tmp_path}' in err and 'tfds build piqa --file_format=array_record' in err
  assert err.count('\n') == 1 and not (run_dir / 'eval').exists()
