"""The tiled output layer's effect on memory: per-device temp of the train step compiled for each preset's own
TPU slice, `model.execution.loss_chunk=0` (untiled) against tiles; prints a table, writes JSON.

  python bench/loss_memory.py [--presets gpt2_xl gpt3_175b] [--chunks 256 512] [--out FILE]

Needs libtpu (the `tpu` extra) for the ahead-of-time compiles; nothing runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lm.planning.compile import compile_report
from lm.config import load_config, preset_slice
from lm.report import format_bytes, format_lines, write_json


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--presets', nargs='+', default=['gpt2_xl', 'gpt3_175b'])
  parser.add_argument('--chunks', nargs='+', type=int, default=[256, 512], help='tile sizes (sequence positions)')
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'loss_memory.json'))
  args = parser.parse_args()

  results, lines = [], []
  for preset in args.presets:
    topology, temps = preset_slice(preset), {}
    for chunk in [0] + args.chunks:
      report = compile_report(load_config(preset, [f'model.execution.loss_chunk={chunk}']), topology)
      temps[chunk] = report['memory_per_device']['temp']
      results.append({'preset': preset, 'topology': topology, 'loss_chunk': chunk,
                      'memory_per_device': report['memory_per_device'], 'fits': report['fits']})
    lines.append((f'{preset} ({topology}) temp per device',
                  f'untiled {format_bytes(temps[0])}; ' + ', '.join(
                    f'loss_chunk={c} {format_bytes(temps[c])} ({temps[c] / temps[0] - 1:+.0%})' for c in args.chunks)))
  print(format_lines(lines))
  print(f'wrote {write_json(args.out, results)}')


if __name__ == '__main__':
  main()
