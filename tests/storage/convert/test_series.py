"""`lm convert --from-hf-series`: three revisions of one random GPT-NeoX, in a folder of revision folders and in a
hub cache, imported as one run whose checkpoints hold each revision's weights; reruns, damage and bad input."""
import csv
import hashlib
import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from lm import cli
from lm.storage.convert.hf import load_hf
from lm.storage.convert.series import parse_revision
from lm.storage.source import ModelSource
from lm.parallel.mesh import one_device_mesh

STEPS = (0, 1000, 2000)


def save_revisions(root, names, vocab=97):
  """The same GPT-NeoX architecture with other weights at each step, as a suite's revisions are."""
  config = transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=64, rotary_pct=0.25)
  for step, name in zip(STEPS, names):
    torch.manual_seed(step)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(root / name, safe_serialization=True)
  return [root / name for name in names]


def hub_cache(folders, root, name='models--EleutherAI--pythia-tiny'):
  """`models--ORG--NAME` as snapshot_download leaves it: refs/<revision> holds a commit, snapshots/<commit>/ links
  each file to blobs/<hash>."""
  cache = root / name
  for folder in folders:
    commit = hashlib.sha1(folder.name.encode()).hexdigest()
    (cache / 'refs').mkdir(parents=True, exist_ok=True)
    (cache / 'refs' / folder.name).write_text(commit)
    snapshot = cache / 'snapshots' / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
      blob = cache / 'blobs' / hashlib.sha256(file.read_bytes()).hexdigest()
      blob.parent.mkdir(exist_ok=True)
      shutil.copy(file, blob)
      (snapshot / file.name).symlink_to(f'../../blobs/{blob.name}')
  (cache / 'refs' / 'main').write_text(hashlib.sha1(folders[-1].name.encode()).hexdigest())  # the hub's alias
  return cache


def loss(model, params, ids):
  logits = model.apply({'params': params}, ids[:, :-1]).astype(np.float32)
  logp = jax.nn.log_softmax(logits)
  return float(-np.take_along_axis(np.asarray(logp), ids[:, 1:, None], -1).mean())


@pytest.mark.parametrize('layout', ['folders', 'hub cache'])
def test_a_series_imports_as_one_run_with_each_revisions_weights(layout, tmp_path, capsys):
  folders = save_revisions(tmp_path / 'suite', [f'step{s}' for s in STEPS])
  src = hub_cache(folders, tmp_path / 'hub') if layout == 'hub cache' else tmp_path / 'suite'
  run = tmp_path / 'run'
  capsys.readouterr()  # transformers' progress bars
  assert cli.main(['convert', '--from-hf-series', str(src), '--to', str(run), '--tokens-per-step', '2048']) == 0
  assert f'{run}: 3 revision(s) converted, 0 already there, 0 skipped' in capsys.readouterr().out
  series = json.loads((run / 'series.json').read_text())
  assert series['steps'] == {str(s): {'revision': f'step{s}', 'tokens': s * 2048} for s in STEPS}
  source = ModelSource(run)
  assert source.steps == STEPS
  ids = np.random.default_rng(0).integers(0, 97, size=(2, 16))
  losses = []
  for step, folder in zip(STEPS, folders):
    model, alone = load_hf(folder)  # the revision imported by itself
    ours = source.params(one_device_mesh(), step)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(ours), alone)
    losses.append(loss(model, ours, ids))
    assert losses[-1] == pytest.approx(loss(model, alone, ids), rel=1e-6)
  assert len(set(losses)) == 3  # three models
  assert cli.main(['convert', '--from-hf-series', str(src), '--to', str(run), '--tokens-per-step', '2048']) == 0
  assert f'{run}: 0 revision(s) converted, 3 already there, 0 skipped' in capsys.readouterr().out


def test_tokens_come_from_olmo_style_names_and_a_new_revision_is_added(tmp_path, capsys):
  names = ['stage1-step0-tokens0B', 'stage1-step1000-tokens4B', 'stage1-step2000-tokens8B']
  folders = save_revisions(tmp_path / 'suite', names)
  later = folders.pop()
  shutil.move(later, tmp_path / 'later')
  run = tmp_path / 'run'
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(run)]) == 0
  shutil.move(tmp_path / 'later', later)  # the suite published another revision
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(run)]) == 0
  out = capsys.readouterr().out
  assert 'converted stage1-step2000-tokens8B: step 2000, 8,000,000,000 tokens' in out
  assert f'{run}: 1 revision(s) converted, 2 already there, 0 skipped' in out
  assert {s: v['tokens'] for s, v in json.loads((run / 'series.json').read_text())['steps'].items()} == \
    {'0': 0, '1000': 4_000_000_000, '2000': 8_000_000_000}
  assert parse_revision('step143000') == (143000, None) and parse_revision('main') is None
  assert parse_revision('stage2-ingredient1-step1000-tokens2.5B') == (1000, 2_500_000_000)


def test_a_damaged_or_pickled_revision_is_one_line_and_the_others_are_imported(tmp_path, capsys):
  folders = save_revisions(tmp_path / 'suite', [f'step{s}' for s in STEPS])
  weights = folders[1] / 'model.safetensors'
  weights.write_bytes(weights.read_bytes()[:1000])  # a download cut short
  (folders[2] / 'model.safetensors').rename(folders[2] / 'pytorch_model.bin')  # an older revision: pickle alone
  run = tmp_path / 'run'
  capsys.readouterr()
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(run),
                   '--tokens-per-step', '2048']) == 2
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 2 and err[0].startswith('skipped step1000: ')
  assert err[1] == ('skipped step2000: it holds only pytorch_model.bin (pickle, which lm never loads); save it '
                    'with save_pretrained(dir, safe_serialization=True)')
  assert ModelSource(run).steps == (0,) and list(json.loads((run / 'series.json').read_text())['steps']) == ['0']


@pytest.mark.parametrize('make, message', [
  (lambda root: root.mkdir(), 'holds no revisions'),
  (lambda root: save_revisions(root, ['step0', 'main']), "revision 'main' in .* names no step"),
  (lambda root: save_revisions(root, ['step0', 'stage2-step0-tokens1B']), 'both name step 0'),
  (lambda root: save_revisions(root, ['step0', 'step1000']), 'pass --tokens-per-step N'),
])
def test_bad_series_input_is_one_line_exit_2_and_writes_nothing(make, message, tmp_path, capsys):
  make(tmp_path / 'suite')
  capsys.readouterr()
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(tmp_path / 'run')]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and __import__('re').search(message, err), err
  assert not (tmp_path / 'run').exists()


def test_a_config_lm_cannot_honour_is_named_and_nothing_is_written(tmp_path, capsys):
  folders = save_revisions(tmp_path / 'suite', ['step0'])
  config = json.loads((folders[0] / 'config.json').read_text())
  (folders[0] / 'config.json').write_text(json.dumps({**config, 'attention_bias': False}))
  capsys.readouterr()
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(tmp_path / 'run'),
                   '--tokens-per-step', '1']) == 2
  assert capsys.readouterr().err == ('skipped step0: config.json attention_bias=False is not supported '
                                     'when converting GPTNeoXForCausalLM (only True)\n')
  assert not (tmp_path / 'run').exists()


def test_collect_evaluates_each_revision_with_the_suites_tokens(tmp_path, capsys):
  """`lm scaling collect --evaluate` over an imported series: a point per trained step (step 0 is none), its tokens
  the series', 6ND with the suite's N, and each held-out bits per byte that of the revision imported alone."""
  from lm.assembly import assemble
  from lm.config import load_config
  from lm.train.held_out import HeldOut
  folders = save_revisions(tmp_path / 'suite', [f'step{s}' for s in STEPS], vocab=264)  # byte-level rows
  run = tmp_path / 'run'
  assert cli.main(['convert', '--from-hf-series', str(tmp_path / 'suite'), '--to', str(run),
                   '--tokens-per-step', '2048']) == 0
  points = tmp_path / 'points.csv'
  assert cli.main(['scaling', 'collect', str(run), '--out', str(points), '--metric', 'bpb', '--evaluate',
                   'train.eval_batches=2', 'data.seq_len=32']) == 0
  rows = list(csv.DictReader(points.open()))
  assert [int(r['step']) for r in rows] == [1000, 2000]
  assembly = assemble(load_config(str(run / 'config.yaml'), ['train.eval_batches=2', 'data.seq_len=32']))
  held_out = HeldOut(assembly)
  for row, folder in zip(rows, folders[1:]):
    tokens, params = int(row['tokens']), int(row['params'])
    assert row['size'] == f'{params / 1e6:.3g}M'  # as suites name their sizes
    assert tokens == int(row['step']) * 2048 and float(row['flops_6nd']) == 6 * params * tokens
    alone = load_hf(folder)[1]
    assert float(row['loss']) == pytest.approx(held_out.evaluate(alone, held_out.validation, 2)['bpb'], rel=1e-6)
