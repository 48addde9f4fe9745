"""lm-eval-harness tasks inside training (`train.harness.tasks`): recorded at the set steps as eval/<task>/<metric>, equal to
`lm eval --subset` on the checkpoint of the same step."""
import json

import pytest

from lm import cli
from lm.jobs.evals.run import Request, run, subset_indices
from lm.train.logging import read_metrics
from tests.jobs.evals import releases

TINY = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=64', 'train.global_batch=8',
        'train.eval_batches=1', 'optim.warmup_steps=1']


def test_a_subset_is_fixed_sorted_and_whole_when_large():
  first, again = subset_indices(100, 7), subset_indices(100, 7)
  assert first == again == sorted(set(first)) and len(first) == 7 and all(0 <= i < 100 for i in first)
  assert subset_indices(5, 7) == [0, 1, 2, 3, 4]


@pytest.mark.long(1.5)
def test_in_loop_records_equal_lm_eval_on_the_same_checkpoint(tmp_path, capsys):
  data = tmp_path / 'data'
  releases.write_both(data, tmp_path / 'hub_layout')
  run_dir = tmp_path / 'run'
  assert cli.main(['train', '--config', 'gpt_tiny', f'train.run_dir={run_dir}', 'train.steps=4', *TINY,
                   'train.eval_every=4', 'train.checkpoint.every=2', 'train.checkpoint.keep=3',
                   'train.harness.tasks=piqa,lambada_openai', 'train.harness.every=2', 'train.harness.limit=6',
                   f'train.harness.data_dir={data}']) == 0
  assert 'piqa/acc ' in capsys.readouterr().out  # the console shows them
  records = {r['step']: r for r in read_metrics(run_dir) if any(k.startswith('eval/') for k in r)}
  assert sorted(records) == [2, 4]
  for step, record in records.items():
    run(run_dir, Request(tasks=('piqa', 'lambada_openai'), data_dir=data, subset=6), step=step,
        out=tmp_path / f'out{step}')
    summary = json.loads((tmp_path / f'out{step}' / 'results.json').read_text())
    assert {t: s['n'] for t, s in summary['tasks'].items()} == {'piqa': 6, 'lambada_openai': 6}
    expected = {f'eval/{task}/{name}': value for task, s in summary['tasks'].items()
                for name, value in [*s['metrics'].items(), ('task_loss', s['task_loss'])]}
    assert set(expected) == {k for k in record if k.startswith('eval/')}
    assert {'eval/piqa/acc', 'eval/piqa/task_loss', 'eval/lambada_openai/perplexity'} <= set(expected)
    for key, value in expected.items():
      assert record[key] == pytest.approx(value, rel=1e-6), key


def test_an_unknown_task_stops_training_before_anything_is_written(tmp_path, capsys):
  run_dir = tmp_path / 'run'
  assert cli.main(['train', '--config', 'gpt_tiny', f'train.run_dir={run_dir}', 'train.steps=1', *TINY,
                   'train.harness.tasks=piqaa']) == 2
  err = capsys.readouterr().err.strip()
  assert "no task 'piqaa'" in err and len(err.splitlines()) == 1, err
  assert not run_dir.exists()
