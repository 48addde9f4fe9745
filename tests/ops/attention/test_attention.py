"""The attention dispatch against a float64 NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm.ops.attention as attention_module
from lm.ops.attention import attention


def reference(q, k, v, causal, seg, bias, scale):
  group = q.shape[2] // k.shape[2]  # grouped-query attention: query head h reads kv head h // group
  q, k, v = (np.asarray(a, np.float64) for a in (q, np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)))
  logits = np.einsum('bqhd,bkhd->bhqk', q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
  allowed = np.ones((b, 1, lq, lk), bool)
  if causal:
    allowed &= np.tril(np.ones((lq, lk), bool))
  if seg is not None:
    seg = np.asarray(seg)
    allowed &= ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]
  logits = np.where(allowed, logits, -np.inf)
  m = np.max(logits, -1, keepdims=True)
  e = np.where(allowed, np.exp(logits - np.where(np.isfinite(m), m, 0)), 0)
  denom = e.sum(-1, keepdims=True)
  probs = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
  return np.einsum('bhqk,bkhd->bqhd', probs, v)


def rel_err(a, b):
  return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('with_segments', [False, True])
@pytest.mark.parametrize('with_bias', [False, True])
@pytest.mark.variants
def test_xla_attention_matches_float64(causal, with_segments, with_bias):
  rng = np.random.default_rng(hash((causal, with_segments, with_bias)) % 2**32)
  b, s, h, d = 2, 19, 3, 8
  q, k, v = (rng.normal(size=(b, s, h, d)).astype(np.float32) for _ in range(3))
  seg = np.sort(rng.integers(0, 3, size=(b, s)), axis=1) if with_segments else None
  bias = rng.normal(size=(1, h, s, s)).astype(np.float32) if with_bias else None
  got = attention(q, k, v, causal=causal, segment_ids=seg, bias=bias)
  want = reference(q, k, v, causal, seg, bias, d ** -0.5)
  assert np.all(np.isfinite(got))
  assert rel_err(got, want) < 1e-5


def test_fully_masked_rows_are_zero_with_finite_grads():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32) for _ in range(3))
  seg = jnp.array([[0, 0, 1, 1, 1, 0]])  # padding queries attend to nothing
  out = attention(q, k, v, causal=True, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(out)[0, [0, 1, 5]], 0.0)
  grads = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, segment_ids=seg) ** 2),
                   argnums=(0, 1, 2))(q, k, v)
  assert all(np.all(np.isfinite(g)) for g in grads)


def test_unknown_impl_is_refused():
  x = jnp.zeros((1, 2, 1, 4))
  with pytest.raises(ValueError, match="attention impl 'nope' is not available"):
    attention(x, x, x, impl='nope')


@pytest.mark.parametrize('impl', ['xla', 'flash'])
@pytest.mark.parametrize('kv_heads', [1, 2])
@pytest.mark.variants
def test_grouped_key_value_heads_match_float64(impl, kv_heads):
  """4 query heads over 1 (multi-query) or 2 key/value heads, causal with segments."""
  rng = np.random.default_rng(kv_heads)
  b, s, d = 2, 70, 16
  q = rng.normal(size=(b, s, 4, d)).astype(np.float32)
  k, v = (rng.normal(size=(b, s, kv_heads, d)).astype(np.float32) for _ in range(2))
  seg = np.sort(rng.integers(1, 3, size=(b, s)), axis=1)
  got = attention(q, k, v, causal=True, segment_ids=seg, impl=impl)
  assert rel_err(got, reference(q, k, v, True, seg, None, d ** -0.5)) < 1e-5


@pytest.mark.parametrize('length, blocks', [(64, 2), (96, 2), (256, 4)])
@pytest.mark.variants
def test_blocked_causal_path_matches_float64_forward_and_gradients(length, blocks, monkeypatch):
  """Causal self-attention of 64+ tokens (every default CPU run) takes the blocked path: packed segments with
  padding and a bias, against the float64 reference, values and gradients."""
  from tests.ops.attention.test_flash import reference as reference_with_grads
  calls, blocked = [], attention_module.blocked_causal_attention
  monkeypatch.setattr(attention_module, 'blocked_causal_attention',
                      lambda *a, **kw: calls.append(kw['num_blocks']) or blocked(*a, **kw))
  rng = np.random.default_rng(length)
  b, h, d = 2, 2, 8
  q, k, v, do = (rng.normal(size=(b, length, h, d)) for _ in range(4))
  seg = np.sort(rng.integers(1, 4, size=(b, length)), axis=1).astype(np.int32)
  seg[1, length - 11:] = 0  # padding at the end of the second row
  bias = rng.normal(size=(1, h, length, length))

  def loss(q, k, v, bias):
    out = attention(q, k, v, causal=True, segment_ids=jnp.asarray(seg), bias=bias)
    return jnp.sum(out * jnp.asarray(do, jnp.float32)), out

  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, bias)]
  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*f32)
  assert calls == [blocks]
  want = reference_with_grads(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=bias, scale=d ** -0.5)
  assert rel_err(out, want[0]) < 1e-5
  for got, expected in zip(grads, want[1:5], strict=True):
    assert rel_err(got, expected) < 1e-5


@pytest.mark.parametrize('platform, expected', [('tpu', 'flash'), ('gpu', 'cudnn'), ('cpu', 'xla')])
@pytest.mark.variants
def test_auto_picks_the_platforms_kernel(platform, expected, monkeypatch):
  """`auto` on a TPU runs our flash kernel, on a GPU cuDNN, elsewhere XLA; a mask or attention dropout (which
  the kernels lack) sends every platform to XLA. The platform is given, the kernels are spied on, not run."""
  monkeypatch.setattr(jax, 'default_backend', lambda: platform)
  ran = []
  for name in attention_module.KERNELS:
    monkeypatch.setitem(attention_module.KERNELS, name, lambda q, *a, name=name, **kw: ran.append(name) or q)
  q = jnp.ones((1, 64, 2, 8))
  attention(q, q, q, causal=True, impl='auto')
  assert ran == ([] if expected == 'xla' else [expected])
  ran.clear()
  attention(q, q, q, mask=jnp.ones((1, 1, 64, 64), bool), impl='auto')
  attention(q, q, q, impl='auto', dropout_rate=0.1, dropout_rng=jax.random.key(0))
  assert ran == []


def test_attention_dropout_drops_at_its_rate_and_rescales_the_rest():
  """Zero queries and keys give uniform probabilities 1/L; values one-hot per key read the dropped probability
  matrix back: a fraction p is 0 (binomial, 5 sigma), the rest is (1/L) / (1 - p)."""
  b, length, h, p = 2, 128, 2, 0.3
  q = jnp.zeros((b, length, h, length))
  v = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (b, length, h, length))
  out = np.asarray(attention(q, q, v, impl='xla', dropout_rate=p, dropout_rng=jax.random.key(0)))
  dropped = np.mean(out == 0)
  n = out.size
  assert abs(dropped - p) < 5 * np.sqrt(p * (1 - p) / n)
  np.testing.assert_allclose(out[out != 0], 1 / length / (1 - p), rtol=1e-6)
  again = np.asarray(attention(q, q, v, impl='xla', dropout_rate=p, dropout_rng=jax.random.key(1)))
  assert np.mean((again == 0) != (out == 0)) > 0.3  # another key, another mask
