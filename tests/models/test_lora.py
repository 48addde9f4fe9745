"""Low-rank adapters (`model.lora`): an adapted projection against float64 NumPy, a fresh adapter leaving the model
as it was, training that moves the adapters alone and keeps optimizer state of nothing else, and bad targets."""
import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from lm.config import ConfigError, LoraConfig, load_config
from lm.jobs.pretraining import Pretraining
from lm.models import build_model, get_family
from lm.models.layers import KERNEL_SCALE, DenseGeneral
from lm.models.lora import ADAPTERS, merged
from lm.models.transformer import unstack_layers
from lm.storage.checkpoint import Checkpointer
from lm.storage.convert.hf import save_hf
from tests.conftest import SMALL


@pytest.mark.parametrize('rslora', [False, True])
def test_an_adapted_projection_adds_its_scaled_low_rank_update(rslora):
  """A query-shaped projection ([embed] -> [heads, head_dim]) and an attention-output-shaped one ([heads, head_dim]
  -> [embed]), with B moved off its zeros: x W + b + s (x A) B, s = alpha / rank (rsLoRA: alpha / sqrt(rank))."""
  lora = LoraConfig(rank=3, alpha=6.0, targets=('query', 'out'), rslora=rslora)
  rng = np.random.default_rng(0)
  for features, axis, x in (((2, 4), -1, rng.normal(size=(2, 5, 8))), (8, (-2, -1), rng.normal(size=(2, 5, 2, 4)))):
    name = 'query' if axis == -1 else 'out'
    layer = DenseGeneral(features, ('embed', 'heads', 'kv')[:1 + len(np.atleast_1d(features))], axis=axis,
                         use_bias=True, lora=lora, name=name)
    params = nn.unbox(layer.init(jax.random.key(0), jnp.asarray(x, jnp.float32))['params'])
    assert not np.any(params['lora_b']) and np.abs(params['lora_a']).max() <= (x.shape[-1] * (x.ndim - 2)) ** -0.5
    params = {**params, 'lora_b': jnp.asarray(rng.normal(size=params['lora_b'].shape), jnp.float32),
              'bias': jnp.asarray(rng.normal(size=params['bias'].shape), jnp.float32)}
    got = layer.apply({'params': params}, jnp.asarray(x, jnp.float32))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n_in = 1 if axis == -1 else 2
    flat = x.reshape(*x.shape[:x.ndim - n_in], -1)
    kernel = p['kernel'].reshape(flat.shape[-1], -1)
    a, b = p['lora_a'].reshape(flat.shape[-1], -1), p['lora_b'].reshape(3, -1)
    scale = 6.0 / (np.sqrt(3) if rslora else 3)
    want = (flat @ kernel + p['bias'].reshape(-1) + scale * (flat @ a) @ b).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def small_lora(*extra):
  return load_config('llama_tiny', SMALL + ['model.lora.rank=4', 'model.lora.targets=[query,value,wi_0,wo]',
                                            *extra])


def test_fresh_adapters_leave_the_model_as_it_was():
  cfg = small_lora().model
  family, model = get_family(cfg.family), build_model(cfg)
  params = nn.unbox(family.init(model, jax.random.key(0), 16))
  flat = traverse_util.flatten_dict(params)
  assert {p[-2] for p in flat if p[-1] == 'lora_a'} == {'query', 'value', 'wi_0', 'wo'}
  base = traverse_util.unflatten_dict({p: v for p, v in flat.items() if p[-1] not in ADAPTERS})
  plain = build_model(cfg.__class__(**{**cfg.__dict__, 'lora': LoraConfig()}))
  tokens = jnp.arange(32).reshape(2, 16) % cfg.vocab_size
  np.testing.assert_array_equal(model.apply({'params': params}, tokens), plain.apply({'params': base}, tokens))


def test_training_moves_the_adapters_alone_and_keeps_state_of_nothing_else(tmp_path):
  """From an HF checkpoint without adapters (`train.init_from`): they start fresh, the base as the checkpoint holds
  it; ten steps later the base is bit for bit the checkpoint's and the optimizer holds moments of the adapters
  alone."""
  plain = load_config('llama_tiny', SMALL).model
  source = nn.unbox(get_family(plain.family).init(build_model(plain), jax.random.key(1), 16))
  save_hf(plain, source, tmp_path / 'hf')
  config = small_lora(f'train.run_dir={tmp_path / "run"}', 'train.steps=10', 'optim.learning_rate=1e-2',
                      f'train.init_from={tmp_path / "hf"}')
  trainer = Pretraining(config, jax.devices()[:1])
  state = trainer._start()  # what `lm train` starts from
  start = jax.tree.map(np.asarray, state.params)
  for path, value in traverse_util.flatten_dict(source).items():
    np.testing.assert_array_equal(traverse_util.flatten_dict(start)[path], value, err_msg=str(path))
  losses = []
  for _ in range(10):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    losses.append(float(metrics['loss']))
  assert losses[-1] < losses[0] - 0.3
  before, after = traverse_util.flatten_dict(start), traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
  adapters = {p for p in before if p[-1] in ADAPTERS}
  for path in before:
    if path in adapters:
      assert not np.array_equal(before[path], after[path]), path  # B from zero, A by B's gradient
    else:
      np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))  # bit for bit
  held = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)  # Adam's two moments
  assert held == 2 * sum(before[p].size for p in adapters)
  # A checkpoint stores the adapters alone (the base once, where it is) and reads back the params as they were.
  saver = Checkpointer(tmp_path / 'saved', async_save=False)
  saver.save_params(10, state.params, config.to_dict(), over_base=True)
  stored = ocp.PyTreeCheckpointer().metadata(tmp_path / 'saved' / '10' / 'params').item_metadata
  assert {p for p, leaf in traverse_util.flatten_dict(dict(stored)).items() if leaf is not None} == adapters
  restored = traverse_util.flatten_dict(saver.restore_params(10, trainer.assembly.abstract_params))
  assert restored.keys() == after.keys()
  for path, value in after.items():
    np.testing.assert_array_equal(restored[path], value, err_msg=str(path))


@pytest.mark.long(0.2)
def test_an_int8_base_is_stored_quantized_once_and_trains_its_adapters(tmp_path):
  """QLoRA's way (model.quantization=int8 with adapters): the HF base's projections load as int8 values and
  per-output-channel scales (against a float64 NumPy quantization), a quarter of their float32 bytes; the first
  loss is the plain model's under int8 matmuls; five steps move the adapters alone; a checkpoint stores the adapters
  and reads the same int8 base back from the source; the merged kernel is values x scales + (alpha / rank) A B."""
  plain = load_config('llama_tiny', SMALL).model
  source = nn.unbox(get_family(plain.family).init(build_model(plain), jax.random.key(1), 16))
  save_hf(plain, source, tmp_path / 'hf')
  common = ['train.steps=5', 'optim.learning_rate=1e-2', f'train.init_from={tmp_path / "hf"}',
            'model.quantization=int8']
  config = small_lora(f'train.run_dir={tmp_path / "q"}', *common)
  trainer = Pretraining(config, jax.devices()[:1])
  state = trainer._start()
  start = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
  quantized = 0
  for path, kernel in traverse_util.flatten_dict(jax.tree.map(np.asarray, source)).items():
    if (*path[:-1], KERNEL_SCALE) not in start:
      np.testing.assert_array_equal(start[path], kernel, err_msg=str(path))
      continue
    quantized += 1
    values, scales = start[path], start[(*path[:-1], KERNEL_SCALE)]
    contracted = tuple(i for i, n in enumerate(scales.shape) if n == 1 and kernel.shape[i] != 1)
    reference = np.abs(kernel.astype(np.float64)).max(axis=contracted, keepdims=True) / 127
    np.testing.assert_allclose(scales, reference, rtol=1e-6)
    assert values.dtype == np.int8 and values.nbytes * 4 == kernel.nbytes
    assert np.abs(values - np.round(kernel / reference)).max() <= 1  # float32 rounding ties aside
    assert np.mean(values == np.round(kernel / reference)) > 0.999
  assert quantized == 7  # query, key, value, out and the gated MLP's three (the layers stacked)

  base = Pretraining(load_config('llama_tiny', [*SMALL, *common, f'train.run_dir={tmp_path / "b"}']),
                     jax.devices()[:1])
  first = float(base.train_step(base._start(), next(base.train_batches))[1]['loss'])
  losses = []
  for _ in range(5):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    losses.append(float(metrics['loss']))
  assert losses[0] == pytest.approx(first, rel=1e-6) and losses[-1] < losses[0] - 0.05
  after = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
  for path, value in start.items():
    if path[-1] not in ADAPTERS:
      np.testing.assert_array_equal(after[path], value, err_msg=str(path))  # int8 values and scales unmoved

  saver = Checkpointer(tmp_path / 'saved', async_save=False)
  saver.save_params(5, state.params, config.to_dict(), over_base=True)
  restored = traverse_util.flatten_dict(saver.restore_params(5, trainer.assembly.abstract_params))
  for path, value in after.items():
    np.testing.assert_array_equal(restored[path], value, err_msg=str(path))
  folded = traverse_util.flatten_dict(merged(unstack_layers(state.params), config.model.lora))  # as exported
  query = ('decoder', 'layers', 'attention', 'query')
  a, b = after[(*query, 'lora_a')].astype(np.float64), after[(*query, 'lora_b')].astype(np.float64)
  expected = after[(*query, 'kernel')] * after[(*query, KERNEL_SCALE)].astype(np.float64) + \
    config.model.lora.scale * np.einsum('lir,lrhd->lihd', a, b)
  for layer in range(plain.num_layers):
    np.testing.assert_allclose(folded[('decoder', f'layers_{layer}', *query[2:], 'kernel')], expected[layer],
                               rtol=1e-5, atol=1e-7)
  assert not any(path[-1] == KERNEL_SCALE for path in folded)


@pytest.mark.long(0.4)
def test_expert_adapters_join_each_expert_kernel_and_train_alone(tmp_path):
  """`experts` adapts every routed expert's kernels (and `wo` the shared MLP's): the model equals the plain one on
  kernels merged as a float64 NumPy einsum gives them; three steps move the adapters alone; a PEFT export of them for
  an architecture without routed experts (Llama's), and dropout on them, are one line."""
  from lm.storage.convert.peft import save_peft
  moe = ['model.d_model=64', 'model.num_heads=4', 'model.num_kv_heads=2', 'model.d_ff=128',
         'model.moe.expert_d_ff=32', 'model.moe.num_experts=4', 'model.moe.shared_experts=1']
  config = load_config('moe_tiny', SMALL + moe + ['model.lora.rank=2', 'model.lora.targets=[experts,wo]',
                                                  f'train.run_dir={tmp_path}', 'train.steps=3',
                                                  'optim.learning_rate=1e-2'])
  cfg, family = config.model, get_family(config.model.family)
  params = nn.unbox(family.init(build_model(cfg), jax.random.key(0), 16))
  flat = traverse_util.flatten_dict(params)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  flat = {p: 0.3 * jax.random.normal(next(keys), v.shape) if p[-1] == 'lora_b' else v for p, v in flat.items()}
  params = traverse_util.unflatten_dict(flat)
  experts = [p for p in flat if p[-2].endswith('_lora') and p[-1] == 'lora_a']
  assert {p[-2] for p in experts} == {'wi_0_lora', 'wi_1_lora', 'wo_lora'}
  assert any(p[-3:] == ('shared', 'wo', 'lora_a') for p in flat)
  merged = {p: np.asarray(v, np.float64) for p, v in flat.items() if p[-1] not in ADAPTERS}
  for path in experts:
    a, b = (np.asarray(flat[(*path[:-1], k)], np.float64) for k in ADAPTERS)
    kernel = (*path[:-2], path[-2].removesuffix('_lora'))
    merged[kernel] = merged[kernel] + cfg.lora.scale * np.einsum('...ir,...ro->...io', a, b)  # per layer, expert
  for path in [p for p in flat if p[-1] == 'lora_a' and not p[-2].endswith('_lora')]:  # the shared MLP's wo
    a, b = (np.asarray(flat[(*path[:-1], k)], np.float64) for k in ADAPTERS)
    merged[(*path[:-1], 'kernel')] = merged[(*path[:-1], 'kernel')] + cfg.lora.scale * a @ b
  plain = cfg.__class__(**{**cfg.__dict__, 'lora': LoraConfig()})
  batch = {'inputs': jnp.arange(32).reshape(2, 16) % 200}
  run = lambda c, p: np.asarray(family.apply(build_model(c), p, batch, deterministic=True, rngs={})['logits'].logits())
  reference = run(plain, traverse_util.unflatten_dict({p: jnp.asarray(v, jnp.float32) for p, v in merged.items()}))
  np.testing.assert_allclose(run(cfg, params), reference, rtol=1e-5, atol=1e-5)

  trainer = Pretraining(config, jax.devices()[:1])
  state = trainer.init_state()
  start = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
  for _ in range(3):
    state, _ = trainer.train_step(state, next(trainer.train_batches))
  after = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params))
  for path in start:
    if path[-1] == 'lora_b':
      assert not np.array_equal(start[path], after[path]), path
    elif path[-1] not in ADAPTERS and path[-1] != 'router_bias':
      np.testing.assert_array_equal(start[path], after[path], err_msg=str(path))
  with pytest.raises(ConfigError, match=r"LlamaForCausalLM has no routed experts to take the experts' adapters "):
    save_peft(cfg, params, tmp_path / 'peft')
  with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 drops out the adapters' input"):
    from lm.assembly import assemble
    assemble(load_config('moe_tiny', SMALL + moe + ['model.lora.rank=2', 'model.lora.targets=[experts]',
                                                    'model.lora.dropout=0.1']), jax.devices()[:1])


@pytest.mark.parametrize('overrides, says', [
  (['model.lora.targets=[q_proj]'], r"model.lora.targets \['q_proj'\] name no projection of this model; its "
                                    r'projections: key, out, query, value, wi_0, wi_1, wo'),
  (['model.lora.rank=100'], r'model.lora.rank=100 is above the width of .* \(64\); use a rank of at most 64'),
  (['model.lora.rank=0', 'model.lora.alpha=16'], r'model.lora fields are set but model.lora.rank=0'),
  (['optim.lr_multipliers=[lora_b=2,embed=0.1]'],
   r"optim.lr_multipliers entry 'embed=0.1' matches only params model.lora freezes"),
])
def test_bad_adapters_are_one_line(overrides, says, tmp_path):
  from lm.assembly import assemble
  with pytest.raises(ConfigError, match=says) as e:
    assemble(small_lora(f'train.run_dir={tmp_path}', *overrides), jax.devices()[:1])
  assert '\n' not in str(e.value)


def test_the_hf_export_folds_the_adapters_into_their_kernels(tmp_path):
  """`--to-hf` writes the merged model: W + (alpha / rank) A B, whose logits equal the adapted model's."""
  cfg = small_lora('model.lora.rslora=true').model
  model = build_model(cfg)
  params = nn.unbox(get_family(cfg.family).init(model, jax.random.key(0), 16))
  flat = traverse_util.flatten_dict(params)
  keys = iter(jax.random.split(jax.random.key(1), len(flat)))
  params = traverse_util.unflatten_dict({p: 0.1 * jax.random.normal(next(keys), v.shape) if p[-1] == 'lora_b' else v
                                         for p, v in flat.items()})
  save_hf(cfg, params, tmp_path / 'hf')
  from lm.storage.convert.hf import load_hf
  plain, loaded = load_hf(tmp_path / 'hf')
  assert not plain.cfg.lora.rank
  tokens = jnp.arange(32).reshape(2, 16) % cfg.vocab_size
  ours = model.apply({'params': params}, tokens)
  bare = build_model(cfg.__class__(**{**cfg.__dict__, 'lora': LoraConfig()}))
  base = traverse_util.unflatten_dict({p: v for p, v in traverse_util.flatten_dict(params).items()
                                       if p[-1] not in ADAPTERS})
  assert float(jnp.abs(bare.apply({'params': base}, tokens) - ours).max()) > 1e-3  # the adapters act
  np.testing.assert_allclose(plain.apply({'params': loaded}, tokens), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.long(0.4)
@pytest.mark.parametrize('architecture', ['mixtral', 'gpt_oss'])
def test_the_experts_adapters_load_in_peft_as_its_target_parameters_with_the_same_logits(architecture, tmp_path):
  """A random HF Mixtral or GPT-OSS imported, adapters on every routed expert (and the queries) moved off their
  init, written with `save_peft`: PEFT puts them on transformers' fused expert parameters (gate_up_proj at 2 x rank,
  B block-diagonal, or interleaved for GPT-OSS; down_proj) and gives lm's logits. (Qwen2/3-MoE, OLMoE and
  DeepSeek-V3 hold their experts as Mixtral does.)"""
  import peft
  import torch
  import transformers
  from lm.storage.convert.hf import load_hf
  from lm.storage.convert.peft import save_peft
  torch.manual_seed(0)
  shape = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, max_position_embeddings=32)
  hf = {'mixtral': lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, intermediate_size=24, num_local_experts=4)),
        'gpt_oss': lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
          **shape, intermediate_size=24, num_local_experts=4, head_dim=8, sliding_window=8,
          layer_types=['sliding_attention', 'full_attention']))}[architecture]().eval()
  hf.save_pretrained(tmp_path / 'hf')
  model, base = load_hf(tmp_path / 'hf')
  cfg = model.cfg.__class__(**{**model.cfg.__dict__, 'lora': LoraConfig(rank=2, targets=('experts', 'query'))})
  adapted, family = build_model(cfg), get_family(cfg.family)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  flat = {p: 0.3 * jax.random.normal(next(keys), v.shape) if p[-1] == 'lora_b' else v
          for p, v in traverse_util.flatten_dict(nn.unbox(family.init(adapted, jax.random.key(0), 8))).items()
          if p[-1] in ADAPTERS}
  assert {p[-2] for p in flat} == {'query', 'wi_0_lora', 'wi_1_lora', 'wo_lora'}
  params = traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **flat})
  save_peft(cfg, params, tmp_path / 'adapter', base_model=str(tmp_path / 'hf'))
  written = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert written['target_parameters'] == ['experts.gate_up_proj', 'experts.down_proj']
  assert written['rank_pattern'] == {f'model.layers.{i}.mlp.experts.gate_up_proj': 4 for i in range(2)}
  tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
  batch = {'inputs': jnp.asarray(tokens), 'segment_ids': jnp.ones(tokens.shape, jnp.int32)}
  ours = np.asarray(family.apply(adapted, params, batch, deterministic=True, rngs={})['logits'].logits())
  with torch.no_grad():
    plain = hf(torch.as_tensor(tokens)).logits.numpy()
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / 'adapter').eval()(torch.as_tensor(tokens)).logits.numpy()
  assert np.abs(plain - theirs).max() > 1e-2  # the adapters act
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('architecture', ['bert', 'llama'])
@pytest.mark.variants
def test_a_fine_tunes_task_head_goes_into_peft_as_modules_to_save(architecture, tmp_path):
  """A GLUE-style fine-tune of a random HF BERT or Llama (3 labels; adapters and a trained head): `save_peft` writes a
  SEQ_CLS adapter whose modules_to_save are the head (BERT's pooler and classifier, a decoder's score); PEFT loads it
  onto AutoModelForSequenceClassification of the base with lm's scores."""
  import peft
  import torch
  import transformers
  from lm.storage.convert.hf import load_hf
  from lm.storage.convert.peft import save_peft
  random_hf(architecture).save_pretrained(tmp_path / 'hf')
  model, base = load_hf(tmp_path / 'hf')
  cfg = model.cfg.__class__(**{**model.cfg.__dict__, 'num_labels': 3,
                               'lora': LoraConfig(rank=4, targets=('query', 'value'))})
  adapted, family = build_model(cfg), get_family(cfg.family)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  heads = family.per_sequence_params()
  flat = {p: 0.2 * jax.random.normal(next(keys), v.shape) if p[-1] in ('lora_b', 'bias') else v
          for p, v in traverse_util.flatten_dict(nn.unbox(family.init(adapted, jax.random.key(0), 8))).items()
          if p[-1] in ADAPTERS or p[0] in heads}
  params = traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **flat})
  save_peft(cfg, params, tmp_path / 'adapter', base_model=str(tmp_path / 'hf'))
  written = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert (written['task_type'], written['modules_to_save']) == ('SEQ_CLS', sorted(heads & {p[0] for p in flat}))
  tokens = np.random.default_rng(0).integers(1, 49, size=(2, 12))
  batch = {'inputs': jnp.asarray(tokens), 'segment_ids': jnp.ones(tokens.shape, jnp.int32),
           'token_types': jnp.zeros(tokens.shape, jnp.int32)}
  ours = np.asarray(family.task_head.apply(adapted, params, batch, deterministic=True, rngs={}))
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / 'hf', num_labels=3,
                                                                       pad_token_id=49)
  with torch.no_grad():
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / 'adapter').eval()(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


def random_hf(architecture: str):
  """A random transformers model: a Llama with grouped-query heads, or a BERT with its MLM head."""
  import torch
  import transformers
  torch.manual_seed(0)
  if architecture == 'llama':
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=32)).eval()
  return transformers.BertForMaskedLM(transformers.BertConfig(
    vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
    max_position_embeddings=32)).eval()


@pytest.mark.parametrize('architecture, targets', [('llama', ('query', 'key', 'value', 'out', 'wi_0', 'wo')),
                                                   ('bert', ('query', 'key', 'value', 'out', 'wi', 'wo'))])
@pytest.mark.variants
def test_a_peft_adapter_written_by_lm_loads_in_peft_with_the_same_logits(architecture, targets, tmp_path):
  """A random HF Llama (grouped-query heads) or BERT imported, adapters on attention and MLP projections moved off
  their init, written with `save_peft`: PEFT loads them onto transformers' model, adapting those modules alone (not
  BERT's MLM-head `dense`), and gives lm's logits; lm reads them back; the merged export gives them too."""
  import peft
  import torch
  from lm.storage.convert.hf import load_hf
  from lm.storage.convert.peft import load_peft, save_peft
  hf = random_hf(architecture)
  hf.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  model, base = load_hf(tmp_path / 'hf')
  cfg = model.cfg.__class__(**{**model.cfg.__dict__, 'lora': LoraConfig(rank=4, alpha=8.0, targets=targets,
                                                                         rslora=architecture == 'llama')})
  adapted, family = build_model(cfg), get_family(cfg.family)
  params = nn.unbox(family.init(adapted, jax.random.key(0), 8))
  keys = iter(jax.random.split(jax.random.key(1), 100))
  flat = {p: 0.2 * jax.random.normal(next(keys), v.shape) if p[-1] == 'lora_b' else v
          for p, v in traverse_util.flatten_dict(params).items() if p[-1] in ADAPTERS}
  params = traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **flat})
  save_peft(cfg, params, tmp_path / 'adapter', base_model=str(tmp_path / 'hf'))
  tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
  batch = {'inputs': jnp.asarray(tokens), 'segment_ids': jnp.ones(tokens.shape, jnp.int32)}
  logits = lambda model, p: np.asarray(family.apply(model, p, batch, deterministic=True, rngs={})['logits'].logits())
  ours = logits(adapted, params)
  with torch.no_grad():
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / 'adapter').eval()
    theirs = loaded(torch.as_tensor(tokens)).logits.numpy()
    plain = type(hf).from_pretrained(tmp_path / 'hf').eval()(torch.as_tensor(tokens)).logits
  assert sum('lora_A' in name for name, _ in loaded.named_parameters()) == len(targets) * 2
  assert np.abs(plain.numpy() - theirs).max() > 1e-3  # the adapters act
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits(*load_peft(tmp_path / 'adapter')), ours, rtol=1e-6, atol=1e-6)
  save_hf(cfg, params, tmp_path / 'merged')
  with torch.no_grad():
    merged = type(hf).from_pretrained(tmp_path / 'merged').eval()(torch.as_tensor(tokens)).logits
  np.testing.assert_allclose(merged.numpy(), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('architecture, targets, rslora', [
  ('gpt2', ('query', 'value', 'out', 'wo'), False), ('neox', ('query', 'key', 'value', 'out', 'wi'), True)])
@pytest.mark.variants
def test_adapters_of_a_fused_projection_load_in_peft_as_one_of_its_rank_times_parts(architecture, targets, rslora,
                                                                                    tmp_path):
  """GPT-2's c_attn (Conv1D) and GPT-NeoX's query_key_value (heads interleaved) hold query, key and value in one
  tensor: their adapters are written as one of rank parts x rank (rank_pattern, alpha_pattern keeping the scale),
  which PEFT loads onto transformers' model with lm's logits."""
  import peft
  import torch
  import transformers
  from lm.storage.convert.hf import load_hf
  from lm.storage.convert.peft import save_peft
  torch.manual_seed(0)
  hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4,
                                                            n_positions=32, bos_token_id=0, eos_token_id=0)) \
    if architecture == 'gpt2' else transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
      vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
      max_position_embeddings=32))
  hf.eval().save_pretrained(tmp_path / 'hf', safe_serialization=True)
  model, base = load_hf(tmp_path / 'hf')
  cfg = model.cfg.__class__(**{**model.cfg.__dict__, 'lora': LoraConfig(rank=3, alpha=8.0, targets=targets,
                                                                         rslora=rslora)})
  adapted, family = build_model(cfg), get_family(cfg.family)
  keys = iter(jax.random.split(jax.random.key(1), 100))
  flat = {p: 0.2 * jax.random.normal(next(keys), v.shape) if p[-1] == 'lora_b' else v for p, v in
          traverse_util.flatten_dict(nn.unbox(family.init(adapted, jax.random.key(0), 8))).items() if p[-1] in ADAPTERS}
  params = traverse_util.unflatten_dict({**traverse_util.flatten_dict(base), **flat})
  save_peft(cfg, params, tmp_path / 'adapter', base_model=str(tmp_path / 'hf'))
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  fused, parts = ('c_attn', 2) if architecture == 'gpt2' else ('query_key_value', 3)
  assert config['rank_pattern'] == {fused: 3 * parts}
  assert config['alpha_pattern'][fused] == pytest.approx(cfg.lora.scale * (3 * parts) ** (0.5 if rslora else 1))
  tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
  ours = np.asarray(family.apply(adapted, params, {'inputs': jnp.asarray(tokens)}, deterministic=True,
                                 rngs={})['logits'].logits())
  with torch.no_grad():
    theirs = peft.PeftModel.from_pretrained(type(hf).from_pretrained(tmp_path / 'hf'), tmp_path / 'adapter').eval()(
      torch.as_tensor(tokens)).logits.numpy()
  assert np.abs(hf(torch.as_tensor(tokens)).logits.detach().numpy() - theirs).max() > 1e-3  # the adapters act
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.long(0.5)
def test_a_killed_lora_run_resumes_as_the_straight_one_and_exports_its_adapters_to_peft(tmp_path, capsys):
  """`lm train` with adapters from an HF model, distilling from that model too (train.distill), straight and killed
  (-9) past its step-4 checkpoint then resumed: the same losses, distillation's included, and `lm convert --from RUN
  --to-peft DIR` writes the same adapters, PEFT's files naming the source as the base, which load onto it; a run
  without adapters is refused in one line."""
  import peft
  import transformers
  from lm import cli
  from lm.train.logging import read_metrics
  from tests.conftest import one_device_env
  from tests.train.test_faults import kill_past, without_timing
  plain = load_config('llama_tiny', SMALL).model
  save_hf(plain, nn.unbox(get_family(plain.family).init(build_model(plain), jax.random.key(1), 16)), tmp_path / 'hf')
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'llama_tiny', *SMALL, 'model.lora.rank=4',
           'train.steps=8', 'train.checkpoint.every=2', f'train.init_from={tmp_path / "hf"}',
           f'train.distill.teacher={tmp_path / "hf"}', 'train.distill.temperature=2']
  env = one_device_env()
  straight = subprocess.run(train + [f'train.run_dir={tmp_path}/straight'], env=env, capture_output=True,
                            timeout=600)
  assert straight.returncode == 0, straight.stderr[-2000:]
  run = tmp_path / 'killed'
  kill_past(train + [f'train.run_dir={run}'], run, 5, env)
  resumed = subprocess.run(train + [f'train.run_dir={run}', '--resume'], env=env, capture_output=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert without_timing(read_metrics(run)) == without_timing(read_metrics(tmp_path / 'straight'))
  assert all(r['distill_loss'] > 0 for r in read_metrics(run) if 'loss' in r)
  # The checkpoints store the adapters alone and name the base (stored once), which every restore reads again.
  stored = ocp.PyTreeCheckpointer().metadata(run / 'checkpoints' / '8' / 'params').item_metadata
  assert {path[-1] for path, leaf in traverse_util.flatten_dict(dict(stored)).items() if leaf is not None} == \
      set(ADAPTERS)
  assert json.loads((run / 'checkpoints' / '8' / 'base' / 'metadata').read_text()) == {
    'source': str(tmp_path / 'hf'), 'step': 0, 'view': 'model'}

  for name in ('straight', 'killed'):
    assert cli.main(['convert', '--from', str(tmp_path / name), '--to-peft', str(tmp_path / f'{name}_peft')]) == 0
  files = [(tmp_path / f'{name}_peft' / 'adapter_model.safetensors').read_bytes() for name in ('straight', 'killed')]
  assert files[0] == files[1]
  config = json.loads((tmp_path / 'killed_peft' / 'adapter_config.json').read_text())
  assert (config['r'], config['target_modules'], config['base_model_name_or_path']) == (
    4, ['k_proj', 'o_proj', 'q_proj', 'v_proj'], str(tmp_path / 'hf'))
  loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'hf'),
                                          tmp_path / 'killed_peft')
  assert sum('lora_A' in name for name, _ in loaded.named_parameters()) == 4 * plain.num_layers
  capsys.readouterr()
  assert cli.main(['convert', '--from-hf', str(tmp_path / 'hf'), '--to', str(tmp_path / 'imported')]) == 0
  assert cli.main(['convert', '--from', str(tmp_path / 'imported'), '--to-peft', str(tmp_path / 'none')]) == 2
  assert 'this model has no adapters (model.lora.rank=0)' in capsys.readouterr().err
  # The run dir generates (greedily, through the one way to open a model) as its merged export does, and not as the
  # base without its adapters.
  assert cli.main(['convert', '--from', str(run), '--to-hf', str(tmp_path / 'merged')]) == 0
  assert cli.main(['convert', '--from-hf', str(tmp_path / 'merged'), '--to', str(tmp_path / 'merged_run')]) == 0
  capsys.readouterr()
  texts = []
  for source in (run, tmp_path / 'merged_run', tmp_path / 'imported'):
    assert cli.main(['generate', '--run', str(source), '--prompt', 'def ', '--max-new-tokens', '12']) == 0
    texts.append(capsys.readouterr().out)
  assert texts[0] == texts[1] != texts[2] and 'def ' in texts[0]
  # a base that no longer opens at the step the adapters were trained on is one line
  (run / 'checkpoints' / '8' / 'base' / 'metadata').write_text(json.dumps({
    'source': str(tmp_path / 'hf'), 'step': 3, 'view': 'model'}))
  assert cli.main(['generate', '--run', str(run), '--prompt', 'def ', '--max-new-tokens', '2']) == 2
  assert f'{tmp_path / "hf"}, the base of this LoRA run\'s adapters, now opens at step 0, not at step 3' in \
      capsys.readouterr().err


def test_an_adapter_peft_made_opens_in_lm_with_peft_logits(tmp_path):
  """PEFT's own LoRA (query and value projections of every layer, B drawn off zero) on a random HF Llama, saved
  by PEFT: lm opens the adapter directory as a model (its base, its adapters as model.lora) with PEFT's logits; an
  adapter on another base is one line."""
  import peft
  import torch
  import transformers
  from lm.storage.source import ModelSource
  torch.manual_seed(0)
  shape = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(tmp_path / 'hf')
  base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'hf').eval()
  adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=['q_proj', 'v_proj'],
                                                      init_lora_weights=False))
  adapted.save_pretrained(tmp_path / 'adapter')
  config = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  config['base_model_name_or_path'] = str(tmp_path / 'hf')
  (tmp_path / 'adapter' / 'adapter_config.json').write_text(json.dumps(config))
  tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
  with torch.no_grad():
    theirs = adapted.eval()(torch.as_tensor(tokens)).logits.numpy()
  source = ModelSource(tmp_path / 'adapter')
  assert source.config.model.lora == LoraConfig(rank=4, alpha=16.0, targets=('query', 'value'))
  model = build_model(source.config.model)
  params = source.params(source.assembly().mesh)
  np.testing.assert_allclose(np.asarray(model.apply({'params': params}, jnp.asarray(tokens))), theirs, rtol=1e-4,
                             atol=1e-4)
  transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**shape, 'hidden_size': 48})).save_pretrained(
    tmp_path / 'wider')
  config['base_model_name_or_path'] = str(tmp_path / 'wider')
  (tmp_path / 'adapter' / 'adapter_config.json').write_text(json.dumps(config))
  with pytest.raises(ConfigError, match=f'is not an adapter of {tmp_path / "wider"}') as e:
    ModelSource(tmp_path / 'adapter')
  assert '\n' not in str(e.value)


def test_the_compiled_step_keeps_optimizer_state_of_the_adapters_alone(tmp_path):
  """`memory_analysis()` of the compiled train step, adapters against full fine-tuning of the same model: its
  arguments (params, Adam's two moments, the batch) differ by exactly the frozen params' two moments less the
  adapters' params and moments; `lm info`'s count of what trains is the adapters'."""
  from lm.assembly import assemble
  from lm.assembly.accounting import count_params
  from lm.train.step import compile_train_step
  full = assemble(load_config('llama_tiny', SMALL + [f'train.run_dir={tmp_path}']), jax.devices()[:1])
  adapted = assemble(small_lora(f'train.run_dir={tmp_path}'), jax.devices()[:1])
  base = count_params(full.abstract_params)['total']
  counts = count_params(adapted.abstract_params, adapted.config.model)
  adapters = counts['total'] - base
  assert counts['trained'] == adapters > 0
  memory = {name: compile_train_step(a).memory_analysis() for name, a in (('full', full), ('lora', adapted))}
  saved = memory['full'].argument_size_in_bytes - memory['lora'].argument_size_in_bytes
  assert saved == 4 * (2 * base - 3 * adapters)  # float32: (P + 2P) - (P + A + 2A)
  print('arguments:', {name: m.argument_size_in_bytes for name, m in memory.items()})
