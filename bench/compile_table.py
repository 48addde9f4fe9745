"""The preset table: compile every preset for the TPU slice it names ahead of time and write
docs/results/scaling_table.md.

  python bench/compile_table.py [--only gpt3_175b ...] [--out docs/results/scaling_table.md] [--json FILE] [--resume]

Needs libtpu (the `tpu` extra), no TPU. Each row is `lm compile --config PRESET` of the preset's real train
step for the slice its header names, with the mesh, remat and microbatches the preset carries; memory is XLA's
per-device `memory_analysis()`, the step time is model FLOPs over the slice's peak at the assumed MFU. A second
table compiles one preset with each remat policy on the same slice.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from lm.planning.compile import compile_report
from lm.config import load_config, preset_slice
from lm.mesh_axes import mesh_text
import lm.models  # noqa: F401  registers the family checks the loader runs
from lm.report import format_bytes

MFU = 0.5
# preset: published parameters (None: a CPU preset of ours), in table order. Each preset's header names its slice
# (`# Slice: v5p-1024 ...`) and the preset carries the mesh, remat, microbatches and loss tiling that fit it: the
# table compiles them with no overrides.
PLAN: dict[str, float | None] = {
  'transformer_base': 65e6, 'transformer_big': 213e6, 'bert_base': 110e6, 'bert_large': 340e6,
  'xlnet_large': 340e6, 'roberta_large': 355e6, 'gpt2_xl': 1542e6, 'megatron_8b': 8.3e9, 'turing_nlg_17b': 17e9,
  'gpt3_175b': 175e9,
  'gpt2_small': 117e6, 'gpt2_medium': 345e6, 'gpt2_large': 762e6,
  'gpt3_125m': 125e6, 'gpt3_350m': 350e6, 'gpt3_760m': 760e6, 'gpt3_1_3b': 1.3e9, 'gpt3_2_7b': 2.7e9,
  'gpt3_6_7b': 6.7e9, 'gpt3_13b': 13e9,
  't5_small': 60e6, 't5_base': 220e6, 't5_large': 770e6, 't5_3b': 3e9, 't5_11b': 11e9,
  't5_v1_1_small': 77e6, 't5_v1_1_base': 248e6, 't5_v1_1_large': 783e6, 't5_v1_1_xl': 2.85e9, 't5_v1_1_xxl': 11.3e9,
  'llama2_7b': 7e9, 'llama2_13b': 13e9, 'llama2_70b': 70e9,
  'llama3_8b': 8e9, 'llama3_70b': 70e9, 'llama3_1_405b': 405e9, 'mistral_7b': 7.3e9, 'qwen2_5_7b': 7.61e9,
  'qwen3_8b': 8.2e9, 'gemma2_9b': 9.24e9, 'gemma2_27b': 27.2e9,
  'gemma3_1b': 1.0e9, 'gemma3_4b': 3.88e9, 'gemma3_12b': 11.77e9, 'gemma3_27b': 27.0e9,
  'pythia_70m': 70.4e6, 'pythia_160m': 162.3e6, 'pythia_410m': 405.3e6, 'pythia_1b': 1.01e9, 'pythia_1_4b': 1.41e9,
  'pythia_2_8b': 2.78e9, 'pythia_6_9b': 6.86e9, 'pythia_12b': 11.85e9,
  'olmo2_1b': 1.48e9, 'olmo2_7b': 7.30e9, 'olmo2_13b': 13.7e9,
  'mixtral_8x7b': 46.7e9, 'qwen3_30b_a3b': 30.5e9, 'olmoe_1b_7b': 6.92e9,
  'gpt_oss_20b': 20.91e9, 'gpt_oss_120b': 116.83e9, 'deepseek_v3_671b': 671e9, 'kimi_k2_1t': 1.04e12,
  'gpt_tiny': None, 'gpt_bench': None, 'bert_tiny': None, 'llama_tiny': None, 't5_tiny': None, 't5_v1_0_tiny': None,
  'llama3_tiny': None, 'qwen3_tiny': None, 'gemma2_tiny': None, 'gemma3_tiny': None,
  'pythia_tiny': None, 'olmo_tiny': None, 'olmo2_tiny': None,
  'moe_tiny': None, 'gpt_oss_tiny': None, 'deepseek_v3_tiny': None,
}
REMAT_PRESET, REMAT_TOPOLOGY = 'gpt3_1_3b', 'v5e-64'
REMAT_OVERRIDES = ['mesh.data=1', 'mesh.fsdp=64']


def gib(n: float) -> str:
  return format_bytes(n, 'GiB', 2, suffix=False)


def seconds(s: float) -> str:
  return f'{s * 1e3:,.0f} ms' if s < 1 else f'{s:,.2f} s'


def published(params: float | None) -> str:
  return '-' if params is None else f'{params / 1e6:,.0f}M'


def mesh_cell(r: dict[str, Any]) -> str:
  return f'{mesh_text(r["mesh"])} ({r["mesh"]["strategy"]})'


def batch_text(r: dict[str, Any]) -> str:
  micro = f' in {r["microbatches"]} microbatches' if r['microbatches'] > 1 else ''
  return f'{r["global_batch"]} x {r["seq_len"]}{micro}'


def scaling_rows(reports: dict[str, dict[str, Any]]) -> list[str]:
  rows = ['| preset | params (ours) | published | topology | mesh | remat | batch | '
          'memory/device GiB (args + temp) | HBM GiB | fits | step at peak | step at 50% MFU | tokens/s |',
          '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for name, r in reports.items():
    mem = r['memory_per_device']
    rows.append(
      f'| {name} | {r["params"]["total"] / 1e6:,.1f}M | {published(PLAN[name])} | {r["topology"]} '
      f'({r["chips"]} chips) | {mesh_cell(r)} | {r["remat"]} | {batch_text(r)} | {gib(mem["total"])} '
      f'({gib(mem["arguments"])} + {gib(mem["temp"])}) | {gib(r["hbm_per_device"])} | '
      f'{"yes" if r["fits"] else "**no**"} | {seconds(r["step_seconds_at_peak"])} | {seconds(r["step_seconds"])} | '
      f'{r["tokens_per_sec"]:,.0f} |')
  return rows


def remat_rows(reports: dict[str, dict[str, Any]]) -> list[str]:
  rows = ['| remat | temp GiB/device | total GiB/device | fits |', '|---|---|---|---|']
  for policy, r in reports.items():
    mem = r['memory_per_device']
    rows.append(f'| {policy} | {gib(mem["temp"])} | {gib(mem["total"])} | {"yes" if r["fits"] else "**no**"} |')
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--only', nargs='*', default=None, choices=list(PLAN), metavar='PRESET',
                      help='presets to compile (default: the whole table)')
  parser.add_argument('--remat', action=argparse.BooleanOptionalAction, default=True,
                      help=f'also compare remat policies on {REMAT_PRESET} (three compiles; default %(default)s)')
  parser.add_argument('--out', default='docs/results/scaling_table.md')
  parser.add_argument('--json', default='docs/results/scaling_table.json',
                      help='the reports behind the table, rewritten after every compile')
  parser.add_argument('--resume', action='store_true',
                      help='keep the reports --json already holds and compile only the others (an interrupted run)')
  args = parser.parse_args()

  start = time.perf_counter()
  saved = json.loads(Path(args.json).read_text()) if args.resume and Path(args.json).is_file() else {}
  reports: dict[str, dict[str, Any]] = {}
  remat: dict[str, dict[str, Any]] = {}
  spent = saved.get('seconds', 0.0)

  def keep() -> None:  # an interrupted run loses at most the compile in flight
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({'table': reports, 'remat': remat,
                                           'seconds': spent + time.perf_counter() - start}, indent=2) + '\n')

  for name in args.only or PLAN:
    if name in saved.get('table', {}):
      reports[name] = saved['table'][name]
      print(f'{name:16s} kept from {args.json}', flush=True)
      continue
    reports[name] = compile_report(load_config(name), preset_slice(name), MFU)
    keep()
    r = reports[name]
    print(f'{name:16s} {r["topology"]:9s} {gib(r["memory_per_device"]["total"]):>8s} GiB/device '
          f'fits={r["fits"]} compiled in {r["compile_seconds"]:.1f}s', flush=True)
  for policy in ('none', 'projections', 'full') if args.remat else ():
    if policy in saved.get('remat', {}):
      remat[policy] = saved['remat'][policy]
      continue
    config = load_config(REMAT_PRESET, REMAT_OVERRIDES + [f'model.execution.remat={policy}'])
    remat[policy] = compile_report(config, REMAT_TOPOLOGY, MFU)
    keep()
    print(f'{REMAT_PRESET} remat={policy:12s} temp {gib(remat[policy]["memory_per_device"]["temp"])} GiB', flush=True)
  total_s = spent + time.perf_counter() - start

  lines = [
    '# The scaling table, compiled for TPU slices',
    '',
    f'Written by `python bench/compile_table.py` ({total_s / 60:.1f} minutes on a 2-core CPU, libtpu, no TPU).',
    'Each row lowers and compiles the preset\'s real train step (AdamW, bf16 compute, fp32 params and',
    'optimizer state, scanned layers, our flash attention through Mosaic) for the slice with `lm compile`.',
    'Memory is XLA\'s per-device `memory_analysis()`: arguments (sharded state and batch; the donated',
    'state aliases the outputs) plus temporaries. Step times are model FLOPs (6N plus causal attention,',
    f'`lm/assembly/accounting.py`) over the slice\'s bf16 peak, and at an assumed {MFU:.0%} MFU.',
    '',
    *scaling_rows(reports),
    '',
  ]
  if remat:
    lines += [
      f'## Remat on {REMAT_PRESET}, {REMAT_TOPOLOGY}, mesh {" ".join(REMAT_OVERRIDES)}',
      '',
      'Selective remat (`projections`: keep the q/k/v/out projections and MLP outputs, recompute the rest)',
      'against none and full (keep only each layer\'s input):',
      '',
      *remat_rows(remat),
      '',
    ]
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text('\n'.join(lines))
  keep()
  print('\n'.join(lines))
  print(f'wrote {out} in {total_s:.0f}s')


if __name__ == '__main__':
  main()
