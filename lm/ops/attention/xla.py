"""Attention in XLA einsums: masks from causality and segments, the masked softmax, whole or in causal blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lm.ops import mixed
from lm.ops.attention.masking import MASKED
from lm.ops.softcap import soft_cap


def attention_mask(q_len: int, kv_len: int, *, causal: bool, segment_ids: jax.Array | None,
                   kv_segment_ids: jax.Array | None, mask: jax.Array | None, window: int = 0) -> jax.Array | None:
  """Boolean [batch or 1, 1, q_len, kv_len] of allowed pairs, or None when all are allowed; `window` > 0 (causal)
  keeps the keys fewer than that many positions back."""
  allowed = None
  if causal:
    offset = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
    allowed = ((offset >= 0) & (offset < window) if window else offset >= 0)[None, None]
  if segment_ids is not None:
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    same = (segment_ids[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    allowed = same[:, None] if allowed is None else allowed & same[:, None]
  elif kv_segment_ids is not None:  # only the keys carry padding (e.g. cross-attention while decoding)
    valid = (kv_segment_ids != 0)[:, None, None, :]
    allowed = valid if allowed is None else allowed & valid
  if mask is not None:
    allowed = mask if allowed is None else allowed & mask
  return allowed


def masked_softmax(logits: jax.Array, allowed: jax.Array | None, sinks: jax.Array | None = None) -> jax.Array:
  """Softmax over the last axis of the allowed entries; rows with none allowed give zeros. `sinks` [heads] (logits
  [batch, heads, q, k]): each head's sink logit joins the denominator, with no value (GPT-OSS).

  Written out rather than `where(allowed, softmax(where(allowed, logits, -big)), 0)`, which selects on the
  logits and again on the probabilities (about 2% slower on gpt_bench's CPU step). The row max is a constant of
  the softmax, so no gradient flows through it.
  """
  if allowed is None and sinks is None:
    return jax.nn.softmax(logits, axis=-1)
  kept = logits if allowed is None else jnp.where(allowed, logits, MASKED)
  row_max = jnp.max(kept, axis=-1, keepdims=True)
  if sinks is not None:
    sink = sinks.astype(jnp.float32)[:, None, None]
    row_max = jnp.maximum(row_max, sink)
  row_max = jax.lax.stop_gradient(row_max)
  shifted = logits - row_max
  e = jnp.exp(shifted if allowed is None else jnp.where(allowed, shifted, -jnp.inf))  # masked: exactly 0, no inf
  total = jnp.sum(e, axis=-1, keepdims=True)  # at least 1 where a key is allowed (its max term is exp(0))
  if sinks is not None:
    return e / (total + jnp.exp(sink - row_max))
  return e / jnp.where(total > 0, total, 1.0)  # an empty row: zeros (a select, not a max: no gradient split at ties)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, allowed: jax.Array | None,
                  bias: jax.Array | None, scale: float, softcap: float = 0.0, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
  """Reference path: einsum logits (soft-capped before the bias), float32 softmax (with `sinks`, see
  `masked_softmax`), rows with no allowed key give zeros."""
  logits = soft_cap(mixed.einsum('bqhd,bkhd->bhqk', q, k, dtype=q.dtype, out_dtype=jnp.float32) * scale, softcap)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  probs = masked_softmax(logits, allowed, sinks)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return mixed.einsum('bhqk,bkhd->bqhd', probs, v, dtype=v.dtype)


def _causal_blocks(q_len: int, kv_len: int) -> int:
  """How many query blocks a causal self-attention is split into (1: no split)."""
  if q_len != kv_len:
    return 1
  for n in (4, 2):
    if q_len % n == 0 and q_len // n >= 32:
      return n
  return 1


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, allowed: jax.Array,
                             bias: jax.Array | None, scale: float, num_blocks: int, softcap: float = 0.0,
                             sinks: jax.Array | None = None) -> jax.Array:
  """`xla_attention` for causal self-attention, skipping the key blocks a query block cannot see.

  Query block i only scores keys [0, (i + 1) * block): the causal mask zeroes the rest, so the
  result equals the reference path while doing about (n + 1) / 2n of its attention work.
  """
  block = q.shape[1] // num_blocks
  qt = jnp.swapaxes(q, 1, 2)  # [batch, heads, q_len, head_dim]
  kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  outs = []
  for i in range(num_blocks):
    q_sl, k_end = slice(i * block, (i + 1) * block), (i + 1) * block
    logits = soft_cap(mixed.einsum('bhqd,bhkd->bhqk', qt[:, :, q_sl], kt[:, :, :k_end], dtype=q.dtype,
                                   out_dtype=jnp.float32) * scale, softcap)
    if bias is not None:
      b = jnp.broadcast_to(bias, bias.shape[:2] + (q.shape[1], k.shape[1]))
      logits = logits + b[:, :, q_sl, :k_end].astype(jnp.float32)
    probs = masked_softmax(logits, allowed[:, :, q_sl, :k_end], sinks)
    outs.append(mixed.einsum('bhqk,bhkd->bhqd', probs, vt[:, :, :k_end], dtype=v.dtype))
  return jnp.swapaxes(jnp.concatenate(outs, axis=2), 1, 2)
