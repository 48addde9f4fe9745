"""The device mesh from config (its axes declared in `lm.mesh_axes`), checked against the devices.

`slice` spans TPU slices joined by the data-center network (multislice); the other axes lie within
a slice, on its fast interconnect, but `stage` may span slices too (mesh.stage_slices: pipelining over the
data-center network). With one slice the slice axis has size 1.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lm import mesh_axes
from lm.config import ConfigError, MeshConfig

MESH_AXES = tuple(a.name for a in mesh_axes.MESH_AXES)


def mesh_shape(mesh_config: MeshConfig, num_devices: int) -> dict[str, int]:
  """Resolves a -1 size to the devices of a slice left over; the product must equal the device count. An axis that
  also spans slices (mesh.stage_slices) is its size within a slice times theirs."""
  slices = mesh_axes.slices_of(mesh_config)
  if num_devices % slices:
    parts = [(a.key, getattr(mesh_config, a.attr)) for a in mesh_axes.MESH_AXES if a.across_slices] + \
        [(f'mesh.{a.slices_field}', _spanned(mesh_config, a)) for a in mesh_axes.MESH_AXES if a.slices_field]
    parts = [f'{key}={value}' for key, value in parts if value > 1]
    total = f' ({slices} slices)' if len(parts) > 1 else ''
    raise ConfigError(f'{" x ".join(parts)}{total} does not divide the {num_devices} devices; use as many slices as '
                      f'the job has')
  per_slice = num_devices // slices
  within = mesh_axes.in_slice_axes()
  sizes = {a.name: getattr(mesh_config, a.attr) for a in within}
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  fill = [axis for axis, s in sizes.items() if s == -1]
  if fill:
    if per_slice % fixed:
      raise ConfigError(
        f'mesh sizes {sizes} do not fit {per_slice} devices per slice: {fixed} does not divide {per_slice}; '
        f'choose {"/".join(a.key for a in within)} whose product divides the device count')
    sizes[fill[0]] = per_slice // fixed
  product = int(np.prod(list(sizes.values())))
  if product != per_slice:
    where = f'{per_slice} devices per slice' if slices > 1 else f'{num_devices} devices'
    raise ConfigError(
      f'mesh {"*".join(sizes)} = {"*".join(map(str, sizes.values()))} = {product} '
      f'but there are {where}; make the product equal {per_slice} or set one size to -1')
  return {a.name: (getattr(mesh_config, a.attr) if a.across_slices else sizes[a.name] * _spanned(mesh_config, a))
          for a in mesh_axes.MESH_AXES}


def _spanned(mesh_config: MeshConfig, axis: mesh_axes.MeshAxis) -> int:
  """The slices an in-slice axis spans too (1 for most)."""
  return getattr(mesh_config, axis.slices_field) if axis.slices_field else 1


def strategy_name(sizes: dict[str, int]) -> str:
  """Human name of the parallelism the mesh implies (dp, fsdp, tp and their combinations)."""
  used = [a.short for a in mesh_axes.MESH_AXES if sizes[a.name] > 1]
  return '+'.join(used) or 'single device'


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the mesh (axes as `lm.mesh_axes` declares them) with Auto axis types, so jit partitions freely.

  Across slices, TPU devices group by their `slice_index`; devices without one (a CPU simulation)
  form slices in order.

  Whether the model and batch split evenly over it is checked where their shardings are
  derived from the rules (`lm.parallel.rules`).
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  auto = (AxisType.Auto,) * len(MESH_AXES)
  slices = mesh_axes.slices_of(mesh_config)
  if len({getattr(d, 'slice_index', 0) for d in devices}) == slices > 1:
    dcn = tuple(sizes[a.name] if a.across_slices else _spanned(mesh_config, a) for a in mesh_axes.MESH_AXES)
    ici = tuple(size // over for size, over in zip(shape, dcn))
    try:
      ordered = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):  # an axis no product of physical ones makes (2 of 4x4x8)
      ordered = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, allow_split_physical_axes=True)
    return Mesh(ordered, MESH_AXES, axis_types=auto)
  if devices == list(jax.devices()) and slices == 1:
    # make_mesh orders devices for the physical topology (ICI rings on TPU, hosts contiguous).
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
  if devices[0].platform == 'tpu' and slices == 1:  # e.g. the compile-only devices of an AOT TPU topology
    try:
      ordered = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
      ordered = np.asarray(devices).reshape(shape)  # a shape the physical-topology layouts do not cover
    return Mesh(ordered, MESH_AXES, axis_types=auto)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def one_device_mesh() -> Mesh:
  """The default mesh on the first device alone (conversions, references)."""
  return make_mesh(MeshConfig(), jax.devices()[:1])
