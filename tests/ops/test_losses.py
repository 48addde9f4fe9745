"""Cross-entropy and z-loss against float64 NumPy."""
import numpy as np

from lm.ops.losses import cross_entropy


def test_weighted_cross_entropy_and_z_loss():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, size=(2, 5, 11)).astype(np.float32)
  targets = rng.integers(0, 11, size=(2, 5))
  weights = (rng.random((2, 5)) > 0.3).astype(np.float32)
  nll, z, w = cross_entropy(logits, targets, weights, z_loss=1e-2)
  x = logits.astype(np.float64)
  log_z = np.log(np.exp(x).sum(-1))
  picked = np.take_along_axis(x, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll, ((log_z - picked) * weights).sum(), rtol=1e-6)
  np.testing.assert_allclose(z, (1e-2 * log_z ** 2 * weights).sum(), rtol=1e-6)
  assert w == weights.sum()


def test_uniform_logits_give_log_vocab():
  nll, _, w = cross_entropy(np.zeros((1, 4, 256), np.float32), np.arange(4)[None], np.ones((1, 4)))
  np.testing.assert_allclose(nll / w, np.log(256), rtol=1e-6)
