"""JAX's shipped kernels behind our dispatch, against the float64 reference, for the features each has."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from lm.config import MeshConfig
from lm.ops.attention import attention, vendor
from lm.parallel.mesh import make_mesh
from lm.parallel.rules import sharding_context
from tests.ops.attention.test_flash import reference, rel

KERNELS = {
  # name: (function, takes bias, needs TPU interpret mode around the jit on CPU)
  'tpu_flash': (vendor.tpu_flash, True, True),
  'tpu_splash': (vendor.tpu_splash, False, False),
  # cuDNN needs a GPU: this runs our cudnn entry (padding, layout, masks) through jax.nn.dot_product_attention's
  # XLA implementation, not the cuDNN kernel.
  'cudnn_entry_via_xla': (lambda *a, **kw: vendor.cudnn(*a, implementation='xla', **kw), True, False),
}


@pytest.mark.parametrize('name', list(KERNELS))
@pytest.mark.parametrize('seed, causal, segments, with_bias', [
  (0, True, None, False), (1, False, 'packed', False), (2, True, 'packed', True),
  (3, True, 'padded', False), (4, False, 'padded', True),  # trailing segment 0: padding attends to nothing
])
@pytest.mark.variants
def test_vendor_kernel_matches_float64(name, seed, causal, segments, with_bias):
  fn, takes_bias, interpret_ctx = KERNELS[name]
  if with_bias and not takes_bias:
    pytest.skip(f'{name} has no bias')
  rng = np.random.default_rng(seed)
  b, h, d, length = 2, 2, 64, int(rng.choice([128, 200]))
  q, k, v, do = (rng.normal(size=(b, length, h, d)) for _ in range(4))
  seg = np.sort(rng.integers(1, 4, size=(b, length)), axis=1) if segments else np.ones((b, length), np.int32)
  if segments == 'padded':
    seg[0, length - 37:], seg[1, length - 90:] = 0, 0
  bias = rng.normal(size=(1, h, length, length)) if with_bias else None

  def loss(q, k, v, bias):
    out = fn(q, k, v, causal=causal, segment_ids=jnp.asarray(seg) if segments else None, kv_segment_ids=None,
             bias=bias, scale=d ** -0.5, platform='cpu')
    return jnp.sum(out * jnp.asarray(do, jnp.float32)), out

  argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
  args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [None if bias is None else jnp.asarray(bias, jnp.float32)]
  run = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
  if interpret_ctx:
    with pltpu.force_tpu_interpret_mode():
      grads, out = run(*args)
  else:
    grads, out = run(*args)
  want = reference(q, k, v, do, causal=causal, q_seg=seg, kv_seg=seg, bias=bias, scale=d ** -0.5)
  assert rel(out, want[0]) < 1e-5
  for got, expected in zip(grads, want[1:], strict=False):
    assert rel(got, expected) < 1e-5


def test_splash_kernel_is_built_afresh_for_each_jit():
  """A second jit with the same shapes must not see the first one's tracers (the kernel is built in each trace: a
  kernel cached by shape kept the mask values of the trace that built it)."""
  q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 128, 2, 64)), jnp.float32)
  run = lambda q: vendor.tpu_splash(q, q, q, causal=True, segment_ids=None, kv_segment_ids=None,
                                              bias=None, scale=0.125, platform='cpu')
  first, second = jax.jit(run)(q), jax.jit(lambda q: run(q) * 1.0)(q)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize('name', ['tpu_flash', 'tpu_splash'])
def test_the_dispatch_runs_them_per_shard_without_segments_or_bias(name):
  """`attention(impl=...)` on a mesh runs the kernel per shard with no segment ids or bias (each passed as None),
  also after a trace of another kind (Flax's init under remat): equal to XLA's attention."""
  mesh = make_mesh(MeshConfig(data=2), jax.devices()[:2])
  q = jnp.asarray(np.random.default_rng(0).normal(size=(2, 128, 2, 64)), jnp.float32)
  run = lambda q: attention(q, q, q, causal=True, impl=name)
  with sharding_context(mesh), (pltpu.force_tpu_interpret_mode() if KERNELS[name][2] else contextlib.nullcontext()):
    jax.eval_shape(jax.checkpoint(run), q)
    got = jax.jit(run)(q)
  assert rel(got, attention(q, q, q, causal=True, impl='xla')) < 1e-5
