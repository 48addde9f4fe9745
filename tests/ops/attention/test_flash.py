"""Our Pallas flash attention (interpret mode on CPU) against a float64 NumPy reference."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.ops.attention import attention
from lm.ops.attention.flash import flash_attention, heads_per_block


def reference(q, k, v, do, *, causal, q_seg, kv_seg, bias, scale, window=0, softcap=0.0, sinks=None):
  """Float64 forward and analytic backward: (out, dq, dk, dv, dbias, dsinks).

  Fewer key/value heads than query heads (grouped-query attention): query head h reads kv head
  h // group, and each kv head's gradient sums over its group. `window`: keys fewer than that many positions
  back; `softcap`: scaled logits through softcap * tanh(. / softcap), before the bias.
  """
  group = q.shape[2] // k.shape[2]
  k, v = (np.repeat(np.asarray(x, np.float64), group, axis=2) for x in (k, v))
  q, k, v, do = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, do))  # b h l d
  s = np.einsum('bhqd,bhkd->bhqk', q, k) * scale
  capped = softcap * np.tanh(s / softcap) if softcap else s
  s = capped
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  lq, lk = q.shape[2], k.shape[2]
  allowed = ((q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0))[:, None]
  if causal:
    allowed = allowed & np.tril(np.ones((lq, lk), bool))
  if window:
    allowed = allowed & (np.arange(lq)[:, None] - np.arange(lk)[None, :] < window)
  s = np.where(allowed, s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
  if sink is not None:
    m = np.maximum(m, sink)
  e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  denom = e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
  p = np.divide(e, denom, out=np.zeros_like(e), where=denom > 0)
  out = np.einsum('bhqk,bhkd->bhqd', p, v)
  dv = np.einsum('bhqk,bhqd->bhkd', p, do)
  dp = np.einsum('bhqd,bhkd->bhqk', do, v)
  delta = np.sum(dp * p, -1, keepdims=True)
  ds = p * (dp - delta)
  dsinks = None if sink is None else -(np.exp(sink - m) / denom * delta).sum(axis=(0, 2, 3))
  ds_qk = ds * (1 - (capped / softcap) ** 2) if softcap else ds
  dq = np.einsum('bhqk,bhkd->bhqd', ds_qk, k) * scale
  dk = np.einsum('bhqk,bhqd->bhkd', ds_qk, q) * scale
  dbias = None
  if bias is not None:
    axes = tuple(a for a in (0, 1) if np.shape(bias)[a] == 1)
    dbias = ds.sum(axis=axes, keepdims=True)
  back = lambda x: x.transpose(0, 2, 1, 3)
  grouped = lambda x: back(x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(axis=2))
  return back(out), back(dq), grouped(dk), grouped(dv), dbias, dsinks


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = [  # (seed, causal, segments, bias, dtype, query heads per key/value head)
  (0, False, False, False, 'float32', 1), (1, True, False, False, 'float32', 1), (2, True, True, False, 'float32', 1),
  (3, False, True, True, 'float32', 1), (4, True, True, True, 'float32', 1), (5, True, False, True, 'bfloat16', 1),
  (6, False, True, False, 'bfloat16', 1),
  (7, True, True, True, 'float32', 2), (8, False, False, False, 'float32', 4), (9, True, True, False, 'bfloat16', 3),
  # cross-attention: queries and keys of other lengths, each with their own segment ids (and padding)
  (10, False, 'cross', True, 'float32', 1), (11, False, 'cross', False, 'bfloat16', 2),
]


@pytest.mark.parametrize('seed, causal, segments, with_bias, dtype, group', CASES)
@pytest.mark.variants
def test_forward_and_gradients_match_float64(seed, causal, segments, with_bias, dtype, group):
  check(seed, causal, segments, with_bias, dtype, group)


# Sliding windows (Mistral, Gemma 2's local layers) with kv-blocks wholly outside them skipped, and Gemma 2's
# attention-logit soft-capping (50 in the model; 2 here, where unit-normal q.k/sqrt(d) reach it), causal with
# packed segments: (seed, bias, dtype, group, window, softcap)
WINDOWED = [(20, False, 'float32', 1, 37, 0.0), (21, True, 'float32', 2, 130, 0.0), (22, False, 'float32', 1, 0, 2.0),
            (23, True, 'float32', 2, 64, 2.0), (24, False, 'bfloat16', 1, 50, 2.0)]


@pytest.mark.parametrize('seed, with_bias, dtype, group, window, softcap', WINDOWED)
@pytest.mark.variants
def test_window_and_softcap_match_float64(seed, with_bias, dtype, group, window, softcap):
  check(seed, True, True, with_bias, dtype, group, window, softcap, length=(200, 300))


# GPT-OSS's learned sinks, alone and with a window, padding, grouped heads, cross-attention or a bias: (seed,
# causal, segments, bias, dtype, group, window)
SINKS = [(30, True, True, False, 'float32', 2, 0), (31, True, True, True, 'float32', 1, 37),
         (32, False, 'cross', False, 'float32', 2, 0), (33, True, False, False, 'bfloat16', 1, 50)]


@pytest.mark.parametrize('seed, causal, segments, with_bias, dtype, group, window', SINKS)
@pytest.mark.variants
def test_sinks_match_float64(seed, causal, segments, with_bias, dtype, group, window):
  check(seed, causal, segments, with_bias, dtype, group, window, sinks=True, length=(40, 200))


def check(seed, causal, segments, with_bias, dtype, group, window=0, softcap=0.0, length=(40, 300), sinks=False):
  """Forward and gradients of the flash kernel (64-row query blocks, 128-key blocks) against `reference`."""
  rng = np.random.default_rng(seed)
  b, kv_heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
  h = kv_heads * group
  d = int(rng.choice([16, 32, 64]))
  lq = int(rng.integers(*length))  # rarely a multiple of the blocks: exercises padding
  lk = lq if causal or segments is True else int(rng.integers(40, 300))
  q = rng.normal(size=(b, lq, h, d))
  k, v = rng.normal(size=(b, lk, kv_heads, d)), rng.normal(size=(b, lk, kv_heads, d))
  do = rng.normal(size=(b, lq, h, d))
  q_seg = np.sort(rng.integers(0, 4, size=(b, lq)), axis=1) if segments else np.ones((b, lq), np.int32)
  kv_seg = q_seg if segments is True else np.ones((b, lk), np.int32)
  if segments == 'cross':
    kv_seg = np.sort(rng.integers(0, 4, size=(b, lk)), axis=1)
  bias = rng.normal(size=(1, h, lq, lk)) if with_bias else None
  sink = rng.normal(size=(h,)) * 2 if sinks else None  # some above the rows' logits, some below
  jdt = jnp.dtype(dtype)
  cast = lambda x: jnp.asarray(x, jdt)
  seg_arg = jnp.asarray(q_seg) if segments else None
  kv_seg_arg = jnp.asarray(kv_seg) if segments == 'cross' else None

  def loss(q, k, v, bias, sinks):
    out = flash_attention(q, k, v, causal=causal, segment_ids=seg_arg, kv_segment_ids=kv_seg_arg, bias=bias,
                          window=window, softcap=softcap, block_q=64, block_k=128, sinks=sinks)
    return jnp.sum(out.astype(jnp.float32) * jnp.asarray(do, jnp.float32)), out

  bias_arg = None if bias is None else jnp.asarray(bias, jnp.float32)
  sink_arg = None if sink is None else jnp.asarray(sink, jnp.float32)
  argnums = (0, 1, 2) + ((3,) if with_bias else ()) + ((4,) if sinks else ())
  grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(cast(q), cast(k), cast(v), bias_arg, sink_arg)
  q64, k64, v64 = (np.asarray(cast(x), np.float64) for x in (q, k, v))  # compare on the rounded inputs
  want = reference(q64, k64, v64, do, causal=causal, q_seg=q_seg, kv_seg=kv_seg, bias=bias, scale=d ** -0.5,
                   window=window, softcap=softcap, sinks=sink)
  expected = [w for i, w in zip((0, 1, 2, 3, 4), want[1:]) if i in argnums]
  tol = 1e-5 if dtype == 'float32' else 2e-2
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert rel(out, want[0]) < tol
  for got, expected in zip(grads, expected, strict=True):
    assert rel(got, expected) < tol


# (query heads, key/value heads, head_dim) -> query heads per kernel block: the fewest whose lanes tile 128 and
# whose key/value heads tile too (or all of them): pairs at 64, single heads at 128 (also sharing one key/value
# head), whole groups, and every head where nothing smaller tiles.
HEAD_BLOCKS = [((6, 6, 64), 2), ((8, 4, 64), 4), ((4, 4, 128), 1), ((8, 2, 128), 1), ((8, 2, 64), 8), ((4, 1, 16), 4)]


@pytest.mark.parametrize('shape, per_block', HEAD_BLOCKS)
@pytest.mark.variants
def test_blocks_of_heads_read_the_model_layout(shape, per_block):
  """The kernels read [B, L, heads * head_dim] in blocks of `per_block` heads: the blocking rule, and each layout
  against the float64 reference (causal, segments, a per-head bias), forward and gradients."""
  h, kv_heads, d = shape
  assert heads_per_block(h, kv_heads, d) == per_block
  rng = np.random.default_rng(h * kv_heads + d)
  b, length = 2, 136  # two q-blocks of 128 (the second padded), as on TPU
  q, do = rng.normal(size=(2, b, length, h, d))
  k, v = rng.normal(size=(2, b, length, kv_heads, d))
  seg = np.sort(rng.integers(1, 3, size=(b, length)), axis=1)
  bias = rng.normal(size=(1, h, length, length))

  def loss(q, k, v, bias):
    out = flash_attention(q, k, v, causal=True, segment_ids=jnp.asarray(seg), bias=bias)
    return jnp.sum(out * do), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
    *(jnp.asarray(x, jnp.float32) for x in (q, k, v, bias)))
  want = reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=bias, scale=d ** -0.5)
  for got, expected in zip((out, *grads), want[:5], strict=True):
    assert rel(got, expected) < 1e-5


def test_fully_masked_rows_give_zeros_not_nan():
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 130, 2, 16)), jnp.float32) for _ in range(3))
  seg = jnp.asarray(np.array([[0] * 10 + [1] * 100 + [0] * 20]))
  out, grads = jax.jit(jax.value_and_grad(
    lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, segment_ids=seg) ** 2), argnums=(0, 1, 2)))(q, k, v)
  full = flash_attention(q, k, v, causal=True, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(full)[0, :10], 0.0)
  np.testing.assert_array_equal(np.asarray(full)[0, 110:], 0.0)
  assert np.isfinite(out) and all(np.all(np.isfinite(g)) for g in grads)


def test_dispatch_runs_flash_and_refuses_masks():
  rng = np.random.default_rng(8)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 70, 2, 16)), jnp.float32) for _ in range(3))
  np.testing.assert_allclose(attention(q, k, v, causal=True, impl='flash'), attention(q, k, v, causal=True),
                             rtol=2e-5, atol=2e-6)
  with pytest.raises(ValueError, match='model.execution.attention_impl=flash has no arbitrary masks'):
    attention(q, k, v, mask=jnp.ones((1, 1, 70, 70), bool), impl='flash')


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')
@pytest.mark.parametrize('h, kv_heads, d', [(4, 4, 64), (8, 2, 128), (8, 4, 64)])  # head blocks of 2, 1 and 4
@pytest.mark.variants
def test_compiles_ahead_of_time_for_tpu_v5e(h, kv_heads, d):
  """Forward and backward (bias, causal, segments, bf16; grouped-query heads) lower through Mosaic and compile for
  v5e:2x2 in each kind of head block."""
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec

  from lm.parallel.rules import sharding_context
  topology = topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2')
  mesh = topologies.make_mesh(topology, (4, 1, 1), ('data', 'fsdp', 'tensor'))
  rows = NamedSharding(mesh, PartitionSpec('data'))
  b, s = 4, 512
  qkv = [jax.ShapeDtypeStruct((b, s, heads, d), jnp.bfloat16, sharding=rows) for heads in (h, kv_heads, kv_heads)]
  bias = jax.ShapeDtypeStruct((1, h, s, s), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  seg = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rows)

  def loss(q, k, v, bias, seg):
    with sharding_context(mesh):
      return jnp.sum(attention(q, k, v, causal=True, bias=bias, segment_ids=seg, impl='flash').astype(jnp.float32))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*qkv, bias, seg).compile()
  kernels = compiled.as_text().count('custom_call_target="tpu_custom_call"')
  assert kernels == 3, kernels  # forward, dK/dV and dQ, compiled by Mosaic rather than interpreted


@pytest.mark.parametrize('length', [40, pytest.param(256, marks=pytest.mark.long(0.2))])  # whole; in causal blocks
def test_the_xla_path_windows_soft_caps_and_sinks_as_the_reference(length):
  rng = np.random.default_rng(length)
  b, h, d, window, softcap = 2, 2, 16, 9, 2.0
  q, k, v, do = (rng.normal(size=(b, length, h, d)) for _ in range(4))
  seg = np.sort(rng.integers(1, 3, size=(b, length)), axis=1)
  sinks = rng.normal(size=(h,))

  def loss(q, k, v, sinks):
    out = attention(q, k, v, causal=True, segment_ids=jnp.asarray(seg), window=window, softcap=softcap, impl='xla',
                    sinks=sinks)
    return jnp.sum(out * jnp.asarray(do, jnp.float32)), out

  for with_sinks in (False, True):
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [jnp.asarray(sinks, jnp.float32) if with_sinks else None]
    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2), has_aux=True)(*args)
    want = reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=None, scale=d ** -0.5, window=window,
                     softcap=softcap, sinks=sinks if with_sinks else None)
    assert rel(out, want[0]) < 1e-5
    for got, expected in zip(grads, [*want[1:4], want[5]], strict=False):
      assert rel(got, expected) < 1e-5
  with pytest.raises(ValueError, match='model.execution.attention_impl=tpu_splash has no model.sliding_window; use '
                                       'model.execution.attention_impl=xla, flash or auto'):
    attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, window=window, impl='tpu_splash')
  with pytest.raises(ValueError, match=r'tpu_flash has no attention sinks \(model.attention_sinks\); use '
                                       'model.execution.attention_impl=xla, flash or auto'):
    attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, impl='tpu_flash',
              sinks=jnp.asarray(sinks))


@pytest.mark.parametrize('impl', ['flash', 'xla'])
def test_value_heads_narrower_than_query_heads_match_float64(impl):
  """Latent attention's heads (DeepSeek-V3: 192 query/key features, 128 value features; 24 and 16 here), through
  the dispatcher: the flash kernel takes the values padded to the query width and gives back their width; the XLA
  path runs at both widths. Output and every gradient against the float64 reference, causal over packed segments
  with padding and a length that is no multiple of the blocks."""
  rng = np.random.default_rng(50)
  b, length, h, d, dv = 2, 75, 2, 24, 16
  q, k = rng.normal(size=(b, length, h, d)), rng.normal(size=(b, length, h, d))
  v, do = rng.normal(size=(b, length, h, dv)), rng.normal(size=(b, length, h, dv))
  seg = np.sort(rng.integers(0, 3, size=(b, length)), axis=1)
  want = reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=None, scale=d ** -0.5)
  run = lambda q, k, v: attention(q, k, v, causal=True, segment_ids=jnp.asarray(seg), impl=impl, block_q=32,
                                  block_k=32)
  out, backward = jax.vjp(run, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
  assert out.shape == (b, length, h, dv) and rel(out, want[0]) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv'], backward(jnp.asarray(do, jnp.float32)), want[1:4], strict=True):
    assert rel(g, w) < 1e-5, name
