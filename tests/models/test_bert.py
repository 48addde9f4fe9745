"""BERT: bidirectional attention, padding masks, heads."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import load_config
from lm.models import build_model, init_params
from lm.models.bert import BERT

SMALL = ['model.d_model=32', 'model.num_layers=2', 'model.num_heads=4', 'model.max_len=32', 'data.seq_len=32']


def make(*overrides):
  cfg = load_config('bert_tiny', SMALL + list(overrides)).model
  model = build_model(cfg)
  params = nn.unbox(jax.jit(lambda r: init_params(model, r, 16))(jax.random.key(0)))
  return model, params


def ids(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(4, 260, size=shape), jnp.int32)


def test_encoder_sees_both_directions():
  model, params = make()
  f = jax.jit(lambda p, x: model.apply({'params': p}, x))
  x = ids(0, (2, 16))
  a, b = f(params, x), f(params, x.at[:, 12].set(9))
  assert not np.allclose(a[:, :12], b[:, :12]) and not np.allclose(a[:, 13:], b[:, 13:])


def test_padding_and_packed_segments_are_isolated():
  model, params = make()
  f = jax.jit(lambda p, x, s, pos: model.apply({'params': p}, x, segment_ids=s, positions=pos))
  x = ids(1, (1, 16))
  seg = jnp.array([[1] * 6 + [2] * 7 + [0] * 3])
  pos = jnp.array([list(range(6)) + list(range(7)) + [0] * 3])
  a = f(params, x, seg, pos)
  b = f(params, x.at[:, :6].set(ids(2, (1, 6))).at[:, 13:].set(5), seg, pos)
  np.testing.assert_allclose(a[:, 6:13], b[:, 6:13], rtol=1e-5, atol=1e-5)


def test_post_ln_and_embedding_norm_and_tied_decoder():
  model, params = make()
  assert set(params) >= {'embed_norm', 'type_embed', 'mlm_dense', 'mlm_norm', 'mlm_bias', 'token_embed'}
  assert 'final_norm' not in params['encoder'], 'post-LN stacks end in their last residual norm'
  hidden = jax.jit(lambda p, x: model.apply({'params': p}, x, method=BERT.encode))(params, ids(3, (2, 16)))
  np.testing.assert_allclose(np.std(hidden, -1), 1.0, rtol=1e-3)


def test_classification_and_nsp_heads():
  model, params = make('model.nsp=true', 'model.num_labels=3')
  assert {'pooler', 'nsp_head', 'classifier'} <= set(params), 'init creates every head'
  x = ids(4, (2, 16))
  variables = {'params': params}
  scores = model.apply(variables, x, method=BERT.classify)
  assert scores.shape == (2, 3)
  nsp = model.apply(variables, x, method=lambda m, x: m.nsp_logits(m.encode(x)))
  assert nsp.shape == (2, 2)
