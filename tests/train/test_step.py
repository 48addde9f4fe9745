"""Gradient accumulation equals one large batch."""
import jax
import numpy as np
import pytest

from lm.train.loop import Trainer


@pytest.mark.parametrize('k', [2, 4])
def test_microbatches_give_the_same_update(small_config, k):
  results = []
  for micro in (1, k):
    trainer = Trainer(small_config(f'train.microbatches={micro}'), jax.devices()[:1])
    state = trainer.init_state()
    batch = next(trainer.train_batches)
    for _ in range(2):
      state, metrics = trainer.train_step(state, batch)
    results.append((float(metrics['loss']), float(metrics['grad_norm']), jax.device_get(state.params)))
  (loss_1, norm_1, params_1), (loss_k, norm_k, params_k) = results
  np.testing.assert_allclose(loss_k, loss_1, rtol=1e-5)
  np.testing.assert_allclose(norm_k, norm_1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params_k), jax.tree.leaves(params_1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_microbatches_on_a_mesh(small_config):
  """Accumulation under dp x fsdp keeps every microbatch spread over all data shards."""
  one = Trainer(small_config('train.microbatches=2'), jax.devices()[:1])
  mesh = Trainer(small_config('train.microbatches=2', 'mesh.data=2', 'mesh.fsdp=4'), jax.devices())
  out = []
  for trainer in (one, mesh):
    state, metrics = trainer.train_step(trainer.init_state(), next(trainer.train_batches))
    out.append(float(metrics['loss']))
  np.testing.assert_allclose(out[0], out[1], rtol=1e-5)
