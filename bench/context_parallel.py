"""Context parallelism at long context: `lm compile` of one preset on a TPU slice with mesh.sequence 1, 2, 4, 8.

  python bench/context_parallel.py [--config llama2_7b] [--topology v5p-32] [--length 32768]
                                   [--ring-blocks xla flash] [--out docs/results/context_parallelism.md] [--json FILE]

Needs libtpu (the `tpu` extra), no TPU. Every row compiles the real train step ahead of time with one sequence
per group of `mesh.sequence` chips (data x fsdp = chips / sequence rows, fsdp filling the rest): each chip holds
length / sequence tokens of the step. Memory is XLA's per-device `memory_analysis()`; the step time is model FLOPs
over the slice's peak at the assumed MFU, as `lm compile` prints it. The first row, without context parallelism,
is the baseline (its attention is the flash kernel); each split row is compiled with the ring's blocks through XLA
(`model.execution.attention_impl=xla`) and through our flash kernel (`flash`).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lm.planning.compile import compile_report
from lm.config import load_config
from lm.parallel.chips import physical_topology, topology_devices
from lm.report import format_bytes

# model.execution.attention_impl -> what runs: without a split sequence `auto` is the flash kernel on TPU; with one,
# the ring
ATTENTION = {'auto': 'flash kernel (no ring)', 'xla': 'ring, XLA blocks', 'flash': 'ring, flash-kernel blocks'}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='llama2_7b')
  parser.add_argument('--topology', default='v5p-32')
  parser.add_argument('--length', type=int, default=32768)
  parser.add_argument('--sequence', type=int, nargs='+', default=[1, 2, 4, 8])
  parser.add_argument('--ring-blocks', nargs='+', choices=['xla', 'flash'], default=['xla', 'flash'],
                      help="the ring's block implementations compiled for each split row")
  parser.add_argument('--mfu', type=float, default=0.5)
  parser.add_argument('--out', default='docs/results/context_parallelism.md')
  parser.add_argument('--json', help='also write the reports here')
  args = parser.parse_args()

  chips = len(topology_devices(physical_topology(args.topology)))
  rows, reports = [], []
  runs = [(n, impl) for n in args.sequence for impl in (['auto'] if n == 1 else args.ring_blocks)]
  for n, impl in runs:
    overrides = [f'data.seq_len={args.length}', f'model.max_len={args.length}', 'mesh.data=1', 'mesh.fsdp=-1',
                 f'mesh.sequence={n}', f'train.global_batch={chips // n}', f'model.execution.attention_impl={impl}']
    t0 = time.perf_counter()
    report = compile_report(load_config(args.config, overrides), args.topology, assumed_mfu=args.mfu)
    memory = report['memory_per_device']
    gib = [format_bytes(memory[k], 'GiB', 2, suffix=False) for k in ('arguments', 'temp', 'total')]
    rows.append(f"| {n} | {ATTENTION[impl]} | {report['mesh']['fsdp']} x {n} | {chips // n} | {args.length // n:,} | "
                f"{' | '.join(gib)} | {'yes' if report['fits'] else 'no'} | {report['step_seconds']:.3g} | "
                f"{report['tokens_per_sec']:,.0f} |")
    reports.append({'sequence': n, 'attention': ATTENTION[impl], 'overrides': overrides, **report})
    print(rows[-1], f'({time.perf_counter() - t0:.0f} s to compile)', flush=True)

  hbm = format_bytes(reports[0]['hbm_per_device'], 'GiB', 0)
  table = '\n'.join([
    f'# Context parallelism: {args.config} at {args.length:,} tokens on {args.topology} ({chips} chips)', '',
    f'`python bench/context_parallel.py --config {args.config} --topology {args.topology} --length {args.length}`: '
    f'the train step compiled ahead of time for each `mesh.sequence`, one sequence per {chips} / sequence chips '
    f'(fsdp fills the rest; parameters and optimizer state shard over fsdp x sequence). Memory per device '
    f'against {hbm} of HBM; step time from model FLOPs at {args.mfu:.0%} MFU.', '',
    '| mesh.sequence | attention | fsdp x sequence | global batch | tokens per chip | arguments GiB | temp GiB | '
    'total GiB | fits | step s | tokens/s |',
    '|---|---|---|---|---|---|---|---|---|---|---|', *rows, ''])
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(table)
  print(f'wrote {args.out}')
  if args.json:
    Path(args.json).write_text(json.dumps(reports, indent=2, default=str) + '\n')


if __name__ == '__main__':
  main()
