"""Layers against float64 NumPy references."""
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import Activation, Norm, Remat
from lm.models.layers import (ACTIVATIONS, GATED, NORMS, DenseGeneral, LayerNorm, Mlp, RMSNorm,
                              sinusoidal_positions)
from lm.models.rope import Rope, rotary
from lm.models.transformer import REMAT_POLICIES


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def test_dense_general_multi_axis():
  x = np.random.default_rng(0).normal(size=(2, 5, 4, 8)).astype(np.float32)
  layer = DenseGeneral(6, ('heads', 'kv', 'embed'), axis=(-2, -1), use_bias=True)
  params = nn.unbox(layer.init(jax.random.key(1), x))
  kernel = np.asarray(params['params']['kernel'], np.float64)
  bias = np.asarray(params['params']['bias'], np.float64)
  want = np.einsum('bshd,hdo->bso', x.astype(np.float64), kernel) + bias
  assert params['params']['kernel'].shape == (4, 8, 6)
  assert rel_err(layer.apply(params, x), want) < 1e-6


def test_layernorm_matches_numpy():
  x = np.random.default_rng(0).normal(3.0, 2.0, size=(4, 7, 32)).astype(np.float32)
  layer = LayerNorm(eps=1e-5)
  params = jax.tree.map(lambda p: p + np.random.default_rng(1).normal(size=p.shape).astype(np.float32),
                        nn.unbox(layer.init(jax.random.key(0), x)))
  scale = np.asarray(params['params']['scale'], np.float64)
  bias = np.asarray(params['params']['bias'], np.float64)
  x64 = x.astype(np.float64)
  want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * scale + bias
  assert rel_err(layer.apply(params, x), want) < 1e-6


def test_rmsnorm_matches_numpy():
  x = np.random.default_rng(2).normal(1.0, 2.0, size=(3, 16)).astype(np.float32)
  layer = RMSNorm(eps=1e-6)
  params = nn.unbox(layer.init(jax.random.key(0), x))
  x64 = x.astype(np.float64)
  want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
  assert 'bias' not in params['params']
  assert rel_err(layer.apply(params, x), want) < 1e-6


def test_every_config_choice_has_an_implementation():
  """The config's Literal types are the one declaration; the layer tables must cover exactly them."""
  assert set(ACTIVATIONS) | set(GATED) == set(typing.get_args(Activation))
  assert set(NORMS) == set(typing.get_args(Norm))
  assert set(REMAT_POLICIES) | {'none'} == set(typing.get_args(Remat))


@pytest.mark.parametrize('activation', typing.get_args(Activation))
@pytest.mark.variants
def test_mlp_matches_numpy(activation):
  from scipy.special import erf
  x = np.random.default_rng(3).normal(size=(2, 3, 16)).astype(np.float32)
  layer = Mlp(d_ff=32, activation=activation, use_bias=True, swiglu=(1.702, 0.5))  # clamped_swiglu: clamps act
  params = jax.tree.map(lambda p: p + 0.1, nn.unbox(layer.init(jax.random.key(0), x)))['params']
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  acts = {
    'gelu': lambda h: 0.5 * h * (1 + erf(h / np.sqrt(2))),
    'gelu_tanh': lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))),
    'relu': lambda h: np.maximum(h, 0), 'silu': lambda h: h / (1 + np.exp(-h)),
  }
  x64 = x.astype(np.float64)
  dense = lambda name, h: h @ p[name]['kernel'] + p[name]['bias']
  gated = {'swiglu': 'silu', 'geglu': 'gelu', 'geglu_tanh': 'gelu_tanh', 'reglu': 'relu'}
  if activation == 'clamped_swiglu':  # GPT-OSS's (transformers' GptOssExperts._apply_gate)
    g = np.minimum(dense('wi_0', x64), 0.5)
    h = (np.clip(dense('wi_1', x64), -0.5, 0.5) + 1) * g / (1 + np.exp(-1.702 * g))
  elif activation in gated:
    h = acts[gated[activation]](dense('wi_0', x64)) * dense('wi_1', x64)
  else:
    h = acts[activation](dense('wi', x64))
  want = dense('wo', h)
  assert rel_err(layer.apply({'params': params}, x), want) < 1e-5


def test_sinusoidal_positions_formula():
  pos = np.arange(50)
  got = np.asarray(sinusoidal_positions(jnp.asarray(pos)[None], 16))[0]
  inv = np.exp(-np.log(1e4) * np.arange(8) / 7)
  want = np.concatenate([np.sin(pos[:, None] * inv), np.cos(pos[:, None] * inv)], -1)
  assert rel_err(got, want) < 1e-5


def numpy_rotary(x, positions, theta):
  """RoPE in float64 as complex rotations of the pairs (i, i + d/2) by positions * theta^(-2i/d)."""
  d = x.shape[-1]
  freq = theta ** (-np.arange(d // 2) * 2.0 / d)
  z = (x[..., :d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * positions[:, :, None, None] * freq)
  return np.concatenate([z.real, z.imag], axis=-1)


def test_rotary_matches_numpy_and_scores_depend_only_on_offsets():
  rng = np.random.default_rng(4)
  x = rng.normal(size=(2, 9, 3, 16)).astype(np.float32)
  positions = np.stack([np.arange(9), np.arange(9)[::-1] * 50])  # far positions too
  got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(positions), Rope(1e4)))
  assert rel_err(got, numpy_rotary(x.astype(np.float64), positions, 1e4)) < 1e-5
  q, k = x[:1, :1], x[:1, 1:2]  # one query and one key vector, placed at (p, p - 3) for several p
  scores = [np.sum(np.asarray(rotary(jnp.asarray(q), jnp.asarray([[p]]), Rope(1e4))) *
                   np.asarray(rotary(jnp.asarray(k), jnp.asarray([[p - 3]]), Rope(1e4)))) for p in (3, 10, 200)]
  np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
