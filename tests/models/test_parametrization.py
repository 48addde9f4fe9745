"""model.parametrization=mup: at the base width it trains as standard does; away from it, the init, the Adam
update and its per-param multipliers follow Tensor Programs V's Table 3 (float64 formulas); bad settings are
one line each."""
import jax
import numpy as np
import pytest

from lm.assembly import assemble
from lm.config import ConfigError, load_config
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL
from tests.train.test_optimizers import EPS, LR, WD, assert_close, first_update


def five_steps(config):
  """(the losses of 5 steps, the params after them) on one device."""
  trainer = Pretraining(config, jax.devices()[:1])
  state, losses = trainer.init_state(), []
  for _ in range(5):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    losses.append(float(metrics['loss']))
  return np.array(losses), jax.device_get(state.params)


@pytest.mark.long(0.6)
@pytest.mark.parametrize('preset, scanned', [('gpt_tiny', True), ('bert_tiny', False), ('t5_tiny', True),
                                             ('llama_tiny', False)])
def test_mup_at_the_base_width_trains_as_standard(preset, scanned, tmp_path):
  overrides = SMALL + [f'model.execution.scan_layers={str(scanned).lower()}', f'train.run_dir={tmp_path}']
  losses, params = five_steps(load_config(preset, overrides))
  mup_losses, mup_params = five_steps(load_config(preset, overrides + ['model.parametrization=mup',
                                                                       'model.mup.base_width=64']))
  np.testing.assert_allclose(mup_losses, losses, rtol=1e-6)
  assert_close(mup_params, params, rtol=1e-6)


HIDDEN = [('attention', 'query'), ('attention', 'key'), ('attention', 'value'), ('attention', 'out'), ('mlp', 'wi'),
          ('mlp', 'wo')]


@pytest.mark.long(0.2)
def test_mup_init_and_first_adamw_update_follow_table_3(small_config):
  """Width 64 over a base of 16 (m = 4): hidden kernels start at std 0.02 / sqrt(m) (the out projections' GPT-2
  residual shrink with them) and step lr / m x g / (|g| + eps / m) with decay x m (lr x decay unchanged);
  embeddings, norms and biases step as standard; optim.lr_multipliers scales what its pattern matches."""
  m = 4
  params, grads, mask, updates, _, _ = first_update(
    small_config, 'adamw', 'model.parametrization=mup', 'model.mup.base_width=16',
    'optim.lr_multipliers=[position_embed=0.5]')
  layers = params['decoder']['layers']
  residual = 0.02 / np.sqrt(2 * 2)
  for block, name in HIDDEN:
    std = (residual if name in ('out', 'wo') else 0.02) / np.sqrt(m)
    np.testing.assert_allclose(layers[block][name]['kernel'].std(), std, rtol=0.06)
  np.testing.assert_allclose(params['token_embed']['embedding'].std(), 0.02, rtol=0.06)  # input: as standard

  def want(path, p, g, decays):
    name = jax.tree_util.keystr(path)
    hidden = any(f"'{block}']['{n}']['kernel'" in name for block, n in HIDDEN)
    lr = LR * (0.5 if 'position_embed' in name else 1.0)
    if hidden:
      return -LR / m * (g / (np.abs(g) + EPS / m) + m * WD * p * decays)
    return -lr * (g / (np.abs(g) + EPS) + WD * p * decays)
  assert_close(updates, jax.tree_util.tree_map_with_path(want, params, grads, mask))


def test_zero_init_starts_the_queries_and_an_untied_output_layer_at_zero(small_config):
  config = small_config('model.family=llama', 'model.position=rotary', 'model.norm=rmsnorm', 'model.use_bias=false',
                        'model.activation=swiglu', 'model.tie_embeddings=false', 'model.parametrization=mup',
                        'model.mup.base_width=32', 'model.mup.zero_init=true')
  params = jax.device_get(assemble(config, jax.devices()[:1]).init_state().params)
  assert not params['decoder']['layers']['attention']['query']['kernel'].any()
  assert not params['lm_head']['kernel'].any()
  assert params['decoder']['layers']['attention']['key']['kernel'].std() > 0


@pytest.mark.parametrize('overrides, message', [
  (['model.parametrization=mup'], 'model.parametrization=mup needs model.mup.base_width > 0'),
  (['model.parametrization=mup', 'model.mup.base_width=-64'], 'needs model.mup.base_width > 0'),
  (['model.mup.base_width=64'], 'model.mup fields are set but model.parametrization=standard'),
  (['optim.lr_multipliers=[embed]'], "optim.lr_multipliers entry 'embed' is not REGEX=FACTOR"),
  (['optim.lr_multipliers=[embed=-1]'], 'needs a pattern and a positive factor'),
])
def test_bad_parametrization_settings_are_one_line(small_config, overrides, message):
  with pytest.raises(ConfigError, match=message.replace('*', r'\*').replace('[', r'\[')) as e:
    small_config(*overrides)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('overrides', [['model.parametrization=mup', 'model.mup.base_width=64', 'optim.name=muon'],
                                       ['optim.lr_multipliers=[embed=0.5]', 'optim.name=schedule_free_adamw']])
def test_an_optimizer_of_one_rate_refuses_param_groups_in_one_line(small_config, overrides):
  """The optimizer code decides (lm.assembly.optim), when the config is assembled."""
  with pytest.raises(ConfigError, match=r'optim.name=\w+ takes one learning rate for every param.*; use adamw, '
                                        r'lion or adafactor') as e:
    assemble(small_config(*overrides), jax.devices()[:1])
  assert '\n' not in str(e.value)


def test_a_mup_t5_with_a_tied_output_layer_cannot_be_exported(small_config, tmp_path):
  """Its d_model^-0.5 output rescale is taken at the base width, which no standard T5 has: one line, no files."""
  from lm.storage.convert.hf import save_hf
  from lm.models import build_model
  config = load_config('t5_tiny', SMALL + ['model.tie_embeddings=true', 'model.parametrization=mup',
                                           'model.mup.base_width=32'])
  params = jax.device_get(assemble(config, jax.devices()[:1]).init_state().params)
  with pytest.raises(ConfigError, match='cannot fold this μP t5 model into a standard one') as e:
    save_hf(build_model(config.model), params, tmp_path / 'hf')
  assert '\n' not in str(e.value) and not (tmp_path / 'hf').exists()


@pytest.mark.long(0.2)
def test_mup_scales_routers_and_experts_as_hidden_matrices_and_leaves_the_selection_bias_alone(small_config):
  """Routed experts (experts x embed x mlp) and their router (embed x experts) are hidden matrices under μP: at m = 4
  they start at the standard std / sqrt(m) and step lr / m x g / (|g| + eps / m) with decay x m; the selection
  bias does not step at all (the train step moves it)."""
  from lm.models.parametrization import standard_std
  from tests.models.test_moe import MOE
  m = 4
  params, grads, mask, updates, assembly, _ = first_update(
    small_config, 'adamw', *MOE, 'model.moe.bias_rate=0.01', 'model.parametrization=mup', 'model.mup.base_width=16')
  cfg = assembly.config.model
  std = standard_std(cfg, 'mlp_in', cfg.num_layers) / np.sqrt(m)
  mlp, steps = params['decoder']['layers']['mlp'], updates['decoder']['layers']['mlp']
  for name in ('router', 'wi_0', 'wi_1'):
    np.testing.assert_allclose(mlp[name].std(), std, rtol=0.06, err_msg=name)
  g, decays = grads['decoder']['layers']['mlp'], mask['decoder']['layers']['mlp']
  for name in ('router', 'wi_0', 'wi_1', 'wo'):
    want = -LR / m * (g[name] / (np.abs(g[name]) + EPS / m) + m * WD * mlp[name] * decays[name])
    np.testing.assert_allclose(steps[name], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)
  assert not steps['router_bias'].any()
