"""Weighted token cross-entropy in float32, the loss every objective reduces to."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sums over tokens (not means, so microbatches add up exactly).

  Returns (sum of weighted NLL, sum of weighted z-loss `z_loss * logsumexp^2`, sum of weights).
  Positions with weight 0 (padding, cross-document targets, unmasked MLM tokens) do not count.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  weights = weights.astype(jnp.float32)
  nll = jnp.sum((log_z - target_logits) * weights)
  z = jnp.sum(z_loss * jnp.square(log_z) * weights)
  return nll, z, jnp.sum(weights)
