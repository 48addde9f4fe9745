"""Optimizer state and params kept in host memory between steps (train.optimizer_offload, train.param_offload):
the same training, bit for bit, and the same resume, with the state resting where the settings say."""
import jax
import numpy as np
import pytest

from lm.assembly import assemble
from lm.assembly.state import HOST
from lm.jobs.pretraining import Pretraining
from lm.train.logging import read_metrics
from lm.train.step import lower_train_step

ONE = jax.devices()[:1]
OFFLOAD = ['train.optimizer_offload=true', 'train.param_offload=true']


def kinds(tree):
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def records(run_dir):
  return {r['step']: {k: v for k, v in r.items() if k in ('loss', 'grad_norm', 'val_loss', 'val_loss_ema')}
          for r in read_metrics(run_dir)}


@pytest.mark.long(0.5)
def test_offloaded_state_trains_and_resumes_bit_for_bit(small_config, tmp_path):
  """6 steps with a moving average evaluated every 3 (the 'ema' view reads the optimizer state): offloaded, stopped
  after step 3 and resumed, every logged loss, gradient norm and held-out loss equals the straight run's (==), and
  so do the final params and optimizer state, which rest in host memory; the device-only run's rest on the devices."""
  common = ['train.steps=6', 'train.checkpoint.every=3', 'optim.decay_steps=6', 'train.eval_every=3',
            'train.ema_decay=0.9']
  straight = Pretraining(small_config(*common, f'train.run_dir={tmp_path}/straight'), ONE)
  straight.run()
  Pretraining(small_config(*common, *OFFLOAD, 'train.steps=3', f'train.run_dir={tmp_path}/off'), ONE).run()
  resumed = Pretraining(small_config(*common, *OFFLOAD, 'train.resume=true', f'train.run_dir={tmp_path}/off'), ONE)
  resumed.run()
  assert records(tmp_path / 'off') == records(tmp_path / 'straight')
  assert [s for s, r in records(tmp_path / 'off').items() if 'val_loss_ema' in r] == [3, 6]
  a, b = straight.loop.final_state, resumed.loop.final_state
  assert kinds(b.params) == kinds(b.opt_state) == {HOST} and HOST not in kinds(a.params) | kinds(a.opt_state)
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_program_keeps_offloaded_state_in_host_memory(small_config):
  """The lowered train step takes and returns the optimizer state (and under param_offload the params) in
  pinned_host memory and moves them to the devices inside; without offloading no array is placed on the host."""
  def program(*overrides):
    return lower_train_step(assemble(small_config(*overrides), ONE)).as_text()
  opt_only = program('train.optimizer_offload=true')
  both = program(*OFFLOAD)
  plain = program()
  host_args = lambda text: text.split('->')[0].count('mhlo.memory_kind = "pinned_host"')
  params = len(jax.tree.leaves(assemble(small_config(), ONE).abstract_params))
  assert host_args(both) - host_args(opt_only) == params  # the params' arguments join the optimizer's
  assert host_args(opt_only) >= 2 * params  # AdamW's two moments per param, at least
  assert 'pinned_host' not in plain
