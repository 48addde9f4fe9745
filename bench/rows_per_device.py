"""Per-device memory of a preset's train step against its rows per device, and the most rows that fit, under each
memory lever: AOT compiles for the preset's TPU slice (or --topology); prints a table, writes JSON.

  python bench/rows_per_device.py [--config llama2_7b] [--rows 1 4 12] [--max-from 44] [key=value ...]
  python bench/rows_per_device.py --levers none offload offload+optimizer --max-between 40 160

Each row count sets train.global_batch = rows x the batch-splitting devices (no microbatches). `--max-from N`
searches upward from N one row at a time; `--max-between LO HI` bisects (LO must fit, HI must not). A step fits
when the compiler accepts it within HBM and (with offloading) its host memory is within what the chip's host has
(`HOST_BYTES`); each row also says which of the two limits it meets. `--levers` repeats the search per lever
set (`LEVERS`). Needs libtpu (the `tpu` extra); nothing runs. docs/results/tpu_step.md holds the figures for llama2_7b
on v5p-64.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

from lm.planning.compile import compile_report
from lm.config import load_config, preset_slice
from lm.parallel.chips import physical_topology, topology_devices
from lm.report import format_bytes, format_lines, write_json

# The memory levers (issue 70): remat's saved layer inputs in host memory, the optimizer state there too, int8
# projections (which change the numerics).
LEVERS = {
  'none': [],
  'offload': ['model.execution.offload=[layer_input]'],
  'offload+optimizer': ['model.execution.offload=[layer_input]', 'train.optimizer_offload=true'],
  'int8': ['model.quantization=int8'],
  'int8+offload': ['model.quantization=int8', 'model.execution.offload=[layer_input]'],
}


def gib(n: float) -> str:
  return format_bytes(n, 'GiB', 2)


def compile_rows(config_name: str, topology: str, overrides: list[str], rows: int) -> dict[str, Any]:
  devices = len(topology_devices(physical_topology(topology)))  # the batch splits over them all (data x fsdp)
  config = load_config(config_name, overrides + [f'train.global_batch={rows * devices}', 'train.microbatches=1'])
  report = compile_report(config, topology)
  memory, host = report['memory_per_device'], report['host_memory_per_device']
  device_fits = 'compile_error' not in report and memory['total'] <= report['hbm_per_device']
  result = {'rows': rows, 'memory_per_device': memory, 'host_memory_per_device': host, 'fits': report['fits'],
            'device_fits': device_fits, 'hbm_per_device': report['hbm_per_device'],
            'host_per_device': report['host_per_device'], 'error': report.get('compile_error')}
  print(f'{rows:4d} rows/device: {describe(result)}', flush=True)
  return result


def describe(r: dict[str, Any]) -> str:
  host = r['host_memory_per_device']['total']
  device = f'{gib(r["memory_per_device"]["total"])} device ({"fits" if r["device_fits"] else "over"} ' \
           f'{gib(r["hbm_per_device"])} HBM)'
  if not host:
    return device
  if r['host_per_device'] is None:
    return f'{device}, {gib(host)} host (its limit unknown)'
  return f'{device}, {gib(host)} host ({"fits" if host <= r["host_per_device"] else "over"} ' \
         f'{gib(r["host_per_device"])})'


def most_rows(compile_at: Callable[[int], dict[str, Any]], low: int, high: int, fits: str = 'fits'
              ) -> tuple[int | None, list]:
  """The most rows in [low, high) whose compile says `fits` ('fits': both memories; 'device_fits': HBM alone), by
  bisection (low fitting, high not); and every compile made."""
  made = [compile_at(low), compile_at(high)]
  if not made[0][fits] or made[1][fits]:
    return None, made
  while high - low > 1:
    middle = (low + high) // 2
    made.append(compile_at(middle))
    low, high = (middle, high) if made[-1][fits] else (low, middle)
  return low, made


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='llama2_7b')
  parser.add_argument('--topology', default=None, help='default: the slice the preset names')
  parser.add_argument('--rows', nargs='*', type=int, default=[], help='rows per device to report')
  parser.add_argument('--max-from', type=int, default=0, help='search the most rows that fit upward from here')
  parser.add_argument('--max-between', type=int, nargs=2, metavar=('LO', 'HI'), help='bisect the most rows that fit')
  parser.add_argument('--levers', nargs='*', choices=sorted(LEVERS), default=['none'])
  parser.add_argument('--device-only', action='store_true',
                      help='--max-between: the most rows within HBM, whatever the host memory they need')
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'rows_per_device.json'))
  parser.add_argument('overrides', nargs='*', help='config overrides (key=value), e.g. model.execution.loss_chunk=0')
  args = parser.parse_args()
  topology = args.topology or preset_slice(args.config)

  summary = {'config': args.config, 'topology': topology, 'overrides': args.overrides, 'levers': {}}
  lines = []
  for lever in args.levers:
    print(f'{lever}:', flush=True)
    compile_at = lambda rows: compile_rows(args.config, topology, args.overrides + LEVERS[lever], rows)  # noqa: B023
    results = [compile_at(rows) for rows in args.rows]
    most = None
    if args.max_between:
      most, made = most_rows(compile_at, *args.max_between, 'device_fits' if args.device_only else 'fits')
      results += made
    elif args.max_from:
      rows = args.max_from
      while (r := compile_at(rows))['fits']:
        results.append(r)
        most, rows = rows, rows + 1
      results.append(r)
    summary['levers'][lever] = {'results': results, 'max_rows': most, 'device_only': args.device_only}
    lines += [(f'{lever}: {r["rows"]} rows/device', describe(r)) for r in sorted(results, key=lambda r: r['rows'])]
    if args.max_between or args.max_from:
      within = ' within HBM' if args.device_only else ''
      lines.append((f'{lever}: most rows/device that fit{within}', str(most) if most else 'none in the range'))
  print(format_lines(lines))
  print(f'wrote {write_json(args.out, summary)}')


if __name__ == '__main__':
  main()
