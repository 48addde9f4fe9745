"""`train.batch_ramp`: a run whose batch grows at set steps equals, step for step, one whose batch is changed by hand
through branches at those steps; a kill -9 and --resume across a ramp point change nothing; a ramp that cannot be
is one line."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from lm.assembly.optim import learning_rate_schedule
from lm.config import ConfigError, batch_at, batch_schedule, load_config, ramp_rates, tokens_after
from lm.jobs.pretraining import Pretraining
from lm.storage.run_dir import read_config
from lm.train.logging import read_metrics
from tests.conftest import SMALL, one_device_env
from tests.train.test_faults import kill_past, without_timing

# Batch 8 over the 8 devices, then 16 after step 3 and 32 after step 6: 2 and 4 microbatches of the same 8 rows.
BASE = ['mesh.data=-1', 'train.global_batch=8', 'optim.schedule=constant', 'train.eval_batches=0']


def _trained(small_config, *overrides):
  run = Pretraining(small_config(*BASE, *overrides), jax.devices())
  run.run()
  return run


def _steps(run_dir):
  return [(r['step'], r['loss'], r['learning_rate']) for r in read_metrics(run_dir) if 'loss' in r]


@pytest.mark.long(0.4)
def test_a_ramped_run_equals_branches_that_change_the_batch_by_hand(small_config, tmp_path):
  ramped = _trained(small_config, 'train.steps=8', 'train.batch_ramp=[16@3,32@6]', f'train.run_dir={tmp_path}/ramp')
  _trained(small_config, 'train.steps=3', f'train.run_dir={tmp_path}/a')
  _trained(small_config, 'train.steps=6', 'train.global_batch=16', f'train.branch_from={tmp_path}/a',
           f'train.run_dir={tmp_path}/b')
  by_hand = _trained(small_config, 'train.steps=8', 'train.global_batch=32', f'train.branch_from={tmp_path}/b',
                     f'train.run_dir={tmp_path}/c')
  # The last branch records its batches as the ramp they make: the first run's batch, then one point per branch.
  kept = read_config(tmp_path / 'c').train
  assert (kept.global_batch, kept.batch_ramp) == (8, ('16@3', '32@6'))
  ramp, hand = _steps(tmp_path / 'ramp'), _steps(tmp_path / 'c')
  assert [s for s, _, _ in ramp] == [s for s, _, _ in hand] == list(range(1, 9))
  np.testing.assert_allclose(np.array(hand)[:, 1:], np.array(ramp)[:, 1:], rtol=1e-6)
  # Params, Adam's moments: within 5e-6 (most within 1e-7; the key bias, whose gradient is zero, is rounding noise).
  for x, y in zip(jax.tree.leaves(ramped.final_state), jax.tree.leaves(by_hand.final_state), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=5e-6)
  # Adam's rule: the rate times sqrt(batch / 8) from each point on; each step logs its batch.
  peak = float(small_config().optim.learning_rate)
  records = {r['step']: r for r in read_metrics(tmp_path / 'ramp') if 'loss' in r}
  assert [records[s]['batch'] for s in (3, 4, 6, 7)] == [8, 16, 16, 32]
  np.testing.assert_allclose([records[s]['learning_rate'] for s in (3, 4, 7)], [peak, peak * 2 ** 0.5, peak * 2])


@pytest.mark.long(0.6)
def test_kill_9_and_resume_across_a_ramp_point_give_the_straight_losses(tmp_path):
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.global_batch=4',
           'train.steps=9', 'train.batch_ramp=[8@3,16@5]', 'train.checkpoint.every=2', 'train.eval_batches=0']
  env = one_device_env()
  straight = subprocess.run(train + [f'train.run_dir={tmp_path}/straight'], env=env, capture_output=True, timeout=600)
  assert straight.returncode == 0, straight.stderr[-2000:]
  run = tmp_path / 'killed'
  kill_past(train + [f'train.run_dir={run}'], run, 4, env)  # past the first point; the latest checkpoint is step 2
  # or 4, before a point either way
  resumed = subprocess.run(train + [f'train.run_dir={run}', '--resume'], env=env, capture_output=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert without_timing(read_metrics(run)) == without_timing(read_metrics(tmp_path / 'straight'))


def test_stages_tokens_and_rates_follow_the_points():
  config = load_config('gpt_tiny', ['data.seq_len=32', 'train.global_batch=8', 'train.steps=100',
                                    'train.batch_ramp=[16@10,64@30]', 'train.batch_ramp_lr=linear'])
  stages = batch_schedule(config)
  assert stages == ((0, 8), (10, 16), (30, 64))
  batches = [batch_at(stages, step) for step in range(1, 101)]
  assert batches[9:11] == [8, 16] and batches[29:31] == [16, 64]
  assert [tokens_after(stages, s, 32) for s in (0, 10, 31, 100)] == [32 * sum(batches[:s]) for s in (0, 10, 31, 100)]
  # The same points in tokens: the first step whose tokens reach each (10 x 8 x 32 = 2,560; then 20 x 16 x 32 more).
  in_tokens = load_config('gpt_tiny', ['data.seq_len=32', 'train.global_batch=8', 'train.steps=100',
                                       'train.batch_ramp=[16@2500,64@12800]', 'train.batch_ramp_unit=tokens'])
  assert batch_schedule(in_tokens) == stages
  schedule = learning_rate_schedule(config.optim, config.train.steps, ramp_rates(config))
  plain = learning_rate_schedule(config.optim, config.train.steps)
  counts = np.arange(100)
  factor = np.array([batch_at(stages, c + 1) / 8 for c in counts])  # count c is step c + 1's update
  np.testing.assert_allclose(np.asarray(schedule(counts)), np.asarray(plain(counts)) * factor, rtol=1e-6)


@pytest.mark.parametrize('ramp, message', [
  ('[16@10,12@20]', 'does not increase both the batch and the step'),
  ('[16@10,32@10]', 'does not increase both the batch and the step'),
  ('[12@10]', '12 is not a multiple of train.global_batch=8'),
  ('[16]', 'is not BATCH@AT'),
  ('[16@100]', 'at or past train.steps=100'),
])
def test_a_ramp_that_cannot_be_is_one_line(ramp, message):
  with pytest.raises(ConfigError) as error:
    load_config('gpt_tiny', ['train.global_batch=8', 'train.steps=100', f'train.batch_ramp={ramp}'])
  assert message in str(error.value) and '\n' not in str(error.value)


def test_compile_and_info_plan_for_the_largest_batch():
  from lm.config import largest_batch
  config = load_config('gpt_tiny', ['train.global_batch=8', 'train.microbatches=2', 'train.steps=100',
                                    'train.batch_ramp=[32@10]'])
  t = largest_batch(config).train
  assert (t.global_batch, t.microbatches, t.batch_ramp) == (32, 8, ())
  rows = load_config('gpt_tiny', ['train.global_batch=8', 'train.microbatches=2', 'train.steps=100',
                                  'train.batch_ramp=[32@10]', 'train.batch_ramp_growth=rows'])
  assert largest_batch(rows).train.microbatches == 2
