"""The device mesh's axes, declared once: `MeshConfig`, its validation, the mesh builder, error texts and every
report derive from this tuple (a new axis is one entry here and one rule in `lm.parallel.rules`).

A leaf module: `lm.config` builds `MeshConfig` from it, so it imports nothing from `lm`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshAxis:
  name: str  # the mesh axis, as the rules table names it
  short: str  # its part of a strategy name (dp, fsdp, tp, ...)
  field: str = ''  # its MeshConfig field (mesh.<field>); the axis name when empty
  default: int = 1  # -1: the devices of a slice left over
  across_slices: bool = False  # spans TPU slices over the data-center network rather than lying within one
  # an axis that lies within slices and may also span them: the MeshConfig field of how many slices it spans (the
  # axis is then that many times its size within a slice, its slices' part the major one)
  slices_field: str = ''

  @property
  def attr(self) -> str:
    """Its MeshConfig field."""
    return self.field or self.name

  @property
  def key(self) -> str:
    """The config key that sets it, e.g. mesh.fsdp."""
    return f'mesh.{self.attr}'


MESH_AXES: tuple[MeshAxis, ...] = (
  MeshAxis('slice', 'multislice', field='slices', across_slices=True),  # the batch, across TPU slices
  MeshAxis('stage', 'pp', slices_field='stage_slices'),  # the layer stack's stages (pipelining); outside it the batch
  MeshAxis('data', 'dp', default=-1),  # the batch
  MeshAxis('fsdp', 'fsdp'),  # the batch, parameters and optimizer state
  MeshAxis('expert', 'ep'),  # the routed experts; outside them the batch, parameters and optimizer state as fsdp
  MeshAxis('sequence', 'cp'),  # the tokens of each sequence (context parallelism: ring attention)
  MeshAxis('tensor', 'tp'),  # heads, MLP units and the vocabulary
)


def in_slice_axes() -> tuple[MeshAxis, ...]:
  """The axes laid out within one slice, on its fast interconnect (their product is the chips of a slice)."""
  return tuple(a for a in MESH_AXES if not a.across_slices)


def slices_of(sizes: object) -> int:
  """The TPU slices a mesh config (a MeshConfig, or any object with its fields) spans: its across-slice axes' sizes
  times the slices the other axes span."""
  total = 1
  for a in MESH_AXES:
    total *= getattr(sizes, a.attr) if a.across_slices else getattr(sizes, a.slices_field, 1) if a.slices_field else 1
  return total


def axis_size(sizes: object, name: str) -> int:
  """A mesh config's whole size of axis `name` (within a slice, times the slices it spans)."""
  a = next(a for a in MESH_AXES if a.name == name)
  return getattr(sizes, a.attr) * (getattr(sizes, a.slices_field) if a.slices_field else 1)


def mesh_text(sizes: dict[str, int]) -> str:
  """`slice=1 data=2 fsdp=4 tensor=1`: a mesh's sizes in declaration order, for reports."""
  return ' '.join(f'{a.name}={sizes[a.name]}' for a in MESH_AXES if a.name in sizes)
