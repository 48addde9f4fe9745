"""The benchmarks' one timing loop: untimed warm-up calls (the first compiles), then timed calls, each waited for;
and interleaved rounds, so that drift on a shared host falls on every contender alike."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Timing:
  first: float  # seconds of the first warm-up call (compilation included); 0 without warm-up
  times: list[float]  # seconds of each timed call

  @property
  def median(self) -> float:
    return statistics.median(self.times)


def time_calls(call: Callable[[], Any], repeats: int, warmup: int = 1) -> Timing:
  """Runs `call` `warmup` times untimed, then `repeats` times timed; waits for each call's arrays."""
  first = 0.0
  for i in range(warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - t0 if i == 0 else first
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t0)
  return Timing(first, times)


def interleaved(rounds: int, contenders: Mapping[str, Callable[[], list[float]]]) -> dict[str, list[float]]:
  """Each round times every contender once, in turn (`contenders` return one round's step times); returns each
  contender's round medians."""
  medians: dict[str, list[float]] = {name: [] for name in contenders}
  for _ in range(rounds):
    for name, round_times in contenders.items():
      medians[name].append(statistics.median(round_times()))
  return medians
