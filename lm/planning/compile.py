"""Ahead-of-time compile of the real train step for a TPU slice, from any machine with libtpu.

`compile_report(config, 'v5p-1024')` builds the abstract train state and batch on the slice's
compile-only devices, lowers and compiles the jitted train step, and reports per-device memory
(XLA's `memory_analysis()`) against the chip's HBM, model FLOPs per step, and the step time and
tokens/s they imply at the chip's peak and at an assumed MFU. Nothing is allocated or run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import jax

from lm.assembly import assemble
from lm.assembly.accounting import cache_bytes_per_token, count_params, estimate_memory, shard_bytes
from lm.assembly.state import HOST
from lm.config import Config, ConfigError
from lm.mesh_axes import mesh_text
from lm.parallel.chips import hbm_bytes, host_bytes, peak_flops, physical_topology, topology_devices
from lm.parallel.mesh import strategy_name
from lm.report import format_bytes, format_lines
from lm.planning import kept
from lm.planning.breakdown import compile_with_breakdown, format_breakdown
from lm.planning.stages import stages_lines, stages_report
from lm.train.distill import Teacher, abstract_teacher
from lm.train.step import compile_train_step, lower_train_step


def _unfitted_memory(assembly: Any, error: str | None) -> tuple[dict[str, int], dict[str, int]]:
  """Per-device memory of a step the compiler refused: the state, and the temporaries its error names; and the
  host memory of its offloaded state."""
  state_bytes = shard_bytes(assembly.abstract_state)
  needed = _oom_figures(error) or 0
  host = shard_bytes(assembly.abstract_state, HOST)
  return ({'arguments': state_bytes, 'outputs': state_bytes, 'aliased': state_bytes, 'temp': needed,
           'generated_code': 0, 'total': state_bytes + needed},
          {'arguments': host, 'outputs': host, 'aliased': host, 'temp': 0, 'total': host})


def on_slices(config: Config, num_slices: int) -> Config:
  """`config` on `num_slices` slices: those the stages span (mesh.stage_slices) times the data-parallel slices."""
  staged = config.mesh.stage_slices
  if num_slices % staged:
    raise ConfigError(f'--num-slices {num_slices} is not a multiple of mesh.stage_slices={staged} (the slices the '
                      f'stages span); use a multiple of it')
  return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, slices=num_slices // staged))


def compile_report(config: Config, topology: str, assumed_mfu: float = 0.5, save: str | None = None,
                   num_slices: int = 1, breakdown: int = 0) -> dict[str, Any]:
  """Compiles the train step for `num_slices` slices of `topology` (joined by the data-center network: data
  parallel across them, mesh.slices, or stages, mesh.stage_slices) and returns memory, FLOPs and predicted speed per
  step; with `breakdown`, what is live at the step's peak and its `breakdown` largest paths
  (`lm.planning.breakdown`)."""
  if not 0 < assumed_mfu <= 1:
    raise ConfigError(f'--mfu {assumed_mfu} must lie in (0, 1]')
  if num_slices < 1:
    raise ConfigError(f'--num-slices {num_slices} must be at least 1')
  physical = physical_topology(topology)
  devices = topology_devices(physical, num_slices)
  config = on_slices(config, num_slices)
  peak, hbm = peak_flops(devices[0], config.model.quantization), hbm_bytes(devices[0])
  if peak is None or hbm is None:
    raise ConfigError(f'no peak FLOP/s or HBM size on record for {devices[0].device_kind}; add it to '
                      f'PEAK_FLOPS and HBM_BYTES in lm/parallel/chips.py')
  assembly = assemble(config, devices)
  sizes = dict(assembly.mesh.shape)
  label = re.sub(r'[^\w.-]', '_', f'{config.name}.{topology}' + f'.x{num_slices}' * (num_slices > 1))
  compiled, figures = _compiled_figures(assembly, breakdown, label, keep=not save)
  memory, host, cost, live, error = (figures[k] for k in ('memory', 'host', 'cost', 'live', 'error'))
  host_per_chip = host_bytes(devices[0])
  t, e = config.train, config.model.execution
  tokens = t.global_batch * config.data.seq_len
  flops_per_token = assembly.flops_per_token()
  flops = flops_per_token * tokens
  at_peak = flops / (peak * len(devices))
  report = {
    'config': config.name, 'topology': topology, 'physical_topology': physical, 'num_slices': num_slices,
    'chips': len(devices), 'device_kind': devices[0].device_kind,
    'mesh': {**sizes, 'strategy': strategy_name(sizes)}, 'remat': e.remat, 'scan_layers': e.scan_layers,
    'attention_impl': e.attention_impl, 'dtype': e.dtype, 'global_batch': t.global_batch,
    'microbatches': t.microbatches, 'seq_len': config.data.seq_len,
    'params': count_params(assembly.abstract_params, config.model),
    'memory_per_device': memory, 'hbm_per_device': hbm, 'host_memory_per_device': host,
    'estimated_memory': with_teacher(estimate_memory(config, assembly.abstract_state, assembly.mesh),
                                     abstract_teacher(assembly))['total (estimate)'],
    'host_per_device': host_per_chip,
    'fits': error is None and memory['total'] <= hbm and (host_per_chip is None or host['total'] <= host_per_chip),
    'flops_per_step': flops, 'flops_per_token': flops_per_token, 'peak_flops_per_device': peak,
    'step_seconds_at_peak': at_peak, 'assumed_mfu': assumed_mfu, 'step_seconds': at_peak / assumed_mfu,
    'tokens_per_sec': tokens * assumed_mfu / at_peak, 'compile_seconds': figures['compile_seconds'],
  }
  if 'kept' in figures:
    report['compile_kept'] = figures['kept']
  if (stages := stages_report(config, assembly.mesh)) is not None:
    report['pipeline'] = stages
  if cost is not None:
    report['cost_per_device'] = cost
  if error is not None:
    report['compile_error'] = error
  if live is not None:
    report['memory_breakdown'] = live
  if save and compiled is not None:
    report['saved'] = save_executable(compiled, save, report)
  return report


def _compiled_figures(assembly: Any, breakdown: int, label: str, keep: bool
                      ) -> tuple[jax.stages.Compiled | None, dict[str, Any]]:
  """(the compiled step, None when its figures were kept from an earlier compile of the same program
  (`lm.planning.kept`, with `keep`); its figures: memory and host memory per device, cost, what is live at the peak
  with `breakdown`, the compiler's refusal, and the compile's seconds)."""
  lowered = lower_train_step(assembly)
  parts = kept.key_parts(lowered, assembly.mesh.devices.flat, {'breakdown': breakdown}) \
      if keep and kept.directory() else None
  key = parts and kept.digest(parts)
  if key and (found := kept.read(key, label)) is not None:
    figures, path = found
    return None, {**figures, 'kept': path}
  t0 = time.perf_counter()
  compiled, live, error = _compile(lowered, breakdown)
  memory, host = _unfitted_memory(assembly, error) if compiled is None else \
      (compiled_memory(compiled), compiled_memory(compiled, 'host_'))
  figures = {'memory': memory, 'host': host, 'cost': None if compiled is None else compiled_cost(compiled),
             'live': live, 'error': error, 'compile_seconds': time.perf_counter() - t0}
  if key:
    kept.write(key, label, figures, parts)
  return compiled, figures


def _compile(lowered: jax.stages.Lowered, breakdown: int
             ) -> tuple[jax.stages.Compiled | None, dict[str, Any] | None, str | None]:
  """(the compiled step, what is live at its peak with `breakdown`, the compiler's refusal): a step that cannot
  fit in HBM is refused by the TPU compiler, which names the bytes."""
  try:
    with _not_persistently_cached():
      if breakdown:
        return *compile_with_breakdown(lowered, breakdown), None
      return lowered.compile(), None, None
  except jax.errors.JaxRuntimeError as e:
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    return None, None, str(e).splitlines()[0]


@contextlib.contextmanager
def _not_persistently_cached():
  """JAX writes a compile-only (TPU topology) executable to its persistent cache, where one is set, but cannot load
  it back: each later compile of the step would warn and compile again. These are never written."""
  key = 'jax_persistent_cache_min_compile_time_secs'
  previous = getattr(jax.config, key)
  jax.config.update(key, float('inf'))
  try:
    yield
  finally:
    jax.config.update(key, previous)


def compiled_memory(compiled: jax.stages.Compiled, where: str = '') -> dict[str, int]:
  """Per-device bytes from XLA's `memory_analysis()` in device memory, or (`where='host_'`) in the host memory the
  device addresses (offloaded state and remat checkpoints); total counts donated (aliased) state once."""
  stats = compiled.memory_analysis()
  memory = {key: getattr(stats, f'{where}{field}_size_in_bytes') for key, field in (
    ('arguments', 'argument'), ('outputs', 'output'), ('aliased', 'alias'), ('temp', 'temp'),
    ('generated_code', 'generated_code'))}
  memory['total'] = memory['arguments'] + memory['outputs'] - memory['aliased'] + memory['temp'] + \
      memory['generated_code']
  return memory


def compiled_cost(compiled: jax.stages.Compiled) -> dict[str, float] | None:
  """FLOPs and bytes accessed per device as XLA's cost analysis counts them (loops times their trip counts)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  if not cost or 'flops' not in cost:
    return None
  return {'flops': float(cost['flops']), 'bytes_accessed': float(cost.get('bytes accessed', 0.0))}


def _oom_figures(error: str) -> int | None:
  """Bytes of temporaries the TPU compiler said it needed, e.g. '... HLO temporaries (44.46G) exceeds ...'."""
  match = re.search(r'temporaries \(([0-9.]+)([KMGT])\)', error)
  if match is None:
    return None
  return int(float(match.group(1)) * 2 ** (10 * ' KMGT'.index(match.group(2))))


def save_executable(compiled: jax.stages.Compiled, path: str, report: dict[str, Any]) -> str:
  """Writes the serialized XLA executable (PjRt bytes, no pickle) and the report beside it as JSON."""
  executable = compiled._executable._unloaded_executable.xla_executable  # noqa: SLF001  (no public accessor)
  out = Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(executable.serialize())
  out.with_suffix(out.suffix + '.json').write_text(json.dumps(report, indent=2) + '\n')
  return str(out)


def _seconds(s: float) -> str:
  return f'{s * 1e3:,.1f} ms' if s < 1 else f'{s:,.2f} s'


def format_report(r: dict[str, Any]) -> str:
  mem, mesh = r['memory_per_device'], r['mesh']
  lines = [
    ('config', f'{r["config"]} ({r["params"]["total"] / 1e9:,.3f}B params)'),
    ('topology', f'{r["num_slices"]} x ' * (r['num_slices'] > 1) +
     f'{r["topology"]} = {r["physical_topology"]}: {r["chips"]} x {r["device_kind"]}'),
    ('mesh', f'{mesh_text(mesh)} ({mesh["strategy"]})'),
    ('remat / scan / attention', f'{r["remat"]} / {r["scan_layers"]} / {r["attention_impl"]}, {r["dtype"]}'),
    ('batch', f'{r["global_batch"]} x {r["seq_len"]} tokens in {r["microbatches"]} microbatch(es)'),
    *(stages_lines(r['pipeline']) if 'pipeline' in r else []),
  ]
  lines += [(f'memory/device: {k}', format_bytes(mem[k])) for k in ('arguments', 'outputs', 'aliased', 'temp', 'total')]
  lines.append(('memory/device: planned', f'{format_bytes(r["estimated_memory"])} (--plan\'s estimate, '
                                          f'{r["estimated_memory"] / mem["total"]:.2f}x)'))
  host, per_chip = r['host_memory_per_device'], r['host_per_device']
  if host['total']:
    lines += [(f'host memory/device: {k}', format_bytes(host[k])) for k in ('arguments', 'temp', 'total')]
    lines.append(('host memory/device', 'unknown for this chip' if per_chip is None else
                  f'{format_bytes(per_chip)}: {"fits" if host["total"] <= per_chip else "DOES NOT FIT"} '
                  f'({host["total"] / per_chip:.0%} needed)'))
  if 'compile_error' in r:
    lines.append(('compiler', r['compile_error']))
  lines += [
    ('HBM/device', f'{format_bytes(r["hbm_per_device"])}: '
                   f'{"fits" if mem["total"] <= r["hbm_per_device"] and "compile_error" not in r else "DOES NOT FIT"} '
                   f'({mem["total"] / r["hbm_per_device"]:.0%} needed)'),
    ('model FLOPs/step', f'{r["flops_per_step"]:.4g} ({r["flops_per_token"]:.4g} per token)'),
    ('step time at peak', _seconds(r['step_seconds_at_peak'])),
    (f'step time at {r["assumed_mfu"]:.0%} MFU', _seconds(r['step_seconds'])),
    (f'tokens/s at {r["assumed_mfu"]:.0%} MFU', f'{r["tokens_per_sec"]:,.0f}'),
    ('compile time', f'{r["compile_seconds"]:.1f} s' +
     (f' (its figures kept in {r["compile_kept"]})' if 'compile_kept' in r else '')),
  ]
  if 'saved' in r:
    lines.append(('executable', r['saved']))
  text = format_lines(lines)
  return text + '\n' + format_breakdown(r['memory_breakdown']) if 'memory_breakdown' in r else text


def does_not_fit_message(r: dict[str, Any]) -> str:
  mem, host, per_chip = r['memory_per_device'], r['host_memory_per_device'], r['host_per_device']
  if mem['total'] <= r['hbm_per_device'] and 'compile_error' not in r and per_chip and host['total'] > per_chip:
    return (f'{r["config"]} does not fit {r["topology"]}: the step keeps {format_bytes(host["total"])} per device '
            f'in host memory (temporaries {format_bytes(host["temp"])}) of the {format_bytes(per_chip)} its host has '
            f'for each chip; offload less (model.execution.offload, train.optimizer_offload, train.param_offload) '
            f'or lower train.global_batch')
  return (f'{r["config"]} does not fit {r["topology"]}: the step needs {format_bytes(mem["total"])} per device '
          f'(temp {format_bytes(mem["temp"])}, arguments {format_bytes(mem["arguments"])}) of '
          f'{format_bytes(r["hbm_per_device"])} HBM; '
          f'try model.execution.remat=full, a larger mesh.fsdp, more train.microbatches or a bigger slice')


def with_teacher(memory: dict[str, int], teacher: Teacher | None) -> dict[str, int]:
  """`estimate_memory`'s bytes with a distillation teacher's params (`train.distill`) in the step beside them."""
  if teacher is None:
    return memory
  teacher_bytes, out = shard_bytes(teacher.params), {}
  for name, value in memory.items():
    if name == 'total (estimate)':
      out['teacher params'], value = teacher_bytes, value + teacher_bytes
    out[name] = value
  return out


def model_report(config: Config, compile_step: bool = False) -> dict[str, Any]:
  """Parameter counts, FLOPs per token, mesh and per-device memory for `lm info`."""
  assembly = assemble(config)
  sizes = dict(assembly.mesh.shape)
  report = {
    'name': config.name,
    'params': count_params(assembly.abstract_params, config.model),
    'flops_per_token': assembly.flops_per_token(),
    'cache_bytes_per_token': cache_bytes_per_token(config.model),
    'mesh': {**sizes, 'strategy': strategy_name(sizes), 'devices': jax.device_count(),
             'platform': jax.default_backend()},
    'memory_per_device': with_teacher(estimate_memory(config, assembly.abstract_state, assembly.mesh),
                                      abstract_teacher(assembly)),
  }
  if (stages := stages_report(config, assembly.mesh)) is not None:
    report['pipeline'] = stages
  if compile_step:
    report['compiled_memory_per_device'] = compiled_memory(compile_train_step(assembly))
  return report
