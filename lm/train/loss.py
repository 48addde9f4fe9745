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


def pretraining_loss(outputs: dict[str, jax.Array], batch: dict[str, jax.Array], z_loss: float,
                     total_weight: jax.Array, total_sequences: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token loss per target token (plus BERT's NSP loss per sequence when the batch has NSP labels).

  Normalised by the WHOLE batch's totals, so microbatch losses and gradients add up exactly.
  Returns (loss, sums of the pieces for metrics).
  """
  nll, z, _ = cross_entropy(outputs['logits'], batch['targets'], batch['weights'], z_loss)
  loss = (nll + z) / total_weight
  sums = {'nll': nll, 'z': z}
  if 'nsp_logits' in outputs:
    nsp = outputs['nsp_logits'].astype(jnp.float32)
    labels = batch['nsp_labels'].astype(jnp.int32)
    picked = jnp.take_along_axis(nsp, labels[:, None], axis=-1)[:, 0]
    sums['nsp_nll'] = jnp.sum(jax.nn.logsumexp(nsp, axis=-1) - picked)
    sums['nsp_correct'] = jnp.sum((jnp.argmax(nsp, axis=-1) == labels).astype(jnp.float32))
    loss = loss + sums['nsp_nll'] / total_sequences
  return loss, sums
