"""Ahead-of-time compile of the real train step for a TPU slice, from any machine with libtpu.

`compile_report(config, 'v5p-1024')` builds the abstract train state and batch on the slice's
compile-only devices, lowers and compiles the jitted train step, and reports per-device memory
(XLA's `memory_analysis()`) against the chip's HBM, model FLOPs per step, and the step time and
tokens/s they imply at the chip's peak and at an assumed MFU. Nothing is allocated or run.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import jax

from lm.config import Config, ConfigError
from lm.train import metrics

# generation: (TensorCores per chip in Cloud TPU slice names, dimensions of its interconnect)
GENERATIONS = {'v4': (2, 3), 'v5p': (2, 3), 'v5e': (1, 2), 'v6e': (1, 2)}


def physical_topology(name: str) -> str:
  """'v5p-1024' (Cloud TPU slice: cores for v4/v5p, chips for v5e/v6e) or 'v5p:8x8x8' -> 'v5p:8x8x8'."""
  match = re.fullmatch(r'(v4|v5p|v5e|v6e)([-:])([0-9x]+)', name.strip().lower())
  if match is None:
    raise ConfigError(f'--topology {name!r} is not a TPU slice; write it as a Cloud TPU name such as v5p-1024 '
                      f'or v5e-256, or as generation:shape such as v5e:2x2 ({", ".join(GENERATIONS)})')
  generation, sep, size = match.groups()
  if sep == ':':
    return f'{generation}:{size}'
  cores_per_chip, dims = GENERATIONS[generation]
  count = int(size) if size.isdigit() else 0
  chips = count // cores_per_chip
  if count % cores_per_chip or chips < 1 or chips & (chips - 1):
    raise ConfigError(f'--topology {name}: {generation} slices have a power-of-two number of chips '
                      f'({cores_per_chip} per chip in the name), e.g. {generation}-{8 * cores_per_chip}')
  shape = [1] * dims
  if dims == 3 and chips >= 4:
    shape = [1, 2, 2]  # the smallest 3D slice is 2x2x1
  while math.prod(shape) < chips:
    shape[shape.index(min(shape))] *= 2
  shape = sorted(shape)
  if shape[0] == 1 and dims == 3:
    shape = shape[1:] + [1]  # written 2x2x1, as Cloud TPU does
  return f'{generation}:{"x".join(str(s) for s in shape)}'


def topology_devices(physical: str) -> list[jax.Device]:
  """Compile-only devices of a TPU slice given as `physical_topology` writes it (needs libtpu: the `tpu` extra)."""
  if importlib.util.find_spec('libtpu') is None:
    raise ConfigError('compiling for a TPU topology needs libtpu: pip install -e ".[tpu]"')
  from jax.experimental import topologies
  if not glob.glob('/dev/accel*') and not glob.glob('/dev/vfio/[0-9]*'):
    # Not a TPU VM: without these libtpu probes for the VM's metadata and logs errors about it.
    for key, value in (('TPU_SKIP_MDS_QUERY', '1'), ('TPU_WORKER_HOSTNAMES', 'localhost'),
                       ('TPU_ACCELERATOR_TYPE', 'v5litepod-4')):
      os.environ.setdefault(key, value)
  try:
    return list(topologies.get_topology_desc(platform='tpu', topology_name=physical).devices)
  except Exception as e:  # libtpu rejects shapes it does not know with a runtime error
    raise ConfigError(f'libtpu cannot describe topology {physical}: {str(e).splitlines()[0]}') from None


def compile_report(config: Config, topology: str, assumed_mfu: float = 0.5, save: str | None = None
                   ) -> dict[str, Any]:
  """Compiles the train step for `topology` and returns memory, FLOPs and predicted speed per step."""
  from lm.parallel.mesh import strategy_name
  from lm.train.loop import Trainer

  if not 0 < assumed_mfu <= 1:
    raise ConfigError(f'--mfu {assumed_mfu} must lie in (0, 1]')
  physical = physical_topology(topology)
  devices = topology_devices(physical)
  peak, hbm = metrics.peak_flops(devices[0]), metrics.hbm_bytes(devices[0])
  if peak is None or hbm is None:
    raise ConfigError(f'no peak FLOP/s or HBM size on record for {devices[0].device_kind}; add it to '
                      f'PEAK_FLOPS and HBM_BYTES in lm/train/metrics.py')
  trainer = Trainer(config, devices=devices, with_data=False)
  sizes = dict(trainer.mesh.shape)
  t0 = time.perf_counter()
  compiled, error = None, None
  try:
    compiled = trainer.compile_train_step()
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a step that cannot fit in HBM
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    error = str(e).splitlines()[0]
  compile_s = time.perf_counter() - t0
  if compiled is not None:
    memory = compiled_memory(compiled)
  else:
    state_bytes = metrics.shard_bytes(trainer.abstract_state)
    needed = _oom_figures(error)
    memory = {'arguments': state_bytes, 'outputs': state_bytes, 'aliased': state_bytes,
              'temp': needed or 0, 'generated_code': 0}
    memory['total'] = state_bytes + (needed or 0)
  t, m = config.train, config.model
  tokens = t.global_batch * config.data.seq_len
  flops = trainer.flops_per_token * tokens
  at_peak = flops / (peak * len(devices))
  report = {
    'config': config.name, 'topology': topology, 'physical_topology': physical,
    'chips': len(devices), 'device_kind': devices[0].device_kind,
    'mesh': {**sizes, 'strategy': strategy_name(sizes)}, 'remat': m.remat, 'scan_layers': m.scan_layers,
    'attention_impl': m.attention_impl, 'dtype': m.dtype, 'global_batch': t.global_batch,
    'microbatches': t.microbatches, 'seq_len': config.data.seq_len,
    'params': metrics.count_params(trainer.abstract_state.params),
    'memory_per_device': memory, 'hbm_per_device': hbm, 'fits': error is None and memory['total'] <= hbm,
    'flops_per_step': flops, 'flops_per_token': trainer.flops_per_token, 'peak_flops_per_device': peak,
    'step_seconds_at_peak': at_peak, 'assumed_mfu': assumed_mfu, 'step_seconds': at_peak / assumed_mfu,
    'tokens_per_sec': tokens * assumed_mfu / at_peak, 'compile_seconds': compile_s,
  }
  if error is not None:
    report['compile_error'] = error
  if save and compiled is not None:
    report['saved'] = save_executable(compiled, save, report)
  return report


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes from XLA's `memory_analysis()`; total counts donated (aliased) state once."""
  stats = compiled.memory_analysis()
  memory = {
    'arguments': stats.argument_size_in_bytes, 'outputs': stats.output_size_in_bytes,
    'aliased': stats.alias_size_in_bytes, 'temp': stats.temp_size_in_bytes,
    'generated_code': stats.generated_code_size_in_bytes,
  }
  memory['total'] = memory['arguments'] + memory['outputs'] - memory['aliased'] + memory['temp'] + \
      memory['generated_code']
  return memory


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


def _size(n: float) -> str:
  return f'{n / 2**30:,.2f} GiB'


def _seconds(s: float) -> str:
  return f'{s * 1e3:,.1f} ms' if s < 1 else f'{s:,.2f} s'


def format_report(r: dict[str, Any]) -> str:
  mem, mesh = r['memory_per_device'], r['mesh']
  lines = [
    ('config', f'{r["config"]} ({r["params"]["total"] / 1e9:,.3f}B params)'),
    ('topology', f'{r["topology"]} = {r["physical_topology"]}: {r["chips"]} x {r["device_kind"]}'),
    ('mesh', f'data={mesh["data"]} fsdp={mesh["fsdp"]} tensor={mesh["tensor"]} ({mesh["strategy"]})'),
    ('remat / scan / attention', f'{r["remat"]} / {r["scan_layers"]} / {r["attention_impl"]}, {r["dtype"]}'),
    ('batch', f'{r["global_batch"]} x {r["seq_len"]} tokens in {r["microbatches"]} microbatch(es)'),
  ]
  lines += [(f'memory/device: {k}', _size(mem[k])) for k in ('arguments', 'outputs', 'aliased', 'temp', 'total')]
  if 'compile_error' in r:
    lines.append(('compiler', r['compile_error']))
  lines += [
    ('HBM/device', f'{_size(r["hbm_per_device"])}: {"fits" if r["fits"] else "DOES NOT FIT"} '
                   f'({mem["total"] / r["hbm_per_device"]:.0%} needed)'),
    ('model FLOPs/step', f'{r["flops_per_step"]:.4g} ({r["flops_per_token"]:.4g} per token)'),
    ('step time at peak', _seconds(r['step_seconds_at_peak'])),
    (f'step time at {r["assumed_mfu"]:.0%} MFU', _seconds(r['step_seconds'])),
    (f'tokens/s at {r["assumed_mfu"]:.0%} MFU', f'{r["tokens_per_sec"]:,.0f}'),
    ('compile time', f'{r["compile_seconds"]:.1f} s'),
  ]
  if 'saved' in r:
    lines.append(('executable', r['saved']))
  width = max(len(k) for k, _ in lines)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in lines)


def does_not_fit_message(r: dict[str, Any]) -> str:
  mem = r['memory_per_device']
  return (f'{r["config"]} does not fit {r["topology"]}: the step needs {_size(mem["total"])} per device '
          f'(temp {_size(mem["temp"])}, arguments {_size(mem["arguments"])}) of {_size(r["hbm_per_device"])} HBM; '
          f'try model.remat=full, a larger mesh.fsdp, more train.microbatches or a bigger slice')
