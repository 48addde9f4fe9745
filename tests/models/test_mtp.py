"""Multi-token prediction (`model.mtp`, `lm.models.mtp`): its loss against a float64 NumPy reference of the modules,
the main loss's gradient untouched at weight 0, refusals, and export to an architecture without MTP."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from scipy.special import erf

from lm.config import ConfigError, ModelConfig, MtpConfig, load_config
from lm.models import build_model, get_family
from lm.models.mtp import ahead_keys, look_ahead
from lm.storage.convert.hf import load_hf, save_hf
from lm.train.step import pretraining_loss

VOCAB, LEN = 40, 12


def packed_batch() -> dict[str, np.ndarray]:
  """Two rows of 13 tokens made into a causal LM batch as `CausalLM` makes it: row 0 two documents, row 1 one
  document then padding."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, size=(2, LEN + 1))
  seg = np.array([[1] * 6 + [2] * 7, [1] * 10 + [0] * 3])
  tokens[seg == 0] = 0
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'segment_ids': seg[:, :-1],
          'positions': np.array([list(range(6)) + list(range(6)), list(range(LEN))]),
          'weights': ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float32)}


def tiny(depth: int, weight: float = 0.3) -> ModelConfig:
  """A 1-layer GPT (learned positions, LayerNorm, exact GELU, biases; tied output layer)."""
  return ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16,
                     mtp=MtpConfig(depth=depth, weight=weight))


def perturbed_params(cfg: ModelConfig) -> dict:
  """Init params with every one (norms and biases too) moved off its init."""
  params = get_family(cfg.family).init(build_model(cfg), jax.random.key(0), LEN)
  leaves, tree = jax.tree.flatten(nn.unbox(params))
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def objective(cfg: ModelConfig, params: dict, batch: dict) -> tuple[jax.Array, dict]:
  """The pretraining loss of `batch` with each MTP depth's shifted features added, as the train step takes it."""
  batch = look_ahead({k: jnp.asarray(v) for k, v in batch.items()}, cfg.mtp.depth)
  total = lambda w: jnp.maximum(jnp.sum(w), 1.0)
  outputs = get_family(cfg.family).apply(build_model(cfg), params, batch, deterministic=True, rngs={})
  return pretraining_loss((), outputs, batch, 0.0, total(batch['weights']), jnp.asarray(2.0),
                          [total(batch[ahead_keys(k)[2]]) for k in range(1, cfg.mtp.depth + 1)], cfg.mtp.weight)


# --- the float64 reference ---

def layer_norm(x, p):
  x = x - x.mean(-1, keepdims=True)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * p['scale'] + p['bias']


def block(x, p, seg):
  """A pre-norm GPT block over [batch, length, d], attention within each document, causal."""
  a = p['attention']
  h = layer_norm(x, p['attention_norm'])
  q, k, v = (np.einsum('bld,dhk->blhk', h, a[n]['kernel']) + a[n]['bias'] for n in ('query', 'key', 'value'))
  scores = np.einsum('bqhk,bshk->bhqs', q, k) / np.sqrt(q.shape[-1])
  allowed = np.tril(np.ones((LEN, LEN), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  scores = np.where(allowed[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  x = x + np.einsum('bhqs,bshk,hkd->bqd', probs, v, a['out']['kernel']) + a['out']['bias']
  h = layer_norm(x, p['mlp_norm']) @ p['mlp']['wi']['kernel'] + p['mlp']['wi']['bias']
  return x + (0.5 * h * (1 + erf(h / np.sqrt(2)))) @ p['mlp']['wo']['kernel'] + p['mlp']['wo']['bias']


def mean_nll(hidden, table, targets, weights):
  logits = hidden @ table.T
  m = logits.max(-1, keepdims=True)
  logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  nll = logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  return (nll * weights).sum() / weights.sum()


def reference(params, batch, main_hidden, depth, weight):
  """(main loss, [each depth's loss], the loss) in float64 from the stack's output `main_hidden`."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  table, seg = p['token_embed']['embedding'], batch['segment_ids']
  main = mean_nll(main_hidden, table, batch['targets'], batch['weights'])
  h, ahead = main_hidden, []
  for k in range(1, depth + 1):
    m = p[f'mtp_{k - 1}']
    shift = lambda a: np.concatenate([a[:, k:], np.zeros_like(a[:, :k])], axis=1)
    e = table[shift(batch['inputs'])]
    x = (layer_norm(e, m['embed_norm']) @ m['embed_proj']['kernel']
         + layer_norm(h, m['hidden_norm']) @ m['hidden_proj']['kernel'])
    h = block(x, m['block'], seg)
    weights = shift(batch['weights']) * (shift(seg) == seg)
    ahead.append(mean_nll(layer_norm(h, m['final_norm']), table, shift(batch['targets']), weights))
  return main, ahead, main + weight * np.mean(ahead)


def test_the_mtp_loss_equals_a_float64_reference_of_its_modules():
  """Two depths over packed documents and padding: each depth's loss (its shift kept inside each document) and the
  weighted total, from the stack's output."""
  cfg, batch = tiny(depth=2), packed_batch()
  params = perturbed_params(cfg)
  loss, sums = objective(cfg, params, batch)
  outputs = get_family('gpt').apply(build_model(cfg), params, {k: jnp.asarray(v) for k, v in batch.items()},
                                    deterministic=True, rngs={})
  main, ahead, total = reference(params, batch, np.asarray(outputs['logits'].hidden, np.float64), 2, 0.3)
  weights = look_ahead({k: jnp.asarray(v) for k, v in batch.items()}, 2)
  ours = [float(sums[f'mtp_nll_{k}'] / weights[ahead_keys(k)[2]].sum()) for k in (1, 2)]
  print('mtp losses', ours, ahead)
  np.testing.assert_allclose(ours, ahead, rtol=1e-5)
  np.testing.assert_allclose(float(sums['nll'] / batch['weights'].sum()), main, rtol=1e-5)
  np.testing.assert_allclose(float(loss), total, rtol=1e-5)
  assert float(weights['mtp_weights_2'].sum()) == 3 + 4 + 7  # 3 + 4 look-aheads in row 0's documents, 7 in row 1's


@pytest.mark.long(0.3)
def test_at_weight_zero_the_main_loss_gradient_is_unchanged():
  cfg = tiny(depth=1, weight=0.0)
  params, batch = perturbed_params(cfg), packed_batch()
  grads = jax.grad(lambda p: objective(cfg, p, batch)[0])(params)
  plain = {k: v for k, v in params.items() if not k.startswith('mtp_')}
  expected = jax.grad(lambda p: objective(tiny(depth=0), p, batch)[0])(plain)
  for path, g in traverse_util.flatten_dict(expected, sep='/').items():
    np.testing.assert_allclose(traverse_util.flatten_dict(grads, sep='/')[path], g, rtol=1e-6, atol=1e-9,
                               err_msg=path)
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads['mtp_0']))
  weighted = jax.grad(lambda p: objective(dataclasses.replace(cfg, mtp=MtpConfig(depth=1)), p, batch)[0])(params)
  assert float(jnp.abs(weighted['token_embed']['embedding'] - grads['token_embed']['embedding']).max()) > 1e-4


@pytest.mark.parametrize('preset, overrides, says', [
  ('t5_tiny', ['model.mtp.depth=1'], 'the t5 family is not one'),
  ('bert_tiny', ['model.mtp.depth=2'], 'the bert family is not one'),
  ('llama_tiny', ['model.mtp.depth=-1'], 'must be >= 0'),
  ('llama_tiny', ['model.mtp.depth=1', 'mesh.stage=2', 'model.execution.pipeline.schedule=1f1b',
                  'model.execution.scan_layers=true',
                  'train.microbatches=2'], 'schedule=gpipe or circular'),
])
def test_mtp_where_it_cannot_go_is_one_line(preset, overrides, says):
  with pytest.raises(ConfigError, match=says) as e:
    load_config(preset, overrides)
  assert '\n' not in str(e.value)


def test_an_architecture_without_mtp_exports_the_model_and_says_it_left_the_modules_out(tmp_path):
  cfg = dataclasses.replace(load_config('llama_tiny', ['model.mtp.depth=1', 'model.num_layers=1']).model,
                            vocab_size=VOCAB)
  params = perturbed_params(cfg)
  with pytest.warns(UserWarning, match='the 1 model.mtp module'):
    save_hf(cfg, params, tmp_path / 'hf')
  model, loaded = load_hf(tmp_path / 'hf')
  assert model.cfg.mtp.depth == 0 and 'mtp_0' not in loaded
  batch = {k: jnp.asarray(v) for k, v in packed_batch().items()}
  ours = build_model(cfg).apply({'params': params}, batch['inputs'], segment_ids=batch['segment_ids'])
  np.testing.assert_allclose(model.apply({'params': loaded}, batch['inputs'], segment_ids=batch['segment_ids']),
                             ours, rtol=1e-5, atol=1e-6)
