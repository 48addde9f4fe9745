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
from lm.train.loss import cross_entropy, pretraining_loss
from lm.train.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Batch rows over the data-parallel axes; the rest of each row stays whole."""
  return NamedSharding(mesh, logical_to_spec(('batch',) + (None,) * (ndim - 1)))


def abstract_batch(config: Config, mesh: Mesh) -> Batch:
  """Shapes, dtypes and shardings of a training batch, for ahead-of-time lowering."""
  return {k: jax.ShapeDtypeStruct((config.train.global_batch, *shape), dtype,
                                  sharding=batch_sharding(mesh, 1 + len(shape)))
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

  def loss_fn(params: Any, batch: Batch, rng: jax.Array, totals: tuple[jax.Array, jax.Array]
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    outputs = forward(model, params, batch, deterministic=False, rng=rng)
    return pretraining_loss(outputs, batch, z_loss, *totals)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    with sharding_context(mesh):
      rng = jax.random.fold_in(jax.random.key(seed), state.step)
      total_weight = jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)
      totals = (total_weight, jnp.asarray(batch['targets'].shape[0], jnp.float32))
      if k == 1:
        (_, sums), grads = grad_fn(state.params, batch, rng, totals)
      else:
        def accumulate(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
          micro, i = inputs
          (_, sums), grads = grad_fn(state.params, micro, jax.random.fold_in(rng, i), totals)
          return jax.tree.map(jnp.add, carry, (grads, sums)), None
        micro = _split_microbatches(batch, k)
        shapes = jax.eval_shape(grad_fn, state.params, jax.tree.map(lambda x: x[0], micro), rng, totals)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][1]))
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(k)))
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    metrics = {'loss': sums['nll'] / total_weight, 'z_loss': sums['z'] / total_weight, 'grad_norm': grad_norm,
               'learning_rate': schedule(state.step), 'target_tokens': total_weight}
    if 'nsp_nll' in sums:
      metrics['nsp_loss'] = sums['nsp_nll'] / totals[1]
      metrics['nsp_accuracy'] = sums['nsp_correct'] / totals[1]
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  # The batch arrives as global arrays already sharded by the data pipeline (see batch_sharding).
  return jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=(0,))


def make_eval_step(model: nn.Module, mesh: Mesh, param_shardings: Any) -> Callable[[Any, Batch], Metrics]:
  """Sums of weighted NLL and weights for one batch; the caller adds them over batches."""
  def step(params: Any, batch: Batch) -> Metrics:
    with sharding_context(mesh):
      logits = forward(model, params, batch, deterministic=True)['logits']
      nll, _, weight = cross_entropy(logits, batch['targets'], batch['weights'])
    return {'nll': nll, 'weight': weight}
  return jax.jit(step, in_shardings=(param_shardings, None))
