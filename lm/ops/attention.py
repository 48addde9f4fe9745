"""The one attention entry point; every family calls `attention` and the config picks the impl.

Layout is Flax's: q [batch, q_len, heads, head_dim], k/v [batch, kv_len, heads, head_dim].
Segment ids are [batch, len] with 0 marking padding; tokens attend only within their segment.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ('xla',)
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so fully masked rows give no NaN


def attention_mask(q_len: int, kv_len: int, *, causal: bool, segment_ids: jax.Array | None,
                   kv_segment_ids: jax.Array | None, mask: jax.Array | None) -> jax.Array | None:
  """Boolean [batch or 1, 1, q_len, kv_len] of allowed pairs, or None when all are allowed."""
  allowed = None
  if causal:
    allowed = (jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :])[None, None]
  if segment_ids is not None:
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    same = (segment_ids[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    allowed = same[:, None] if allowed is None else allowed & same[:, None]
  if mask is not None:
    allowed = mask if allowed is None else allowed & mask
  return allowed


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, allowed: jax.Array | None,
                  bias: jax.Array | None, scale: float, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None) -> jax.Array:
  """Reference path: einsum logits, float32 softmax, rows with no allowed key give zeros."""
  logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if allowed is not None:
    logits = jnp.where(allowed, logits, _MASKED)
  probs = jax.nn.softmax(logits, axis=-1)
  if allowed is not None:
    probs = jnp.where(allowed, probs, 0.0)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return jnp.einsum('bhqk,bkhd->bqhd', probs.astype(v.dtype), v)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              mask: jax.Array | None = None, bias: jax.Array | None = None, scale: float | None = None,
              impl: str = 'xla', dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None) -> jax.Array:
  """Multi-head attention; `mask` and `bias` broadcast to [batch, heads, q_len, kv_len]."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention impl {impl!r} is not available; choose one of {IMPLEMENTATIONS}')
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  allowed = attention_mask(q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, mask=mask)
  return xla_attention(q, k, v, allowed=allowed, bias=bias, scale=scale,
                       dropout_rate=dropout_rate, dropout_rng=dropout_rng)
