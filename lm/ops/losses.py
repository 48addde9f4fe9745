"""The losses, in float32: weighted token cross-entropy (the loss every objective reduces to, whole here or in
tiles in `lm.ops.unembed`, both through `weighted_sums`), squared error, per-sequence classification."""
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
  # a sum, not a gather: inside a pipeline stage XLA's partitioner aborts on a gather from logits whose vocab dim is
  # sharded (tensor); the tiled loss does the same
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
  target_logits = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
  weights = weights.astype(jnp.float32)
  nll, z = weighted_sums(z_loss, log_z, target_logits, weights)
  return nll, z, jnp.sum(weights)


def weighted_sums(z_loss: float, log_z: jax.Array, target_logits: jax.Array, weights: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted NLL, sum of weighted z-loss) from log-partitions and the targets' logits."""
  return jnp.sum((log_z - target_logits) * weights), jnp.sum(z_loss * jnp.square(log_z) * weights)


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


def distillation(student: jax.Array, teacher: jax.Array, weights: jax.Array, temperature: float = 1.0,
                 divergence: str = 'forward', top_k: int = 0) -> jax.Array:
  """Sum over tokens of weights x temperature^2 x the KL divergence of the temperature-softened distributions of
  logits [..., vocab]: forward, KL(teacher || student) (Hinton et al. 2015); reverse, KL(student || teacher)
  (MiniLLM). The teacher's side is a constant. `top_k` (forward): the teacher's distribution over its k likeliest
  tokens, renormalised, against the student's log-probabilities (over the whole vocabulary) at them."""
  log_s = jax.nn.log_softmax(student.astype(jnp.float32) / temperature, axis=-1)
  teacher = jax.lax.stop_gradient(teacher).astype(jnp.float32) / temperature
  if top_k:
    teacher, tokens = jax.lax.top_k(teacher, top_k)
    log_s = jnp.take_along_axis(log_s, tokens, axis=-1)
  log_t = jax.nn.log_softmax(teacher, axis=-1)
  log_p, log_q = (log_t, log_s) if divergence == 'forward' else (log_s, log_t)
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return temperature ** 2 * jnp.sum(kl * weights.astype(jnp.float32))
