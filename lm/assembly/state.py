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

from lm.config import TrainConfig
from lm.models import init_params


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array  # steps whose update was withheld: a non-finite loss or gradient, a spike (train.on_spike=skip)
  spike_window: Any = None  # train.on_spike: the running window of `WATCHED` values (`abstract_window`)


Window = dict[str, jax.Array]
WATCHED = ('loss', 'grad_norm')  # the step metrics a spike guard judges


def abstract_window(train: TrainConfig, mesh: Mesh) -> Window | None:
  """The spike guard's window in the train state (replicated): the last `train.spike_window` values of each watched
  metric, how many were seen and how many spikes skipped; None under on_spike=off (the state as without it)."""
  if train.on_spike == 'off':
    return None
  replicated = NamedSharding(mesh, PartitionSpec())
  values = jax.ShapeDtypeStruct((train.spike_window,), jnp.float32, sharding=replicated)
  count = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  return {**{name: values for name in WATCHED}, 'seen': count, 'spikes': count}


def with_fresh_window(state: TrainState, abstract: Window | None) -> TrainState:
  """`state` with an empty window where the guard keeps one and the state has none (a fresh start, init_from, a
  checkpoint written without the guard)."""
  if abstract is None or state.spike_window is not None:
    return state
  return state.replace(spike_window=jax.tree.map(
    lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding), abstract))


def shardings_of(tree: Any) -> Any:
  return jax.tree.map(lambda a: a.sharding, tree)


HOST = 'pinned_host'  # the host memory a device addresses directly (what offloading moves state to)


def in_memory(tree: Any, kind: str) -> Any:
  """`tree`'s ShapeDtypeStructs with their shardings in memory `kind` ('device', HOST)."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding.with_memory_kind(kind)),
                      tree)


def offloaded(state: TrainState, train: TrainConfig) -> TrainState:
  """Where the train state rests between steps: the optimizer state (train.optimizer_offload) and the params
  (train.param_offload) in host memory, the rest on the devices."""
  return state.replace(opt_state=in_memory(state.opt_state, HOST) if train.optimizer_offload else state.opt_state,
                       params=in_memory(state.params, HOST) if train.param_offload else state.params)


def is_offloaded(tree: Any) -> bool:
  return any(leaf.sharding.memory_kind == HOST for leaf in jax.tree.leaves(tree))


def to_device(tree: Any, abstract: Any) -> Any:
  """Inside a jit: `tree` (resting where `abstract` says) in device memory, for computing with; a tree with
  nothing offloaded is returned as it is, so the program is the one without offloading."""
  if not is_offloaded(abstract):
    return tree
  return jax.device_put(tree, shardings_of(in_memory(abstract, 'device')))


def abstract_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """The whole train state as ShapeDtypeStructs with shardings: optimizer moments follow their params; a moment
  of another shape (Adafactor's factored rows and columns: vectors) is replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  by_path = {tuple(path): param for path, param in jax.tree_util.tree_flatten_with_path(params)[0]}

  def with_sharding(path: tuple, moment: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    # A moment of a param sits at a path ending in the param's own (optax states nest the params' tree).
    param = next((by_path[path[i:]] for i in range(len(path)) if path[i:] in by_path), None)
    sharding = param.sharding if param is not None and param.shape == moment.shape else replicated
    return jax.ShapeDtypeStruct(moment.shape, moment.dtype, sharding=sharding)
  opt_state = jax.tree_util.tree_map_with_path(with_sharding, jax.eval_shape(tx.init, params))
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
  return TrainState(step=scalar, params=params, opt_state=opt_state, skipped=scalar)


def make_init_fn(model: nn.Module, tx: optax.GradientTransformation, shardings: TrainState,
                 length: int) -> Callable[[jax.Array], TrainState]:
  """jit(init) whose outputs land directly in their shards."""
  def init(rng: jax.Array) -> TrainState:
    # No sharding context: the dummy forward pass only creates params (XLA drops its activations),
    # and its batch of 1 need not divide over the data axes.
    params = nn.unbox(init_params(model, rng, length))
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=tx.init(params), skipped=zero)
  return jax.jit(init, out_shardings=shardings)
