"""Weighted data mixtures: which source each training row comes from, stage by stage, through grain's mixing.

Every source packs its own rows (`lm.data.pipeline`); rows are then drawn by weight. Each of the S streams
draws its rows from grain's deterministic weighted interleave of the sources (`grain.MapDataset.mix`), stream k
from the interleave's k-th place on: at every step the streams hold consecutive stretches of the interleave, so
a batch holds each source by its weight (to a row or two), and every stream draws every source by its weight
(so it reads its share of each source's records). Shares are exact to a row per stream, the same on any number
of processes, and a resumed run draws the same. A stage from step s switches the weights from each stream's
row s x (rows a stream gives a step) on.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import grain

from lm.config import DataConfig, mixture_stages, named_sources


def _proportions(weights: Sequence[float]) -> list[int]:
  """grain's integer proportions for `weights` (the least scaled to 100), the interleave's period their sum."""
  return [int(w * 100 / min(weights)) for w in weights]


def _interleave_counts(n: int, weights: Sequence[float]) -> list[int]:
  """How many of the first `n` elements of `grain.MapDataset.mix(datasets, weights)` each dataset gives, in closed
  form (its selection: each dataset in turn takes its integer proportion's share of what the ones before left),
  so a count at step 10^6 costs no walk through 10^6 x batch positions."""
  proportions = _proportions(weights)
  remaining, counts = sum(proportions), []
  for p in proportions:
    left = n * (remaining - p) // remaining
    counts.append(n - left)
    n, remaining = left, remaining - p
  return counts


class Mixture:
  """The sources' names and, per stage, its first step and grain's interleave of the sources with weight > 0."""

  def __init__(self, names: Sequence[str], stages: Sequence[tuple[int, Sequence[float]]]):
    self.names = tuple(names)
    self.steps = [step for step, _ in stages]
    self.active = [[j for j, w in enumerate(weights) if w > 0] for _, weights in stages]
    self.weights = [[weights[j] for j in active] for (_, weights), active in zip(stages, self.active)]
    self.order = [grain.MapDataset.mix([grain.MapDataset.source([j]).repeat() for j in active], weights)
                  for active, weights in zip(self.active, self.weights)]

  @classmethod
  def of(cls, data: DataConfig) -> Mixture | None:
    """`data.mixture` with `data.weights`, or None for a run on one source."""
    if not data.mixture:
      return None
    return cls([source.name for source in named_sources(data, 'mixture')], mixture_stages(data))

  def source_of(self, row: int, stream: int, rows_per_step: int) -> int:
    """The source of stream `stream`'s `row`-th row (each stream giving `rows_per_step` rows a step)."""
    stage = bisect.bisect_right(self.steps, row // rows_per_step) - 1
    return self.order[stage][row - self.steps[stage] * rows_per_step + stream]

  def tokens(self, step: int, streams: int, rows_per_step: int, row_len: int) -> dict[str, int]:
    """Tokens each source gave the first `step` steps (rows of `row_len`), counted in closed form."""
    counts = dict.fromkeys(self.names, 0)
    for stage, (first, last) in enumerate(zip(self.steps, [*self.steps[1:], step])):
      rows = (min(last, step) - first) * rows_per_step
      if rows <= 0:
        break
      for stream in range(streams):
        for j, end, begin in zip(self.active[stage], _interleave_counts(stream + rows, self.weights[stage]),
                                 _interleave_counts(stream, self.weights[stage])):
          counts[self.names[j]] += (end - begin) * row_len
    return counts
