"""Checkpoints by step multiple kept for good (`train.checkpoint.keep_every`) and by wall time (`train.checkpoint.every_minutes`):
they appear where set, the latest-N policy leaves the kept ones alone, and a run continues from each exactly."""
import jax
import numpy as np
import pytest

from lm.config import ConfigError, load_config
from lm.jobs.pretraining import Pretraining
from lm.train.logging import read_metrics
from lm.train.loop import After, Checkpoint


def steps_of(run_dir) -> list[int]:
  return sorted(int(p.name) for p in (run_dir / 'checkpoints').iterdir())


def losses(run_dir) -> dict[int, float]:
  return {r['step']: r['loss'] for r in read_metrics(run_dir) if 'loss' in r}


def continues_exactly(small_config, straight, step: int, tmp_path, *overrides: str) -> None:
  """A run branched from the straight run's checkpoint `step` takes the straight run's next two steps (a constant
  rate after warmup: a branch's shorter train.steps leaves the schedule as it was)."""
  branch = tmp_path / f'from{step}'
  Pretraining(small_config(*overrides, f'train.steps={step + 2}', f'train.run_dir={branch}',
                           f'train.branch_from={straight}/checkpoints/{step}'), jax.devices()[:1]).run()
  want = losses(straight)
  np.testing.assert_array_equal([losses(branch)[s] for s in (step + 1, step + 2)], [want[step + 1], want[step + 2]])


@pytest.mark.long(0.3)
def test_every_kth_step_is_checkpointed_and_kept_and_each_continues(small_config, tmp_path):
  run = tmp_path / 'run'
  cadence = ['train.checkpoint.every=3', 'train.checkpoint.keep_every=4', 'train.checkpoint.keep=1', 'optim.schedule=constant']
  Pretraining(small_config(*cadence, 'train.steps=12', f'train.run_dir={run}'), jax.devices()[:1]).run()
  # saved at 3, 4, 6, 8, 9, 12; the latest one kept, and the multiples of 4 for good
  assert steps_of(run) == [4, 8, 12]
  for step in (4, 8):
    continues_exactly(small_config, run, step, tmp_path, *cadence)


class Saves:
  """A checkpointer that records the steps it is asked to save."""
  def __init__(self):
    self.steps = []

  def save(self, step, state, data, config):
    self.steps.append(step)


def test_a_checkpoint_comes_at_the_first_logging_step_past_the_minutes():
  """25 s per step, 1 minute, logging every 2 steps: past 60 s at step 4 (100 s), then again 60 s after each save."""
  now = [0.0]
  saves = Saves()
  callback = Checkpoint(saves, 0, None, {}, minutes=1, check_every=2, clock=lambda: now[0])
  callback.start(0, None, [])
  for step in range(1, 14):
    now[0] = 25.0 * step
    if callback.due(step, final=False, stopping=False):
      callback(After(step, None, []))
  assert saves.steps == [4, 8, 12]


@pytest.mark.long(0.2)
def test_time_based_checkpoints_appear_at_logging_steps_and_continue(small_config, tmp_path):
  run = tmp_path / 'run'
  cadence = ['train.checkpoint.every=0', 'train.checkpoint.every_minutes=1e-9', 'train.log_every=3',
             'train.checkpoint.keep=5', 'optim.schedule=constant']
  Pretraining(small_config(*cadence, 'train.steps=8', f'train.run_dir={run}'), jax.devices()[:1]).run()
  assert steps_of(run) == [3, 6, 8]  # each logging step (past the minutes) and the final one
  continues_exactly(small_config, run, 3, tmp_path, *cadence)


@pytest.mark.parametrize('override', ['train.checkpoint.keep_every=-1', 'train.checkpoint.every_minutes=-5'])
def test_negative_cadences_are_refused(override):
  with pytest.raises(ConfigError, match='must be >= 0'):
    load_config('gpt_tiny', [override])
