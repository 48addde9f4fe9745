"""Gradient accumulation equals one large batch."""
import jax
import numpy as np
import pytest

from lm.jobs.pretraining import Pretraining


def one_update(trainer):
  """(loss, grad norm, param update) of the first step."""
  state = trainer.init_state()
  before = jax.device_get(state.params)
  state, metrics = trainer.train_step(state, next(trainer.train_batches))
  update = jax.tree.map(lambda new, old: new - old, jax.device_get(state.params), before)
  return float(metrics['loss']), float(metrics['grad_norm']), update


def assert_same_update(got, want):
  (loss_k, norm_k, update_k), (loss_1, norm_1, update_1) = got, want
  np.testing.assert_allclose(loss_k, loss_1, rtol=1e-5)
  np.testing.assert_allclose(norm_k, norm_1, rtol=1e-5)
  reference = dict(jax.tree_util.tree_flatten_with_path(update_1)[0])
  for path, a in jax.tree_util.tree_flatten_with_path(update_k)[0]:
    if "['key']['bias']" in jax.tree_util.keystr(path):
      continue  # its true gradient is 0 (softmax ignores a shared shift); Adam scales float noise to lr
    b = reference[path]
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), jax.tree_util.keystr(path)


@pytest.mark.parametrize('k', [2, 4])
@pytest.mark.variants
def test_microbatches_give_the_same_update(small_config, k):
  one, accumulated = (one_update(Pretraining(small_config(f'train.microbatches={m}'), jax.devices()[:1])) for m in (1, k))
  assert_same_update(accumulated, one)


@pytest.mark.long(0.2)
def test_microbatches_on_a_mesh(small_config):
  """Accumulation under dp x fsdp keeps every microbatch spread over all data shards: the update equals one
  device's whole-batch update."""
  one = one_update(Pretraining(small_config('train.microbatches=1'), jax.devices()[:1]))
  mesh = one_update(Pretraining(small_config('train.microbatches=2', 'mesh.data=2', 'mesh.fsdp=4'), jax.devices()))
  assert_same_update(mesh, one)
