"""The tiled output layer and cross-entropy against a float64 NumPy reference: values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.ops.unembed import Unembedding, tiled_cross_entropy

B, L, D, V = 2, 13, 8, 24


def reference(hidden, kernel, bias, layout, targets, weights, z_loss):
  """(loss, nll, z) and the gradients of the loss w.r.t. hidden, kernel, bias, in float64."""
  h, k = hidden.astype(np.float64), kernel.astype(np.float64)
  w_dv = k.T if layout == 'vd' else k
  logits = h @ w_dv + (0.0 if bias is None else bias.astype(np.float64))
  m = logits.max(-1, keepdims=True)
  log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  target_logits = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  nll = np.sum((log_z - target_logits) * weights)
  z = np.sum(z_loss * log_z ** 2 * weights)
  probs = np.exp(logits - log_z[..., None])
  onehot = np.eye(V)[targets]
  d_logits = (probs * (1 + 2 * z_loss * log_z)[..., None] - onehot) * weights[..., None]
  d_h = d_logits @ w_dv.T
  d_w_dv = np.einsum('bld,blv->dv', h, d_logits)
  d_k = d_w_dv.T if layout == 'vd' else d_w_dv
  return (nll + z, nll, z), (d_h, d_k, None if bias is None else d_logits.sum((0, 1)))


@pytest.mark.parametrize('layout,with_bias,z_loss,chunk', [
  ('vd', False, 0.0, 4),    # a tied table; 13 positions in tiles of 4: the last tile padded
  ('vd', True, 1e-2, 13),   # BERT's MLM bias, z-loss, one tile
  ('dv', False, 1e-2, 5),   # an lm_head kernel
  ('dv', True, 0.0, 1),
])
@pytest.mark.variants
def test_tiled_loss_and_gradients_match_float64(layout, with_bias, z_loss, chunk):
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(B, L, D)).astype(np.float32)
  kernel = rng.normal(size=(V, D) if layout == 'vd' else (D, V)).astype(np.float32)
  bias = rng.normal(size=V).astype(np.float32) if with_bias else None
  targets = rng.integers(0, V, size=(B, L))
  weights = (rng.random((B, L)) > 0.3).astype(np.float32)  # zero weights: padding, unmasked MLM positions

  def loss(h, k, b):
    u = Unembedding(h, k, b, layout=layout, axes=('vocab', 'embed'), dtype=jnp.float32, chunk=chunk)
    return tiled_cross_entropy(u, jnp.asarray(targets), jnp.asarray(weights), z_loss)

  (got, grads) = jax.value_and_grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2))(hidden, kernel, bias)
  want, want_grads = reference(hidden, kernel, bias, layout, targets, weights, z_loss)
  np.testing.assert_allclose([float(x) for x in loss(hidden, kernel, bias)], want, rtol=2e-6)
  np.testing.assert_allclose(float(got), want[0], rtol=2e-6)
  for g, w in zip(grads, want_grads):
    if w is None:
      assert g is None
    else:
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_metric_sums_carry_no_gradient_and_logits_apply_the_layer():
  rng = np.random.default_rng(1)
  hidden, kernel = rng.normal(size=(B, L, D)).astype(np.float32), rng.normal(size=(D, V)).astype(np.float32)
  bias = rng.normal(size=V).astype(np.float32)
  targets, weights = jnp.asarray(rng.integers(0, V, size=(B, L))), jnp.ones((B, L))
  u = lambda h: Unembedding(h, kernel, bias, layout='dv', axes=('embed', 'vocab'), dtype=jnp.float32, chunk=4)
  nll_grad = jax.grad(lambda h: tiled_cross_entropy(u(h), targets, weights, 1e-3)[1])(hidden)
  assert not np.any(np.asarray(nll_grad))
  np.testing.assert_allclose(np.asarray(u(hidden).logits()), hidden @ kernel + bias, rtol=1e-5, atol=1e-5)
