"""`lm.models.moe.RoutedMlp`: its params through the float64 loop over experts (tests/ops/test_moe.py) give its
output, with shared experts and their gate; the balance and z-losses it sows leave padding out."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import Config, ConfigError, ModelConfig, MoeConfig, from_dict
from lm.models.moe import BALANCE, DROPPED, Z_LOSS, RoutedMlp
from lm.models.parametrization import Init
from lm.ops import moe
from tests.ops.test_moe import loop_over_experts

BATCH, LENGTH, D = 2, 7, 16


def layer(activation='swiglu', **moe_fields):
  cfg = ModelConfig(d_model=D, d_ff=24, activation=activation,
                    moe=MoeConfig(num_experts=4, experts_per_token=2, expert_d_ff=12, **moe_fields))
  return RoutedMlp(cfg, Init(cfg))


def reference(params, x, m, activation):
  """The routed experts by the float64 loop, from the layer's own params (unboxed), plus the shared MLP."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  tokens = np.asarray(x, np.float64).reshape(-1, D)
  r = moe.route(jnp.asarray(tokens @ p['router']), m.experts_per_token, m.router, m.normalize, m.routed_scale)
  gated = activation == 'swiglu'
  act = jax.nn.silu if gated else (lambda h: jax.nn.gelu(h, approximate=False))
  with jax.enable_x64(True):
    y = loop_over_experts(jnp.asarray(tokens), np.asarray(r.experts), jnp.asarray(r.weights, jnp.float64),
                          p['wi_1' if gated else 'wi'], p['wo'], p['wi_0'] if gated else None, act)
    y = np.asarray(y)
  if m.shared_experts:
    s = p['shared']
    h = jax.nn.silu(tokens @ s['wi_0']['kernel']) * (tokens @ s['wi_1']['kernel'])
    shared = np.asarray(h) @ s['wo']['kernel']
    if m.shared_gate:
      shared = shared * jax.nn.sigmoid(tokens @ p['shared_gate']['kernel'])
    y = y + np.asarray(shared)
  return y.reshape(BATCH, LENGTH, D)


@pytest.mark.parametrize('activation, fields', [
  ('swiglu', {}), ('gelu', {}), ('swiglu', {'compute': 'dense'}),
  ('swiglu', {'shared_experts': 1, 'shared_d_ff': 20, 'shared_gate': True}),  # Qwen2-MoE's
])
def test_the_layer_is_the_loop_over_its_own_params(activation, fields):
  x = jax.random.normal(jax.random.key(0), (BATCH, LENGTH, D))
  module = layer(activation, **fields)
  params = jax.tree.map(np.asarray, nn.unbox(module.init(jax.random.key(1), x)['params']))
  y = module.apply({'params': params}, x)
  np.testing.assert_allclose(y, reference(params, x, module.cfg.moe, activation), rtol=2e-5, atol=2e-6)
  assert params['wo'].shape == (4, 12, D) and params['router'].shape == (D, 4)


def test_the_sown_losses_leave_padding_out_and_capacity_sows_its_drop_rate():
  x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, D))
  mask = jnp.ones((BATCH, LENGTH)).at[1, 3:].set(0)
  module = layer(compute='capacity', capacity_factor=0.5)
  params = module.init(jax.random.key(3), x)['params']
  _, sown = module.apply({'params': params}, x, mask, mutable=['intermediates'])
  sown = sown['intermediates']
  kept = np.asarray(mask).reshape(-1) > 0
  logits = np.asarray(x).reshape(-1, D)[kept] @ np.asarray(nn.unbox(params)['router'])
  r = moe.route(jnp.asarray(logits), 2)
  np.testing.assert_allclose(sown[BALANCE][0], moe.load_balance_loss(r.probs, r.experts), rtol=1e-5)
  np.testing.assert_allclose(sown[Z_LOSS][0], moe.router_z_loss(jnp.asarray(logits)), rtol=1e-5)
  assert 0 < float(sown[DROPPED][0]) < 1


def test_a_moe_config_round_trips_through_its_dict():
  cfg = dataclasses.replace(ModelConfig(), moe=MoeConfig(num_experts=8, dense_layers=(0, 2)))
  values = Config(model=cfg).to_dict()
  assert values['model']['moe']['dense_layers'] == [0, 2]
  with pytest.raises(ConfigError, match='builds no routed experts'):  # no family builds them yet
    from_dict(values)
