"""Schedule shape and the weight-decay mask."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.assembly.optim import decay_mask, learning_rate_schedule, make_optimizer
from lm.config import OptimConfig


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
