"""What every attention path shares: the masked-logit value and block rounding."""
from __future__ import annotations

MASKED = -1e30  # finite: a fully masked row gives zeros, never inf - inf (NaN); far below any real logit


def round_up(n: int, m: int) -> int:
  """The least multiple of `m` that is at least `n`."""
  return -(-n // m) * m
