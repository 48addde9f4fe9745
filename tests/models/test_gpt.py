"""GPT: causality, packed-document isolation, parameter count, scan/remat equivalence."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.assembly.accounting import count_params
from lm.config import load_config
from lm.models import abstract_params, build_model

SMALL = ['model.d_model=32', 'model.num_layers=2', 'model.num_heads=4', 'model.max_len=24', 'data.seq_len=24',
         'model.execution.scan_layers=true']


def make(*overrides):
  cfg = load_config('gpt_tiny', SMALL + list(overrides)).model
  model = build_model(cfg)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 24), jnp.int32)))['params']
  return cfg, model, params


def logits_fn(model):
  return jax.jit(lambda p, x, seg=None, pos=None: model.apply({'params': p}, x, segment_ids=seg, positions=pos))


def tokens(seed, shape=(2, 24)):
  return jnp.asarray(np.random.default_rng(seed).integers(3, 259, size=shape), jnp.int32)


def test_changing_future_tokens_never_changes_past_logits():
  _, model, params = make()
  apply = logits_fn(model)
  x = tokens(0)
  base = apply(params, x)
  for t in (0, 7, 22):
    changed = x.at[:, t + 1:].set(tokens(t + 1)[:, t + 1:])
    out = apply(params, changed)
    np.testing.assert_array_equal(np.asarray(out[:, :t + 1]), np.asarray(base[:, :t + 1]))
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


def test_packed_documents_do_not_see_each_other():
  _, model, params = make()
  seg = jnp.array([[1] * 10 + [2] * 8 + [3] * 6] * 2)
  pos = jnp.array([list(range(10)) + list(range(8)) + list(range(6))] * 2)
  apply = logits_fn(model)
  x = tokens(1)
  base = apply(params, x, seg, pos)
  # Rewrite document 1 (positions 0..9): documents 2 and 3 must not move.
  changed = x.at[:, :10].set(tokens(2)[:, :10])
  out = apply(params, changed, seg, pos)
  np.testing.assert_array_equal(np.asarray(out[:, 10:]), np.asarray(base[:, 10:]))
  # And document 2 alone, placed first in a fresh row, gives the same logits as inside the pack.
  alone = apply(params, x[:, 10:18], jnp.ones((2, 8), jnp.int32), jnp.arange(8)[None].repeat(2, 0))
  np.testing.assert_allclose(alone, base[:, 10:18], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('preset_overrides', [[], ['model.tie_embeddings=false'], ['model.activation=swiglu']])
def test_param_count_matches_formula(preset_overrides):
  cfg = load_config('gpt_tiny', preset_overrides).model
  d, f, v, p, n = cfg.d_model, cfg.resolved_d_ff, cfg.vocab_size, cfg.max_len, cfg.num_layers
  mlp = (3 * d * f + 2 * f + d) if cfg.activation == 'swiglu' else (2 * d * f + f + d)
  per_layer = 2 * 2 * d + 4 * d * d + 4 * d + mlp
  want = v * d + p * d + n * per_layer + 2 * d + (0 if cfg.tie_embeddings else v * d)
  counts = count_params(abstract_params(build_model(cfg)))
  assert counts['total'] == want
  assert counts['non_embedding'] == want - v * d - p * d


def unstack(params, num_layers):
  """Scanned params (a leading layer axis under 'layers') -> per-layer 'layers_i' trees."""
  decoder = dict(params['decoder'])
  stacked = decoder.pop('layers')
  for i in range(num_layers):
    decoder[f'layers_{i}'] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return {**params, 'decoder': decoder}


def test_scanned_and_unrolled_layers_agree():
  cfg, model, params = make()
  _, unrolled, _ = make('model.execution.scan_layers=false')
  x = tokens(3)
  np.testing.assert_allclose(logits_fn(unrolled)(unstack(params, cfg.num_layers), x),
                             logits_fn(model)(params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('policy', ['full', 'dots', 'projections'])
@pytest.mark.variants
def test_remat_keeps_gradients(policy):
  _, model, params = make()
  _, remat_model, _ = make(f'model.execution.remat={policy}')
  x = tokens(4)
  loss = lambda m: lambda p: jnp.mean(jax.nn.log_softmax(m.apply({'params': p}, x))[..., 5])
  g0 = jax.jit(jax.grad(loss(model)))(params)
  g1 = jax.jit(jax.grad(loss(remat_model)))(params)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_keeps_float32_params():
  cfg32, model32, params = make()
  _, model16, params16 = make('model.execution.dtype=bfloat16')
  assert jax.tree.structure(params16) == jax.tree.structure(params)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params16))
  grads = jax.grad(lambda p: logits_fn(model16)(p, tokens(5)).astype(jnp.float32).sum())(params16)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  x = tokens(5)
  out16, out32 = logits_fn(model16)(params, x), logits_fn(model32)(params, x)
  assert out16.dtype == jnp.bfloat16
  err = np.linalg.norm(np.asarray(out16, np.float32) - out32) / np.linalg.norm(out32)
  assert 1e-5 < err < 3e-2  # bf16 rounding shows, but the model is the same


def test_post_ln_stack_ends_in_a_norm():
  _, model, params = make('model.norm_position=post')
  from lm.models.transformer import Stack
  cfg = load_config('gpt_tiny', SMALL + ['model.norm_position=post']).model
  stack = Stack(cfg, causal=True, num_layers=cfg.num_layers)
  h = jax.random.normal(jax.random.key(0), (2, 24, 32)) * 3 + 1
  out = jax.jit(lambda p, h: stack.apply({'params': p}, h))(params['decoder'], h)
  np.testing.assert_allclose(np.mean(out, -1), 0.0, atol=1e-4)
  np.testing.assert_allclose(np.std(out, -1), 1.0, rtol=1e-3)


def test_hidden_dropout_drops_at_its_rate_and_rescales_the_rest():
  """Every nn.Dropout in the model, intercepted: about a fraction p of its nonzero inputs become 0 (binomial,
  5 sigma over all of them) and every kept value is its input / (1 - p)."""
  p = 0.25
  _, model, params = make(f'model.dropout={p}', 'model.execution.scan_layers=false')  # unrolled: concrete values
  seen = []

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, nn.Dropout) and context.method_name == '__call__':
      seen.append((np.asarray(args[0]), np.asarray(out)))
    return out
  with nn.intercept_methods(record):
    model.apply({'params': params}, tokens(8), deterministic=False, rngs={'dropout': jax.random.key(0)})
  assert len(seen) >= 5  # embeddings, and attention and MLP outputs of each layer
  x = np.concatenate([a.ravel() for a, _ in seen])
  y = np.concatenate([b.ravel() for _, b in seen])
  live = x != 0
  dropped = np.mean(y[live] == 0)
  assert abs(dropped - p) < 5 * np.sqrt(p * (1 - p) / live.sum())
  kept = live & (y != 0)
  np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-6)


@pytest.mark.parametrize('remat, offload', [('full', 'layer_input'), ('projections', 'query_proj,mlp_out'),
                                            ('full', 'layer_input,attention_out')])
@pytest.mark.variants
def test_offloaded_remat_keeps_loss_and_gradients_and_moves_them_to_host(remat, offload):
  """What remat keeps for the backward pass, kept in host memory instead (model.execution.offload): the loss and
  every gradient equal the device-memory remat's (float32, 1e-6 relative); the program moves the named activations to the
  host (their residuals typed <host>) and back, which the device remat never does."""
  _, model, params = make(f'model.execution.remat={remat}')
  _, offloaded, _ = make(f'model.execution.remat={remat}', f'model.execution.offload=[{offload}]')
  x = tokens(4)
  loss = lambda m: lambda p: jnp.mean(jax.nn.log_softmax(m.apply({'params': p}, x))[..., 5])
  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(loss(m)))(params) for m in (model, offloaded))
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  flat = lambda g: np.concatenate([np.ravel(np.asarray(leaf, np.float64)) for leaf in jax.tree.leaves(g)])
  assert np.linalg.norm(flat(g1) - flat(g0)) <= 1e-6 * np.linalg.norm(flat(g0))  # fusions round apart
  host = lambda m: str(jax.make_jaxpr(jax.grad(loss(m)))(params)).count('MemorySpace.Host')
  assert host(model) == 0 and host(offloaded) >= 1


@pytest.mark.parametrize('family', ['gpt', 'llama'])
@pytest.mark.variants
def test_int8_projections_stay_near_the_float_model(family):
  """model.quantization=int8: the same params give logits within int8's rounding of the float model's (a few
  percent), the program's projections are s8 x s8 -> s32 dots, and every param gets a gradient."""
  preset = [] if family == 'gpt' else ['model.family=llama', 'model.position=rotary', 'model.norm=rmsnorm',
                                       'model.activation=swiglu', 'model.use_bias=false']
  _, model, params = make(*preset)
  _, int8, _ = make(*preset, 'model.quantization=int8')
  x = tokens(6)
  exact, quantized = logits_fn(model)(params, x), logits_fn(int8)(params, x)
  error = np.linalg.norm(np.asarray(quantized) - np.asarray(exact)) / np.linalg.norm(np.asarray(exact))
  assert 1e-4 < error < 5e-2, error
  lowered = jax.jit(logits_fn(int8)).lower(params, x).as_text()
  assert lowered.count('xi8>) -> tensor<') >= 4 and 'xi8>) -> tensor<' not in jax.jit(logits_fn(model)).lower(
    params, x).as_text()
  grads = jax.grad(lambda p: jnp.mean(logits_fn(int8)(p, x) ** 2))(params)
  assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
