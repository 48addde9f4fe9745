"""The device mesh (data, fsdp, tensor) from config, checked against the devices and the model."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lm.config import Config, ConfigError, MeshConfig

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


def check_divisibility(config: Config, sizes: dict[str, int]) -> None:
  """Fails early, with the fix, when a sharded dimension does not split evenly over its mesh axis."""
  m, t = config.model, config.train
  batch_shards = sizes['data'] * sizes['fsdp']
  micro = t.global_batch // t.microbatches
  if micro % batch_shards:
    raise ConfigError(
      f'train.global_batch={t.global_batch} over {t.microbatches} microbatch(es) gives {micro} sequences, '
      f'not divisible by the data-parallel size data*fsdp={batch_shards}; '
      f'use a global batch that is a multiple of {batch_shards * t.microbatches}')
  tensor = sizes['tensor']
  for key, value in (('model.num_heads', m.num_heads), ('model.d_ff', m.resolved_d_ff),
                     ('model.vocab_size', m.vocab_size)):
    if value % tensor:
      raise ConfigError(f'{key}={value} is not divisible by mesh.tensor={tensor}; '
                        f'pick a tensor size that divides it (or pad {key})')
  if m.d_model % sizes['fsdp']:
    raise ConfigError(f'model.d_model={m.d_model} is not divisible by mesh.fsdp={sizes["fsdp"]}; '
                      f'pick an fsdp size that divides the width')


def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, tensor) mesh with Auto axis types, so jit partitions freely."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(config.mesh, len(devices))
  check_divisibility(config, sizes)
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
