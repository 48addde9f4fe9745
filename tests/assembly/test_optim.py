"""Schedule shape and the weight-decay mask."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lm.assembly.optim import decay_mask, ema_params, learning_rate_schedule, make_optimizer
from lm.config import ConfigError, OptimConfig, load_config


@pytest.mark.parametrize('kind', ['cosine', 'linear', 'constant'])
def test_schedule_warmup_then_decay(kind):
  cfg = OptimConfig(learning_rate=1.0, warmup_steps=10, schedule=kind, min_lr_ratio=0.1)
  lr = learning_rate_schedule(cfg, total_steps=110)
  np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 0.5, 1.0], atol=1e-6)
  progress = 50 / 100
  want = {'cosine': 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)), 'linear': 1.0 - 0.9 * progress,
          'constant': 1.0}[kind]
  np.testing.assert_allclose(lr(60), want, rtol=1e-5)
  np.testing.assert_allclose(lr(110), {'constant': 1.0}.get(kind, 0.1), rtol=1e-5)


def wsd_reference(step: int, peak: float, warmup: int, length: int, fraction: float, ratio: float,
                  shape: str) -> float:
  """The README's warmup-stable-decay formula in float64."""
  decay = max(round(fraction * length), 1)
  stable_end, end = length - decay, ratio * peak
  if step < warmup:
    return peak * step / warmup
  if step < stable_end:
    return peak
  p = min((step - stable_end) / decay, 1.0)
  return {'linear': peak + (end - peak) * p, 'sqrt': end + (peak - end) * (1 - np.sqrt(p)),
          'cosine': end + (peak - end) * (1 + np.cos(np.pi * p)) / 2}[shape]


@pytest.mark.parametrize('shape', ['linear', 'sqrt', 'cosine'])
# The last two have no stable phase.
@pytest.mark.parametrize('warmup, length, fraction', [(10, 200, 0.2), (0, 97, 0.1), (0, 40, 1.0), (10, 50, 0.8)])
def test_wsd_follows_its_formula_at_every_step(shape, warmup, length, fraction):
  cfg = OptimConfig(learning_rate=3e-3, warmup_steps=warmup, schedule='wsd', decay_fraction=fraction,
                    decay_shape=shape, min_lr_ratio=0.1)
  lr = jax.jit(learning_rate_schedule(cfg, total_steps=length))
  got = [float(lr(step)) for step in range(length + 5)]  # and past the end: the minimum
  want = [wsd_reference(step, 3e-3, warmup, length, fraction, 0.1, shape) for step in range(length + 5)]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
  assert got[length] == pytest.approx(3e-4, rel=1e-6)


def test_wsd_refuses_a_warmup_that_runs_into_the_decay():
  with pytest.raises(ConfigError, match=r'warmup \(90 steps\) runs into the decay \(the last 20 of 100 steps\)'):
    load_config('gpt_tiny', ['optim.schedule=wsd', 'optim.warmup_steps=90', 'train.steps=100'])
  with pytest.raises(ConfigError, match=r'optim.decay_fraction=0.0 in \(0, 1\]'):
    load_config('gpt_tiny', ['optim.schedule=wsd', 'optim.decay_fraction=0.0'])


@pytest.mark.parametrize('grad_clip', [0.0, 1.0])
@pytest.mark.variants
def test_the_params_moving_average_is_the_debiased_mean_of_the_params_after_each_update(grad_clip):
  """ema_decay keeps sum_i (1 - d) d^(t-i) params_i / (1 - d^t) over the params after updates 1..t (float64
  NumPy from the params the optimizer produced), and leaves the updates as AdamW alone makes them."""
  cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, schedule='constant', grad_clip=grad_clip)
  (tx, _), (plain, _) = make_optimizer(cfg, total_steps=10, ema_decay=0.8), make_optimizer(cfg, total_steps=10)
  rng = np.random.default_rng(0)
  params = {'w': {'kernel': jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}, 'b': jnp.ones(2)}
  state, plain_state, seen = tx.init(params), plain.init(params), []
  for _ in range(6):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    updates, state = tx.update(grads, state, params)
    plain_updates, plain_state = plain.update(grads, plain_state, params)
    jax.tree.map(np.testing.assert_array_equal, updates, plain_updates)
    params = optax.apply_updates(params, updates)
    seen.append(jax.tree.map(lambda p: np.asarray(p, np.float64), params))
  t = len(seen)
  weights = [(1 - 0.8) * 0.8 ** (t - 1 - i) / (1 - 0.8 ** t) for i in range(t)]
  want = jax.tree.map(lambda *ps: sum(w * p for w, p in zip(weights, ps)), *seen)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), ema_params(state, 0.8), want)


def test_decay_mask_excludes_norms_biases_embeddings():
  params = {'token_embed': {'embedding': 1}, 'final_norm': {'scale': 1, 'bias': 1},
            'decoder': {'layers': {'mlp': {'wi': {'kernel': 1, 'bias': 1}}}}}
  mask = decay_mask(params, ('bias', 'scale', 'embedding'))
  assert mask == {'token_embed': {'embedding': False}, 'final_norm': {'scale': False, 'bias': False},
                  'decoder': {'layers': {'mlp': {'wi': {'kernel': True, 'bias': False}}}}}


def test_weight_decay_applies_only_to_masked_in_params():
  cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, schedule='constant', weight_decay=0.5, grad_clip=0.0)
  tx, _ = make_optimizer(cfg, total_steps=10)
  params = {'w': {'kernel': jnp.ones(3)}, 'n': {'scale': jnp.ones(3)}}
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(updates['w']['kernel'], -0.1 * 0.5 * np.ones(3), rtol=1e-6)
  np.testing.assert_array_equal(updates['n']['scale'], 0.0)
