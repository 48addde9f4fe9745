"""Per-device memory of a preset's train step against its rows per device, and the most rows that fit: AOT
compiles for the preset's TPU slice (or --topology); prints a table, writes JSON.

  python bench/rows_per_device.py [--config llama2_7b] [--rows 1 4 12] [--max-from 44] [key=value ...]

Each row count sets train.global_batch = rows x the batch-splitting devices (no microbatches); the maximum is
the largest count from --max-from upward whose step compiles within HBM. Needs libtpu (the `tpu` extra); nothing
runs. docs/tpu_step.md holds the figures for llama2_7b on v5p-64.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lm.planning.compile import compile_report
from lm.config import load_config, preset_slice
from lm.parallel.chips import physical_topology, topology_devices
from lm.report import format_bytes, format_lines, write_json


def gib(n: float) -> str:
  return format_bytes(n, 'GiB', 2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='llama2_7b')
  parser.add_argument('--topology', default=None, help='default: the slice the preset names')
  parser.add_argument('--rows', nargs='*', type=int, default=[1, 4, 12], help='rows per device to report')
  parser.add_argument('--max-from', type=int, default=0, help='search the most rows that fit upward from here')
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'rows_per_device.json'))
  parser.add_argument('overrides', nargs='*', help='config overrides (key=value), e.g. model.execution.loss_chunk=0')
  args = parser.parse_args()

  topology = args.topology or preset_slice(args.config)
  devices = len(topology_devices(physical_topology(topology)))  # the batch splits over them all (data x fsdp)

  def compile_rows(rows: int) -> dict[str, Any]:
    config = load_config(args.config, args.overrides + [f'train.global_batch={rows * devices}',
                                                         'train.microbatches=1'])
    report = compile_report(config, topology)
    host = report['host_memory_per_device']
    print(f'{rows:4d} rows/device: {gib(report["memory_per_device"]["total"])} device, {gib(host["total"])} host '
          f'(temp {gib(host["temp"])}) fits={report["fits"]}', flush=True)
    return {'rows': rows, 'memory_per_device': report['memory_per_device'], 'host_memory_per_device': host,
            'fits': report['fits'], 'hbm_per_device': report['hbm_per_device'],
            'host_per_device': report['host_per_device'], 'error': report.get('compile_error')}

  results = [compile_rows(rows) for rows in args.rows]
  most = None
  if args.max_from:
    rows = args.max_from
    while (r := compile_rows(rows))['fits']:
      results.append(r)
      most, rows = rows, rows + 1
    results.append(r)
  fit = lambda r: f'{"fits" if r["fits"] else "does not fit"} {gib(r["hbm_per_device"])}'
  lines = [(f'{r["rows"]} rows/device', f'{gib(r["memory_per_device"]["total"])} ({fit(r)})') for r in results]
  if args.max_from:
    lines.append(('most rows/device that fit', str(most) if most else f'none from {args.max_from}'))
  print(format_lines(lines))
  summary = {'config': args.config, 'topology': topology, 'overrides': args.overrides, 'results': results,
             'max_rows': most}
  print(f'wrote {write_json(args.out, summary)}')


if __name__ == '__main__':
  main()
