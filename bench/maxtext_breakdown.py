"""What is live at the train step's peak, lm beside MaxText, from the same compiler's live-range dumps: prints a
table by part and each side's largest buffers, writes JSON.

  python bench/maxtext_breakdown.py --maxtext-venv V [--preset mixtral_8x7b] [--rows 8] [--top 12] [key=value ...]

lm's side is `lm compile --config PRESET --memory-breakdown` at ROWS rows a device (key=value overrides lm's
config). MaxText's is its ahead-of-time `train_compile` of the same model, slice, sequence, rows, full remat and
loss tiling (`MAXTEXT`), run from V, a Python 3.12 venv with `pip install "maxtext[tpu]==0.2.5"` (the same libtpu),
with `XLA_FLAGS` asking for the dump; both dumps are read by `lm.planning.breakdown`. Needs libtpu; nothing runs.
Each compile takes one to four minutes on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from lm.config import load_config, preset_slice
from lm.planning.breakdown import printed_memory, read_peak, summarize
from lm.parallel.chips import physical_topology, topology_devices
from lm.planning.compile import compile_report
from lm.report import format_bytes, format_lines, write_json

# MaxText's arguments for the step each preset compiles (PERF-NOTES's side-by-side commands).
MAXTEXT = {
  'mixtral_8x7b': ['model_name=mixtral-8x7b', 'max_target_length=8192', 'ici_fsdp_parallelism=-1',
                   'sparse_matmul=True', 'megablox=True', 'num_vocab_tiling=8', 'load_balance_loss_weight=0.001'],
  'llama2_7b': ['model_name=llama2-7b', 'max_target_length=4096', 'num_vocab_tiling=16'],
}


def maxtext_side(venv: Path, preset: str, rows: int, top: int) -> dict[str, Any]:
  """MaxText's compiled memory (arguments + temporaries + code, as lm counts) and what is live at its peak."""
  package = next((venv / 'lib').glob('python3*/site-packages/maxtext'))
  with tempfile.TemporaryDirectory(prefix='maxtext_breakdown_') as directory:
    dump = Path(directory) / 'dump'
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'DECOUPLE_GCLOUD': 'TRUE', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1',
           'XLA_FLAGS': f'--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step'}
    command = [str(venv / 'bin' / 'python'), '-m', 'maxtext.trainers.pre_train.train_compile',
               str(package / 'configs' / 'base.yml'), f'compile_topology={preset_slice(preset)}',
               'compile_topology_num_slices=1', f'per_device_batch_size={rows}', 'remat_policy=full',
               'run_name=breakdown', f'base_output_directory={directory}/out', 'enable_checkpointing=false',
               *MAXTEXT[preset]]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    memory = printed_memory(out.stdout + out.stderr)
    if memory is None:
      raise SystemExit(f'MaxText printed no memory analysis (exit {out.returncode}):\n{out.stderr[-2000:]}')
    live = sorted(dump.glob('*jit_train_step*live-range.txt'))[-1].read_text()
    return {**memory, 'breakdown': summarize(*read_peak(live), top)}


def lm_side(preset: str, rows: int, top: int, overrides: list[str]) -> dict[str, Any]:
  """lm's compile at `rows` a device: both presets split the batch over every chip of their slice (fsdp)."""
  topology = preset_slice(preset)
  chips = len(topology_devices(physical_topology(topology), 1))
  config = load_config(preset, [*overrides, f'train.global_batch={rows * chips}'])
  report = compile_report(config, topology, breakdown=top)
  memory = report['memory_per_device']
  return {'total': memory['total'], 'temp': memory['temp'], 'breakdown': report['memory_breakdown']}


def table(sides: dict[str, dict[str, Any]]) -> str:
  parts = sorted({p for s in sides.values() for p in s['breakdown']['parts']},
                 key=lambda p: -max(s['breakdown']['parts'].get(p, 0) for s in sides.values()))
  cell = lambda size: f'{format_bytes(size):>12}'
  lines = [('', ''.join(f'{name:>12}' for name in sides))]
  lines += [('compiled total', ''.join(cell(s['total']) for s in sides.values())),
            ('live at the peak', ''.join(cell(s['breakdown']['peak']) for s in sides.values()))]
  lines += [(f'  {p}', ''.join(cell(s['breakdown']['parts'].get(p, 0)) for s in sides.values())) for p in parts]
  for name, side in sides.items():
    lines += [(f'{name}: largest', '')]
    lines += [(f'  {row["path"][-110:]}' + (f' (x{row["buffers"]})' if row['buffers'] > 1 else ''),
               format_bytes(row['bytes'])) for row in side['breakdown']['largest']]
  return format_lines(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--maxtext-venv', type=Path, required=True, help='a venv with maxtext[tpu]==0.2.5')
  parser.add_argument('--preset', default='mixtral_8x7b', choices=sorted(MAXTEXT))
  parser.add_argument('--rows', type=int, default=8, help='rows (sequences) a device')
  parser.add_argument('--top', type=int, default=12, help='largest buffers listed per side')
  parser.add_argument('--out', default='bench/results/maxtext_breakdown.json')
  parser.add_argument('overrides', nargs='*', help="lm's config overrides, e.g. model.execution.mlp_chunks=1")
  args = parser.parse_args()
  sides = {'lm': lm_side(args.preset, args.rows, args.top, args.overrides),
           'MaxText': maxtext_side(args.maxtext_venv, args.preset, args.rows, args.top)}
  print(table(sides))
  print(f'wrote {write_json(args.out, {"preset": args.preset, "rows": args.rows, "overrides": args.overrides, **sides})}')


if __name__ == '__main__':
  main()
