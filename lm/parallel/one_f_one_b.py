"""The 1F1B schedule as one SPMD program: each stage runs a microbatch's backward pass as soon as its gradient
arrives, so it holds at most 2 (p - s) - 1 microbatches' stage inputs, whatever the number of microbatches m.

`one_f_one_b(layer, loss, params, head, xs, mesh)` is sum_i loss(head, layers(xs[i])) for params [stages, ...] (the
stages dim over mesh `axis`), with the sums the loss reports beside it added up too, and its gradients for params,
head and xs come from a custom VJP: the forward pass of the tick loop already computed them. Each tick follows
`lm.parallel.schedules.table('1f1b', p, m)`: a stage runs its F slot (stashing its input; the last stage also takes
the loss and its gradient, for its B slot of the same tick) and its B slot (the stage's forward recomputed from the
stashed input, then its VJP), hands the F output to the next stage and the B output to the previous one (two
`ppermute`s; each arrives the tick it is used), and stage 0 writes each microbatch's input gradient over that
microbatch's input, which it no longer needs. A slot with nothing to run computes on zeros, whatever its buffers hold,
and its results are dropped.

The loss runs on every stage each tick (kept only on the last): the stages run in step, so a `lax.cond` would save
no time, and it would hide collectives inside it from some devices.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from lm.parallel.rules import active_sharding, sharding_context, without
from lm.parallel.schedules import table

Layer = Callable[[Any, jax.Array, Any], Any]  # y, or (y, (its own loss, stats))
Loss = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]  # (value, sums: a pytree to add up, not differentiated)


def slots(stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray, int]:
  """The 1F1B table as arrays [ticks, stages] of the microbatch each stage's F and B slots run (-1: none), and the
  stash's size: the most microbatches any stage holds."""
  tbl = table('1f1b', stages, microbatches)
  f, b = (np.full((len(tbl.ticks), stages), -1, np.int32) for _ in range(2))
  for t, tick in enumerate(tbl.ticks):
    for s, runs in enumerate(tick):
      for slot in runs:
        (f if slot.kind == 'F' else b)[t, s] = slot.microbatch
  return f, b, max(tbl.in_flight())


def one_f_one_b(layer: Layer, loss: Loss, params: Any, head: Any, xs: jax.Array, mesh: Mesh, sides: Any = None,
                axis: str = 'stage', bubble: float = 0.0) -> tuple[jax.Array, tuple[Any, Any]]:
  """(sum_i value_i, (sum_i sums_i, stats)) of `loss(head, y_i, sides[i]) = (value_i, sums_i)`, y_i being `layer` of
  each stage's params (params [stages, ...]) in turn on xs[i] ([m, ...]), pipelined by 1F1B over mesh `axis`;
  differentiable in params (their inexact leaves), head and xs. `sides` [m, ...] (a pytree) are read by whichever
  stage runs the microbatch; `bubble`: what the stages' buffers hold before the first send.

  A `layer` that returns (y, (value, stats)) adds `value` (a routed layer's auxiliary loss) to the loss, and its
  `stats` come back as [stages, m, ...]; stats are None otherwise."""
  stages, m = jax.tree.leaves(params)[0].shape[0], xs.shape[0]
  active = active_sharding()
  inside = (lambda: sharding_context(active[0], without(axis, active[1]))) if active else contextlib.nullcontext
  with inside():
    with_stats = isinstance(jax.eval_shape(layer, jax.tree.map(lambda a: a[0], params), xs[0],
                                           jax.tree.map(lambda a: a[0], sides)), tuple)
  run = layer if with_stats else lambda p, x, side: (layer(p, x, side), (jnp.zeros((), jnp.float32), None))

  def per_stage(params, head, xs, sides):
    with inside():
      return _tick_loop(run, loss, jax.tree.map(lambda a: a[0], params), head, xs, sides, slots(stages, m), axis,
                        bubble)

  specs = jax.tree.map(lambda a: P(axis), params)
  stacked = jax.shard_map(per_stage, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=P(axis),
                          axis_names={axis}, check_vma=False)

  def run_all(params, head, xs, sides):
    (total, sums, stats), (grads, head_grads, dxs) = stacked(params, head, xs, sides)
    # the head's loss was taken on the last stage, the routed layers' on every one; the inputs' gradients on the first
    added = lambda tree: jax.tree.map(lambda a: a.sum(0), tree)
    return (total.sum(0), (added(sums), stats)), (grads, jax.tree.map(lambda a: a[-1], head_grads), dxs[0])

  @jax.custom_vjp
  def pipeline(params, head, xs, sides):
    return run_all(params, head, xs, sides)[0]

  def pipeline_fwd(params, head, xs, sides):
    return run_all(params, head, xs, sides)

  def pipeline_bwd(grads, g):
    g = g[0]  # the sums and stats are not differentiated; integer params (layer indices) get None: no cotangent
    return (*jax.tree.map(lambda a: (g * a).astype(a.dtype), grads), None)

  pipeline.defvjp(pipeline_fwd, pipeline_bwd)
  return pipeline(params, head, xs, sides)


def _tick_loop(layer: Layer, loss: Loss, params: Any, head: Any, xs: jax.Array, sides: Any,
               table_slots: tuple[np.ndarray, np.ndarray, int], axis: str, bubble: float) -> tuple[Any, Any]:
  """One stage's ticks (inside the shard_map; `layer` returns (y, (value, stats))): its loss, sums and stats
  [m, ...], and gradients (params, head, inputs), each with a leading dim of 1 that the stages stack along."""
  f_slots, b_slots, stash_size = table_slots
  stages = f_slots.shape[1]
  forward = [(s, s + 1) for s in range(stages - 1)]
  backward = [(s + 1, s) for s in range(stages - 1)]
  stage = jax.lax.axis_index(axis)
  last = stage == stages - 1
  take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  mask = lambda keep, tree: jax.tree.map(lambda a: jnp.where(keep, a, jnp.zeros_like(a)), tree)

  def tick(carry, slots_now):
    received, returned, stash, xs, grads, head_grads, total, sums, stats = carry
    i, j = slots_now[0][stage], slots_now[1][stage]
    f_valid, b_valid = i >= 0, j >= 0
    i, j = jnp.maximum(i, 0), jnp.maximum(j, 0)
    # F slot: this stage's layers on microbatch i (stage 0 reads it from xs), its input stashed for its B slot
    x = jnp.where(f_valid, jnp.where(stage == 0, xs[i], received), jnp.zeros_like(received))
    stash = stash.at[i % stash_size].set(jnp.where(f_valid, x, stash[i % stash_size]))
    y, (own, stats_i) = layer(params, x, take(sides, i))
    stats = jax.tree.map(lambda b, a: b.at[i].set(jnp.where(f_valid, a, b[i])), stats, stats_i)
    (value, sums_i), (head_grad, dy) = jax.value_and_grad(loss, (0, 1), has_aux=True)(head, y, take(sides, i))
    keep = f_valid & last  # the last stage's loss, whose gradient its B slot takes in this same tick
    total = total + jnp.where(keep, value, 0.0) + jnp.where(f_valid, own, 0.0)
    head_grads, sums = jax.tree.map(jnp.add, (head_grads, sums), mask(keep, (head_grad, sums_i)))
    # B slot: the stage's forward on microbatch j recomputed from its stash, and its VJP (its own loss's too)
    xb = jnp.where(b_valid, stash[j % stash_size], jnp.zeros_like(x))
    g = jnp.where(b_valid, jnp.where(last, dy, returned), jnp.zeros_like(dy))
    _, vjp = jax.vjp(lambda p, x: _output_and_own(layer(_merged(p, params), x, take(sides, j))), _inexact(params), xb)
    param_grad, dx = vjp((g, jnp.ones_like(own)))
    grads = jax.tree.map(jnp.add, grads, mask(b_valid, param_grad))
    xs = xs.at[j].set(jnp.where(b_valid & (stage == 0), dx, xs[j]))  # stage 0 has used xs[j] by now
    received = jax.lax.ppermute(y, axis, forward)
    returned = jax.lax.ppermute(dx, axis, backward)
    return (received, returned, stash, xs, grads, head_grads, total, sums, stats), None

  m = xs.shape[0]
  filler = jnp.full_like(xs[0], bubble)
  zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
  y, (_, stats) = jax.eval_shape(layer, params, xs[0], take(sides, 0))
  sums = jax.eval_shape(loss, head, y, take(sides, 0))[1]
  init = (filler, filler, jnp.full((stash_size, *xs.shape[1:]), bubble, xs.dtype), xs, zeros(_inexact(params)),
          zeros(head), jnp.zeros((), jnp.float32), zeros(sums),
          jax.tree.map(lambda s: jnp.zeros((m, *s.shape), s.dtype), stats))
  (_, _, _, dxs, grads, head_grads, total, sums, stats), _ = jax.lax.scan(
    tick, init, (jnp.asarray(f_slots), jnp.asarray(b_slots)))
  return jax.tree.map(lambda a: a[None], ((total, sums, stats), (grads, head_grads, dxs)))


def _output_and_own(out: tuple[jax.Array, tuple[jax.Array, Any]]) -> tuple[jax.Array, jax.Array]:
  """A layer's output and its own loss, without its stats: what the B slot differentiates."""
  y, (own, _) = out
  return y, own


def _inexact(tree: Any) -> Any:
  """`tree` with None for its integer leaves (a layer's index): what has a gradient."""
  return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else None, tree)


def _merged(inexact: Any, tree: Any) -> Any:
  """`tree` with its inexact leaves from `inexact` (`_inexact`'s)."""
  return jax.tree.map(lambda a, b: b if a is None else a, inexact, tree, is_leaf=lambda a: a is None)
