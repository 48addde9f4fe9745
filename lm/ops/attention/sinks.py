"""Learned attention sinks (GPT-OSS): one more logit per head in each softmax's denominator, with no value.

A kernel that returns its output o and log-sum-exp lse without the sink gets it afterwards: the sink's share
leaves exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink) of every row, and the row's log-sum-exp becomes
logaddexp(lse, sink). Its backward is the kernel's own, given the rescaled output and that log-sum-exp: it
recomputes p = exp(s - lse), which are then the probabilities with the sink, and delta = rowsum(dO * O) over the
keys (the sink has no value, so it adds nothing to delta). The sink's own gradient is -sum over rows of
p_sink * delta.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sunk(o: jax.Array, lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(o, lse) of attention with the sinks from those without: o [B, L, H, D], lse [B, H, L] float32 (a row with no
  allowed key: a very negative lse and o = 0, which stays 0), sinks [H]."""
  total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
  keep = jnp.swapaxes(jnp.exp(lse - total), 1, 2)[..., None]  # [B, L, H, 1]
  return (o.astype(jnp.float32) * keep).astype(o.dtype), total


def sink_grad(o: jax.Array, lse: jax.Array, do: jax.Array, sinks: jax.Array) -> jax.Array:
  """d loss / d sinks [H] given the output with the sinks o [B, L, H, D], its log-sum-exp lse [B, H, L] and dO."""
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, L, H]
  p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)  # [B, H, L]
  return -jnp.einsum('blh,bhl->h', delta, p_sink).astype(sinks.dtype)
