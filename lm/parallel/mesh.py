"""The device mesh (slice, data, fsdp, tensor) from config, checked against the devices.

`slice` spans TPU slices joined by the data-center network (multislice); data, fsdp and tensor
lie within a slice, on its fast interconnect. With one slice the slice axis has size 1.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lm.config import ConfigError, MeshConfig

MESH_AXES = ('slice', 'data', 'fsdp', 'tensor')
SLICE_AXES = MESH_AXES[1:]


def mesh_shape(mesh_config: MeshConfig, num_devices: int) -> dict[str, int]:
  """Resolves a -1 size to the devices of a slice left over; the product must equal the device count."""
  slices = mesh_config.slices
  if num_devices % slices:
    raise ConfigError(f'mesh.slices={slices} does not divide the {num_devices} devices; use as many slices as '
                      f'the job has')
  per_slice = num_devices // slices
  sizes = {axis: getattr(mesh_config, axis) for axis in SLICE_AXES}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  fill = [axis for axis, s in sizes.items() if s == -1]
  if fill:
    if per_slice % fixed:
      raise ConfigError(
        f'mesh sizes {sizes} do not fit {per_slice} devices per slice: {fixed} does not divide {per_slice}; '
        f'choose mesh.data/fsdp/tensor whose product divides the device count')
    sizes[fill[0]] = per_slice // fixed
  product = int(np.prod(list(sizes.values())))
  if product != per_slice:
    where = f'{per_slice} devices per slice' if slices > 1 else f'{num_devices} devices'
    raise ConfigError(
      f'mesh data*fsdp*tensor = {sizes["data"]}*{sizes["fsdp"]}*{sizes["tensor"]} = {product} '
      f'but there are {where}; make the product equal {per_slice} or set one size to -1')
  return {'slice': slices, **sizes}


def strategy_name(sizes: dict[str, int]) -> str:
  """Human name of the parallelism the mesh implies (dp, fsdp, tp and their combinations)."""
  names = {'slice': 'multislice', 'data': 'dp', 'fsdp': 'fsdp', 'tensor': 'tp'}
  used = [names[a] for a in MESH_AXES if sizes[a] > 1]
  return '+'.join(used) or 'single device'


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (slice, data, fsdp, tensor) mesh with Auto axis types, so jit partitions freely.

  Across slices, TPU devices group by their `slice_index`; devices without one (a CPU simulation)
  form slices in order.

  Whether the model and batch split evenly over it is checked where their shardings are
  derived from the rules (`lm.parallel.rules`).
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (AxisType.Auto,) * len(MESH_AXES)
  if len({getattr(d, 'slice_index', 0) for d in devices}) == sizes['slice'] > 1:
    ordered = mesh_utils.create_hybrid_device_mesh((1,) + shape[1:], (sizes['slice'], 1, 1, 1), devices=devices)
    return Mesh(ordered, MESH_AXES, axis_types=auto)
  if devices == list(jax.devices()) and sizes['slice'] == 1:
    # make_mesh orders devices for the physical topology (ICI rings on TPU, hosts contiguous).
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  if devices[0].platform == 'tpu' and sizes['slice'] == 1:  # e.g. the compile-only devices of an AOT TPU topology
    try:
      ordered = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
      ordered = np.asarray(devices).reshape(shape)  # a shape the physical-topology layouts do not cover
    return Mesh(ordered, MESH_AXES, axis_types=auto)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)
