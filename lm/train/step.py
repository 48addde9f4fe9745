"""The jitted train and eval steps: sharded in and out, state donated, microbatches scanned."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from lm.config import Config
from lm.data.pipeline import feature_specs
from lm.models import forward
from lm.parallel.rules import constrain, logical_to_spec, sharding_context
from lm.train.loss import cross_entropy
from lm.train.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over the data-parallel axes; the rest of each row stays whole."""
  return NamedSharding(mesh, logical_to_spec(('batch', 'length')))


def abstract_batch(config: Config, mesh: Mesh) -> Batch:
  """Shapes, dtypes and shardings of a training batch, for ahead-of-time lowering."""
  sharding = batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((config.train.global_batch, *shape), dtype, sharding=sharding)
          for k, (shape, dtype) in feature_specs(config).items()}


def _split_microbatches(batch: Batch, k: int) -> Batch:
  """[B, ...] -> [k, B/k, ...], microbatch i taking rows i, i+k, ... so each spans every data shard."""
  def split(x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, 'batch') + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    config: Config, mesh: Mesh, shardings: TrainState
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  k, z_loss, seed = config.train.microbatches, config.train.z_loss, config.train.seed

  def loss_fn(params: Any, batch: Batch, rng: jax.Array, total_weight: jax.Array
              ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    logits = forward(model, params, batch, deterministic=False, rng=rng)
    nll, z, _ = cross_entropy(logits, batch['targets'], batch['weights'], z_loss)
    # Divided by the whole batch's weight, so microbatch gradients sum to the full-batch gradient.
    return (nll + z) / total_weight, (nll, z)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    with sharding_context(mesh):
      rng = jax.random.fold_in(jax.random.key(seed), state.step)
      total_weight = jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)
      if k == 1:
        (_, (nll, z)), grads = grad_fn(state.params, batch, rng, total_weight)
      else:
        def accumulate(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
          grads_acc, nll_acc, z_acc = carry
          micro, i = inputs
          (_, (nll, z)), grads = grad_fn(state.params, micro, jax.random.fold_in(rng, i), total_weight)
          return (jax.tree.map(jnp.add, grads_acc, grads), nll_acc + nll, z_acc + z), None
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, nll, z), _ = jax.lax.scan(accumulate, init, (_split_microbatches(batch, k), jnp.arange(k)))
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    metrics = {'loss': nll / total_weight, 'z_loss': z / total_weight, 'grad_norm': grad_norm,
               'learning_rate': schedule(state.step), 'target_tokens': total_weight}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  data = batch_sharding(mesh)
  return jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=(0,))


def make_eval_step(model: nn.Module, mesh: Mesh, param_shardings: Any) -> Callable[[Any, Batch], Metrics]:
  """Sums of weighted NLL and weights for one batch; the caller adds them over batches."""
  def step(params: Any, batch: Batch) -> Metrics:
    with sharding_context(mesh):
      logits = forward(model, params, batch, deterministic=True)
      nll, _, weight = cross_entropy(logits, batch['targets'], batch['weights'])
    return {'nll': nll, 'weight': weight}
  return jax.jit(step, in_shardings=(param_shardings, batch_sharding(mesh)))
