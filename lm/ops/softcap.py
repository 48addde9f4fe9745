"""Soft-capping (Gemma 2): logits squashed smoothly into (-cap, cap), for attention scores and output logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(logits / cap); cap 0: the logits as they are."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def soft_cap_grad(capped: jax.Array, cap: float) -> jax.Array:
  """d capped / d logits at the capped values: 1 - tanh^2 = 1 - (capped / cap)^2; 1 without a cap."""
  return 1.0 - jnp.square(capped / cap) if cap else jnp.ones_like(capped)
