"""`train.noise_scale`: the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018,
arXiv:1812.06162, appendix A), from the norms the microbatch scan already has.

With k microbatches of B/k rows each, |G_small|^2 is the mean squared norm of a microbatch's own mean gradient and
|G_big|^2 the batch's; the unbiased two-batch estimates
  |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small),
  tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
are each smoothed by a bias-corrected moving average (0.99 a step, as GPT-NeoX's), and B_simple is their ratio, in
rows (`gns/b_simple`) and tokens (`gns/b_simple_tokens`).
"""
from __future__ import annotations

from typing import Any, Callable

from lm.train.callbacks import Callback, Interval
from lm.train.step import GNS_BIG as BIG, GNS_SMALL as SMALL

DECAY = 0.99


def two_batch(small_sq: Any, big_sq: Any, b_small: float, b_big: float) -> tuple[Any, Any]:
  """(|G|^2, tr Sigma) from the squared norms of mean gradients over b_small and b_big examples."""
  g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
  trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
  return g2, trace


class NoiseScale(Callback):
  """Turns each step's squared norms into the smoothed estimates, logged every `every` steps (each interval's last
  record when 0)."""

  def __init__(self, rows_at: Callable[[int], tuple[int, int]], seq_len: int, every: int):
    """`rows_at(step)`: (the batch's rows, its microbatches) at `step` (a batch ramp changes them)."""
    self.rows_at, self.seq_len, self.watch = rows_at, seq_len, every
    self.g2 = self.trace = 0.0
    self.seen = 0

  def annotate(self, interval: Interval) -> None:
    for record in interval.records:
      if SMALL not in record:
        continue
      rows, microbatches = self.rows_at(record['step'])
      g2, trace = two_batch(record.pop(SMALL), record.pop(BIG), rows / microbatches, rows)
      self.g2, self.trace = DECAY * self.g2 + (1 - DECAY) * g2, DECAY * self.trace + (1 - DECAY) * trace
      self.seen += 1
      if (self.watch and record['step'] % self.watch == 0) or (not self.watch and record is interval.records[-1]):
        correction = 1 - DECAY ** self.seen
        g2_ema, trace_ema = self.g2 / correction, self.trace / correction
        record.update({'gns/g2': g2_ema, 'gns/trace': trace_ema, 'gns/b_simple': trace_ema / g2_ema,
                       'gns/b_simple_tokens': trace_ema / g2_ema * self.seq_len})
