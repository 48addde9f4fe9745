"""`lm scaling collect`: points from run dirs, with sizes, tokens and FLOPs derived by hand, and losses that
re-evaluating the checkpoints reproduces."""
import csv
import json
import sysconfig
from pathlib import Path

import pytest

from lm import cli
from lm.config import load_config
from lm.data.sources import open_documents
from lm.train.logging import read_metrics
from tests.conftest import built_once

WIDTHS = (32, 64)
LAYERS, SEQ, BATCH, VOCAB, MAX_LEN = 2, 32, 8, 264, 256


@pytest.fixture(scope='module')
def runs():
  """Two runs on the embedded corpus, each also evaluating two named sets: `copy`, the validation split's
  documents written to JSONL (so it must match val_loss and val_bpb), and `code`, text files of Python."""
  def build(root):
    split = open_documents(load_config('gpt_tiny').data, 'validation')
    (root / 'copy.jsonl').write_text(''.join(json.dumps({'text': split[i]}) + '\n' for i in range(len(split))))
    (root / 'code').mkdir()
    for name in ('json/decoder.py', 'csv.py'):
      (root / 'code' / name.replace('/', '_')).write_text((Path(sysconfig.get_paths()['stdlib']) / name).read_text())
    evals = f'data.evals=[copy=jsonl:{root}/copy.jsonl, code=text:{root}/code/*.py]'
    for width in WIDTHS:
      assert cli.main(['train', '--config', 'gpt_tiny', f'model.d_model={width}', f'model.num_layers={LAYERS}',
                       'model.num_heads=2', f'data.seq_len={SEQ}', f'train.global_batch={BATCH}', 'train.steps=4',
                       'train.eval_every=2', 'train.checkpoint.every=2', 'train.checkpoint.keep=3',
                       'train.eval_batches=2', 'train.progress=false', f'train.run_dir={root / str(width)}',
                       evals]) == 0
  return built_once('scaling_runs', build)


def read(path):
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


@pytest.mark.long(0.2)
def test_points_carry_hand_derived_sizes_tokens_and_flops(runs, tmp_path):
  out = tmp_path / 'points.csv'
  assert cli.main(['scaling', 'collect', *(str(runs / str(w)) for w in WIDTHS), '--out', str(out)]) == 0
  rows = read(out)
  assert [(r['run'], int(r['step'])) for r in rows] == [(str(runs / str(w)), s) for w in WIDTHS for s in (2, 4)]
  for row in rows:
    d, step = int(row['run'].rsplit('/', 1)[1]), int(row['step'])
    non_embedding = LAYERS * (12 * d * d + 13 * d) + 2 * d  # per layer: 4d^2 + 8d^2 kernels, biases, 2 norms
    tokens = step * BATCH * SEQ
    assert int(row['non_embedding_params']) == non_embedding
    assert int(row['params']) == non_embedding + VOCAB * d + MAX_LEN * d
    assert int(row['tokens']) == tokens
    matmul = LAYERS * 12 * d * d + VOCAB * d  # the tied output layer multiplies too
    assert float(row['flops']) == pytest.approx((6 * matmul + 6 * LAYERS * SEQ * d) * tokens, rel=1e-12)
    assert float(row['flops_6nd']) == 6 * int(row['params']) * tokens
    records = [json.loads(line) for line in (runs / str(d) / 'metrics.jsonl').read_text().splitlines()]
    assert float(row['loss']) == [r['val_loss'] for r in records if r.get('step') == step and 'val_loss' in r][-1]
    # every held-out column of that step beside it, for loss-to-loss laws; the batch; no cap: every token new
    held = [r for r in records if r.get('step') == step and 'val/code/loss' in r][-1]
    assert float(row['val/code/loss']) == held['val/code/loss'] and float(row['val/copy/bpb']) == held['val/copy/bpb']
    assert (int(row['global_batch']), int(row['batch_tokens'])) == (BATCH, BATCH * SEQ)
    assert int(row['unique_tokens']) == tokens and float(row['epochs']) == 1.0


@pytest.mark.long(0.2)  # with its sibling: the runs fixture (~35 s) stays out of the fast tier
def test_evaluate_reproduces_the_recorded_losses_from_the_checkpoints(runs, tmp_path):
  """A second path to the same numbers: params restored through orbax, the validation split read again."""
  recorded, evaluated = tmp_path / 'recorded.csv', tmp_path / 'evaluated.csv'
  paths = [str(runs / str(w)) for w in WIDTHS]
  assert cli.main(['scaling', 'collect', *paths, '--out', str(recorded)]) == 0
  assert cli.main(['scaling', 'collect', *paths, '--out', str(evaluated), '--evaluate']) == 0
  want, got = read(recorded), read(evaluated)
  assert [r['step'] for r in got] == [r['step'] for r in want]
  from lm.jobs.scaling.collect import recorded_losses  # the recorded column is metrics.jsonl's validation losses
  assert [float(r['loss']) for r in want] == [loss for w in WIDTHS for loss in recorded_losses(runs / str(w)).values()]
  for a, b in zip(want, got):
    assert float(b['loss']) == pytest.approx(float(a['loss']), rel=1e-5)


@pytest.mark.long(0.2)
def test_a_named_set_in_bits_per_byte_is_collected_recorded_and_evaluated(runs, tmp_path):
  """`--eval NAME --metric bpb` takes val/NAME/bpb; a set holding the validation split's documents equals the
  split's own val_loss and val_bpb; `--evaluate` reproduces the set's records from the checkpoints."""
  paths = [str(runs / str(w)) for w in WIDTHS]
  for w in WIDTHS:
    for record in (r for r in read_metrics(runs / str(w)) if 'val_loss' in r):
      assert record['val/copy/loss'] == record['val_loss'] and record['val/copy/bpb'] == record['val_bpb']
      assert record['val/code/bpb'] != record['val_bpb'] and 0 < record['val/code/bpb'] < 12
  for metric in ('loss', 'bpb'):
    recorded, evaluated = tmp_path / f'{metric}.csv', tmp_path / f'{metric}_evaluated.csv'
    assert cli.main(['scaling', 'collect', *paths, '--out', str(recorded), '--eval', 'code', '--metric', metric]) == 0
    assert cli.main(['scaling', 'collect', *paths, '--out', str(evaluated), '--eval', 'code', '--metric', metric,
                     '--evaluate']) == 0
    want = [r[f'val/code/{metric}'] for w in WIDTHS for r in read_metrics(runs / str(w))
            if f'val/code/{metric}' in r and r['step'] > 0]
    assert [float(r['loss']) for r in read(recorded)] == want
    assert {r['loss_of'] for r in read(recorded) + read(evaluated)} == {f'val/code/{metric}'}
    assert [float(r['loss']) for r in read(evaluated)] == pytest.approx(want, rel=1e-5)
  assert cli.main(['scaling', 'plot', str(tmp_path / 'bpb.csv'), '--out', str(tmp_path / 'bpb.png')]) == 0


def test_loss_labels_name_the_set_and_the_unit():
  from lm.jobs.scaling.plot import loss_label
  assert loss_label('val_loss') == 'validation loss (nats/token)'
  assert loss_label('val_bpb') == 'validation bits per byte'
  assert loss_label('val/code/bpb') == 'code bits per byte' and loss_label('val/c4/loss') == 'c4 loss (nats/token)'


def test_a_run_without_metrics_is_one_line(tmp_path, capsys):
  bare = tmp_path / 'bare'
  bare.mkdir()
  (bare / 'config.yaml').write_text(load_config('gpt_tiny', [f'train.run_dir={bare}']).to_yaml())
  assert cli.main(['scaling', 'collect', str(bare), '--out', str(tmp_path / 'p.csv')]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'no val_loss records' in err and '--evaluate' in err
  assert not (tmp_path / 'p.csv').exists()


def test_a_routed_run_carries_its_active_params_and_expert_layout(tmp_path):
  """A run of moe_tiny's recipe (as its config.yaml and metrics.jsonl hold it): the active params are the total
  less 6 of 8 experts' kernels, flops_6nd counts them, and the layout is 8 experts, 2 per token, granularity 2."""
  run = tmp_path / 'moe'
  run.mkdir()
  config = load_config('moe_tiny', [f'train.run_dir={run}'])
  (run / 'config.yaml').write_text(config.to_yaml())
  (run / 'metrics.jsonl').write_text(json.dumps({'step': 100, 'val_loss': 2.5}) + '\n')
  out = tmp_path / 'p.csv'
  assert cli.main(['scaling', 'collect', str(run), '--out', str(out)]) == 0
  (row,) = read(out)
  idle = 4 * 6 * 3 * 128 * 176  # 4 layers, 6 of 8 experts, 3 kernels of 128 x 176
  assert int(row['active_params']) == int(row['params']) - idle
  assert int(row['active_non_embedding_params']) == int(row['non_embedding_params']) - idle
  assert float(row['flops_6nd']) == 6 * int(row['active_params']) * 100 * 8 * 128
  assert (int(row['experts']), int(row['experts_per_token']), float(row['granularity'])) == (8, 2, 2.0)
  from lm.jobs.scaling.points import read_points
  assert read_points(out, 'active').params[0] == int(row['active_params'])
