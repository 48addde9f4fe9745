"""Pipelined train steps, lm beside MaxText, compiled ahead of time for the same slice by the same libtpu: memory per
device and compile time; prints a table, writes JSON. (The TPU executables' HLO carries no loop trip counts, so the
sends a tick are counted on CPU, by tests/parallel/test_pipeline.py and test_one_f_one_b.py.)

  python bench/pipeline_side_by_side.py --maxtext-venv V [--topology v5p-128] [--rows 4] [--out FILE]

Both sides compile llama2_7b (4,096 positions, full remat, ROWS rows a device) on 4 stages with fsdp over the rest,
16 microbatches, GPipe (8 layers a stage) and circular (8 repeats of 1 layer a stage), as PIPELINE-NOTES's commands.
MaxText runs from V, a Python 3.12 venv with `pip install "maxtext[tpu]==0.2.5"`. Needs libtpu; nothing runs. Each compile takes about a minute on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from lm.parallel.chips import physical_topology, topology_devices
from lm.planning.breakdown import printed_memory
from lm.report import format_bytes, format_lines, write_json

STAGES, MICROBATCHES, LAYERS = 4, 16, 32
CASES = {  # name: (lm's overrides, MaxText's)
  'gpipe': (['model.execution.pipeline.schedule=gpipe'], [f'num_layers_per_pipeline_stage={LAYERS // STAGES}']),
  'circular': (['model.execution.pipeline.schedule=circular', f'model.execution.pipeline.repeats={LAYERS // STAGES}'],
               ['num_layers_per_pipeline_stage=1']),
}


def lm_side(case: str, topology: str, rows: int) -> dict[str, Any]:
  """`lm compile` in a process of its own, as MaxText's."""
  chips = len(topology_devices(physical_topology(topology), 1))
  out = subprocess.run(['lm', 'compile', '--config', 'llama2_7b', '--topology', topology, '--json',
                        f'mesh.stage={STAGES}', 'mesh.fsdp=-1', f'train.microbatches={MICROBATCHES}',
                        f'train.global_batch={rows * chips}', 'data.seq_len=4096', *CASES[case][0]],
                       env={**os.environ, 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}, capture_output=True, text=True,
                       timeout=3600)
  if out.returncode:
    raise SystemExit(f'lm compile failed (exit {out.returncode}):\n{out.stderr[-2000:]}')
  report = json.loads(out.stdout)
  return {'total': report['memory_per_device']['total'], 'compile_seconds': report['compile_seconds'],
          'bubble': report['pipeline']['bubble']}


def maxtext_side(venv: Path, case: str, topology: str, rows: int) -> dict[str, Any]:
  package = next((venv / 'lib').glob('python3*/site-packages/maxtext'))
  with tempfile.TemporaryDirectory(prefix='pipeline_side_by_side_') as directory:
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'DECOUPLE_GCLOUD': 'TRUE', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}
    command = [str(venv / 'bin' / 'python'), '-m', 'maxtext.trainers.pre_train.train_compile',
               str(package / 'configs' / 'base.yml'), f'compile_topology={topology}', 'compile_topology_num_slices=1',
               'model_name=llama2-7b', 'max_target_length=4096', f'per_device_batch_size={rows}', 'remat_policy=full',
               'run_name=pipeline', f'base_output_directory={directory}/out', 'enable_checkpointing=false',
               f'ici_pipeline_parallelism={STAGES}', 'ici_fsdp_parallelism=-1',
               f'num_pipeline_microbatches={MICROBATCHES}', 'scan_layers=true', *CASES[case][1]]
    start = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
  memory = printed_memory(out.stdout + out.stderr)
  if memory is None:
    raise SystemExit(f'MaxText printed no memory analysis (exit {out.returncode}):\n{out.stderr[-2000:]}')
  return {'total': memory['total'], 'compile_seconds': seconds}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--maxtext-venv', type=Path, required=True)
  parser.add_argument('--topology', default='v5p-128')
  parser.add_argument('--rows', type=int, default=4, help='rows a device')
  parser.add_argument('--out', default='bench/results/pipeline_side_by_side.json')
  args = parser.parse_args()
  results = {case: {'lm': lm_side(case, args.topology, args.rows),
                    'maxtext': maxtext_side(args.maxtext_venv, case, args.topology, args.rows)} for case in CASES}
  for case, r in results.items():
    lm, mt = r['lm'], r['maxtext']
    print(format_lines([
      (f'{case}: memory/device', f'lm {format_bytes(lm["total"])}, MaxText {format_bytes(mt["total"])} '
                                 f'({lm["total"] / mt["total"]:.2f}x)'),
      (f'{case}: compile', f'lm {lm["compile_seconds"]:.0f} s (the step), MaxText {mt["compile_seconds"]:.0f} s '
                           f'(its process)'),
      (f'{case}: bubble', f'{lm["bubble"]:.1%}'),
    ]))
  write_json(args.out, {'topology': args.topology, 'rows_per_device': args.rows, 'stages': STAGES,
                        'microbatches': MICROBATCHES, 'results': results})


if __name__ == '__main__':
  main()
