"""The one printer for `lm info` and `lm compile` reports (aligned `name  value` lines, byte sizes), and the
benchmarks' JSON writer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def format_bytes(n: float) -> str:
  """GiB from 128 MiB up, MiB below: `0.209 GiB`, `12.56 MiB`."""
  return f'{n / 2**30:,.3f} GiB' if n >= 2**27 else f'{n / 2**20:,.2f} MiB'


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
