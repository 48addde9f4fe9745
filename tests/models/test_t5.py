"""T5: relative-position buckets against NumPy, bidirectional encoder, causal decoder."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import load_config
from lm.models import build_model, init_params
from lm.models.layers import relative_position_bucket

SMALL = ['model.d_model=32', 'model.num_layers=2', 'model.num_decoder_layers=2', 'model.num_heads=4',
         'model.d_ff=64', 'model.vocab_size=300']


def numpy_bucket(rel, bidirectional, num_buckets, max_distance):
  """Raffel et al.'s bucketing of key - query offsets, written out in float64 NumPy."""
  out = np.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    out += (rel > 0) * num_buckets
    n = np.abs(rel)
  else:
    n = np.maximum(-rel, 0)
  max_exact = num_buckets // 2
  with np.errstate(divide='ignore'):
    large = max_exact + (np.log(n / max_exact) / np.log(max_distance / max_exact)
                         * (num_buckets - max_exact))
  large = np.minimum(np.where(n < max_exact, 0, large).astype(np.int64), num_buckets - 1)
  return out + np.where(n < max_exact, n, large)


@pytest.mark.parametrize('bidirectional', [True, False])
@pytest.mark.parametrize('buckets, distance', [(32, 128), (16, 64)])
@pytest.mark.variants
def test_relative_buckets_match_numpy(bidirectional, buckets, distance):
  rel = np.arange(-300, 301)[None, :] - np.arange(0, 5)[:, None]
  got = np.asarray(relative_position_bucket(jnp.asarray(rel), bidirectional, buckets, distance))
  np.testing.assert_array_equal(got, numpy_bucket(rel, bidirectional, buckets, distance))
  assert got.max() == buckets - 1 and got.min() == 0


def make(*overrides):
  cfg = load_config('t5_tiny', SMALL + list(overrides)).model
  model = build_model(cfg)
  params = nn.unbox(jax.jit(lambda r: init_params(model, r, 16))(jax.random.key(0)))
  return model, params


def ids(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(4, 260, size=shape), jnp.int32)


@pytest.mark.parametrize('variant', ['t5_tiny', 't5_v1_0_tiny'])
@pytest.mark.variants
def test_encoder_is_bidirectional_and_decoder_causal(variant):
  cfg = load_config(variant, SMALL).model
  model = build_model(cfg)
  params = nn.unbox(jax.jit(lambda r: init_params(model, r, 16))(jax.random.key(0)))
  encode = jax.jit(lambda p, x: model.apply({'params': p}, x, method=type(model).encode))
  logits = jax.jit(lambda p, x, y: model.apply({'params': p}, x, y))
  x, y = ids(0, (2, 12)), ids(1, (2, 10))
  enc = encode(params, x)
  # Changing encoder token j changes encoder outputs before j.
  enc2 = encode(params, x.at[:, 9].set(7))
  assert not np.allclose(enc[:, :9], enc2[:, :9])
  # Changing decoder token t never changes logits at positions < t ... but does change later ones.
  base = logits(params, x, y)
  for t in (0, 4, 9):
    out = logits(params, x, y.at[:, t].set(5))
    np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
    assert not np.allclose(out[:, t:], base[:, t:])


def test_encoder_padding_is_ignored():
  model, params = make()
  logits = jax.jit(lambda p, x, s, y: model.apply({'params': p}, x, y, segment_ids=s))
  x, y = ids(2, (1, 12)), ids(3, (1, 6))
  seg = jnp.array([[1] * 8 + [0] * 4])
  a = logits(params, x, seg, y)
  b = logits(params, x.at[:, 8:].set(11), seg, y)  # rewrite only padding
  np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  short = logits(params, x[:, :8], jnp.ones((1, 8), jnp.int32), y)
  np.testing.assert_allclose(a, short, rtol=1e-5, atol=1e-5)


def test_relative_bias_is_one_table_per_stack():
  _, params = make('model.execution.scan_layers=true')
  assert params['encoder']['relpos']['rel_embedding'].shape == (4, 32)
  assert params['decoder']['relpos']['rel_embedding'].shape == (4, 32)
  assert 'relpos' not in params['encoder']['layers']
