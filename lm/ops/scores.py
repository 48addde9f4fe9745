"""Per-example scores of given target tokens: what zero-shot tasks and rank classification compare."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def continuation_scores(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> dict[str, jax.Array]:
  """Per row of `logits` [batch, length, vocab] against `targets` [batch, length]: 'logprob', the sum of the
  log-probabilities of the targets where `weights` is 1 (the continuation); 'tokens', their count; 'greedy',
  whether each of them is its position's argmax. In float32; the targets are picked by a sum, not a gather,
  so the vocabulary may be sharded."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
  picked = jnp.sum(jnp.where(is_target, log_probs, 0.0), axis=-1)
  counted = weights > 0
  greedy = (jnp.argmax(logits, axis=-1) == targets) | ~counted
  return {'logprob': jnp.sum(jnp.where(counted, picked, 0.0), axis=-1),
          'tokens': jnp.sum(counted.astype(jnp.int32), axis=-1), 'greedy': jnp.all(greedy, axis=-1)}
