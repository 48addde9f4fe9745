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

`ring_attention` computes each block with XLA einsums (`query_chunk` query rows at a time);
`ring_flash_attention` runs our flash kernel on the sub-blocks the zig-zag layout leaves visible.

Layout is the model's: q [batch, q_len, heads, head_dim], k/v [batch, kv_len, heads, head_dim] (key/value heads
already repeated to the query heads), all local to the calling shard under `shard_map`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lm.ops import mixed
from lm.ops.attention.flash import flash_block, flash_block_grads
from lm.ops.attention.masking import MASKED
from lm.ops.attention.sinks import sink_grad, sunk
from lm.ops.softcap import soft_cap, soft_cap_grad


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
             causal: bool, window: int = 0) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k]: causal by global position (within `window` positions back when > 0), same
  segment, key not padding (segment 0)."""
  allowed = None
  if causal:
    offset = q_pos[:, None] - kv_pos[None, :]
    allowed = ((offset >= 0) & (offset < window) if window else offset >= 0)[None, None]
  if q_seg is not None:
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    allowed = same[:, None] if allowed is None else allowed & same[:, None]
  return allowed


def _hidden(q_pos: jax.Array, kv_pos: jax.Array, causal: bool, window: int) -> jax.Array | bool:
  """Whether no query at `q_pos` may see any key at `kv_pos` (all later, or all `window` or more back): the
  block's scores are skipped."""
  if not causal:
    return False
  later = jnp.min(kv_pos) > jnp.max(q_pos)
  return later | (jnp.min(q_pos) - jnp.max(kv_pos) >= window) if window else later


def _scores(q, k, scale, softcap):
  """Scaled q.k, soft-capped when softcap > 0: the logits before the bias and mask."""
  return soft_cap(mixed.einsum('bqhd,bkhd->bhqk', q, k, dtype=q.dtype, out_dtype=jnp.float32) * scale, softcap)


def _logits(s, bias_rows, kv_pos, allowed):
  """`_scores` plus this block's bias columns, masked."""
  if bias_rows is not None:  # the rows of this shard's queries, every key column: take the block's keys
    s = s + jnp.take(bias_rows, kv_pos, axis=-1).astype(jnp.float32)
  return s if allowed is None else jnp.where(allowed, s, MASKED)


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


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def ring_attention(axis_name: str, causal: bool, scale: float, query_chunk: int, window: int, softcap: float,
                   q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, kv_pos: jax.Array,
                   q_seg: jax.Array | None, kv_seg: jax.Array | None, bias_rows: jax.Array | None,
                   sinks: jax.Array | None) -> jax.Array:
  """Attention of this shard's queries over the whole ring's keys and values (call under `shard_map`).

  q_pos/kv_pos: [q_len]/[kv_len] global positions of the local tokens; q_seg/kv_seg: [batch, len] segment ids
  (0 is padding) or None; bias_rows: [batch or 1, heads, q_len, total kv_len] with columns in global position
  order (this shard's rows of the full bias), or None. Queries meet each block `query_chunk` rows at a time
  (all at once when that does not divide q_len). `window` > 0 (causal): keys fewer than that many positions
  back, a chunk's scores against a block wholly outside it skipped; `softcap` > 0: logits soft-capped before the
  bias; `sinks` [heads] or None: each head's sink logit, joined once the ring's blocks are merged.
  """
  return _forward(axis_name, causal, scale, query_chunk, window, softcap, q, k, v, q_pos, kv_pos, q_seg, kv_seg,
                  bias_rows, sinks)[0]


def _query_side(c, q, q_pos, q_seg, bias_rows):
  return _chunks(q, c, 1), _chunks(q_pos, c, 0), _chunks(q_seg, c, 1), _chunks(bias_rows, c, 2)


def _forward(axis_name, causal, scale, query_chunk, window, softcap, q, k, v, q_pos, kv_pos, q_seg, kv_seg,
             bias_rows, sinks):
  n, send = _ring(axis_name)
  b, lq, h, d = q.shape
  c = query_chunk if lq % query_chunk == 0 else lq
  queries = _query_side(c, q, q_pos, q_seg, bias_rows)

  def step(_, carry):
    o, m, l, blocks = carry
    k, v, kv_pos, kv_seg = blocks

    def rows(args):  # one chunk of query rows against this block: rows are independent in the forward pass
      (q, q_pos, q_seg, bias_rows), o, m, l = args

      def scores():
        allowed = _allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window)
        s = _logits(_scores(q, k, scale, softcap), bias_rows, kv_pos, allowed)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        if allowed is not None:
          p = jnp.where(allowed, p, 0.0)
        rescale = jnp.exp(m - m_new)
        pv = mixed.einsum('bhqk,bkhd->bqhd', p, v, dtype=v.dtype, out_dtype=jnp.float32)
        return o * jnp.swapaxes(rescale, 1, 2)[..., None] + pv, m_new, l * rescale + p.sum(axis=-1)
      if not window:
        return scores()
      return jax.lax.cond(_hidden(q_pos, kv_pos, causal, window), lambda: (o, m, l), scores)
    o, m, l = jax.lax.map(rows, (queries, o, m, l))
    return o, m, l, send(blocks)

  chunks = lq // c
  init = (jnp.zeros((chunks, b, c, h, d), jnp.float32), jnp.full((chunks, b, h, c), MASKED, jnp.float32),
          jnp.zeros((chunks, b, h, c), jnp.float32), (k, v, kv_pos, kv_seg))
  o, m, l, _ = jax.lax.fori_loop(0, n, step, init)
  o, m, l = _joined(o, 1), _joined(m, 2), _joined(l, 2)
  seen = l > 0  # rows with no allowed key anywhere give zeros, as the single-device path does
  o = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], o / jnp.swapaxes(jnp.where(seen, l, 1.0), 1, 2)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  o = o.astype(q.dtype)
  if sinks is not None:  # the backward below, given these, is the gradient with the sinks (`sinks`)
    o, lse = sunk(o, lse, sinks)
  return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows, sinks, o, lse)


def _backward(axis_name, causal, scale, query_chunk, window, softcap, residuals, do):
  q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias_rows, sinks, o, lse = residuals
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
      (q, q_pos, q_seg, bias_rows, do, lse, delta), dq, dbias = args

      def scores():
        dk, dv = grads
        allowed = _allowed(q_pos, kv_pos, q_seg, kv_seg, causal, window)
        capped = _scores(q, k, scale, softcap)
        p = jnp.exp(_logits(capped, bias_rows, kv_pos, allowed) - lse[..., None])
        if allowed is not None:
          p = jnp.where(allowed, p, 0.0)
        dv = dv + mixed.einsum('bhqk,bqhd->bkhd', p, do, dtype=do.dtype, out_dtype=jnp.float32)
        dp = mixed.einsum('bqhd,bkhd->bhqk', do, v, dtype=do.dtype, out_dtype=jnp.float32)
        ds = p * (dp - delta[..., None])
        ds_qk = ds * soft_cap_grad(capped, softcap) if softcap else ds
        dq_new = dq + mixed.einsum('bhqk,bkhd->bqhd', ds_qk, k, dtype=q.dtype, out_dtype=jnp.float32) * scale
        dk = dk + mixed.einsum('bhqk,bqhd->bkhd', ds_qk, q, dtype=q.dtype, out_dtype=jnp.float32) * scale
        db = dbias
        if db is not None:  # summed over the dims the bias broadcasts along, into this block's key columns
          db = db.at[..., kv_pos].add(ds.sum(axis=0, keepdims=True) if db.shape[0] == 1 else ds)
        return (dk, dv), (dq_new, db)
      if not window:
        return scores()
      return jax.lax.cond(_hidden(q_pos, kv_pos, causal, window), lambda: (grads, (dq, dbias)), scores)
    (dk, dv), (dq, dbias) = jax.lax.scan(rows, (dk, dv), (queries, dq, dbias))
    return dq, dbias, send((k, v, kv_pos, kv_seg, dk, dv))  # after n hops each block and its gradient are home

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dbias = None if bias_rows is None else _chunks(zeros(bias_rows), c, 2)
  init = (_chunks(zeros(q), c, 1), dbias, (k, v, kv_pos, kv_seg, zeros(k), zeros(v)))
  dq, dbias, (_, _, _, _, dk, dv) = jax.lax.fori_loop(0, n, step, init)
  dq, dbias = _joined(dq, 1), _joined(dbias, 2)
  dbias = None if dbias is None else dbias.astype(bias_rows.dtype)
  dsinks = None if sinks is None else sink_grad(o, lse, do, sinks)  # this shard's rows: shard_map sums the ring's
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, dbias, dsinks)


ring_attention.defvjp(_forward, _backward)


# ---------------------------------------------------------------- flash blocks

def _merge(o: jax.Array, lse: jax.Array, o_block: jax.Array, lse_block: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two partial attentions of the same queries over disjoint keys, each normalised with its log-sum-exp
  [b, h, q], combined into one (float32)."""
  lse_new = jnp.logaddexp(lse, lse_block)
  weight = lambda x: jnp.swapaxes(jnp.exp(x - lse_new), 1, 2)[..., None]
  return o * weight(lse) + o_block.astype(jnp.float32) * weight(lse_block), lse_new


def _keys(blocks: tuple[jax.Array, ...], keys: slice) -> tuple[jax.Array, ...]:
  """Some keys of a block (k, v [batch, len, ...], segment ids [batch, len], positions [len]): with the zig-zag
  layout the first half of a block is its early chunk, the second its late one."""
  return tuple(x[:, keys] if x.ndim > 1 else x[keys] for x in blocks)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def ring_flash_attention(axis_name: str, causal: bool, scale: float, block_q: int, block_k: int, interpret: bool,
                         q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
                         kv_pos: jax.Array, bias_rows: jax.Array | None, sinks: jax.Array | None) -> jax.Array:
  """`ring_attention` with each block computed by our flash kernel (interpreted on CPU); segment ids
  [batch, len] (0 is padding), `kv_pos`, `bias_rows` and `sinks` as `ring_attention`'s. Causal attention needs the
  `zigzag_order` layout: shard i holds chunks i and 2n-1-i, so against the block of shard s its early chunk sees
  all of the block's early chunk when s < i, its late chunk all of the block's late chunk when s > i, its late
  chunk always all of the block's early chunk, and against its own block each chunk its own causally; the kernel
  runs exactly those sub-blocks, full or causal, and skips the rest."""
  return _flash_forward(axis_name, causal, scale, block_q, block_k, interpret, q, k, v, q_seg, kv_seg, kv_pos,
                        bias_rows, sinks)[0]


def _bias_block(bias_rows: jax.Array | None, rows: slice, kv_pos: jax.Array) -> jax.Array | None:
  """The bias of some query rows against the keys at `kv_pos` (columns of `bias_rows` are global positions)."""
  return None if bias_rows is None else jnp.take(bias_rows[:, :, rows], kv_pos, axis=-1)


def _flash_forward(axis_name, causal, scale, block_q, block_k, interpret, q, k, v, q_seg, kv_seg, kv_pos,
                   bias_rows, sinks):
  n, send = _ring(axis_name)
  lq = q.shape[1]
  every, early, late = slice(None), slice(0, lq // 2), slice(lq // 2, lq)

  def block(rows, k, v, kv_seg, kv_pos, causal):  # query rows against keys: output and log-sum-exp, float32
    o, lse = flash_block(q[:, rows], k, v, q_seg[:, rows], kv_seg, _bias_block(bias_rows, rows, kv_pos),
                         causal=causal, scale=scale, block_q=block_q, block_k=block_k, interpret=interpret)
    return o.astype(jnp.float32), lse

  def merged(acc, rows, blocks, keys, causal):  # acc: (o, lse) of every query row; rows' share of keys added
    o, lse = acc
    o_rows, lse_rows = _merge(o[:, rows], lse[:, :, rows], *block(rows, *_keys(blocks, keys), causal))
    return o.at[:, rows].set(o_rows), lse.at[:, :, rows].set(lse_rows)

  i = jax.lax.axis_index(axis_name)

  def hop(t, acc, blocks, own=False):  # this shard's queries against the block of shard s = i - t
    if not causal:
      return merged(acc, every, blocks, every, False)
    acc = merged(acc, late, blocks, early, False)  # the late chunk sees all of any block's early chunk
    if own:  # hop 0, its own block: each chunk its own, causally
      return merged(merged(acc, early, blocks, early, True), late, blocks, late, True)
    return jax.lax.cond((i - t) % n < i, lambda: merged(acc, early, blocks, early, False),
                        lambda: merged(acc, late, blocks, late, False))

  b, _, h, d = q.shape
  own = (k, v, kv_seg, kv_pos)
  acc = hop(0, (jnp.zeros((b, lq, h, d), jnp.float32), jnp.full((b, h, lq), MASKED, jnp.float32)), own, own=True)

  def step(t, carry):
    acc, blocks = carry
    return hop(t, acc, blocks), send(blocks)  # the next block travels while this one is computed
  (o, lse), _ = jax.lax.fori_loop(1, n, step, (acc, send(own)))
  seen = lse > 0.5 * MASKED  # rows with no allowed key anywhere give zeros, as the single-device path does
  o = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], o, 0.0).astype(q.dtype)
  lse = jnp.where(seen, lse, 0.0)
  if sinks is not None:
    o, lse = sunk(o, lse, sinks)
  return o, (q, k, v, q_seg, kv_seg, kv_pos, bias_rows, sinks, o, lse)


def _flash_backward(axis_name, causal, scale, block_q, block_k, interpret, residuals, do):
  q, k, v, q_seg, kv_seg, kv_pos, bias_rows, sinks, o, lse = residuals
  n, send = _ring(axis_name)
  lq = q.shape[1]
  every, early, late = slice(None), slice(0, lq // 2), slice(lq // 2, lq)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  i = jax.lax.axis_index(axis_name)

  def share(grads, rows, blocks, keys, causal):
    """Adds query `rows`' share against the `keys` (slice) of a block to (dq, d bias_rows, dk, dv): dk and dv
    are the block's."""
    dq, dbias, dk, dv = grads
    k, v, kv_seg, kv_pos = _keys(blocks, keys)
    g = flash_block_grads(q[:, rows], k, v, q_seg[:, rows], kv_seg, _bias_block(bias_rows, rows, kv_pos),
                          o[:, rows], lse[:, :, rows], do[:, rows], causal=causal, scale=scale, block_q=block_q,
                          block_k=block_k, interpret=interpret)
    dq = dq.at[:, rows].add(g[0].astype(jnp.float32))
    if dbias is not None:  # into the block's key columns
      dbias = dbias.at[:, :, rows, kv_pos].add(g[3].astype(jnp.float32))
    return dq, dbias, dk.at[:, keys].add(g[1].astype(jnp.float32)), dv.at[:, keys].add(g[2].astype(jnp.float32))

  def hop(t, grads, blocks, own=False):  # as the forward pass's hop
    if not causal:
      return share(grads, every, blocks, every, False)
    grads = share(grads, late, blocks, early, False)
    if own:
      return share(share(grads, early, blocks, early, True), late, blocks, late, True)
    return jax.lax.cond((i - t) % n < i, lambda: share(grads, early, blocks, early, False),
                        lambda: share(grads, late, blocks, late, False))

  own = (k, v, kv_seg, kv_pos)
  dbias = None if bias_rows is None else zeros(bias_rows)
  dq, dbias, dk, dv = hop(0, (zeros(q), dbias, zeros(k), zeros(v)), own, own=True)

  def step(t, carry):
    # `pending`: the gradient of the block this shard last held; sent on while this hop computes (it is only
    # added to at the end), as is the next key/value block.
    (dq, dbias), blocks, pending = carry
    dk, dv = send(pending)  # the gradient gathered so far by the block that is here now
    dq, dbias, dk, dv = hop(t, (dq, dbias, dk, dv), blocks)
    return (dq, dbias), send(blocks), (dk, dv)
  (dq, dbias), _, pending = jax.lax.fori_loop(1, n, step, ((dq, dbias), send(own), (dk, dv)))
  dk, dv = send(pending)  # one hop more brings each block's gradient home
  dbias = None if dbias is None else dbias.astype(bias_rows.dtype)
  dsinks = None if sinks is None else sink_grad(o, lse, do, sinks)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, dbias, dsinks


ring_flash_attention.defvjp(_flash_forward, _flash_backward)
