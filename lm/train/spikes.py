"""Loss spikes that stay finite (`train.on_spike`): a running window of the loss and the gradient norm kept in the
train state, a z-score of each step's against it computed inside the jitted step (no host sync), and the host's
side: one line per spike, and under `rollback` the signal the loop restores the last checkpoint on.

A step is a spike when its loss or its gradient norm lies more than `train.spike_threshold` standard deviations
above the mean of the window (the last `train.spike_window` steps that were neither spikes nor non-finite), once
the window is half full (OLMo-core's skip-step AdamW and Levanter's skip-on-spike judge the same way).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lm.assembly.state import WATCHED, Window
from lm.config import TrainConfig
from lm.train.callbacks import Callback, Record, TrainingError

MIN_STD = 1e-6  # a flat window's deviation: a rise of a millionth is not a spike


def judge(window: Window, values: dict[str, jax.Array], threshold: float) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(whether this step is a spike, each watched value's z-score against the window; 0 until it is half full)."""
  size = window['loss'].shape[0]
  ready = window['seen'] >= (size + 1) // 2
  filled = jnp.arange(size) < window['seen']
  z = {}
  for name in WATCHED:
    n = jnp.maximum(jnp.minimum(window['seen'], size), 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(filled, window[name], 0.0)) / n
    std = jnp.sqrt(jnp.sum(jnp.where(filled, (window[name] - mean) ** 2, 0.0)) / n)
    z[name] = jnp.where(ready, (values[name] - mean) / jnp.maximum(std, MIN_STD), 0.0)
  spike = ready & functools.reduce(jnp.logical_or, [z[name] > threshold for name in WATCHED])
  return spike, z


def advance(window: Window, values: dict[str, jax.Array], keep: jax.Array, skipped_spike: jax.Array) -> Window:
  """The window with this step's values in the next slot where `keep` (a step neither a spike nor non-finite)."""
  size = window['loss'].shape[0]
  slot = window['seen'] % size
  new = {name: jnp.where(keep, window[name].at[slot].set(values[name]), window[name]) for name in WATCHED}
  return {**new, 'seen': window['seen'] + keep.astype(jnp.int32),
          'spikes': window['spikes'] + skipped_spike.astype(jnp.int32)}


class Rollback(Exception):
  """A spike under on_spike=rollback: the loop restores the last checkpoint and skips the spike's batches."""

  def __init__(self, record: Record):
    super().__init__(record['step'])
    self.record = record


def describe(record: Record, window: int) -> str:
  """`step 57: loss 9.31 is 8.2 standard deviations above the mean of the last 128 steps`."""
  name = max(WATCHED, key=lambda n: record[f'spike/{n}_z'])
  return (f'step {record["step"]}: {name} {record[name]:.4g} is {record[f"spike/{name}_z"]:.1f} standard deviations '
          f'above the mean of the last {window} steps')


class SpikeGuard(Callback):
  """Says what the step's spike guard did, in one line (process 0); under rollback raises `Rollback` for the
  first spike logged, or stops the run once `train.max_rollbacks` are spent."""

  def __init__(self, train: TrainConfig, rollbacks: int, speak: bool):
    self.train, self.rollbacks, self.speak = train, rollbacks, speak

  def due(self, step, final, stopping):
    return False

  def logged(self, records: list[Record]) -> None:
    t = self.train
    for record in records:
      if record.get('spike/skipped') and self.speak:
        print(f'{describe(record, t.spike_window)}; its update was skipped (train.on_spike=skip)', flush=True)
      if record.get('spike/detected'):
        if self.rollbacks >= t.max_rollbacks:
          raise TrainingError(f'{describe(record, t.spike_window)}, after {self.rollbacks} rollbacks '
                              f'(train.max_rollbacks={t.max_rollbacks}); lower optim.learning_rate, or raise '
                              f'train.max_rollbacks or train.rollback_skip_batches')
        raise Rollback(record)


def count_rollbacks(history: list[Record]) -> int:
  return sum(1 for r in history if 'spike/rolled_back_from' in r)


def guard(window: Window | None, loss: jax.Array, grad_norm: jax.Array, finite: jax.Array, train: TrainConfig
          ) -> tuple[jax.Array, Window | None, dict[str, jax.Array]]:
  """Inside the step: (whether to withhold its update as a spike, the window after it, what it logs: the flag,
  `spike/skipped` or `spike/detected`, and each z-score). Without a window (on_spike=off): nothing."""
  if window is None:
    return jnp.asarray(False), None, {}
  watched = {'loss': loss, 'grad_norm': grad_norm}
  spike, z = judge(window, watched, train.spike_threshold)
  skip = spike & finite & (train.on_spike == 'skip')
  flag = 'spike/skipped' if train.on_spike == 'skip' else 'spike/detected'
  return skip, advance(window, watched, finite & ~spike, skip), \
      {flag: spike.astype(jnp.float32), **{f'spike/{name}_z': value for name, value in z.items()}}


def nonfinite_steps(state: Any) -> jax.Array:
  """The state's withheld updates that were non-finite (its skipped steps but the spikes skipped)."""
  return state.skipped - (0 if state.spike_window is None else state.spike_window['spikes'])
