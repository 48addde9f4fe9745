"""The device mesh (data, fsdp, tensor) from config, checked against the devices."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lm.config import ConfigError, MeshConfig

MESH_AXES = ('data', 'fsdp', 'tensor')


def mesh_shape(mesh_config: MeshConfig, num_devices: int) -> dict[str, int]:
  """Resolves a -1 size to the devices left over; the product must equal the device count."""
  sizes = {axis: getattr(mesh_config, axis) for axis in MESH_AXES}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  fill = [axis for axis, s in sizes.items() if s == -1]
  if fill:
    if num_devices % fixed:
      raise ConfigError(
        f'mesh sizes {sizes} do not fit {num_devices} devices: {fixed} does not divide {num_devices}; '
        f'choose mesh.data/fsdp/tensor whose product divides the device count')
    sizes[fill[0]] = num_devices // fixed
  product = int(np.prod(list(sizes.values())))
  if product != num_devices:
    raise ConfigError(
      f'mesh data*fsdp*tensor = {sizes["data"]}*{sizes["fsdp"]}*{sizes["tensor"]} = {product} '
      f'but there are {num_devices} devices; make the product equal {num_devices} or set one size to -1')
  return sizes


def strategy_name(sizes: dict[str, int]) -> str:
  """Human name of the parallelism the mesh implies (dp, fsdp, tp and their combinations)."""
  names = {'data': 'dp', 'fsdp': 'fsdp', 'tensor': 'tp'}
  used = [names[a] for a in MESH_AXES if sizes[a] > 1]
  return '+'.join(used) or 'single device'


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh with Auto axis types, so jit partitions freely.

  Whether the model and batch split evenly over it is checked where their shardings are
  derived from the rules (`lm.parallel.rules`).
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if devices == list(jax.devices()):
    # make_mesh orders devices for the physical topology (ICI rings on TPU, hosts contiguous).
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  if devices[0].platform == 'tpu':  # e.g. the compile-only devices of an ahead-of-time TPU topology
    try:
      ordered = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
      ordered = np.asarray(devices).reshape(shape)  # a shape the physical-topology layouts do not cover
    return Mesh(ordered, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
