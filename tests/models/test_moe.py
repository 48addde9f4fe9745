"""`lm.models.moe.RoutedMlp`: its params through the float64 loop over experts (tests/ops/test_moe.py) give its
output, with shared experts and their gate; the balance and z-losses it sows leave padding out."""
import dataclasses

import flax.linen as nn
from flax.traverse_util import flatten_dict
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import Config, ConfigError, ExecutionConfig, ModelConfig, MoeConfig, from_dict, load_config
from lm.models.moe import DROPPED, LOAD, PROB, Z_LOSS, RoutedMlp
from lm.models.parametrization import Init
from tests.conftest import needs_libtpu
from lm.ops import moe
from tests.ops.test_moe import clamped_swiglu, loop_over_experts

BATCH, LENGTH, D = 2, 7, 16


def layer(activation='swiglu', use_bias=False, **moe_fields):
  cfg = ModelConfig(d_model=D, d_ff=24, activation=activation, use_bias=use_bias,
                    swiglu_limit=0.5 if activation == 'clamped_swiglu' else 7.0,
                    moe=MoeConfig(num_experts=4, experts_per_token=2, expert_d_ff=12, **moe_fields))
  return RoutedMlp(cfg, Init(cfg))


def reference(params, x, m, activation):
  """The routed experts by the float64 loop, from the layer's own params (unboxed), plus the shared MLP."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  tokens = np.asarray(x, np.float64).reshape(-1, D)
  logits = tokens @ p['router'] + p.get('router_logit_bias', 0)
  r = moe.route(jnp.asarray(logits), m.experts_per_token, m.router, m.normalize, m.routed_scale)
  gated = activation != 'gelu'
  act = {'swiglu': moe.gated(jax.nn.silu), 'clamped_swiglu': clamped_swiglu(0.5),
         'gelu': lambda h: jax.nn.gelu(h, approximate=False)}[activation]
  up = 'wi_1' if gated else 'wi'
  bias = moe.Biases(p[f'{up}_bias'], p['wo_bias'], p.get('wi_0_bias')) if 'wo_bias' in p else None
  with jax.enable_x64(True):
    y = loop_over_experts(jnp.asarray(tokens), np.asarray(r.experts), jnp.asarray(r.weights, jnp.float64),
                          p[up], p['wo'], p['wi_0'] if gated else None, act, bias)
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
  ('clamped_swiglu', {'use_bias': True}), ('gelu', {'use_bias': True, 'compute': 'capacity', 'capacity_factor': 2.0}),  # GPT-OSS's
])
@pytest.mark.variants
def test_the_layer_is_the_loop_over_its_own_params(activation, fields):
  """With model.use_bias the router and each expert's projections have biases (set at random here, not zero)."""
  x = jax.random.normal(jax.random.key(0), (BATCH, LENGTH, D))
  module = layer(activation, **fields)
  params = jax.tree.map(np.asarray, nn.unbox(module.init(jax.random.key(1), x)['params']))
  rng = np.random.default_rng(2)
  params = {k: rng.normal(size=v.shape).astype(np.float32) if k.endswith('bias') else v for k, v in params.items()}
  assert fields.get('use_bias', False) == ('wo_bias' in params and 'router_logit_bias' in params)
  y = module.apply({'params': params}, x)
  np.testing.assert_allclose(y, reference(params, x, module.cfg.moe, activation), rtol=2e-5, atol=2e-6)
  assert params['wo'].shape == (4, 12, D) and params['router'].shape == (D, 4)


def test_the_sown_statistics_leave_padding_out_and_capacity_sows_its_drop_rate():
  x = jax.random.normal(jax.random.key(2), (BATCH, LENGTH, D))
  mask = jnp.ones((BATCH, LENGTH)).at[1, 3:].set(0)
  module = layer(compute='capacity', capacity_factor=0.5)
  params = module.init(jax.random.key(3), x)['params']
  _, sown = module.apply({'params': params}, x, mask, mutable=['intermediates'])
  sown = sown['intermediates']
  kept = np.asarray(mask).reshape(-1) > 0
  logits = np.asarray(x).reshape(-1, D)[kept] @ np.asarray(nn.unbox(params)['router'])
  r = moe.route(jnp.asarray(logits), 2)
  for got, want in zip((sown[LOAD][0], sown[PROB][0]), moe.expert_load(r.probs, r.experts), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(sown[Z_LOSS][0], moe.router_z_loss(jnp.asarray(logits)), rtol=1e-5)
  assert 0 < float(sown[DROPPED][0]) < 1


def test_capacity_fills_each_sequences_own_slots():
  """GShard's groups: at a factor that drops choices, each row's output (and drop rate) is the row's alone, and
  the first row's slots are those `moe.capacity` gives its tokens."""
  x = jax.random.normal(jax.random.key(4), (BATCH, LENGTH, D))
  module = layer(compute='capacity', capacity_factor=0.5)
  params = module.init(jax.random.key(5), x)['params']
  y, sown = module.apply({'params': params}, x, mutable=['intermediates'])
  alone = [module.apply({'params': params}, x[i:i + 1], mutable=['intermediates']) for i in range(BATCH)]
  for i, (row, row_sown) in enumerate(alone):
    np.testing.assert_allclose(y[i], row[0], rtol=1e-6, atol=1e-6)
  dropped = [float(row_sown['intermediates'][DROPPED][0]) for _, row_sown in alone]
  assert float(sown['intermediates'][DROPPED][0]) == pytest.approx(np.mean(dropped)) and min(dropped) > 0
  p = nn.unbox(params)
  r = moe.route(x[0] @ p['router'], 2)
  want, _ = moe.capacity(x[0], r, p['wi_1'], p['wo'], p['wi_0'], moe.gated(jax.nn.silu), 0.5)
  np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-6)


def test_a_moe_config_round_trips_through_its_dict():
  cfg = dataclasses.replace(ModelConfig(), family='llama', position='rotary', moe=MoeConfig(num_experts=8, every=2),
                            execution=ExecutionConfig(scan_layers=False))
  values = Config(model=cfg).to_dict()
  assert values['model']['moe']['every'] == 2
  assert from_dict(values).model == cfg
  with pytest.raises(ConfigError, match='the gpt family builds no routed experts'):
    from_dict({**values, 'model': {**values['model'], 'family': 'gpt', 'position': 'learned'}})
  bad = {'experts_per_token': (9, r'experts_per_token=9 must lie in \[1, model.moe.num_experts=8\]'),
         'router': ('softplus', 'model.moe.router'),
         'bias_rate': (-0.001, 'routed_scale and expert_buffer must be >= 0'),
         'expert_buffer': (-1.0, 'routed_scale and expert_buffer must be >= 0'),
         'compute': ('capacity', r'capacity_factor=0.0 must be > 0')}
  for field, (value, message) in bad.items():
    extra = {'capacity_factor': 0} if field == 'compute' else {}
    with pytest.raises(ConfigError, match=message):
      from_dict({**values, 'model': {**values['model'], 'moe': {**values['model']['moe'], field: value, **extra}}})


MOE = ['model.family=llama', 'model.position=rotary', 'model.norm=rmsnorm', 'model.activation=swiglu',
       'model.use_bias=false', 'model.moe.num_experts=4', 'model.moe.experts_per_token=2', 'model.moe.expert_d_ff=48']


@pytest.mark.long(0.5)
@pytest.mark.parametrize('pattern', [[], ['model.num_layers=4', 'model.moe.first_dense=1',
                                          'model.moe.dense_layers=[3]']])
def test_a_scanned_routed_stack_equals_the_unrolled_one(small_config, pattern):
  """Logits and each auxiliary term of a scanned stack of routed layers equal the unrolled stack's on its params
  (relaid out), with padding in the batch; the balance loss is the float64 mean of each layer's from what it sowed.
  Dense layers among routed ones scan in runs of their own (dense 0, routed 1-2, dense 3)."""
  from lm.models import build_model, get_family, init_params
  from lm.models.moe import aux_losses
  from lm.models.transformer import relayout
  config = small_config(*MOE, 'model.moe.z_loss=0.001', *pattern)
  family = get_family('llama')
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 200)
  batch = {'inputs': tokens, 'segment_ids': jnp.ones((2, 32), jnp.int32).at[1, 20:].set(0)}
  outputs = {}
  for scanned in (True, False):
    model = build_model(config.model.with_execution(scan_layers=scanned))
    params = nn.unbox(init_params(build_model(config.model), jax.random.key(1), 32))
    if pattern:  # three runs, each scanned on its own
      assert {k for k in params['decoder'] if 'layers' in k} == {'layers_from_0', 'layers_from_1', 'layers_from_3'}
    params = relayout(params, scanned)
    out = family.apply(model, params, batch, deterministic=True, rngs={})
    outputs[scanned] = out['logits'].logits(), out['aux_terms'], out['aux_loss']
    _, sown = model.apply({'params': params}, tokens, segment_ids=batch['segment_ids'], mutable=['intermediates'])
    flat = {'/'.join(k): np.asarray(v[0], np.float64) for k, v in
            flatten_dict(sown['intermediates']).items()}
    load = [v for k, v in sorted(flat.items()) if k.endswith('moe_load')]
    prob = [v for k, v in sorted(flat.items()) if k.endswith('moe_prob')]
    f, p = np.concatenate(load).reshape(-1, 4), np.concatenate(prob).reshape(-1, 4)
    np.testing.assert_allclose(out['aux_terms']['moe/balance_loss'], 4 * np.mean((f * p).sum(-1)), rtol=1e-6)
    assert aux_losses(sown['intermediates'], config.model.moe)[0] == pytest.approx(float(out['aux_loss']))
  for got, want in zip(jax.tree.leaves(outputs[True]), jax.tree.leaves(outputs[False]), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.long(0.6)
def test_the_logged_loss_leaves_the_auxiliary_losses_out_and_microbatches_add_up(small_config):
  """One step: the logged token loss is the same with and without a balance weight (the aux term changes the
  gradients only), the terms are logged apart; with the aux weights at 0, two microbatches give one batch's update."""
  from lm.jobs.pretraining import Pretraining
  from tests.train.test_step import assert_same_update, one_update
  first = lambda *o: Pretraining(small_config(*MOE, *o), jax.devices()[:1])
  weighted, plain = first('model.moe.balance_loss=0.5'), first('model.moe.balance_loss=0')
  metrics = [t.train_step(t.init_state(), next(t.train_batches))[1] for t in (weighted, plain)]
  assert float(metrics[0]['loss']) == pytest.approx(float(metrics[1]['loss']), rel=1e-6)
  assert float(metrics[0]['grad_norm']) != pytest.approx(float(metrics[1]['grad_norm']), rel=1e-3)
  assert 1.5 < float(metrics[0]['moe/balance_loss']) < 4 and float(metrics[0]['moe/z_loss']) > 0
  # with the selection biases moved by the counts of both microbatches together
  aux_free = ('model.moe.balance_loss=0', 'model.moe.bias_rate=0.01')
  assert_same_update(one_update(first(*aux_free, 'train.microbatches=2')), one_update(first(*aux_free)))


def test_active_params_and_flops_are_a_dense_model_of_the_chosen_width_plus_the_router():
  """moe_tiny's k = 2 experts of width 176 run what a dense MLP of width 352 runs: its active params and FLOPs per
  token are the dense twin's plus the routers' (d_model x E per layer)."""
  from lm.assembly.accounting import count_params, flops_per_token
  from lm.models import abstract_params, build_model
  moe_cfg = load_config('moe_tiny').model
  dense_cfg = dataclasses.replace(moe_cfg, moe=MoeConfig(), d_ff=2 * moe_cfg.moe.expert_d_ff)
  sized = lambda cfg: (count_params(p := abstract_params(build_model(cfg)), cfg), flops_per_token(p, cfg, 128))
  (moe_counts, moe_flops), (dense_counts, dense_flops) = sized(moe_cfg), sized(dense_cfg)
  router = moe_cfg.num_layers * moe_cfg.d_model * moe_cfg.moe.num_experts
  assert moe_counts['active'] == dense_counts['total'] + router
  assert moe_counts['active_non_embedding'] == dense_counts['non_embedding'] + router
  assert moe_counts['total'] - moe_counts['active'] == 6 * 4 * 3 * 128 * 176  # 6 of 8 experts idle, 3 kernels each
  assert moe_flops == pytest.approx(dense_flops + 6 * router, rel=1e-12)
  assert 'active' not in dense_counts


@pytest.mark.parametrize('mesh', [['mesh.expert=8', 'mesh.data=1'],
                                  ['mesh.expert=2', 'mesh.fsdp=2', 'mesh.tensor=2', 'mesh.data=1'],
                                  ['mesh.data=2', 'mesh.expert=4']])
@pytest.mark.long(0.3)
def test_an_expert_mesh_gives_one_devices_update(small_config, mesh):
  """With the experts split over the `expert` axis (and the batch and the other params over it and the rest), one
  step's loss, gradient norm and update (the selection biases' too: counts over every data shard) equal one
  device's; expert kernels lead with the expert axis, the non-expert params shard over it as over fsdp."""
  from lm.jobs.pretraining import Pretraining
  from tests.train.test_step import assert_same_update, one_update
  moe = [*MOE, 'model.moe.z_loss=0.001', 'model.moe.num_experts=8', 'model.moe.bias_rate=0.01']
  one = one_update(Pretraining(small_config(*moe), jax.devices()[:1]))
  sharded = Pretraining(small_config(*moe, *mesh), jax.devices())
  specs = {'/'.join(str(getattr(k, 'key', k)) for k in path): leaf.sharding.spec
           for path, leaf in jax.tree_util.tree_flatten_with_path(sharded.init_state().params)[0]}
  expert = int(mesh[0].split('=')[1]) if 'expert' in mesh[0] else 4
  assert specs['decoder/layers/mlp/wi_0'][1] == 'expert'  # [layers, experts, embed, mlp]
  assert 'expert' in str(specs['decoder/layers/attention/query/kernel'][1]) and expert > 1
  assert_same_update(one_update(sharded), one)


def test_an_expert_count_the_axis_cannot_divide_names_the_field(small_config):
  from lm.jobs.pretraining import Pretraining
  with pytest.raises(ConfigError, match=r'model.moe.num_experts=4 is not divisible by mesh.expert=8'):
    Pretraining(small_config(*MOE, 'mesh.expert=8', 'mesh.data=1'), jax.devices()).init_state()


@pytest.mark.long(0.5)
def test_the_selection_bias_moves_against_the_load_outside_the_optimizer_and_is_checkpointed(small_config, tmp_path):
  """Aux-loss-free balancing: after a step each layer's `router_bias` moved by rate * sign(mean - count) of the
  expert counts the step's batch routed (float64 NumPy on the counts the forward pass sows; padding left out); no
  optimizer state holds it, the EMA view carries it as it is, and a checkpoint restores it."""
  from lm.jobs.pretraining import Pretraining
  from lm.models.family import EXPERT_COUNTS
  from lm.storage.checkpoint import Checkpointer
  rate = 0.01
  trainer = Pretraining(small_config(*MOE, f'model.moe.bias_rate={rate}', 'train.ema_decay=0.9',
                                     'train.steps=2'), jax.devices()[:1])
  a, state = trainer.assembly, trainer.init_state()
  batch = next(trainer.train_batches)
  counts = a.family.apply(a.model, state.params, batch, deterministic=True, rngs={})[EXPERT_COUNTS]
  counts = np.asarray(counts['decoder']['layers']['mlp']['router_bias'], np.float64)  # [layers, experts]
  assert counts.shape == (2, 4) and np.allclose(counts.sum(-1), 2 * np.asarray(batch['weights']).size, rtol=0.1)
  bias = lambda params: np.asarray(params['decoder']['layers']['mlp']['router_bias'])
  assert not bias(state.params).any()
  state, metrics = trainer.train_step(state, batch)
  np.testing.assert_array_equal(bias(state.params), (rate * np.sign(counts.mean(-1, keepdims=True) - counts)
                                                     ).astype(np.float32))
  assert float(metrics['moe/max_load']) == pytest.approx((counts.max(-1) * 4 / counts.sum(-1)).mean(), rel=1e-5)
  held = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]]
  assert held and not [path for path in held if 'router_bias' in path]
  np.testing.assert_array_equal(bias(a.params_of(state, 'ema')), bias(state.params))
  state, _ = trainer.train_step(state, next(trainer.train_batches))
  checkpoints = Checkpointer(tmp_path, async_save=False)
  checkpoints.save(2, state, trainer.train_batches.iterator, a.config.to_dict())
  restored = checkpoints.restore(2, a.abstract_state, a.config.to_dict(), trainer.train_batches.iterator)
  assert np.abs(bias(state.params)).max() > rate
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))


@pytest.mark.long(0.5)
def test_the_selection_bias_evens_out_the_load_while_the_loss_falls(small_config, tmp_path):
  """60 steps of a 2-layer MoE (8 experts, k = 2) on the embedded corpus without a balance loss: its load grows
  lopsided early (the busiest expert gets ~3.5x an even share); with bias_rate 0.01 the imbalance of the last 20
  steps falls well below the first 20's and below the unbalanced run's, while the loss falls as much."""
  from lm.jobs.pretraining import Pretraining
  curves = {}
  for rate in (0.0, 0.01):
    config = small_config(*MOE, 'model.moe.num_experts=8', 'model.moe.balance_loss=0', f'model.moe.bias_rate={rate}',
                          'train.steps=60', f'train.run_dir={tmp_path}/{rate}')
    records = [r for r in Pretraining(config, jax.devices()[:1]).run() if 'loss' in r]
    curves[rate] = [np.mean([r[name] for r in part]) for name in ('loss', 'moe/max_load')
                    for part in (records[:20], records[-20:])]
  (loss_start, loss_end, load_start, load_end), (_, plain_loss_end, _, plain_load_end) = curves[0.01], curves[0.0]
  assert loss_end < loss_start - 1 and loss_end < plain_loss_end + 0.1
  assert load_end < load_start - 0.4 and load_end < plain_load_end - 0.4


@needs_libtpu
def test_the_tpu_step_moves_tokens_by_ragged_all_to_all():
  """moe_tiny's train step for a v5p-8 with its 4 chips on the expert axis: each routed layer's dispatch and
  return, forward and backward, lower to ragged all-to-alls (the CPU runs their all-gather stand-in) and the
  grouped matmuls to megablox gmm."""
  from lm.assembly import assemble
  from lm.parallel.chips import physical_topology, topology_devices
  from lm.train.step import lower_train_step
  config = load_config('moe_tiny', ['mesh.data=1', 'mesh.expert=4'])
  text = lower_train_step(assemble(config, topology_devices(physical_topology('v5p-8')))).as_text()
  assert text.count('ragged_all_to_all') >= 4  # dispatch and return, forward and backward
  assert 'all_gather' in text and 'gmm' in text
