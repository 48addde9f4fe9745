"""Loss spikes (train.on_spike): a poisoned batch's update skipped, or the run rolled back past it, each against a
run that never took that update or never saw those batches."""
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.jobs.pretraining import Pretraining
from lm.train.callbacks import Callback, TrainingError
from lm.train.logging import read_metrics
from lm.train.loop import Trainer
from lm.train.step import PretrainingLoss
from lm.train.timing import is_timing

POISON = 1e4  # the test hook's loss multiplier on a poisoned batch: the loss and the gradient norm jump with it
POISONED = 7  # the step whose batch is poisoned
GUARD = ['train.spike_window=8', 'train.spike_threshold=20', 'train.checkpoint.every=5', 'train.eval_batches=0']


@dataclass(frozen=True)
class ScaledLoss:
  """The pretraining loss times the batch's `loss_scale`, in what it minimises and in the logged loss."""
  inner: PretrainingLoss

  def prepare(self, batch):
    return self.inner.prepare(batch)

  def totals(self, batch):
    return self.inner.totals(batch)

  def __call__(self, params, batch, rng, totals):
    loss, sums = self.inner(params, batch, rng, totals)
    return loss * batch['loss_scale'], {**sums, 'nll': sums['nll'] * batch['loss_scale']}

  def metrics(self, sums, totals):
    return self.inner.metrics(sums, totals)


class Stream:
  """The job's training batches, each with a loss scale: POISON on the `poisoned` draws (1-based); the `dropped`
  draws are taken from the pipeline and thrown away (a run that never saw them)."""

  def __init__(self, batches, poisoned=(), dropped=()):
    self.batches, self.poisoned, self.dropped, self.drawn = batches, set(poisoned), set(dropped), 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self.batches)
    self.drawn += 1
    while self.drawn in self.dropped:
      batch = next(self.batches)
      self.drawn += 1
    return {**batch, 'loss_scale': jnp.float32(POISON if self.drawn in self.poisoned else 1.0)}


class States(Callback):
  """Every step's params and optimizer state, copied to the host."""
  every = 1

  def __init__(self):
    self.states = {}

  def __call__(self, after):
    self.states[after.step] = jax.device_get((after.state.params, after.state.opt_state))
    return []


def train(config, **stream):
  """The run's records and its states by step, trained through the one loop on the poisoned stream."""
  job = Pretraining(config, jax.devices()[:1])
  trainer = Trainer(job.assembly, ScaledLoss(PretrainingLoss(job.assembly)), run_dir=config.run_dir)
  states = States()
  records = trainer.run(Stream(job.train_batches, **stream), job.init_state, [states],
                        position=job.train_batches.iterator)
  return [r for r in records if 'loss' in r], states.states


def same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_skip_withholds_the_spikes_update(small_config, capsys):
  skip, states = train(small_config('train.steps=9', 'train.on_spike=skip', *GUARD), poisoned=[POISONED])
  assert [r['step'] for r in skip if r['spike/skipped']] == [POISONED]
  assert same(states[POISONED], states[POISONED - 1])  # params and optimizer state (its count too) untouched
  assert not same(states[POISONED + 1], states[POISONED])  # and the run goes on
  assert skip[-1]['skipped_steps'] == 1 and skip[POISONED]['learning_rate'] == skip[POISONED - 1]['learning_rate']
  line = next(line for line in capsys.readouterr().out.splitlines() if 'skipped' in line)
  assert line.startswith(f'step {POISONED}: ') and line.endswith('its update was skipped (train.on_spike=skip)')
  assert 'standard deviations above the mean of the last 8 steps' in line


@pytest.mark.long(0.2)
def test_off_takes_the_spikes_update_and_the_guard_changes_no_other_step(small_config, tmp_path):
  off, states = train(small_config('train.steps=7', *GUARD[2:]), poisoned=[POISONED])
  assert not any(k.startswith('spike/') for r in off for k in r)
  assert not same(states[POISONED], states[POISONED - 1])  # off: the spike's update is taken
  guarded, _ = train(small_config('train.steps=7', 'train.on_spike=skip', *GUARD, f'train.run_dir={tmp_path}/skip'),
                     poisoned=[POISONED])
  # the guard changes nothing at steps that are not spikes (to rounding: its program fuses differently)
  for a, b in zip(off[:POISONED - 1], guarded[:POISONED - 1], strict=True):
    assert {k: v for k, v in b.items() if k in a and not is_timing(k)} == \
        pytest.approx({k: v for k, v in a.items() if not is_timing(k)}, rel=1e-5)


@pytest.mark.long(0.3)
def test_rollback_equals_a_run_that_never_saw_the_skipped_batches(small_config, tmp_path, capsys):
  """Poisoned at step 8 with checkpoints every 5: back to 5, the batches of steps 6-8 and 2 more skipped."""
  settings = ['train.steps=14', 'train.on_spike=rollback', 'train.rollback_skip_batches=2', *GUARD]
  rolled, _ = train(small_config(*settings, f'train.run_dir={tmp_path}/rolled'), poisoned=[8])
  line = next(line for line in capsys.readouterr().out.splitlines() if 'rolled back' in line)
  assert line.startswith('step 8: ') and line.endswith('rolled back to step 5 and skipped the batches of steps 6-8 '
                                                       'and 2 more (rollback 1 of at most 3)')
  straight, _ = train(small_config(*settings, f'train.run_dir={tmp_path}/straight'), dropped=range(6, 11))
  clean = lambda records: [{k: v for k, v in r.items() if not is_timing(k)} for r in records
                           if 'spike/rolled_back_from' not in r]
  assert clean(rolled) == clean(straight) and [r['step'] for r in rolled] == list(range(1, 15))
  marks = [r for r in read_metrics(tmp_path / 'rolled') if 'spike/rolled_back_from' in r]
  assert marks == [{'step': 5, 'spike/rolled_back_from': 8, 'spike/skipped_batches': 5}]
  assert clean(read_metrics(tmp_path / 'rolled')) == clean(read_metrics(tmp_path / 'straight'))

  with pytest.raises(TrainingError, match=r'^step 8: (loss|grad_norm) \S+ is \S+ standard deviations above the '
                                          r'mean of the last 8 steps, after 0 rollbacks \(train.max_rollbacks=0\)'):
    train(small_config(*settings, 'train.max_rollbacks=0', f'train.run_dir={tmp_path}/none'), poisoned=[8])
