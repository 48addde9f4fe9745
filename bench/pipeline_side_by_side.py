"""Pipelined train steps, lm beside MaxText, compiled ahead of time for the same slice by the same libtpu: memory per
device and compile time at ROWS rows a device, and the most rows a device that fit each schedule; prints a table,
writes JSON. (The TPU executables' HLO carries no loop trip counts, so the sends a tick are counted on CPU, by
tests/parallel/test_pipeline.py and test_one_f_one_b.py.)

  python bench/pipeline_side_by_side.py --maxtext-venv V [--setup ici|dcn] [--rows 4] [--no-search] [--out FILE]

Both sides compile, as PIPELINE-NOTES's commands, llama2_7b on a v5p-128 slice (`ici`: 4 stages, fsdp over the rest of
the slice) or llama2_13b on 4 v5p-64 slices (`dcn`: a stage a slice, fsdp within it), 4,096 positions, full remat, 16
microbatches, under GPipe and circular (a layer a stage each repeat; 2 for llama2_13b's 40 layers, 5 repeats); lm also
under 1F1B, which MaxText does not have. The search doubles the rows from 4 while they fit the chip's memory, then
halves the gap, in steps of 4 (a microbatch's rows over the fsdp devices). MaxText runs from V, a Python 3.12 venv
with `pip install "maxtext[tpu]==0.2.5"`. Needs libtpu; nothing runs. Each compile takes about a minute on a 2-core
CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

from lm.parallel.chips import physical_topology, topology_devices
from lm.planning.breakdown import printed_memory
from lm.report import format_bytes, format_lines, write_json

STAGES, MICROBATCHES = 4, 16
ROW_STEP = 4
OUT_OF_MEMORY = ('RESOURCE_EXHAUSTED', 'Ran out of memory', 'exceeds the memory')


@dataclass(frozen=True)
class Setup:
  """A model on one slice or several, 4 stages over the slice's interconnect or across the slices."""
  config: str  # lm's preset
  maxtext_model: str
  topology: str
  slices: int
  layers: int
  circular_layers: int  # a stage's layers each repeat of the circular schedule
  lm_mesh: tuple[str, ...]
  maxtext_mesh: tuple[str, ...]

  def cases(self) -> dict[str, tuple[list[str], list[str] | None]]:
    """Each schedule's overrides: lm's, MaxText's (None: it has no such schedule)."""
    repeats = self.layers // STAGES // self.circular_layers
    return {
      'gpipe': (['model.execution.pipeline.schedule=gpipe'],
                [f'num_layers_per_pipeline_stage={self.layers // STAGES}']),
      'circular': (['model.execution.pipeline.schedule=circular', f'model.execution.pipeline.repeats={repeats}'],
                   [f'num_layers_per_pipeline_stage={self.circular_layers}']),
      '1f1b': (['model.execution.pipeline.schedule=1f1b'], None),
    }


SETUPS = {
  'ici': Setup('llama2_7b', 'llama2-7b', 'v5p-128', 1, 32, 1, (f'mesh.stage={STAGES}', 'mesh.fsdp=-1'),
               (f'ici_pipeline_parallelism={STAGES}', 'ici_fsdp_parallelism=-1')),
  'dcn': Setup('llama2_13b', 'llama2-13b', 'v5p-64', 4, 40, 2,
               ('mesh.stage=1', f'mesh.stage_slices={STAGES}', 'mesh.fsdp=-1'),
               (f'dcn_pipeline_parallelism={STAGES}', 'ici_fsdp_parallelism=-1')),
}


def lm_side(setup: Setup, case: str, rows: int) -> dict[str, Any]:
  """`lm compile` in a process of its own, as MaxText's."""
  chips = len(topology_devices(physical_topology(setup.topology), setup.slices))
  out = subprocess.run(['lm', 'compile', '--config', setup.config, '--topology', setup.topology, '--json',
                        '--num-slices', str(setup.slices), *setup.lm_mesh, f'train.microbatches={MICROBATCHES}',
                        f'train.global_batch={rows * chips}', 'data.seq_len=4096', *setup.cases()[case][0]],
                       env={**os.environ, 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}, capture_output=True, text=True,
                       timeout=3600)
  if out.returncode not in (0, 3):  # 3: it does not fit, the report printed
    raise SystemExit(f'lm compile failed (exit {out.returncode}):\n{out.stderr[-2000:]}')
  report = json.loads(out.stdout)
  return {'total': report['memory_per_device']['total'], 'compile_seconds': report['compile_seconds'],
          'bubble': report['pipeline']['bubble'], 'fits': report['fits'], 'hbm': report['hbm_per_device']}


def maxtext_side(venv: Path, setup: Setup, case: str, rows: int, hbm: int) -> dict[str, Any] | None:
  """Its memory a device; None when the compiler found the program does not fit (`hbm` bytes a device)."""
  package = next((venv / 'lib').glob('python3*/site-packages/maxtext'))
  with tempfile.TemporaryDirectory(prefix='pipeline_side_by_side_') as directory:
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'DECOUPLE_GCLOUD': 'TRUE', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}
    command = [str(venv / 'bin' / 'python'), '-m', 'maxtext.trainers.pre_train.train_compile',
               str(package / 'configs' / 'base.yml'), f'compile_topology={setup.topology}',
               f'compile_topology_num_slices={setup.slices}', f'model_name={setup.maxtext_model}',
               'max_target_length=4096', f'per_device_batch_size={rows}', 'remat_policy=full', 'run_name=pipeline',
               f'base_output_directory={directory}/out', 'enable_checkpointing=false', *setup.maxtext_mesh,
               f'num_pipeline_microbatches={MICROBATCHES}', 'scan_layers=true', *setup.cases()[case][1]]
    start = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
  memory = printed_memory(out.stdout + out.stderr)
  if memory is None and any(s in out.stdout + out.stderr for s in OUT_OF_MEMORY):
    return None
  if memory is None:
    raise SystemExit(f'MaxText printed no memory analysis (exit {out.returncode}):\n{out.stderr[-2000:]}')
  return {'total': memory['total'], 'compile_seconds': seconds, 'fits': memory['total'] <= hbm}


def most_rows(fits: Callable[[int], bool]) -> int:
  """The most rows a device (a multiple of ROW_STEP) for which `fits`: doubling from ROW_STEP, then halving the
  gap; 0 if not even ROW_STEP fits."""
  low, high = 0, ROW_STEP
  while fits(high):
    low, high = high, 2 * high
  while high - low > ROW_STEP:
    middle = (low + high) // (2 * ROW_STEP) * ROW_STEP
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--maxtext-venv', type=Path, required=True)
  parser.add_argument('--setup', choices=SETUPS, default='ici', help='ici: llama2_7b on a v5p-128 slice; dcn: '
                                                                     'llama2_13b on 4 v5p-64 slices, a stage each')
  parser.add_argument('--rows', type=int, default=4, help='rows a device')
  parser.add_argument('--no-search', action='store_true', help='skip the search for the most rows that fit')
  parser.add_argument('--out', help='default: bench/results/pipeline_side_by_side[_dcn].json')
  args = parser.parse_args()
  setup = SETUPS[args.setup]
  results = {}
  for case, (_, maxtext) in setup.cases().items():
    lm = lm_side(setup, case, args.rows)
    results[case] = {'lm': lm, 'maxtext': maxtext and maxtext_side(args.maxtext_venv, setup, case, args.rows,
                                                                    lm['hbm'])}
    if not args.no_search:
      results[case]['lm']['most_rows'] = most_rows(lambda r: lm_side(setup, case, r)['fits'])
      if maxtext:
        results[case]['maxtext']['most_rows'] = most_rows(lambda r: bool(
          (mt := maxtext_side(args.maxtext_venv, setup, case, r, lm['hbm'])) and mt['fits']))
  print(format_lines([line for case, r in results.items() for line in _lines(case, r['lm'], r['maxtext'])]))
  out = args.out or f'bench/results/pipeline_side_by_side{"" if args.setup == "ici" else "_" + args.setup}.json'
  write_json(out, {'setup': dataclasses.asdict(setup), 'rows_per_device': args.rows, 'stages': STAGES,
                   'microbatches': MICROBATCHES, 'results': results})


def _lines(case: str, lm: dict[str, Any], mt: dict[str, Any] | None) -> list[tuple[str, str]]:
  if mt is None:
    lines = [(f'{case}: memory/device', f'lm {format_bytes(lm["total"])} (MaxText has no {case})'),
             (f'{case}: compile', f'lm {lm["compile_seconds"]:.0f} s (the step)')]
  else:
    lines = [(f'{case}: memory/device', f'lm {format_bytes(lm["total"])}, MaxText {format_bytes(mt["total"])} '
                                        f'({lm["total"] / mt["total"]:.2f}x)'),
             (f'{case}: compile', f'lm {lm["compile_seconds"]:.0f} s (the step), MaxText {mt["compile_seconds"]:.0f} '
                                  f's (its process)')]
  lines.append((f'{case}: bubble', f'{lm["bubble"]:.1%}'))
  if 'most_rows' in lm:
    most = f'lm {lm["most_rows"]}' + (f', MaxText {mt["most_rows"]}' if mt else '')
    lines.append((f'{case}: most rows a device', most))
  return lines


if __name__ == '__main__':
  main()
