"""Logical axis names -> mesh axes, in one table, and everything derived from it.

One table serves every strategy: a mesh axis of size 1 shards nothing, so the mesh
shape alone selects dp (data>1), fsdp (fsdp>1), cp (sequence>1: ring attention), tp (tensor>1)
or any mix. Rules are
tried in order and a mesh axis is used at most once per array (Flax semantics), so an
activation `(batch, length, embed)` takes `fsdp` for its batch and leaves `embed`
replicated, while a parameter `(embed, mlp)` shards `embed` over `fsdp`.

Shardings are resolved against shapes (`spec_for`): a dimension that does not divide over
its mesh axes is an error naming the config field to change, except broadcast dimensions
of size 1 and the axes in REPLICATED_WHEN_UNEVEN, which stay whole. Divisibility checks,
batch and bias shardings, memory estimates and kernel shard specs all come from here, so a
new mesh axis is a rule change.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.config import ConfigError
from lm.mesh_axes import MESH_AXES

LogicalRules = tuple[tuple[str, Any], ...]

RULES: LogicalRules = (
  ('batch', ('slice', 'stage', 'data', 'fsdp', 'expert')),  # inside a pipelined stack, without stage
  ('vocab', 'tensor'),
  ('heads', 'tensor'),
  ('kv_heads', 'tensor'),
  ('mlp', 'tensor'),
  ('experts', 'expert'),  # a routed layer's experts; claimed before 'embed', which falls back below
  ('embed', ('fsdp', 'sequence', 'expert')),  # parameters shard over the sequence devices too (they hold the same
  # batch), and over the expert devices outside the routed layers
  ('embed', ('fsdp', 'sequence')),  # an expert kernel's, whose experts took the expert axis
  ('latent', ('fsdp', 'sequence', 'expert')),  # latent attention's low ranks (`lm.models.mla`): the up projections'
  # parameters shard over them as others over 'embed'
  ('kv', None),
  ('length', 'sequence'),
  ('position', None),  # a table indexed by position (learned positions): a parameter, never split by sequence
  ('layers', 'stage'),  # a scanned stack's layers, stage s holding the s-th run of them (pipelining)
)

def without(axis: str, rules: LogicalRules = RULES) -> LogicalRules:
  """`rules` with mesh `axis` taken out of every entry: the rules inside a `shard_map` that is manual over it."""
  def drop(entry: Any) -> Any:
    if isinstance(entry, str) or entry is None:
      return None if entry == axis else entry
    return tuple(a for a in entry if a != axis) or None
  return tuple((name, drop(entry)) for name, entry in rules)


# Grouped-query attention may have fewer key/value heads than tensor devices: those stay replicated; so do the layers
# of a stack the pipeline stages do not split evenly (each stage runs its share, padded: `lm.models.transformer`),
# and latent ranks that the parameter devices do not divide.
REPLICATED_WHEN_UNEVEN = frozenset({'kv_heads', 'layers', 'latent'})

# The config field that sets each logical dimension, so an uneven split names what to change.
AXIS_FIELDS = {'batch': 'train.global_batch', 'vocab': 'model.vocab_size', 'heads': 'model.num_heads',
               'kv_heads': 'model.num_kv_heads', 'mlp': 'model.d_ff', 'embed': 'model.d_model',
               'length': 'data.seq_len', 'position': 'model.max_len', 'experts': 'model.moe.num_experts'}

MESH_FIELDS = {a.name: a.key for a in MESH_AXES}  # the config field that sizes each mesh axis

_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
  'lm_sharding', default=None)


class UnevenShardingError(ConfigError):
  """A dimension of `size` does not split evenly over the mesh axes its logical axis maps to."""

  def __init__(self, logical: str, size: int, mesh_axes: tuple[str, ...], shards: int):
    self.logical, self.size, self.mesh_axes, self.shards = logical, size, mesh_axes, shards
    self.field = AXIS_FIELDS.get(logical, f'the {logical!r} dimension')
    super().__init__(f'{self.field}={size} is not divisible by {self.mesh_product}')

  @property
  def mesh_product(self) -> str:
    return f'{"*".join(MESH_FIELDS[a] for a in self.mesh_axes)}={self.shards}'


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: LogicalRules = RULES) -> Iterator[None]:
  """Makes `constrain` active while a step function is traced (jit cannot take a mesh context)."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def unsharded() -> Iterator[None]:
  """No `sharding_context` while tracing what needs none (the shapes of a layer's params)."""
  token = _ACTIVE.set(None)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_sharding() -> tuple[Mesh, LogicalRules] | None:
  """The (mesh, rules) of the enclosing `sharding_context`, if any."""
  return _ACTIVE.get()


def target_platform() -> str:
  """The platform the code being traced will run on: the active mesh's devices (in an ahead-of-time compile for a
  TPU slice these differ from the host's), else JAX's default backend."""
  active = _ACTIVE.get()
  return active[0].devices.flat[0].platform if active else jax.default_backend()


def logical_to_spec(axes: Sequence[str | None], rules: LogicalRules = RULES) -> PartitionSpec:
  """Mesh axes of logical `axes`, ignoring shapes (see `spec_for`)."""
  return nn.logical_to_mesh_axes(tuple(axes), rules)


def _mesh_axes(entry: Any, mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes of one spec entry that this mesh has and that split it (size > 1)."""
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def axis_size(mesh: Mesh, logical: str, rules: LogicalRules = RULES) -> int:
  """Devices one dimension named `logical` is split over on `mesh` (1 when it is replicated)."""
  spec = logical_to_spec((logical,), rules)
  return math.prod(mesh.shape[a] for a in _mesh_axes(spec[0], mesh))


def spec_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
             rules: LogicalRules = RULES) -> PartitionSpec:
  """PartitionSpec of an array of `shape` whose dims are named `axes`, checked for even splits."""
  spec = logical_to_spec(axes, rules)
  out = []
  for size, logical, entry in zip(shape, axes, tuple(spec) + (None,) * (len(axes) - len(spec))):
    mesh_axes = _mesh_axes(entry, mesh)
    shards = math.prod(mesh.shape[a] for a in mesh_axes)
    if size % shards == 0:
      out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes or None)
    elif size == 1 or logical in REPLICATED_WHEN_UNEVEN:
      out.append(None)
    else:
      raise UnevenShardingError(logical, size, mesh_axes, shards)
  return PartitionSpec(*out)


def sharding_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: LogicalRules = RULES) -> NamedSharding:
  return NamedSharding(mesh, spec_for(axes, shape, mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int, rules: LogicalRules = RULES) -> NamedSharding:
  """Batch rows over the data-parallel axes; the rest of each row stays whole."""
  return NamedSharding(mesh, PartitionSpec(_mesh_axes(logical_to_spec(('batch',), rules)[0], mesh) or None))


def check_batch(mesh: Mesh, global_batch: int, microbatches: int, rules: LogicalRules = RULES) -> None:
  """A microbatch's rows must split evenly over the data-parallel axes; on a mesh with stages (pipelined) over
  those within a stage, and the whole batch over all of them (outside the layer stack)."""
  rows = global_batch // microbatches
  pipelined = mesh.shape.get('stage', 1) > 1
  for size, count, axes in ((rows, microbatches, without('stage', rules) if pipelined else rules),
                            (global_batch, 1, rules)):
    try:
      spec_for(('batch',), (size,), mesh, axes)
    except UnevenShardingError as e:
      raise ConfigError(f'train.global_batch={global_batch} over {microbatches} microbatch(es) gives {rows} rows, '
                        f'not divisible by the data-parallel size {e.mesh_product}; use a global batch that is a '
                        f'multiple of {e.shards * count}') from None


def tree_shardings(logical_specs: Any, shapes: Any, mesh: Mesh, rules: LogicalRules = RULES) -> Any:
  """NamedShardings for a tree of arrays (`shapes`: anything with .shape) named by `logical_specs`.

  An uneven split is a ConfigError naming the config field, the mesh axes and the parameter.
  """
  def resolve(path: tuple, spec: PartitionSpec, leaf: Any) -> NamedSharding:
    axes = tuple(spec) if spec is not None else ()
    axes = axes + (None,) * (len(leaf.shape) - len(axes))
    try:
      return sharding_for(axes, leaf.shape, mesh, rules)
    except UnevenShardingError as e:
      name = '/'.join(path_names(path))
      raise ConfigError(f'{e} (parameter {name}); choose mesh sizes that divide it or change {e.field}') from None
  is_spec = lambda x: isinstance(x, PartitionSpec) or x is None
  return jax.tree_util.tree_map_with_path(resolve, logical_specs, shapes, is_leaf=is_spec)


def manual_axes() -> set[str]:
  """The mesh axes a `shard_map` being traced is manual over (a pipeline's stages); empty outside one."""
  context = jax.sharding.get_abstract_mesh()
  return set() if context.empty else set(context.manual_axes)


def shard_map(f: Any, mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
  """`jax.shard_map(f)` over every axis of `mesh`, or, traced inside a shard_map manual over some of them (a
  pipeline's stages), over the others (on the context's mesh, as JAX requires)."""
  context, manual = jax.sharding.get_abstract_mesh(), manual_axes()
  if not manual:
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return jax.shard_map(f, mesh=context, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                       axis_names=set(mesh.axis_names) - manual)


def path_names(path: tuple) -> list[str]:
  """A tree path's keys as names (dict keys, attribute names), e.g. ['decoder', 'layers', 'mlp', 'kernel']."""
  return [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside `sharding_context` (e.g. eager tests)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  sharding = sharding_for(axes, x.shape, mesh, rules)
  if manual_axes():  # inside a pipeline's stages: on the mesh whose stage is manual
    sharding = NamedSharding(jax.sharding.get_abstract_mesh(), sharding.spec)
  return jax.lax.with_sharding_constraint(x, sharding)
