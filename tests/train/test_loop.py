"""The loop: exact resume, run outputs, and refusing to clobber or mismatch checkpoints."""
import json

import jax
import numpy as np
import pytest

from lm.config import ConfigError
from lm.train.logging import read_metrics
from lm.jobs.pretraining import Pretraining


def train_losses(records):
  return {r['step']: r['loss'] for r in records if 'loss' in r}


@pytest.mark.long(0.2)
def test_resume_is_exact(small_config, tmp_path):
  common = ['optim.decay_steps=20', 'train.checkpoint.every=5', 'train.eval_every=10']
  straight = Pretraining(small_config('train.steps=20', f'train.run_dir={tmp_path}/a', *common), jax.devices()[:1])
  straight.run()
  first = Pretraining(small_config('train.steps=10', f'train.run_dir={tmp_path}/b', *common), jax.devices()[:1])
  first.run()
  second = Pretraining(small_config('train.steps=20', f'train.run_dir={tmp_path}/b', 'train.resume=true', *common),
                   jax.devices()[:1])
  second.run()
  a, b = train_losses(read_metrics(tmp_path / 'a')), train_losses(read_metrics(tmp_path / 'b'))
  assert sorted(a) == sorted(b) == list(range(1, 21))
  assert [a[s] for s in a] == [b[s] for s in a]
  for x, y in zip(jax.tree.leaves(straight.final_state), jax.tree.leaves(second.final_state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert int(second.final_state.step) == 20


@pytest.mark.long(0.2)
def test_run_outputs(small_config, tmp_path):
  config = small_config('train.steps=6', 'train.log_every=3', 'train.eval_every=3', 'train.peak_flops=1e12',
                        f'train.run_dir={tmp_path}/run')
  Pretraining(config, jax.devices()[:1]).run()
  records = read_metrics(tmp_path / 'run')
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == list(range(1, 7))
  for r in train:
    assert {'loss', 'learning_rate', 'grad_norm'} <= set(r)
  timed = [r for r in train if 'tokens_per_sec' in r]
  assert [r['step'] for r in timed] == [3, 6] and all(r['tokens_per_sec'] > 0 and 0 < r['mfu'] for r in timed)
  evals = [r for r in records if 'val_loss' in r]
  assert [r['step'] for r in evals] == [0, 3, 6]
  assert abs(evals[0]['val_loss'] - np.log(264)) < 0.25, 'an untrained model is near-uniform'
  assert list((tmp_path / 'run' / 'tensorboard').glob('events.out.tfevents.*'))
  saved = (tmp_path / 'run' / 'config.yaml').read_text()
  assert 'seq_len: 32' in saved
  assert sorted(p.name for p in (tmp_path / 'run' / 'checkpoints').iterdir() if p.name.isdigit()) == ['6']
  json.dumps(records)


def test_refuses_to_overwrite_or_mismatch_checkpoints(small_config, tmp_path):
  run = f'train.run_dir={tmp_path}/run'
  Pretraining(small_config('train.steps=2', run), jax.devices()[:1]).run()
  with pytest.raises(ConfigError, match='already holds checkpoints.*--resume'):
    Pretraining(small_config('train.steps=4', run), jax.devices()[:1]).run()
  with pytest.raises(ConfigError, match='different model.*model.d_model'):
    Pretraining(small_config('train.steps=4', run, 'train.resume=true', 'model.d_model=32'), jax.devices()[:1]).run()


@pytest.mark.parametrize('preset, extra, start, end', [
  ('gpt_tiny', [], 5.4, 3.5),
  pytest.param('llama_tiny', ['model.num_kv_heads=2'], 5.4, 3.5, marks=pytest.mark.long(0.2)),
  pytest.param('bert_tiny', ['model.max_len=32'], 5.0, 4.0, marks=pytest.mark.long(0.2)),
  pytest.param('t5_tiny', ['model.d_ff=128'], 5.0, 3.8, marks=pytest.mark.long(0.5)),
  # Vaswani et al.'s encoder-decoder (sinusoidal positions, post-LN, ReLU, dropout 0.1 / 0.3) at tiny width
  *[pytest.param(name, ['model.vocab_size=384', 'data.tokenizer=byte', 'model.max_len=32', 'model.num_heads=4',
                        'model.d_ff=128', 'model.num_decoder_layers=2', 'model.execution.dtype=float32',
                        'model.execution.attention_impl=xla'], 5.9, 5.4, marks=pytest.mark.long(0.5))
    for name in ('transformer_base', 'transformer_big')],
])
def test_training_lowers_validation_loss(preset, extra, start, end, tmp_path):
  from lm.config import load_config
  from tests.conftest import SMALL
  config = load_config(preset, SMALL + extra + ['train.steps=40', 'train.eval_every=40', 'train.eval_batches=2',
                                                f'train.run_dir={tmp_path}'])
  records = Pretraining(config, jax.devices()[:1]).run()
  evals = [r['val_loss'] for r in records if 'val_loss' in r]
  assert evals[0] > start and evals[-1] < end, evals


@pytest.mark.long(0.2)
def test_bert_with_next_sentence_prediction(small_config, tmp_path):
  from lm.config import load_config
  from tests.conftest import SMALL
  config = load_config('bert_tiny', SMALL + ['model.max_len=32', 'model.nsp=true',
                                             'train.steps=6', f'train.run_dir={tmp_path}'])
  records = Pretraining(config, jax.devices()[:1]).run()
  steps = [r for r in records if 'nsp_loss' in r]
  assert len(steps) == 6 and all(0 <= r['nsp_accuracy'] <= 1 for r in steps)
  assert abs(steps[0]['nsp_loss'] - np.log(2)) < 0.3


@pytest.mark.long(0.5)
def test_sigterm_checkpoints_and_resume_continues(small_config, tmp_path):
  import os
  import signal
  run = f'train.run_dir={tmp_path}/run'
  trainer = Pretraining(small_config('train.steps=10', run), jax.devices()[:1])
  step_fn, calls = trainer.loop.train_step, []

  def preempt_on_third_step(*args):
    calls.append(1)
    if len(calls) == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return step_fn(*args)
  trainer.loop.train_step = preempt_on_third_step
  trainer.run()
  assert int(trainer.final_state.step) == 3
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  resumed = Pretraining(small_config('train.steps=10', run, 'train.resume=true'), jax.devices()[:1])
  resumed.run()
  straight = Pretraining(small_config('train.steps=10', f'train.run_dir={tmp_path}/straight'), jax.devices()[:1])
  straight.run()
  losses, expected = (train_losses(read_metrics(tmp_path / d)) for d in ('run', 'straight'))
  assert sorted(losses) == list(range(1, 11)) and losses == expected
  for x, y in zip(jax.tree.leaves(straight.final_state), jax.tree.leaves(resumed.final_state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_callback_runs_at_its_cadence_and_after_the_final_step():
  from lm.train.loop import Callback
  every_3, final_only = Callback(), Callback()
  every_3.every = 3
  assert [s for s in range(1, 11) if every_3.due(s, s == 10, False)] == [3, 6, 9, 10]
  assert [s for s in range(1, 11) if final_only.due(s, s == 10, False)] == [10]
