"""Ring attention: attention over a sequence sharded across a mesh axis (context parallelism).

Each device keeps its block of queries and passes its key/value block around the ring of the axis (`ppermute`),
one hop per step; after n steps every query block has met every key/value block, and no device ever holds more
than one block of another's keys and values. Blocks combine by the online-softmax rescaling (running max and
sum), so the result is exact. The backward pass goes around the ring again, recomputing each block's
probabilities from the saved log-sum-exp (as flash attention does) and sending the key/value gradients along
with their blocks, so that after n hops they are home: nothing of size [length, length] is kept between passes.

Masks come from global token positions, which travel with their blocks: any layout works. For causal attention
the load-balanced one is `zigzag_order` (shard i holds chunks i and 2n-1-i of 2n), where every shard scores about
the same number of query-key pairs (`causal_pairs_per_shard`); contiguous chunks would leave the first shard
with almost nothing to do and the last with most of it.

Layout is the model's: q [batch, q_len, heads, head_dim], k/v [batch, kv_len, heads, head_dim] (key/value heads
already repeated to the query heads), all local to the calling shard under `shard_map`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lm.kernels.flash_attention import MASKED, flash_block, flash_block_grads
from lm.ops import mixed

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so fully masked rows give no NaN (attention.py's too)


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """The global token index at each place of the sharded sequence: with the sequence cut into 2n chunks,
  shard i holds chunk i followed by chunk 2n-1-i, so each has an early and a late part of a causal row."""
  if length % (2 * shards):
    raise ValueError(f'a sequence of {length} tokens does not split into {2 * shards} equal chunks')
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def causal_pairs_per_shard(order: np.ndarray, shards: int) -> np.ndarray:
  """How many (query, key) pairs each shard scores under a causal mask: query at position p sees p + 1 keys."""
  return (order.reshape(shards, -1) + 1).sum(axis=1)


def _allowed(q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array | None, kv_seg: jax.Array | None,
             causal: bool) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k]: causal by global position, same segment, key not padding (segment 0)."""
  allowed = (q_pos[:, None] >= kv_pos[None, :])[None, None] if causal else None
  if q_seg is not None:
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    allowed = same[:, None] if allowed is None else allowed & same[:, None]
  return allowed


def _logits(q, k, bias_rows, kv_pos, allowed, scale):
  s = mixed.einsum('bqhd,bkhd->bhqk', q, k, dtype=q.dtype, out_dtype=jnp.float32) * scale
  if bias_rows is not None:  # the rows of this shard's queries, every key column: take the block's keys
    s = s + jnp.take(bias_rows, kv_pos, axis=-1).astype(jnp.float32)
  return s if allowed is None else jnp.where(allowed, s, _MASKED)


def _ring(axis_name: str):
  n = jax.lax.axis_size(axis_name)
  perm = [(i, (i + 1) % n) for i in range(n)]
  return n, lambda tree: jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


QUERY_CHUNK = 512  # query rows scored at once against a key/value block: bounds its [heads, rows, block] scores


def _chunks(x: jax.Array | None, c: int, axis: int) -> jax.Array | None:
  """`axis` cut into chunks of `c`, stacked in front: [..., L, ...] -> [L / c, ..., c, ...]."""
  if x is None:
    return None
  x = x.reshape(x.shape[:axis] + (x.shape[axis] // c, c) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _joined(x: jax.Array | None, axis: int) -> jax.Array | None:
  """The inverse of `_chunks`."""
  if x is None:
    return None
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def ring_attention(axis_name: str, causal: bool, scale: float, query_chunk: int, q: jax.Array, k: jax.Array,
                   v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array | None,
                   kv_seg: jax.Array | None, bias_rows: jax.Array | None) -> jax.Array:
  """Attention of this shard's queries over the whole ring's keys and values (call under `shard_map`).

  q_pos/kv_pos: [q_len]/[kv_len] global positions of the local tokens; q_seg/kv_seg: [batch, len] segment ids
  (0 is padding) or None; bias_rows: [batch or 1, heads, q_len, total kv_len] with columns in global position
  order (this shard's rows of the full bias), or None. Queries meet each block `query_chunk` rows at a time
  (all at once when that does not divide q_len).
  """
  return _forward(axis_name, causal, scale, query_chunk, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows)[0]


def _query_side(c, q, q_pos, q_seg, bias_rows):
  return _chunks(q, c, 1), _chunks(q_pos, c, 0), _chunks(q_seg, c, 1), _chunks(bias_rows, c, 2)


def _forward(axis_name, causal, scale, query_chunk, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows):
  n, send = _ring(axis_name)
  b, lq, h, d = q.shape
  c = query_chunk if lq % query_chunk == 0 else lq
  queries = _query_side(c, q, q_pos, q_seg, bias_rows)

  def step(_, carry):
    o, m, l, blocks = carry
    k, v, kv_pos, kv_seg = blocks

    def rows(args):  # one chunk of query rows against this block: rows are independent in the forward pass
      (q, q_pos, q_seg, bias_rows), o, m, l = args
      allowed = _allowed(q_pos, kv_pos, q_seg, kv_seg, causal)
      s = _logits(q, k, bias_rows, kv_pos, allowed, scale)
      m_new = jnp.maximum(m, s.max(axis=-1))
      p = jnp.exp(s - m_new[..., None])
      if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
      rescale = jnp.exp(m - m_new)
      pv = mixed.einsum('bhqk,bkhd->bqhd', p, v, dtype=v.dtype, out_dtype=jnp.float32)
      return o * jnp.swapaxes(rescale, 1, 2)[..., None] + pv, m_new, l * rescale + p.sum(axis=-1)
    o, m, l = jax.lax.map(rows, (queries, o, m, l))
    return o, m, l, send(blocks)

  chunks = lq // c
  init = (jnp.zeros((chunks, b, c, h, d), jnp.float32), jnp.full((chunks, b, h, c), _MASKED, jnp.float32),
          jnp.zeros((chunks, b, h, c), jnp.float32), (k, v, kv_pos, kv_seg))
  o, m, l, _ = jax.lax.fori_loop(0, n, step, init)
  o, m, l = _joined(o, 1), _joined(m, 2), _joined(l, 2)
  seen = l > 0  # rows with no allowed key anywhere give zeros, as the single-device path does
  o = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], o / jnp.swapaxes(jnp.where(seen, l, 1.0), 1, 2)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  o = o.astype(q.dtype)
  return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows, o, lse)


def _backward(axis_name, causal, scale, query_chunk, residuals, do):
  q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows, o, lse = residuals
  n, send = _ring(axis_name)
  lq = q.shape[1]
  c = query_chunk if lq % query_chunk == 0 else lq
  delta = jnp.einsum('bqhd,bqhd->bhq', do.astype(jnp.float32), o.astype(jnp.float32))
  queries = (*_query_side(c, q, q_pos, q_seg, bias_rows), _chunks(do, c, 1), _chunks(lse, c, 2),
             _chunks(delta, c, 2))

  def step(_, carry):
    dq, dbias, blocks = carry
    k, v, kv_pos, kv_seg, dk, dv = blocks

    def rows(grads, args):  # one chunk of query rows: its dQ, and its share of this block's dK, dV
      dk, dv = grads
      (q, q_pos, q_seg, bias_rows, do, lse, delta), dq, dbias = args
      allowed = _allowed(q_pos, kv_pos, q_seg, kv_seg, causal)
      p = jnp.exp(_logits(q, k, bias_rows, kv_pos, allowed, scale) - lse[..., None])
      if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
      dv = dv + mixed.einsum('bhqk,bqhd->bkhd', p, do, dtype=do.dtype, out_dtype=jnp.float32)
      dp = mixed.einsum('bqhd,bkhd->bhqk', do, v, dtype=do.dtype, out_dtype=jnp.float32)
      ds = p * (dp - delta[..., None])
      dq = dq + mixed.einsum('bhqk,bkhd->bqhd', ds, k, dtype=q.dtype, out_dtype=jnp.float32) * scale
      dk = dk + mixed.einsum('bhqk,bqhd->bkhd', ds, q, dtype=q.dtype, out_dtype=jnp.float32) * scale
      if dbias is not None:  # summed over the dims the bias broadcasts along, into this block's key columns
        dbias = dbias.at[..., kv_pos].add(ds.sum(axis=0, keepdims=True) if dbias.shape[0] == 1 else ds)
      return (dk, dv), (dq, dbias)
    (dk, dv), (dq, dbias) = jax.lax.scan(rows, (dk, dv), (queries, dq, dbias))
    return dq, dbias, send((k, v, kv_pos, kv_seg, dk, dv))  # after n hops each block and its gradient are home

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dbias = None if bias_rows is None else _chunks(zeros(bias_rows), c, 2)
  init = (_chunks(zeros(q), c, 1), dbias, (k, v, kv_pos, kv_seg, zeros(k), zeros(v)))
  dq, dbias, (_, _, _, _, dk, dv) = jax.lax.fori_loop(0, n, step, init)
  dq, dbias = _joined(dq, 1), _joined(dbias, 2)
  dbias = None if dbias is None else dbias.astype(bias_rows.dtype)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, dbias)


ring_attention.defvjp(_forward, _backward)


# ---------------------------------------------------------------- flash blocks

def _merge(o: jax.Array, lse: jax.Array, o_block: jax.Array, lse_block: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two partial attentions of the same queries over disjoint keys, each normalised with its log-sum-exp
  [b, h, q], combined into one (float32)."""
  lse_new = jnp.logaddexp(lse, lse_block)
  weight = lambda x: jnp.swapaxes(jnp.exp(x - lse_new), 1, 2)[..., None]
  return o * weight(lse) + o_block.astype(jnp.float32) * weight(lse_block), lse_new


def _halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """A shard's zig-zag halves: its early chunk and its late chunk."""
  return tuple(jnp.split(x, 2, axis=axis))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def ring_flash_attention(axis_name: str, causal: bool, scale: float, block_q: int, block_k: int, interpret: bool,
                         q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array,
                         kv_seg: jax.Array) -> jax.Array:
  """`ring_attention` with each block computed by our flash kernel (interpreted on CPU); segment ids
  [batch, len] (0 is padding), no bias. Causal attention needs the `zigzag_order` layout: shard i holds chunks i
  and 2n-1-i, so against the block of shard s its early chunk sees all of the block's early chunk when s < i,
  its late chunk all of the block's late chunk when s > i, its late chunk always all of the block's early chunk,
  and against its own block each chunk its own causally; the kernel runs exactly those sub-blocks, full or
  causal, and skips the rest."""
  return _flash_forward(axis_name, causal, scale, block_q, block_k, interpret, q, k, v, q_seg, kv_seg)[0]


def _flash_forward(axis_name, causal, scale, block_q, block_k, interpret, q, k, v, q_seg, kv_seg):
  n, send = _ring(axis_name)
  block = partial(flash_block, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
  b, lq, h, d = q.shape
  empty = lambda length: (jnp.zeros((b, length, h, d), jnp.float32), jnp.full((b, h, length), MASKED, jnp.float32))
  if not causal:
    def step(_, carry):
      o, lse, blocks = carry
      o, lse = _merge(o, lse, *block(q, *blocks[:2], q_seg, blocks[2], causal=False))
      return o, lse, send(blocks)
    o, lse, _ = jax.lax.fori_loop(0, n, step, (*empty(lq), (k, v, kv_seg)))
  else:
    i = jax.lax.axis_index(axis_name)
    (qa, qb), (sa, sb) = _halves(q, 1), _halves(q_seg, 1)

    (ka, kb), (va, vb), (ska, skb) = _halves(k, 1), _halves(v, 1), _halves(kv_seg, 1)
    a = block(qa, ka, va, sa, ska, causal=True)  # hop 0, its own block: each chunk its own, causally
    b_ = _merge(*block(qb, kb, vb, sb, skb, causal=True), *block(qb, ka, va, sb, ska, causal=False))

    def step(t, carry):
      a, b_, blocks = carry
      blocks = send(blocks)  # now the block of shard s = i - t
      ka, kb, va, vb, ska, skb = (y for x in blocks for y in _halves(x, 1))
      b_ = _merge(*b_, *block(qb, ka, va, sb, ska, causal=False))
      a, b_ = jax.lax.cond((i - t) % n < i,
                           lambda: (_merge(*a, *block(qa, ka, va, sa, ska, causal=False)), b_),
                           lambda: (a, _merge(*b_, *block(qb, kb, vb, sb, skb, causal=False))))
      return a, b_, blocks
    a = tuple(x.astype(jnp.float32) for x in a)
    a, b_, _ = jax.lax.fori_loop(1, n, step, (a, b_, (k, v, kv_seg)))
    o, lse = jnp.concatenate([a[0], b_[0]], axis=1), jnp.concatenate([a[1], b_[1]], axis=2)
  seen = lse > 0.5 * MASKED  # rows with no allowed key anywhere give zeros, as the single-device path does
  o = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], o, 0.0).astype(q.dtype)
  lse = jnp.where(seen, lse, 0.0)
  return o, (q, k, v, q_seg, kv_seg, o, lse)


def _flash_backward(axis_name, causal, scale, block_q, block_k, interpret, residuals, do):
  q, k, v, q_seg, kv_seg, o, lse = residuals
  n, send = _ring(axis_name)
  grads = partial(flash_block_grads, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  if not causal:
    def step(_, carry):
      dq, (k, v, kv_seg, dk, dv) = carry
      dq_b, dk_b, dv_b = f32(*grads(q, k, v, q_seg, kv_seg, o, lse, do, causal=False))
      return dq + dq_b, send((k, v, kv_seg, dk + dk_b, dv + dv_b))  # after n hops each block's grads are home
    dq, (_, _, _, dk, dv) = jax.lax.fori_loop(0, n, step, (zeros(q), (k, v, kv_seg, zeros(k), zeros(v))))
  else:
    i = jax.lax.axis_index(axis_name)
    (qa, qb), (sa, sb), (oa, ob), (la, lb), (da, db) = (_halves(x, ax) for x, ax in
                                                         ((q, 1), (q_seg, 1), (o, 1), (lse, 2), (do, 1)))
    query_a, query_b = (qa, sa, oa, la, da), (qb, sb, ob, lb, db)

    def share(query, ka, va, ska, causal):  # (dq, dk, dv) of a query chunk against a key/value chunk
      qx, sx, ox, lx, dx = query
      return f32(*grads(qx, ka, va, sx, ska, ox, lx, dx, causal=causal))

    (ka, kb), (va, vb), (ska, skb) = _halves(k, 1), _halves(v, 1), _halves(kv_seg, 1)
    dqa, dka, dva = share(query_a, ka, va, ska, True)
    dqb, dkb, dvb = share(query_b, kb, vb, skb, True)
    dqb2, dka2, dva2 = share(query_b, ka, va, ska, False)
    dq, dk, dv = (dqa, dqb + dqb2), (dka + dka2, dkb), (dva + dva2, dvb)

    def step(t, carry):
      (dqa, dqb), blocks = carry
      k, v, kv_seg, dk, dv = send(blocks)  # the block of shard s = i - t, with the gradient it has gathered
      (ka, kb), (va, vb), (ska, skb), (dka, dkb), (dva, dvb) = (_halves(x, 1) for x in (k, v, kv_seg, dk, dv))
      g = share(query_b, ka, va, ska, False)
      dqb, dka, dva = dqb + g[0], dka + g[1], dva + g[2]

      def early():  # s < i: the early chunk sees all of the block's early chunk
        g = share(query_a, ka, va, ska, False)
        return dqa + g[0], dqb, dka + g[1], dkb, dva + g[2], dvb

      def late():  # s > i: the late chunk sees all of the block's late chunk
        g = share(query_b, kb, vb, skb, False)
        return dqa, dqb + g[0], dka, dkb + g[1], dva, dvb + g[2]
      dqa, dqb, dka, dkb, dva, dvb = jax.lax.cond((i - t) % n < i, early, late)
      join = lambda x, y: jnp.concatenate([x, y], axis=1)
      return (dqa, dqb), (k, v, kv_seg, join(dka, dkb), join(dva, dvb))
    join = lambda x: jnp.concatenate(x, axis=1)
    dq, blocks = jax.lax.fori_loop(1, n, step, (dq, (k, v, kv_seg, join(dk), join(dv))))
    dq = join(dq)
    dk, dv = send(blocks[3:])  # one hop more brings each block's gradient home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_flash_attention.defvjp(_flash_forward, _flash_backward)
