"""The layer stack split over the `stage` mesh axis, run as one SPMD program: GPipe and circular schedules.

`pipelined(layer, params, xs, mesh)` equals applying the stack's layers in turn to each microbatch. Params carry a
leading [repeats, stages] layout (layer j p + s of the stack is repeat j's stage s; its stages dim shards over
`stage`); the microbatches xs [m, ...] go in whole and come out whole. Each tick is `lm.parallel.schedules`' table:
stage s runs work item t - s (microbatch i mod m of repeat i // m), hands its output to stage s + 1 by a `ppermute`
(the last stage's to stage 0: a circular repeat re-enters there, parked until its tick), and the last stage of the
last repeat writes the result. A bubble tick (no item) computes on zeros, whatever its buffers hold (`bubble` before
the first send), and its output is dropped, so nothing of it reaches the outputs or the gradients; the backward pass
is the tick loop's transpose (GPipe's order, reversed). Inside the stages `lm.parallel.rules.constrain` shards over
the other mesh axes (the rules without `stage`), so data, fsdp, tensor and sequence splits compose with it.

A train step on a mesh with stages hands its microbatches to the stack through `pipelining(m)`: one fill and drain
a step, rather than one per accumulated microbatch. Under 1F1B (`lm.parallel.one_f_one_b`) the last stage takes the
loss of each microbatch as it leaves the stack: the step's loss offers itself per microbatch (`offering_loss`), and
a stack that takes it leaves the loss and its sums in the offer.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from lm.config import ConfigError
from lm.parallel.rules import active_sharding, sharding_context, without
from lm.parallel.schedules import table

Layer = Callable[[Any, jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Pipelining:
  """What a pipelined stack runs while tracing a train step: `microbatches` in flight; `bubble`, what the stages'
  buffers hold before the first send (a test fills them with NaN to show none of it reaches anything)."""
  microbatches: int
  bubble: float = 0.0


_ACTIVE: contextvars.ContextVar[Pipelining | None] = contextvars.ContextVar('lm_pipelining', default=None)


@contextlib.contextmanager
def pipelining(microbatches: int, bubble: float = 0.0) -> Iterator[None]:
  """Makes a stack on a mesh with stages pipeline its layers over `microbatches` of the batch while a step is
  traced; without it (evaluation, scoring, decoding) the stack runs its layers in turn, gathered from the stages."""
  token = _ACTIVE.set(Pipelining(microbatches, bubble))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_pipelining() -> Pipelining | None:
  return _ACTIVE.get()


@dataclasses.dataclass
class LossOffer:
  """A train step's loss, offered to a stack that takes it in its last stage (1F1B): `loss(outputs, rows)` is
  (loss, sums) of the family's outputs (an `Unembedding` under 'logits') on a microbatch's `rows` of `batch`,
  normalised by whole-batch totals, so microbatches' losses and sums add up; `aux_loss(value, rows)` is what a
  routed layers' auxiliary loss (a mean over rows) `value` on those rows adds. A stack that takes it sets `taken` to
  the batch's (loss, sums)."""
  loss: Callable[[dict[str, Any], dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
  aux_loss: Callable[[jax.Array, dict[str, jax.Array]], jax.Array]
  batch: dict[str, jax.Array]
  taken: tuple[jax.Array, dict[str, jax.Array]] | None = None


_OFFER: contextvars.ContextVar[LossOffer | None] = contextvars.ContextVar('lm_loss_offer', default=None)


@contextlib.contextmanager
def offering_loss(loss: Callable, aux_loss: Callable, batch: dict[str, jax.Array]) -> Iterator[LossOffer]:
  """Offers a step's loss per microbatch (`LossOffer`) to the stack traced inside; the offer says whether it took it."""
  offer = LossOffer(loss, aux_loss, batch)
  token = _OFFER.set(offer)
  try:
    yield offer
  finally:
    _OFFER.reset(token)


def loss_taker(schedule: str, decode: bool = False) -> LossOffer | None:
  """The offered loss when a stack traced now takes it in its last stage (a train step pipelining by 1F1B); None
  otherwise. A 1F1B step whose loss is not offered (a job's own loss) is one line."""
  plan, active = active_pipelining(), active_sharding()
  if schedule != '1f1b' or decode or plan is None or active is None or active[0].shape.get('stage', 1) == 1:
    return None
  if _OFFER.get() is None:
    raise ConfigError('model.execution.pipeline.schedule=1f1b takes the loss in the last stage, and this job\'s loss '
                      'does not offer itself per microbatch; use schedule=gpipe or circular')
  return _OFFER.get()


def split_rows(x: jax.Array, m: int) -> jax.Array:
  """[B, ...] -> [m, B/m, ...], microbatch i taking rows i, i + m, ... (each spans every data shard)."""
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def join_rows(x: jax.Array) -> jax.Array:
  """`split_rows` undone: [m, B/m, ...] -> [B, ...]."""
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def pipelined(layer: Layer, params: Any, xs: jax.Array, mesh: Mesh, sides: Any = None, axis: str = 'stage',
              bubble: float = 0.0) -> jax.Array | tuple[jax.Array, Any]:
  """`layer(params of one (repeat, stage), x, sides of x's microbatch)` over the [repeats, stages, ...] `params` for
  each microbatch of xs [m, ...], pipelined over mesh `axis` (GPipe for one repeat, circular for more: m >= stages).
  `sides` [m, ...] (a pytree: segment ids, positions) are read by every stage for the microbatch it runs; a stage
  holding several layers scans them inside `layer`. `bubble`: what the buffers hold before the first send.

  A `layer` that returns (y, aux) (a pytree: a routed layer's statistics) gets (ys, each aux leaf as
  [m, repeats, stages, ...]) back, bubbles' left out."""
  repeats, stages = jax.tree.leaves(params)[0].shape[:2]
  m = xs.shape[0]
  ticks = table('circular' if repeats > 1 else 'gpipe', stages, m, repeats).forward_ticks  # m r + p - 1
  param_specs = jax.tree.map(lambda a: P(None, axis), params)
  active = active_sharding()
  inside = (lambda: sharding_context(active[0], without(axis, active[1]))) if active else contextlib.nullcontext
  one = jax.tree.map(lambda a: a[0, 0], params), xs[0], jax.tree.map(lambda a: a[0], sides)
  with inside():
    shapes = jax.eval_shape(layer, *one)
  with_aux = isinstance(shapes, tuple)

  def per_stage(params, xs, sides):
    with inside():
      out, aux = run(params, xs, sides)
    return (out, jax.tree.map(lambda a: a[:, :, None], aux)) if with_aux else out

  def run(params, xs, sides):
    params = jax.tree.map(lambda a: a[:, 0], params)  # [repeats, ...]: this stage's layers
    stage = jax.lax.axis_index(axis)
    work = m * repeats

    def tick(carry, t):
      received, parked, out, aux = carry
      item = t - stage
      valid = (item >= 0) & (item < work)
      i, repeat = item % m, jnp.clip(item // m, 0, repeats - 1)
      first = jnp.where(repeat == 0, xs[i], parked[i])
      # a bubble's input is whatever its buffers hold (stale, or `bubble` before any send): it computes on zeros
      # instead, and its output is dropped, so neither its values nor its gradients reach anything. (Skipping it by
      # a `lax.cond` would save no time, as the stages run in step, and would hide collectives from some devices.)
      x = jnp.where(valid, jnp.where(stage == 0, first, received), jnp.zeros_like(received))
      y = layer(jax.tree.map(lambda a: a[repeat], params), x, jax.tree.map(lambda a: a[i], sides))
      if with_aux:
        y, a = y
        aux = jax.tree.map(lambda b, a: b.at[i, repeat].set(jnp.where(valid, a, b[i, repeat])), aux, a)
      out = out.at[i].set(jnp.where(valid & (stage == stages - 1) & (repeat == repeats - 1), y, out[i]))
      received = jax.lax.ppermute(y, axis, [(s, (s + 1) % stages) for s in range(stages)])
      # stage 0 parks the last stage's output of the item finished last tick until that microbatch's next repeat
      done = t - (stages - 1)
      parks = (stage == 0) & (done >= 0) & (done < work - m)
      parked = parked.at[done % m].set(jnp.where(parks, received, parked[done % m]))
      return (received, parked, out, aux), None

    aux = jax.tree.map(lambda s: jnp.zeros((m, repeats, *s.shape), s.dtype), shapes[1]) if with_aux else None
    init = (jnp.full_like(xs[0], bubble), jnp.full_like(xs, bubble), jnp.zeros_like(xs), aux)
    (_, _, out, aux), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
    return jax.lax.psum(out, axis), aux  # only the last stage wrote the outputs; each stage its layers' aux

  out_specs = (P(), jax.tree.map(lambda a: P(None, None, axis), shapes[1])) if with_aux else P()
  return jax.shard_map(per_stage, mesh=mesh, in_specs=(param_specs, P(), P()), out_specs=out_specs,
                       axis_names={axis}, check_vma=False)(params, xs, sides)
