"""`train.ema_decay`: the params' moving average is kept through training (its math: tests/assembly/test_optim.py),
evaluated beside the params, checkpointed with the optimizer state, and resumed exactly."""
import jax
import numpy as np
import pytest

from lm import cli
from lm.assembly.optim import ema_params
from lm.config import ConfigError
from lm.jobs.evals.run import load_checkpoint
from lm.models.transformer import relayout
from lm.jobs.pretraining import Pretraining
from lm.storage.source import ModelSource, open_model
from lm.train.init_from import initial_state
from lm.train.logging import read_metrics

COMMON = ['train.ema_decay=0.9', 'train.eval_every=4', 'train.checkpoint.every=4', 'optim.decay_steps=8']


@pytest.mark.long(0.2)
def test_the_moving_average_is_evaluated_checkpointed_and_resumed(small_config, tmp_path):
  config = small_config('train.steps=8', f'train.run_dir={tmp_path}/a', *COMMON)
  straight = Pretraining(config, jax.devices()[:1])
  straight.run()
  records = read_metrics(tmp_path / 'a')
  ema = {r['step']: r['val_loss_ema'] for r in records if 'val_loss_ema' in r}
  plain = {r['step']: r['val_loss'] for r in records if 'val_loss' in r}
  assert sorted(ema) == [4, 8] and sorted(plain) == [0, 4, 8]  # no average before the first update
  average = ema_params(straight.final_state.opt_state, 0.9)
  assert ema[8] == pytest.approx(straight.held_out.evaluate(average, straight.held_out.validation,
                                                           config.train.eval_batches)['loss'],
                                rel=1e-6)
  assert ema[8] != plain[8]

  first = Pretraining(small_config('train.steps=4', f'train.run_dir={tmp_path}/b', *COMMON), jax.devices()[:1])
  first.run()
  second = Pretraining(small_config('train.steps=8', f'train.run_dir={tmp_path}/b', 'train.resume=true', *COMMON),
                       jax.devices()[:1])
  second.run()
  for x, y in zip(jax.tree.leaves(straight.final_state), jax.tree.leaves(second.final_state), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  # `lm eval --ema` reads the same average from the checkpoint (on all 8 devices); a run without one says so
  _, loaded, step = load_checkpoint(tmp_path / 'a', ema=True)
  assert step == 8
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(average), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # ... and so do `lm generate --ema`, `lm convert --to-hf --ema` and train.init_from_ema (on 8 devices and on one)
  mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  for params in (open_model(tmp_path / 'a', ema=True)[2], ModelSource(tmp_path / 'a', view='ema').params(mesh),
                 initial_state(straight.assembly, str(tmp_path / 'a'), ema=True).state.params):
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(average), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert cli.main(['convert', '--to-hf', str(tmp_path / 'hf'), '--from', str(tmp_path / 'a'), '--ema']) == 0
  exported = ModelSource(tmp_path / 'hf').params(mesh)
  for x, y in zip(jax.tree.leaves(relayout(exported, True)), jax.tree.leaves(average), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  Pretraining(small_config('train.steps=1', f'train.run_dir={tmp_path}/plain'), jax.devices()[:1]).run()
  with pytest.raises(ConfigError, match=rf'--ema: {tmp_path}/plain keeps no moving average .*; drop --ema'):
    load_checkpoint(tmp_path / 'plain', ema=True)
  with pytest.raises(ConfigError, match=rf'--ema: {tmp_path}/plain keeps no moving average .*; drop --ema'):
    ModelSource(tmp_path / 'plain', view='ema')

  other = small_config('train.steps=8', f'train.run_dir={tmp_path}/b', 'train.resume=true',
                       *[c.replace('0.9', '0.99') for c in COMMON])
  with pytest.raises(ConfigError, match=r'written for a different seed or moving average \(differs in '
                                        r'train.ema_decay\)'):
    Pretraining(other, jax.devices()[:1]).run()


def test_ema_decay_outside_zero_to_one_is_refused(small_config):
  with pytest.raises(ConfigError, match=r'train.ema_decay=1.0 must lie in \[0, 1\)'):
    small_config('train.ema_decay=1.0')
