"""Logical axis names -> mesh axes, in one table, and the sharding constraint layers call.

One table serves every strategy: a mesh axis of size 1 shards nothing, so the mesh
shape alone selects dp (data>1), fsdp (fsdp>1), tp (tensor>1) or any mix. Rules are
tried in order and a mesh axis is used at most once per array (Flax semantics), so an
activation `(batch, length, embed)` takes `fsdp` for its batch and leaves `embed`
replicated, while a parameter `(embed, mlp)` shards `embed` over `fsdp`.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalRules = tuple[tuple[str, Any], ...]

RULES: LogicalRules = (
  ('batch', ('data', 'fsdp')),
  ('vocab', 'tensor'),
  ('heads', 'tensor'),
  ('mlp', 'tensor'),
  ('embed', 'fsdp'),
  ('kv', None),
  ('length', None),
  ('layers', None),
)

_ACTIVE: contextvars.ContextVar[tuple[Mesh, LogicalRules] | None] = contextvars.ContextVar(
  'lm_sharding', default=None)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: LogicalRules = RULES) -> Iterator[None]:
  """Makes `constrain` active while a step function is traced (jit cannot take a mesh context)."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_sharding() -> tuple[Mesh, LogicalRules] | None:
  """The (mesh, rules) of the enclosing `sharding_context`, if any."""
  return _ACTIVE.get()


def logical_to_spec(axes: Sequence[str | None], rules: LogicalRules = RULES) -> PartitionSpec:
  return nn.logical_to_mesh_axes(tuple(axes), rules)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside `sharding_context` (e.g. eager tests)."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules)))


def logical_to_sharding(logical_specs: Any, mesh: Mesh, rules: LogicalRules = RULES) -> Any:
  """Pytree of logical PartitionSpecs -> pytree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
