"""int8 matmuls (lm/ops/int8.py): the forward equals a float64 reference of quantize -> int dot -> dequantize, the
program's dot is s8 x s8 -> s32, and the backward is the float matmul's (straight through)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.ops import mixed
from lm.ops.int8 import frozen_int8_matmul, int8_matmul, quantize_kernel


def reference(x, kernel):
  """float64: each row of x and column of kernel scaled by its largest magnitude / 127, rounded (half to even, as
  jnp.round) and clipped, multiplied exactly, rescaled."""
  x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  sx = np.abs(x).max(1, keepdims=True) / 127
  sk = np.abs(kernel).max(0, keepdims=True) / 127
  sx, sk = np.where(sx > 0, sx, 1), np.where(sk > 0, sk, 1)
  qx = np.clip(np.round(np.float32(x) / np.float32(sx)), -127, 127)
  qk = np.clip(np.round(np.float32(kernel) / np.float32(sk)), -127, 127)
  return (qx @ qk) * sx * sk


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_int8_matmul_equals_quantize_dot_dequantize_and_its_gradient_is_the_float_matmuls(dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(24, 64)), jnp.float32).at[3].set(0.0)  # an all-zero token keeps scale 1
  kernel = jnp.asarray(rng.normal(size=(64, 48)) * 0.05, jnp.float32)
  out = int8_matmul(x, kernel, dtype)
  assert out.dtype == dtype
  expected = reference(x, kernel)
  error = np.linalg.norm(np.asarray(out, np.float64) - expected) / np.linalg.norm(expected)
  assert error <= (1e-6 if dtype == jnp.float32 else 4e-3), error
  # against the unquantized product, int8's own error: about 1% here
  exact = np.asarray(x, np.float64) @ np.asarray(kernel, np.float64)
  assert 1e-4 < np.linalg.norm(expected - exact) / np.linalg.norm(exact) < 3e-2
  lowered = jax.jit(int8_matmul, static_argnums=2).lower(x, kernel, dtype).as_text()
  assert 'xi8>, tensor<64x48xi8>) -> tensor<24x48xi32>' in lowered
  g = jnp.asarray(rng.normal(size=(24, 48)), jnp.float32)
  grads = jax.grad(lambda a, b: jnp.sum(int8_matmul(a, b, dtype).astype(jnp.float32) * g), (0, 1))(x, kernel)
  floats = jax.grad(lambda a, b: jnp.sum(mixed.einsum('ti,io->to', a, b, dtype=dtype).astype(jnp.float32) * g),
                    (0, 1))(x, kernel)
  for ours, theirs in zip(grads, floats):
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=1e-6, atol=1e-6)


def test_a_kernel_stored_in_int8_multiplies_as_int8_matmul_and_passes_gradients_through_its_dequantized_self():
  """An int8 base (model.lora under model.quantization=int8): quantize_kernel's values and scales are the float64
  reference's, frozen_int8_matmul's product int8_matmul's (the float64 reference's), its input gradient the float
  matmul's with values x scales, and the program's dot s8 x s8 -> s32."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(24, 64)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(64, 48)) * 0.05, jnp.float32)
  values, scales = quantize_kernel(kernel, (1, 48))
  sk = np.abs(np.asarray(kernel, np.float64)).max(0, keepdims=True) / 127
  np.testing.assert_allclose(scales, sk, rtol=1e-6)
  np.testing.assert_array_equal(values, np.clip(np.round(np.float32(kernel) / np.float32(sk)), -127, 127))
  out = frozen_int8_matmul(x, values, scales, jnp.float32)
  expected = reference(x, kernel)
  assert np.linalg.norm(np.asarray(out, np.float64) - expected) / np.linalg.norm(expected) <= 1e-6
  lowered = jax.jit(frozen_int8_matmul, static_argnums=3).lower(x, values, scales, jnp.float32).as_text()
  assert 'xi8>, tensor<64x48xi8>) -> tensor<24x48xi32>' in lowered
  g = jnp.asarray(rng.normal(size=(24, 48)), jnp.float32)
  dx = jax.grad(lambda a: jnp.sum(frozen_int8_matmul(a, values, scales, jnp.float32) * g))(x)
  dequantized = np.asarray(values, np.float64) * np.asarray(scales, np.float64)
  np.testing.assert_allclose(dx, np.asarray(g, np.float64) @ dequantized.T, rtol=1e-5, atol=1e-6)


def test_an_int8_model_counts_mfu_against_the_int8_peak():
  """Published dense peaks: int8 doubles bf16 from v5e on (v5p 918 against 459 T/s); v4 runs both at 275."""
  from types import SimpleNamespace
  from lm.parallel.chips import peak_flops
  v5p, v4 = SimpleNamespace(device_kind='TPU v5p'), SimpleNamespace(device_kind='TPU v4')
  assert (peak_flops(v5p), peak_flops(v5p, 'int8')) == (459e12, 918e12)
  assert peak_flops(v4, 'int8') == peak_flops(v4) == 275e12
  assert peak_flops(SimpleNamespace(device_kind='cpu'), 'int8') is None


@pytest.mark.parametrize('family', ['gpt', 'llama'])
@pytest.mark.long(0.5)
def test_int8_training_follows_bf16_over_200_steps(family, small_config, tmp_path):
  """200 steps on the embedded corpus in bf16 and with int8 projections: the int8 run's loss stays within 3% of
  bf16's at every logged step past the first 20 (the stated tolerance; 0.2% at most measured), and both learn. At
  a rate of 1e-3: at the small config's 3e-3 the bf16 run spiked at step 10 on an AVX-512 BF16 CPU (not on the
  machines before), and a spike one run has and the other not is no measure of int8."""
  from lm.jobs.pretraining import Pretraining
  from lm.train.logging import read_metrics
  preset = [] if family == 'gpt' else ['model.family=llama', 'model.position=rotary', 'model.norm=rmsnorm',
                                       'model.activation=swiglu', 'model.use_bias=false']
  losses = {}
  for quantization in ('none', 'int8'):
    run = tmp_path / quantization
    Pretraining(small_config(*preset, 'train.steps=200', 'train.log_every=10', 'model.execution.dtype=bfloat16',
                             'optim.learning_rate=1e-3',
                             f'model.quantization={quantization}', f'train.run_dir={run}'), jax.devices()[:1]).run()
    losses[quantization] = np.array([r['loss'] for r in read_metrics(run) if 'loss' in r and r['step'] % 10 == 0])
  bf16, int8 = losses['none'], losses['int8']
  assert bf16[-1] < 0.8 * bf16[0] and int8[-1] < 0.8 * int8[0]
  assert np.max(np.abs(int8[2:] - bf16[2:]) / bf16[2:]) < 0.03, (bf16, int8)
