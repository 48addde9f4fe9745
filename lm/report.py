"""The one printer for `lm info` and `lm compile` reports: aligned `name  value` lines and byte sizes."""
from __future__ import annotations

from typing import Sequence


def format_bytes(n: float) -> str:
  """GiB from 128 MiB up, MiB below: `0.209 GiB`, `12.56 MiB`."""
  return f'{n / 2**30:,.3f} GiB' if n >= 2**27 else f'{n / 2**20:,.2f} MiB'


def format_lines(lines: Sequence[tuple[str, str]]) -> str:
  """Names left-aligned in one column, values after two spaces."""
  width = max(len(name) for name, _ in lines)
  return '\n'.join(f'{name:<{width}}  {value}' for name, value in lines)
