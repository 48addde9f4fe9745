"""What we know about accelerator chips: peak FLOP/s, memory, TPU slice topologies, and libtpu's quiet start."""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import math
import os
import re
from typing import Any

import jax

from lm.config import ConfigError

# Dense bf16 peak FLOP/s per device (per chip for TPUs; v4/v5p chips have 2 TensorCores as one device).
PEAK_FLOPS = {
  'TPU v4': 275e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v5p': 459e12,
  'TPU v5': 459e12,
  'TPU v6 lite': 918e12,
  'TPU v6e': 918e12,
  'NVIDIA A100': 312e12,
  'NVIDIA H100': 989e12,
  'NVIDIA H200': 989e12,
}

# Dense int8 peak op/s per device (model.quantization=int8): twice bf16's from v5e on; v4 and bf16 alike.
INT8_PEAK_OPS = {
  'TPU v4': 275e12,
  'TPU v5 lite': 394e12,
  'TPU v5e': 394e12,
  'TPU v5p': 918e12,
  'TPU v5': 918e12,
  'TPU v6 lite': 1836e12,
  'TPU v6e': 1836e12,
  'NVIDIA A100': 624e12,
  'NVIDIA H100': 1979e12,
  'NVIDIA H200': 1979e12,
}

# High-bandwidth memory per device, bytes (the largest variant where a chip comes in several).
HBM_BYTES = {
  'TPU v4': 32 * 2**30,
  'TPU v5 lite': 16 * 2**30,
  'TPU v5e': 16 * 2**30,
  'TPU v5p': 95 * 2**30,
  'TPU v5': 95 * 2**30,
  'TPU v6 lite': 32 * 2**30,
  'TPU v6e': 32 * 2**30,
  'NVIDIA A100': 80 * 10**9,
  'NVIDIA H100': 80 * 10**9,
  'NVIDIA H200': 141 * 10**9,
}

# Host memory per chip, bytes: a TPU VM's RAM over its chips, for the VM type multi-host slices use; offloaded
# state and remat checkpoints live there (model.execution.offload, train.optimizer_offload, train.param_offload).
# v5p: 448 GiB for 4 chips; v5e: ct5lp-hightpu-4t, 192 GB for 4; v6e: 1536 GiB for 8 (Cloud TPU's tables).
HOST_BYTES = {
  'TPU v5p': 448 * 2**30 // 4,
  'TPU v5': 448 * 2**30 // 4,
  'TPU v5 lite': 192 * 10**9 // 4,
  'TPU v5e': 192 * 10**9 // 4,
  'TPU v6 lite': 1536 * 2**30 // 8,
  'TPU v6e': 1536 * 2**30 // 8,
}

# Host-to-device bandwidth per chip and direction, bytes/s: the nominal rate of a PCIe x16 link, Gen5 for v6e (its
# documented interface), Gen4 assumed for v5e and v5p. What offloading moves each step crosses it.
HOST_LINK_BYTES_PER_S = {
  'TPU v5p': 32e9,
  'TPU v5': 32e9,
  'TPU v5 lite': 32e9,
  'TPU v5e': 32e9,
  'TPU v6 lite': 64e9,
  'TPU v6e': 64e9,
}

# Inter-chip interconnect bandwidth per chip, bytes/s (Cloud TPU's published Gbps over 8; GPUs: NVLink per GPU).
ICI_BYTES_PER_S = {
  'TPU v4': 2400e9 / 8,
  'TPU v5 lite': 1600e9 / 8,
  'TPU v5e': 1600e9 / 8,
  'TPU v5p': 4800e9 / 8,
  'TPU v5': 4800e9 / 8,
  'TPU v6 lite': 3584e9 / 8,
  'TPU v6e': 3584e9 / 8,
  'NVIDIA A100': 600e9,
  'NVIDIA H100': 900e9,
  'NVIDIA H200': 900e9,
}
# generation: (TensorCores per chip in Cloud TPU slice names, dimensions of its interconnect)
GENERATIONS = {'v4': (2, 3), 'v5p': (2, 3), 'v5e': (1, 2), 'v6e': (1, 2)}


def _lookup(table: dict[str, Any], device: jax.Device) -> Any:
  kind = getattr(device, 'device_kind', '')
  matches = [name for name in table if kind.startswith(name)]
  return table[max(matches, key=len)] if matches else None


def peak_flops(device: jax.Device, quantization: str = 'none') -> float | None:
  """Per-device peak for known accelerators (longest matching name), None for CPUs and unknown kinds; the int8
  peak for a model whose projections run in int8 (model.quantization=int8)."""
  return _lookup(INT8_PEAK_OPS if quantization == 'int8' else PEAK_FLOPS, device)


def hbm_bytes(device: jax.Device) -> int | None:
  """Per-device accelerator memory for known kinds, None for CPUs and unknown kinds."""
  return _lookup(HBM_BYTES, device)


def host_bytes(device: jax.Device) -> int | None:
  """Host memory per chip (`HOST_BYTES`) for known kinds, None for others."""
  return _lookup(HOST_BYTES, device)


def host_link_bytes_per_s(device: jax.Device) -> float | None:
  return _lookup(HOST_LINK_BYTES_PER_S, device)


def ici_bytes_per_s(device: jax.Device) -> float | None:
  """Per-device interconnect bandwidth for known accelerators, None for CPUs and unknown kinds."""
  return _lookup(ICI_BYTES_PER_S, device)


def on_tpu_vm() -> bool:
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def quiet_libtpu() -> None:
  """Off a TPU VM, keeps an installed libtpu from probing VM metadata and logging errors about it.

  Must run before JAX starts its backends. The values only stop the probe: with no TPU attached
  the TPU backend still fails to start (quietly) and JAX falls back to the CPU or GPU. Where no GPU plugin is
  installed either, JAX is told so (JAX_PLATFORMS=cpu, unless set): with the failed TPU backend loaded,
  jax.profiler's traces crash the process (`train.profile`); AOT compiles for TPU topologies need no backend.
  """
  if importlib.util.find_spec('libtpu') is None or on_tpu_vm():
    return
  for key, value in (('TPU_SKIP_MDS_QUERY', '1'), ('TPU_WORKER_HOSTNAMES', 'localhost'),
                     ('TPU_ACCELERATOR_TYPE', 'v5litepod-4')):
    os.environ.setdefault(key, value)
  if not importlib.metadata.entry_points(group='jax_plugins') and 'JAX_PLATFORMS' not in os.environ:
    os.environ['JAX_PLATFORMS'] = 'cpu'  # processes this one starts
    jax.config.update('jax_platforms', 'cpu')  # this one (jax read the environment when imported)


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


def slice_chips(name: str) -> int:
  """Chips in a slice named as `physical_topology` takes it ('v5p-64' -> 32)."""
  return math.prod(int(d) for d in physical_topology(name).split(':')[1].split('x'))


def topology_devices(physical: str, num_slices: int = 1) -> list[jax.Device]:
  """Compile-only devices of `num_slices` TPU slices of the shape `physical_topology` writes (needs libtpu: the
  `tpu` extra); with several, each device knows its `slice_index`."""
  if importlib.util.find_spec('libtpu') is None:
    raise ConfigError('compiling for a TPU topology needs libtpu: pip install -e ".[tpu]"')
  from jax.experimental import topologies
  quiet_libtpu()
  try:
    slices = {'num_slices': num_slices} if num_slices > 1 else {}
    return list(topologies.get_topology_desc(platform='tpu', topology_name=physical, **slices).devices)
  except Exception as e:  # libtpu rejects shapes it does not know with a runtime error
    raise ConfigError(f'libtpu cannot describe topology {physical}: {str(e).splitlines()[0]}') from None
