"""The one printer for `lm info` and `lm compile` reports (aligned `name  value` lines, byte sizes), and the
benchmarks' JSON writer."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal


def format_bytes(n: float, unit: Literal['GiB', 'MiB'] | None = None, digits: int | None = None,
                 suffix: bool = True) -> str:
  """`0.209 GiB`, `12.56 MiB`: GiB (3 decimals) from 128 MiB up and MiB (2) below, or the `unit` and `digits`
  given; `suffix=False` leaves the unit out (a table cell under a `GiB` heading)."""
  unit = unit or ('GiB' if n >= 2**27 else 'MiB')
  digits = (3 if unit == 'GiB' else 2) if digits is None else digits
  text = f'{n / (2**30 if unit == "GiB" else 2**20):,.{digits}f}'
  return f'{text} {unit}' if suffix else text


def format_lines(lines: Sequence[tuple[str, str]]) -> str:
  """Names left-aligned in one column, values after two spaces."""
  width = max(len(name) for name, _ in lines)
  return '\n'.join(f'{name:<{width}}  {value}' for name, value in lines)


def write_json(out: str | Path, result: Any) -> Path:
  """Writes a benchmark's `result` as indented JSON to `out`, making its folder."""
  out = Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + '\n')
  return out
