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
    before = jax.device_get(state.params)
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    update = jax.tree.map(lambda new, old: new - old, jax.device_get(state.params), before)
    results.append((float(metrics['loss']), float(metrics['grad_norm']), update))
  (loss_1, norm_1, update_1), (loss_k, norm_k, update_k) = results
  np.testing.assert_allclose(loss_k, loss_1, rtol=1e-5)
  np.testing.assert_allclose(norm_k, norm_1, rtol=1e-5)
  for path, a in jax.tree_util.tree_flatten_with_path(update_k)[0]:
    if "['key']['bias']" in jax.tree_util.keystr(path):
      continue  # its true gradient is 0 (softmax ignores a shared shift); Adam scales float noise to lr
    b = dict(jax.tree_util.tree_flatten_with_path(update_1)[0])[path]
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), jax.tree_util.keystr(path)


def test_microbatches_on_a_mesh(small_config):
  """Accumulation under dp x fsdp keeps every microbatch spread over all data shards."""
  one = Trainer(small_config('train.microbatches=2'), jax.devices()[:1])
  mesh = Trainer(small_config('train.microbatches=2', 'mesh.data=2', 'mesh.fsdp=4'), jax.devices())
  out = []
  for trainer in (one, mesh):
    state, metrics = trainer.train_step(trainer.init_state(), next(trainer.train_batches))
    out.append(float(metrics['loss']))
  np.testing.assert_allclose(out[0], out[1], rtol=1e-5)
