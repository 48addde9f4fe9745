"""Train state, built sharded from the start: abstract init -> NamedShardings -> jitted init.

No device ever holds the whole unsharded model: shapes come from `jax.eval_shape`, the
shardings from the params' logical axes, and the real init runs under jit with those
out-shardings so each device materialises only its shard.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.models import init_params
from lm.parallel.rules import logical_to_sharding


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: Any
  opt_state: Any


def state_shardings(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh, seq_len: int
                    ) -> tuple[TrainState, TrainState]:
  """(abstract state of ShapeDtypeStructs carrying their shardings, matching NamedSharding tree)."""
  boxed = jax.eval_shape(lambda rng: init_params(model, rng, seq_len), jax.random.key(0))
  param_shardings = logical_to_sharding(nn.get_partition_spec(boxed), mesh)
  params = nn.unbox(boxed)
  opt_state = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_shardings = optax.tree_map_params(tx, lambda _, sharding: sharding, opt_state, param_shardings,
                                        transform_non_params=lambda _: replicated)
  shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
  abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=opt_state)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return abstract, shardings


def make_init_fn(model: nn.Module, tx: optax.GradientTransformation, shardings: TrainState,
                 seq_len: int) -> Callable[[jax.Array], TrainState]:
  """jit(init) whose outputs land directly in their shards."""
  def init(rng: jax.Array) -> TrainState:
    # No sharding context: the dummy forward pass only creates params (XLA drops its activations),
    # and its batch of 1 need not divide over the data axes.
    params = nn.unbox(init_params(model, rng, seq_len))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  return jax.jit(init, out_shardings=shardings)
