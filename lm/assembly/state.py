"""Train state, built sharded from the start: abstract init -> NamedShardings -> jitted init.

No device ever holds the whole unsharded model: shapes come from `jax.eval_shape`, the
shardings from the params' logical axes and the rules, and the real init runs under jit with
those out-shardings so each device materialises only its shard.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.models.family import Family


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array  # steps whose loss or gradient was not finite, so their update was withheld


def shardings_of(tree: Any) -> Any:
  return jax.tree.map(lambda a: a.sharding, tree)


def abstract_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """The whole train state as ShapeDtypeStructs with shardings: optimizer moments follow their params."""
  param_shardings = shardings_of(params)
  opt_state = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_shardings = optax.tree_map_params(tx, lambda _, sharding: sharding, opt_state, param_shardings,
                                        transform_non_params=lambda _: replicated)
  with_sharding = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  return TrainState(step=scalar, params=params, opt_state=jax.tree.map(with_sharding, opt_state, opt_shardings),
                    skipped=scalar)


def make_init_fn(family: Family, model: nn.Module, tx: optax.GradientTransformation, shardings: TrainState,
                 length: int) -> Callable[[jax.Array], TrainState]:
  """jit(init) whose outputs land directly in their shards."""
  def init(rng: jax.Array) -> TrainState:
    # No sharding context: the dummy forward pass only creates params (XLA drops its activations),
    # and its batch of 1 need not divide over the data axes.
    params = nn.unbox(family.init(model, rng, length))
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), skipped=zero)
  return jax.jit(init, out_shardings=shardings)
