"""Weighted token cross-entropy in float32, the loss every objective reduces to."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp

from lm.ops.unembed import Unembedding, tiled_cross_entropy

if TYPE_CHECKING:
  from lm.models.family import Head


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


def token_loss(head: Unembedding, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(sum of weighted NLL + z-loss, the NLL sum, the z-loss sum, sum of weights) of the output layer `head`
  against `targets`: untiled, or in tiles when `head.chunk` > 0 (`model.loss_chunk`). Only the first is
  differentiated; the sums are metrics."""
  weights = weights.astype(jnp.float32)
  if head.chunk:
    loss, nll, z = tiled_cross_entropy(head, targets, weights, z_loss)
  else:
    nll, z, _ = cross_entropy(head.logits(), targets, weights, z_loss)
    loss, nll, z = nll + z, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(z)
  return loss, nll, z, jnp.sum(weights)


def squared_error(scores: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted squared errors, sum of weights) of regression scores [batch] in float32."""
  weights = weights.astype(jnp.float32)
  error = scores.astype(jnp.float32) - labels.astype(jnp.float32)
  return jnp.sum(jnp.square(error) * weights), jnp.sum(weights)


def sequence_classification(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of NLL, count of correct argmax) of per-sequence logits [batch, classes] against labels [batch]."""
  logits = logits.astype(jnp.float32)
  labels = labels.astype(jnp.int32)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  nll = jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)
  return nll, jnp.sum((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))


def pretraining_loss(heads: Sequence[Head], outputs: dict[str, jax.Array], batch: dict[str, jax.Array],
                     z_loss: float, total_weight: jax.Array, total_sequences: jax.Array
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token loss per target token, plus each active head's loss per sequence (BERT's NSP).

  Normalised by the WHOLE batch's totals, so microbatch losses and gradients add up exactly.
  Returns (loss, sums of the pieces for metrics: 'nll', 'z', and '{head}_nll', '{head}_correct').
  """
  token_sum, nll, z, _ = token_loss(outputs['logits'], batch['targets'], batch['weights'], z_loss)
  loss = token_sum / total_weight
  sums = {'nll': nll, 'z': z}
  for head in heads:
    sums[f'{head.name}_nll'], sums[f'{head.name}_correct'] = sequence_classification(
      outputs[head.name], batch[head.labels])
    loss = loss + sums[f'{head.name}_nll'] / total_sequences
  return loss, sums
