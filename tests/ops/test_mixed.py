"""`mixed.einsum`: bf16 operands, float32 accumulation in the forward and both backward dots, checked against
float64 NumPy on the bf16-rounded operands; and every dot of a bf16 training step compiled that way."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm.config import load_config
from lm.ops import mixed
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL

CASES = [  # spec, a's shape and dtype, b's shape and dtype, out dtype: each use in the model
  ('ti,io->to', (24, 16), jnp.bfloat16, (16, 12), jnp.float32, jnp.bfloat16),  # dense layer, float32 kernel
  ('bld,vd->blv', (2, 6, 16), jnp.bfloat16, (40, 16), jnp.float32, jnp.bfloat16),  # tied output layer
  ('bqhd,bkhd->bhqk', (2, 6, 3, 8), jnp.bfloat16, (2, 7, 3, 8), jnp.bfloat16, jnp.float32),  # attention scores
  ('bhqk,bkhd->bqhd', (2, 3, 6, 7), jnp.float32, (2, 7, 3, 8), jnp.bfloat16, jnp.bfloat16),  # probs @ values
  ('abc,bu->acu', (5, 4, 6), jnp.bfloat16, (4, 3), jnp.float32, jnp.bfloat16),  # a leading contracted axis
]


def bf16(x):
  return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize('spec, a_shape, a_dtype, b_shape, b_dtype, out_dtype', CASES)
@pytest.mark.variants
def test_values_and_gradients_equal_float64_on_the_rounded_operands(spec, a_shape, a_dtype, b_shape, b_dtype,
                                                                   out_dtype):
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal(a_shape), a_dtype)
  b = jnp.asarray(rng.standard_normal(b_shape), b_dtype)
  out, vjp = jax.vjp(lambda a, b: mixed.einsum(spec, a, b, dtype=jnp.bfloat16, out_dtype=out_dtype), a, b)
  g = jnp.asarray(rng.standard_normal(out.shape), out_dtype)
  da, db = vjp(g)
  assert (out.dtype, da.dtype, db.dtype) == (out_dtype, a_dtype, b_dtype)
  inputs, result = spec.split('->')
  a_spec, b_spec = inputs.split(',')
  want = {  # float64 products of the bf16-rounded operands and cotangent: the only rounding is the result's
    'out': np.einsum(spec, bf16(a), bf16(b)),
    'da': np.einsum(f'{result},{b_spec}->{a_spec}', bf16(g), bf16(b)),
    'db': np.einsum(f'{a_spec},{result}->{b_spec}', bf16(a), bf16(g)),
  }
  for name, got in {'out': out, 'da': da, 'db': db}.items():
    # float32 results: accumulation order only; bf16 results: one rounding (2^-9 relative, as a norm ~2^-10)
    rtol = 1e-6 if got.dtype == jnp.float32 else 4e-3
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want[name]) <= rtol * np.linalg.norm(want[name]), name


def test_float32_is_the_plain_einsum():
  rng = np.random.default_rng(1)
  a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 5), (5, 3)))
  f = lambda a, b: mixed.einsum('ij,jk->ik', a, b, dtype=jnp.float32).sum()  # noqa: E731
  g = lambda a, b: jnp.einsum('ij,jk->ik', a, b).sum()  # noqa: E731
  for got, want in zip(jax.grad(f, (0, 1))(a, b), jax.grad(g, (0, 1))(a, b)):
    np.testing.assert_array_equal(got, want)


def dots(hlo: str) -> list[str]:
  """(operand, operand -> result) element types of each dot in StableHLO text."""
  t = r'tensor<(?:[\d?]+x)*(\w+)>'
  found = re.findall(rf'stablehlo\.dot_general[^\n]*?: \({t}, {t}\) -> {t}', hlo)
  return [f'{a},{b}->{c}' for a, b, c in found]


@pytest.mark.parametrize('preset', ['gpt_tiny', 'bert_tiny', 't5_tiny', 'llama_tiny'])
@pytest.mark.variants
def test_every_dot_of_a_bf16_training_step_multiplies_bf16_into_float32(preset, tmp_path):
  """The whole step (forward, backward, for each family): no dot runs at the float32 rate."""
  config = load_config(preset, SMALL + ['model.execution.dtype=bfloat16', f'train.run_dir={tmp_path}'])
  trainer = Pretraining(config, jax.devices()[:1])
  state = trainer.init_state()
  hlo = trainer.train_step.lower(state, next(trainer.train_batches)).as_text()
  kinds = dots(hlo)
  assert len(kinds) >= 3 * 6  # a (scanned) layer's matmuls, forward and backward
  assert set(kinds) == {'bf16,bf16->f32'}, sorted(set(kinds))
