"""`lm info` (params, FLOPs, mesh and memory of a config) and `lm compile` (ahead of time for a TPU slice, or
`--plan`: the mesh, remat and microbatch search), each at a batch ramp's largest batch (what must fit)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lm.commands.common import add_config, checked_config
from lm.config import ConfigError, largest_batch, parse_overrides, preset_slice


def cmd_info(args: argparse.Namespace) -> int:
  from lm.mesh_axes import mesh_text
  from lm.report import format_bytes, format_lines
  devices = args.devices
  if not devices and (named := preset_slice(args.config)):  # a preset sized for a slice: plan on its chips
    from lm.parallel.chips import slice_chips
    chips = slice_chips(named)
    devices = chips if chips > 1 else 0  # one chip: the host's devices, as they are
  if devices:
    import jax
    try:
      jax.config.update('jax_num_cpu_devices', devices)
    except RuntimeError:  # JAX has started already (lm called as a library): plan on the devices it has
      if args.devices:
        raise
  from lm.planning.compile import model_report
  report = model_report(largest_batch(checked_config(args)), args.compile)
  if args.json:
    print(json.dumps(report, indent=2))
    return 0
  p, mesh, mem = report['params'], report['mesh'], report['memory_per_device']
  lines = [
    ('config', report['name']),
    ('parameters', f'{p["total"]:,} total, {p["non_embedding"]:,} non-embedding'
                   + (f'; {p["active"]:,} active per token, {p["active_non_embedding"]:,} non-embedding'
                      if 'active' in p else '')
                   + (f'; {p["trained"]:,} trained (model.lora)' if 'trained' in p else '')),
    ('training FLOPs/token', f'{report["flops_per_token"]:.4g}'),
    ('KV cache/token', f'{report["cache_bytes_per_token"]:,} bytes (decoding, all layers)'),
    ('mesh', f'{mesh_text(mesh)} ({mesh["strategy"]}, '
             f'{mesh["devices"]} {mesh["platform"]} devices)'),
  ]
  if 'pipeline' in report:
    from lm.planning.stages import stages_lines
    lines += stages_lines(report['pipeline'])
  lines += [(f'memory/device: {k}', format_bytes(v)) for k, v in mem.items()]
  for k, v in report.get('compiled_memory_per_device', {}).items():
    lines.append((f'compiled memory/device: {k}', format_bytes(v)))
  print(format_lines(lines))
  return 0


def cmd_compile(args: argparse.Namespace) -> int:
  from lm.planning.compile import compile_report, does_not_fit_message, format_report
  topology = args.topology or preset_slice(args.config)
  if topology is None:
    raise ConfigError(f'lm compile: {args.config} names no slice in its header (a "# Slice: v5p-1024" line); '
                      f'pass --topology, e.g. --topology v5e-256')
  if args.plan:
    from lm.planning.plan import best_preset, format_plan, plan, plan_json
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
        (lambda line: print(line, flush=True))
    result = plan(largest_batch(checked_config(args)), topology, args.plan_top, args.num_slices,
                  args.plan_max_compiles, log=log, int8=args.plan_int8)
    print(json.dumps(plan_json(result), indent=2) if args.json else format_plan(result), flush=True)
    if args.write and result['plan']:
      Path(args.write).write_text(best_preset(result, args.config, parse_overrides(args.overrides)))
      print(f'wrote the best candidate as a preset: {args.write}', file=sys.stderr if args.json else sys.stdout)
    if not result['plan']:
      print(f'lm compile --plan: no candidate fits {topology}; try a bigger slice or a smaller train.global_batch',
            file=sys.stderr, flush=True)
      return 3
    return 0
  report = compile_report(largest_batch(checked_config(args)), topology, args.mfu, args.save, args.num_slices,
                          args.memory_breakdown)
  print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
  if not report['fits']:
    print(does_not_fit_message(report), file=sys.stderr, flush=True)
    return 3
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  info = sub.add_parser('info', help='parameters, FLOPs per token, mesh and per-device memory of a config')
  add_config(info)
  info.add_argument('--json', action='store_true', help='print the report as JSON')
  info.add_argument('--compile', action='store_true', help='also compile the train step and report its memory')
  info.add_argument('--devices', type=int, default=0,
                    help='simulate this many CPU devices (mesh planning; default: the chips of the slice the '
                         'preset\'s header names when it has more than one, else the host\'s devices)')
  info.set_defaults(fn=cmd_info, joins_job=True)

  aot = sub.add_parser('compile', help='compile the train step for a TPU slice ahead of time (no TPU needed): '
                                       'per-device memory, FLOPs and predicted step time')
  add_config(aot)
  aot.add_argument('--topology', help='TPU slice: v5p-1024, v5e-256, v4-128, v6e-64 or v5e:2x2 (default: the '
                                      'slice in the preset\'s header)')
  aot.add_argument('--mfu', type=float, default=0.5, help='assumed MFU for the predicted step time (default 0.5)')
  aot.add_argument('--num-slices', type=int, default=1, help='slices joined by the data-center network (multislice)')
  aot.add_argument('--save', metavar='PATH', help='write the serialized executable (and PATH.json with the report)')
  aot.add_argument('--json', action='store_true', help='print the report as JSON')
  aot.add_argument('--memory-breakdown', type=int, nargs='?', const=15, default=0, metavar='N',
                   help='what is live at the step\'s peak, by part (params, optimizer state, experts, attention, '
                        '...) and its N largest paths by named scope (default 15)')
  aot.add_argument('--plan', action='store_true', help='search meshes, remat and microbatches; compile the '
                                                        'fastest-predicted that may fit and list those that fit')
  aot.add_argument('--plan-top', type=int, default=5, metavar='N', help='--plan stops when N candidates fit (5)')
  aot.add_argument('--plan-max-compiles', type=int, metavar='N', help='--plan compiles at most N candidates '
                                                                      '(default 3 x --plan-top)')
  aot.add_argument('--plan-int8', action='store_true', help='--plan: also try model.quantization=int8 (it changes '
                                                              'the numerics, so the search takes it only when asked)')
  aot.add_argument('--write', metavar='PATH', help='--plan: save the best candidate as a preset YAML')
  aot.set_defaults(fn=cmd_compile)
