"""Hugging Face conversion: logits parity with transformers on padded batches, exact export, clear errors."""
import dataclasses
import json
import os
import shutil
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from lm.config import ConfigError, ExecutionConfig, ModelConfig, MupConfig
from lm.storage.convert.hf import load_hf, read_hf_config, save_hf
from lm.jobs.generate import generate
from lm.models import abstract_params, build_model
from lm.models.transformer import stack_layers

VOCAB, BATCH, LEN = 96, 3, 12
LLAMA3_ROPE = {'rope_type': 'llama3', 'rope_theta': 5e5, 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 8}

CONFIGS = {
  'gpt2': lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                          bos_token_id=1, eos_token_id=2),
  'bert': lambda: transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=32),
  # head_dim * heads != d_model, more decoder than encoder layers, offsets beyond max_distance.
  't5_v1_0': lambda: transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                           num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                                           relative_attention_max_distance=10, feed_forward_proj='relu'),
  't5_v1_1': lambda: transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                           num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                                           relative_attention_max_distance=10, feed_forward_proj='gated-gelu',
                                           tie_word_embeddings=False),
  # Grouped-query attention (4 query heads, 2 key/value heads), an odd vocabulary, untied head, RoPE theta 5e5.
  'llama': lambda: transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=5e5,
                                            tie_word_embeddings=False),
  # Llama 3.1's rotary scaling from an 8-position context (every band of the llama3 rule in use at head dim 8)
  'llama3': lambda: transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                             rope_parameters=LLAMA3_ROPE),
  # Llama 3.2 1B/3B: the same with the output layer tied to the embedding
  'llama3_2': lambda: transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                               max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                               rope_parameters=LLAMA3_ROPE),
  # Qwen2.5: query/key/value biases, YaRN rotary scaling from a 4-position context
  'qwen2': lambda: transformers.Qwen2Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                            rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e4, 'factor': 4.0,
                                                             'original_max_position_embeddings': 4}),
  # Qwen3 0.6B-4B: per-head query/key norms, a head dim apart from d_model / heads, tied output
  'qwen3': lambda: transformers.Qwen3Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                                            tie_word_embeddings=True, rope_parameters={'rope_type': 'default',
                                                                                       'rope_theta': 1e6}),
  # Mistral 7B v0.3: no window
  'mistral': lambda: transformers.MistralConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, sliding_window=None),
  # Mistral 7B v0.1: a sliding window (4 here, shorter than the 12-token rows and the generated 25)
  'mistral_window': lambda: transformers.MistralConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, max_position_embeddings=64,
                                                       sliding_window=4),
  # Gemma 2: sandwich (1 + w) norms, scaled embeddings, GeGLU, query_pre_attn_scalar apart from head_dim, both
  # soft-caps low enough to act on a random model, a 4-token window in layers 0 and 2, layers 1 and 3 global
  'gemma2': lambda: transformers.Gemma2Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                              attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                              max_position_embeddings=64, attn_implementation='eager'),
  # Gemma 3: Gemma 2 without soft-caps, (1 + w) query/key norms, 7 layers (one 5:1 block and a windowed layer past
  # it), the windowed layers rotating at base 1e4, the global one at 1e6 stretched linearly x 8
  'gemma3': lambda: transformers.Gemma3TextConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                                  max_position_embeddings=64, attn_implementation='eager',
                                                  rope_scaling={'rope_type': 'linear', 'factor': 8.0}),
  # Pythia: attention and MLP in parallel, a quarter of each head's 16 features rotating (base 1e4), untied output
  'gpt_neox': lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB + 1, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=80,
                                                 max_position_embeddings=64, rotary_pct=0.25),
  # GPT-NeoX without the parallel residual (attention, then MLP), half of each head rotating at base 5e4
  'gpt_neox_serial': lambda: transformers.GPTNeoXConfig(vocab_size=VOCAB + 1, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=80,
                                                        max_position_embeddings=64, use_parallel_residual=False,
                                                        rope_parameters={'rope_type': 'default', 'rope_theta': 5e4,
                                                                         'partial_rotary_factor': 0.5}),
  # OLMo 1B: LayerNorms without weights, a tied output layer, query/key/value clipped (at 0.5, inside the
  # projections' random range, so the clip acts)
  'olmo': lambda: transformers.OlmoConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, clip_qkv=0.5, tie_word_embeddings=True,
                                          pad_token_id=1, eos_token_id=2),
  # OLMo 2: each branch's output normalised, queries and keys normalised over all heads (grouped: 2 key/value
  # heads), rotary base 5e5, untied
  'olmo2': lambda: transformers.Olmo2Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=1,
                                            eos_token_id=2, rope_parameters={'rope_type': 'default',
                                                                             'rope_theta': 5e5}),
  # OLMo 3: OLMo 2 with a 4-position window in three layers of four (the fourth global), rotary per layer type
  'olmo3': lambda: transformers.Olmo3Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=1,
                                            eos_token_id=2, sliding_window=4,
                                            rope_parameters={t: {'rope_type': 'default', 'rope_theta': 5e5}
                                                             for t in ('full_attention', 'sliding_attention')}),
  # Mixtral: 5 experts, 2 per token, of an odd width
  'mixtral': lambda: transformers.MixtralConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=24,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, num_local_experts=5, num_experts_per_tok=2),
  # Qwen2-MoE: experts in every second layer but the last (decoder_sparse_step 2, mlp_only_layers [3]: layer 1
  # alone routed), dense MLPs elsewhere, 3 of 5 experts per token without renormalising, a gated shared expert
  'qwen2_moe': lambda: transformers.Qwen2MoeConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=40,
                                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=64, num_experts=5, num_experts_per_tok=3,
                                                   moe_intermediate_size=12, shared_expert_intermediate_size=20,
                                                   decoder_sparse_step=2, mlp_only_layers=[3]),
  # Qwen3-MoE: per-head query/key norms, 2 of 6 experts per token renormalised (norm_topk_prob, as released)
  'qwen3_moe': lambda: transformers.Qwen3MoeConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=40,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   head_dim=16, max_position_embeddings=64, num_experts=6,
                                                   num_experts_per_tok=2, moe_intermediate_size=20,
                                                   norm_topk_prob=True),
  # OLMoE: query/key norms over all heads, clipped projections, 2 of 4 experts without renormalising
  'olmoe': lambda: transformers.OlmoeConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=24,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, clip_qkv=0.5, num_experts=4,
                                            num_experts_per_tok=2, pad_token_id=1, eos_token_id=2),
  # DeepSeek-V3: latent attention with a query latent (q_lora), values narrower than the query/key heads, 1 dense
  # layer then routed ones (2 of 8 experts in 4 groups, 2 groups a token, sigmoid scores renormalised and scaled, a
  # shared expert), YaRN x 4 with DeepSeek's mscales (the logits' scale too), interleaved rotary pairs
  'deepseek_v3': lambda: transformers.DeepseekV3Config(
    vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    v_head_dim=12, qk_nope_head_dim=16,
    max_position_embeddings=256, attn_implementation='eager',
    rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e4, 'factor': 4.0, 'original_max_position_embeddings': 64,
                     'mscale': 1.0, 'mscale_all_dim': 0.8}),
  # ... without the query latent, unscaled rotation, 2 dense layers
  'deepseek_v3_plain_q': lambda: transformers.DeepseekV3Config(
    vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=1, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    v_head_dim=24, qk_nope_head_dim=8, max_position_embeddings=64, attn_implementation='eager'),
  # GPT-OSS: 3 layers (windowed, global, windowed) with a window of 4 inside the 12 positions, sinks, biases, 2 of 4
  # experts with the clamped SwiGLU clamping at 0.3 (inside the values' range), YaRN x 4 untruncated
  'gpt_oss': lambda: transformers.GptOssConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=16,
                                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, sliding_window=4, max_position_embeddings=256,
                                               num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.3,
                                               attn_implementation='eager',
                                               rope_parameters={'rope_type': 'yarn', 'rope_theta': 1e4, 'factor': 4.0,
                                                                'beta_fast': 32.0, 'beta_slow': 1.0, 'truncate': False,
                                                                'original_max_position_embeddings': 64}),
}
MODELS = {'gpt2': transformers.GPT2LMHeadModel, 'bert': transformers.BertForMaskedLM,
          't5_v1_0': transformers.T5ForConditionalGeneration, 't5_v1_1': transformers.T5ForConditionalGeneration,
          'llama': transformers.LlamaForCausalLM, 'llama3': transformers.LlamaForCausalLM,
          'llama3_2': transformers.LlamaForCausalLM, 'qwen2': transformers.Qwen2ForCausalLM,
          'qwen3': transformers.Qwen3ForCausalLM, 'mistral': transformers.MistralForCausalLM,
          'mistral_window': transformers.MistralForCausalLM, 'gemma2': transformers.Gemma2ForCausalLM,
          'gemma3': transformers.Gemma3ForCausalLM,
          'gpt_neox': transformers.GPTNeoXForCausalLM, 'gpt_neox_serial': transformers.GPTNeoXForCausalLM,
          'olmo': transformers.OlmoForCausalLM, 'olmo2': transformers.Olmo2ForCausalLM,
          'olmo3': transformers.Olmo3ForCausalLM, 'mixtral': transformers.MixtralForCausalLM,
          'qwen2_moe': transformers.Qwen2MoeForCausalLM, 'qwen3_moe': transformers.Qwen3MoeForCausalLM,
          'olmoe': transformers.OlmoeForCausalLM, 'gpt_oss': transformers.GptOssForCausalLM,
          'deepseek_v3': transformers.DeepseekV3ForCausalLM, 'deepseek_v3_plain_q': transformers.DeepseekV3ForCausalLM}
DECODERS = ('gpt2', 'llama', 'llama3', 'llama3_2', 'qwen2', 'qwen3', 'mistral', 'mistral_window', 'gemma2', 'gemma3',
            'gpt_neox', 'gpt_neox_serial', 'olmo', 'olmo2', 'olmo3', 'mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe',
            'gpt_oss', 'deepseek_v3', 'deepseek_v3_plain_q')


def save_hf_model(kind, directory):
  """A random `kind` model saved by transformers; every weight (norms too) perturbed off its init."""
  torch.manual_seed(0)
  model = MODELS[kind](CONFIGS[kind]()).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():  # DeepSeek's selection bias, a buffer: large enough to change choices
      if name.endswith('e_score_correction_bias'):
        b.copy_(0.3 * torch.randn_like(b))
  model.save_pretrained(directory, safe_serialization=True)
  return model


def batch(seed=0):
  """Token ids and a padding mask with zeros at the end of rows 1 and 2 (row 0 unpadded)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, VOCAB, size=(BATCH, LEN))
  mask = np.ones((BATCH, LEN), np.int64)
  mask[1, 9:] = 0
  mask[2, 5:] = 0
  return ids, mask


def hf_logits(model, kind, ids, mask, dec_ids=None, dec_mask=None, types=None):
  t = torch.as_tensor
  with torch.no_grad():
    if kind.startswith('t5'):
      out = model(input_ids=t(ids), attention_mask=t(mask), decoder_input_ids=t(dec_ids),
                  decoder_attention_mask=t(dec_mask))
    elif kind == 'bert':
      out = model(input_ids=t(ids), attention_mask=t(mask), token_type_ids=t(types))
    else:
      out = model(input_ids=t(ids), attention_mask=t(mask))
  return out.logits.numpy()


def our_logits(model, params, kind, ids, mask, dec_ids=None, dec_mask=None, types=None):
  if kind.startswith('t5'):
    fn = jax.jit(lambda p, a, b, sa, sb: model.apply({'params': p}, a, b, segment_ids=sa, decoder_segment_ids=sb))
    return np.asarray(fn(params, ids, dec_ids, mask, dec_mask))
  if kind == 'bert':
    fn = jax.jit(lambda p, a, s, tt: model.apply({'params': p}, a, segment_ids=s, token_types=tt))
    return np.asarray(fn(params, ids, mask, types))
  return np.asarray(jax.jit(lambda p, a, s: model.apply({'params': p}, a, segment_ids=s))(params, ids, mask))


def relative_error(ours, theirs, mask):
  """Norm of the difference over non-padding positions, relative to the norm of the reference."""
  keep = mask.astype(bool)
  return float(np.linalg.norm(ours[keep] - theirs[keep]) / np.linalg.norm(theirs[keep]))


def compare(hf_model, model, params, kind):
  """Relative logits error of our model against `hf_model` on a padded batch."""
  ids, mask = batch()
  extra, valid = {}, mask
  if kind.startswith('t5'):
    dec_ids, dec_mask = batch(1)
    dec_mask = np.roll(dec_mask, 1, axis=0)  # decoder padding on other rows than the encoder's
    extra, valid = {'dec_ids': dec_ids, 'dec_mask': dec_mask}, dec_mask
  elif kind == 'bert':
    extra = {'types': (np.arange(LEN)[None] >= 6).astype(np.int64).repeat(BATCH, 0)}
  return relative_error(our_logits(model, params, kind, ids, mask, **extra),
                        hf_logits(hf_model, kind, ids, mask, **extra), valid)


def assert_same_tensors(a_dir, b_dir):
  a, b = load_file(str(a_dir / 'model.safetensors')), load_file(str(b_dir / 'model.safetensors'))
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize('kind', list(CONFIGS))
@pytest.mark.variants
def test_logits_match_transformers_and_export_is_exact(kind, tmp_path):
  hf_model = save_hf_model(kind, tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  assert {'layers_0', 'layers_1'} <= set(params['decoder' if kind in DECODERS else 'encoder'])  # unrolled
  error = compare(hf_model, model, params, kind)
  print(f'{kind}: max relative logits error {error:.2e}')
  assert error < 1e-4

  save_hf(model, params, tmp_path / 'out')
  assert_same_tensors(tmp_path / 'hf', tmp_path / 'out')
  modes = {name: os.stat(tmp_path / 'out' / name).st_mode & 0o777 for name in ('model.safetensors', 'config.json')}
  assert modes['model.safetensors'] == modes['config.json']  # the umask's mode, not safetensors' 0600
  reloaded = MODELS[kind].from_pretrained(tmp_path / 'out').eval()  # the exported config.json loads in transformers
  assert compare(reloaded, model, params, kind) < 1e-4


@pytest.mark.parametrize('kind', DECODERS)
@pytest.mark.variants
def test_greedy_generation_equals_transformers_generate(kind, tmp_path):
  """20 new tokens after left-padded prompts of two lengths, KV-cached on both sides."""
  hf_model = save_hf_model(kind, tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
  ours = generate(model, params, prompts, max_new_tokens=20)
  ids = np.array([[0] * (5 - len(p)) + p for p in prompts])
  with torch.no_grad():
    theirs = hf_model.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor((ids > 0).astype(np.int64)),
                               max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
  assert ours == theirs[:, 5:].tolist()


def test_t5_in_the_transformers_4_layout_has_an_untied_unscaled_lm_head(tmp_path):
  """Hub T5 v1.1 checkpoints: `tie_word_embeddings: false`, a separate lm_head.weight, no output rescale."""
  tied = save_hf_model('t5_v1_1', tmp_path / 'v5')
  old = tmp_path / 'v4'
  old.mkdir()
  tensors = load_file(str(tmp_path / 'v5' / 'model.safetensors'))
  tensors['lm_head.weight'] = np.random.default_rng(0).normal(size=tensors['shared.weight'].shape).astype(np.float32)
  save_file(tensors, str(old / 'model.safetensors'), metadata={'format': 'pt'})
  config = json.loads((tmp_path / 'v5' / 'config.json').read_text())
  del config['scale_decoder_outputs']
  config.update(tie_word_embeddings=False, transformers_version='4.46.3')
  (old / 'config.json').write_text(json.dumps(config))

  hf_model = transformers.T5ForConditionalGeneration.from_pretrained(old).eval()
  np.testing.assert_array_equal(hf_model.lm_head.weight.detach().numpy(), tensors['lm_head.weight'])
  assert not hf_model.config.scale_decoder_outputs
  model, params = load_hf(old)
  assert not model.cfg.tie_embeddings
  assert compare(hf_model, model, params, 't5_v1_1') < 1e-4
  assert compare(tied, model, params, 't5_v1_1') > 0.1  # the separate lm_head is really used

  save_hf(model, params, tmp_path / 'out', hf_config=config)
  assert_same_tensors(old, tmp_path / 'out')
  assert json.loads((tmp_path / 'out' / 'config.json').read_text()) == config


def test_bfloat16_checkpoint_loads_as_float32_and_exports_as_bfloat16(tmp_path):
  torch.manual_seed(0)
  MODELS['gpt2'](CONFIGS['gpt2']()).to(torch.bfloat16).save_pretrained(tmp_path / 'hf', safe_serialization=True)
  model, params = load_hf(tmp_path / 'hf')
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(np.float32)}
  save_hf(model, params, tmp_path / 'out', hf_config=read_hf_config(tmp_path / 'hf'))
  assert_same_tensors(tmp_path / 'hf', tmp_path / 'out')


def test_t5_files_repeating_the_embedding_load_and_a_differing_copy_is_an_error(tmp_path):
  save_hf_model('t5_v1_0', tmp_path / 'hf')
  file = str(tmp_path / 'hf' / 'model.safetensors')
  tensors = load_file(file)
  _, expected = load_hf(tmp_path / 'hf')
  for name in ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight'):
    tensors[name] = tensors['shared.weight']
  save_file(tensors, file)
  _, params = load_hf(tmp_path / 'hf')
  jax.tree.map(np.testing.assert_array_equal, params, expected)
  tensors['decoder.embed_tokens.weight'] = tensors['shared.weight'] + 1
  save_file(tensors, file)
  with pytest.raises(ConfigError, match='decoder.embed_tokens.weight differs from shared.weight'):
    load_hf(tmp_path / 'hf')


@pytest.fixture(scope='module')
def gpt2_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp('gpt2')
  save_hf_model('gpt2', directory)
  return directory


def edited_copy(source, target, edit_tensors=None, edit_config=None):
  shutil.copytree(source, target)
  if edit_tensors:
    tensors = load_file(str(target / 'model.safetensors'))
    edit_tensors(tensors)
    save_file(tensors, str(target / 'model.safetensors'))
  if edit_config:
    config = json.loads((target / 'config.json').read_text())
    edit_config(config)
    (target / 'config.json').write_text(json.dumps(config))
  return target


def test_gpt2_files_without_the_transformer_prefix_load(gpt2_dir, tmp_path):
  """The hub's original gpt2 weights were saved from GPT2Model: 'h.0.attn...' not 'transformer.h.0.attn...'."""
  def strip(tensors):
    for name in list(tensors):
      tensors[name.removeprefix('transformer.')] = tensors.pop(name)
  _, params = load_hf(edited_copy(gpt2_dir, tmp_path / 'bare', edit_tensors=strip))
  jax.tree.map(np.testing.assert_array_equal, params, load_hf(gpt2_dir)[1])


def test_missing_files_are_named(gpt2_dir, tmp_path):
  with pytest.raises(ConfigError, match='config.json not found'):
    load_hf(tmp_path)
  (tmp_path / 'config.json').write_text((gpt2_dir / 'config.json').read_text())
  with pytest.raises(ConfigError, match=r'model.safetensors \(or a sharded model.safetensors.index.json\) not found'):
    load_hf(tmp_path)


def test_missing_tensor_is_named(gpt2_dir, tmp_path):
  directory = edited_copy(gpt2_dir, tmp_path / 'hf', edit_tensors=lambda t: t.pop('transformer.h.1.mlp.c_fc.weight'))
  with pytest.raises(ConfigError, match=r"no tensor 'transformer.h.1.mlp.c_fc.weight' \(shape \(32, 128\)\)"):
    load_hf(directory)


def test_wrong_shape_names_tensor_and_both_shapes(gpt2_dir, tmp_path):
  def shrink(tensors):
    tensors['transformer.h.0.attn.c_attn.weight'] = np.zeros((32, 90), np.float32)
  directory = edited_copy(gpt2_dir, tmp_path / 'hf', edit_tensors=shrink)
  with pytest.raises(ConfigError, match=r"'transformer.h.0.attn.c_attn.weight' .* shape \(32, 90\) but config.json "
                                        r"implies \(32, 96\)"):
    load_hf(directory)


def test_unsupported_architecture_lists_the_supported_ones(gpt2_dir, tmp_path):
  directory = edited_copy(gpt2_dir, tmp_path / 'hf', edit_config=lambda c: c.update(architectures=['OPTForCausalLM']))
  with pytest.raises(ConfigError, match="'OPTForCausalLM' .* not supported; supported architectures: GPT2LMHeadModel, "
                                        "BertForMaskedLM, T5ForConditionalGeneration, LlamaForCausalLM"):
    load_hf(directory)


def test_unsupported_setting_is_named(gpt2_dir, tmp_path):
  directory = edited_copy(gpt2_dir, tmp_path / 'hf', edit_config=lambda c: c.update(activation_function='gelu_10'))
  with pytest.raises(ConfigError, match="activation_function='gelu_10' is not supported"):
    load_hf(directory)


def test_export_names_what_the_architecture_cannot_express(tmp_path):
  cfg = ModelConfig(family='gpt', vocab_size=16, d_model=8, num_layers=1, num_heads=2, max_len=8, norm='rmsnorm',
                    execution=ExecutionConfig(scan_layers=False))
  params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(build_model(cfg)))
  with pytest.raises(ConfigError, match=r"as GPT2LMHeadModel: model.norm='rmsnorm' \(needs 'layernorm'\)"):
    save_hf(cfg, params, tmp_path)
  with pytest.raises(ConfigError, match=r'params do not match the model config \(decoder/final_norm/scale \(8,\) != '
                                        r'\(16,\)'):
    save_hf(dataclasses.replace(cfg, d_model=16), params, tmp_path)


def test_llama_grouped_heads_and_rope_settings_are_read_from_config_json(tmp_path):
  save_hf_model('llama', tmp_path / 'hf')
  model, _ = load_hf(tmp_path / 'hf')
  cfg = model.cfg
  assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.rope.theta, cfg.position) == ('llama', 4, 2, 5e5, 'rotary')
  assert not cfg.tie_embeddings and cfg.activation == 'swiglu' and not cfg.use_bias
  for kind, extra in (('dynamic', {}), ('default', {'partial_rotary_factor': 0.5})):
    scaled = edited_copy(tmp_path / 'hf', tmp_path / kind, edit_config=lambda c, kind=kind, extra=extra: c.update(
      rope_parameters={'rope_type': kind, 'rope_theta': 5e5, 'factor': 8.0, **extra}))
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported" if kind == 'dynamic' else
                       f'rope {next(iter(extra))}=.* is not supported when converting LlamaForCausalLM'):
      load_hf(scaled)
  old = edited_copy(tmp_path / 'hf', tmp_path / 'v4', edit_config=lambda c: (c.pop('rope_parameters'), c.update(
    rope_theta=1234.0, rope_scaling=None)))
  assert load_hf(old)[0].cfg.rope.theta == 1234.0


def test_llama3_rope_scaling_is_read_in_both_layouts_and_changes_the_logits(tmp_path):
  hf_model = save_hf_model('llama3', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  cfg = model.cfg
  rope = cfg.rope
  assert (rope.scaling, rope.factor, rope.original_max_len, rope.low_freq_factor, rope.high_freq_factor) == \
    ('llama3', 8.0, 8, 1.0, 4.0)
  unscaled = build_model(dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, scaling='none')))
  assert compare(hf_model, unscaled, params, 'llama3') > 1e-2  # the parity test would see a scaling ignored
  # a transformers 4 config (rope_theta, rope_scaling) reads the same and exports in its own layout
  v4 = edited_copy(tmp_path / 'hf', tmp_path / 'v4', edit_config=lambda c: c.update(
    rope_theta=c['rope_parameters']['rope_theta'], rope_scaling=c.pop('rope_parameters')))
  model4, params4 = load_hf(v4)
  assert model4.cfg == cfg
  save_hf(model4, params4, tmp_path / 'out', hf_config=read_hf_config(v4))
  written = read_hf_config(tmp_path / 'out')
  assert 'rope_parameters' not in written and written['rope_theta'] == 5e5
  assert written['rope_scaling'] == {k: v for k, v in LLAMA3_ROPE.items() if k != 'rope_theta'}


def test_yarn_with_deepseeks_mscales_reads_and_exports_as_transformers(tmp_path):
  """A Llama with YaRN's mscale and mscale_all_dim (cos and sin times their ratio; Llama leaves the logits' scale)
  equals transformers', and export writes both back."""
  save_hf_model('llama', tmp_path / 'hf')
  yarn = {'rope_type': 'yarn', 'rope_theta': 5e5, 'factor': 40.0, 'original_max_position_embeddings': 4,
          'mscale': 1.0, 'mscale_all_dim': 0.5}
  edited = edited_copy(tmp_path / 'hf', tmp_path / 'yarn', edit_config=lambda c: c.update(rope_parameters=yarn))
  hf_model = transformers.LlamaForCausalLM.from_pretrained(edited).eval()
  model, params = load_hf(edited)
  assert (model.cfg.rope.mscale, model.cfg.rope.mscale_all_dim, model.cfg.rope.scale_logits) == (1.0, 0.5, False)
  assert compare(hf_model, model, params, 'llama') < 1e-4
  plain = dataclasses.replace(model.cfg.rope, mscale=None, mscale_all_dim=None)
  assert compare(hf_model, build_model(dataclasses.replace(model.cfg, rope=plain)), params, 'llama') > 1e-3
  save_hf(model, params, tmp_path / 'out', read_hf_config(edited))
  assert read_hf_config(tmp_path / 'out')['rope_parameters'].items() >= yarn.items()


def test_sharded_checkpoints_load_and_export_as_transformers_shards_them(tmp_path):
  hf_model = save_hf_model('qwen3', tmp_path / 'one')
  hf_model.save_pretrained(tmp_path / 'hf', max_shard_size='20KB')  # transformers' shards and index
  assert (tmp_path / 'hf' / 'model.safetensors.index.json').is_file()
  model, params = load_hf(tmp_path / 'hf')
  assert compare(hf_model, model, params, 'qwen3') < 1e-4
  save_hf(model, params, tmp_path / 'out', max_shard_bytes=20_000)
  index = json.loads((tmp_path / 'out' / 'model.safetensors.index.json').read_text())
  shards = sorted(set(index['weight_map'].values()))
  assert len(shards) > 2 and shards[0] == f'model-00001-of-{len(shards):05d}.safetensors'
  assert not (tmp_path / 'out' / 'model.safetensors').exists()
  theirs = {k: v for f in (tmp_path / 'one').glob('*.safetensors') for k, v in load_file(str(f)).items()}
  ours = {k: v for f in shards for k, v in load_file(str(tmp_path / 'out' / f)).items()}
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in ours)
  reloaded = MODELS['qwen3'].from_pretrained(tmp_path / 'out').eval()
  assert compare(reloaded, model, params, 'qwen3') < 1e-4
  (tmp_path / 'out' / shards[1]).unlink()
  with pytest.raises(ConfigError, match=f'names shard\\(s\\) {shards[1]} not found'):
    load_hf(tmp_path / 'out')


@pytest.mark.long(0.2)
def test_mistral_window_holds_on_every_attention_path(tmp_path):
  """The v0.1 window through XLA and our flash kernel equals transformers; without it the logits differ."""
  hf_model = save_hf_model('mistral_window', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  assert model.cfg.sliding_window == 4
  flash = build_model(model.cfg.with_execution(attention_impl='flash'))
  assert compare(hf_model, flash, params, 'mistral_window') < 1e-4
  assert compare(hf_model, build_model(dataclasses.replace(model.cfg, sliding_window=0)), params,
                 'mistral_window') > 1e-3


@pytest.mark.long(0.3)
def test_gemma2_holds_scanned_through_flash_and_each_feature_acts(tmp_path):
  """Scanned layers (the global ones picked by a traced index) through XLA and our flash kernel equal transformers;
  without any one of its features the logits differ."""
  hf_model = save_hf_model('gemma2', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  cfg = model.cfg
  assert (cfg.sliding_window, cfg.global_every, cfg.attn_logit_softcap, cfg.final_logit_softcap,
          cfg.attention_scale_dim, cfg.norm_position, cfg.norm_plus_one) == (4, 2, 1.0, 2.0, 24, 'sandwich', True)
  stacked = {**params, 'decoder': stack_layers(params['decoder'])}
  for impl in ('xla', 'flash'):
    scanned = build_model(cfg.with_execution(scan_layers=True, attention_impl=impl))
    assert compare(hf_model, scanned, stacked, 'gemma2') < 1e-4, impl
  for change in ({'global_every': 0}, {'sliding_window': 0, 'global_every': 0}, {'attn_logit_softcap': 0.0},
                 {'final_logit_softcap': 0.0}, {'attention_scale_dim': None}):
    assert compare(hf_model, build_model(dataclasses.replace(cfg, **change)), params, 'gemma2') > 1e-3, change


@pytest.mark.parametrize('types, pattern', [
  (['sliding_attention', 'full_attention', 'sliding_attention'], {'global_every': 2, 'global_layers': ()}),
  (['full_attention', 'sliding_attention', 'sliding_attention'], {'global_every': 0, 'global_layers': (0,)}),
])
def test_gemma2_layer_types_are_the_per_layer_truth_at_any_layer_count(types, pattern, tmp_path):
  """Three layers (no whole number of alternations): every n-th global as global_every, another pattern as
  global_layers; unrolled and scanned (the traced index picks them) equal transformers, and export writes the
  types back."""
  torch.manual_seed(0)
  config = transformers.Gemma2Config(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                     layer_types=types, max_position_embeddings=64, attn_implementation='eager')
  hf_model = transformers.Gemma2ForCausalLM(config).eval()
  hf_model.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  model, params = load_hf(tmp_path / 'hf')
  assert {k: getattr(model.cfg, k) for k in pattern} == pattern
  assert compare(hf_model, model, params, 'gemma2') < 1e-4
  scanned = build_model(model.cfg.with_execution(scan_layers=True))
  assert compare(hf_model, scanned, {**params, 'decoder': stack_layers(params['decoder'])}, 'gemma2') < 1e-4
  all_windowed = build_model(dataclasses.replace(model.cfg, global_every=0, global_layers=()))
  assert compare(hf_model, all_windowed, params, 'gemma2') > 1e-3  # the global layer acts
  save_hf(model, params, tmp_path / 'out')
  assert json.loads((tmp_path / 'out' / 'config.json').read_text())['layer_types'] == types


@pytest.mark.long(0.3)
def test_gemma3_holds_scanned_through_flash_and_its_rotations_and_norms_act(tmp_path):
  """Scanned layers (the traced index picking each layer's rotation and window) through XLA and our flash kernel
  equal transformers; the windowed layers' own base wavelength, the global layers' scaling and the query/key norms'
  (1 + w) each act."""
  hf_model = save_hf_model('gemma3', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  cfg = model.cfg
  assert (cfg.global_every, cfg.sliding_window, cfg.qk_norm, cfg.attn_logit_softcap, cfg.rope.theta,
          cfg.rope.scaling, cfg.rope.factor, cfg.rope.local_theta) == (6, 4, True, 0.0, 1e6, 'linear', 8.0, 1e4)
  stacked = {**params, 'decoder': stack_layers(params['decoder'])}
  for impl in ('xla', 'flash'):
    scanned = build_model(cfg.with_execution(scan_layers=True, attention_impl=impl))
    assert compare(hf_model, scanned, stacked, 'gemma3') < 1e-4, impl
  rope = cfg.rope
  for change in ({'rope': dataclasses.replace(rope, local_theta=0.0)},
                 {'rope': dataclasses.replace(rope, scaling='none', factor=1.0)}):
    assert compare(hf_model, build_model(dataclasses.replace(cfg, **change)), params, 'gemma3') > 1e-3, change
  plain_qk = jax.tree_util.tree_map_with_path(  # (1 + w) read as w: the query/key norms' offset acts
    lambda path, x: x + 1 if any(getattr(k, 'key', '') in ('query_norm', 'key_norm') for k in path) else x, params)
  assert compare(hf_model, model, plain_qk, 'gemma3') > 1e-3


def test_gemma3_multimodal_checkpoints_and_transformers_4_configs_load_the_language_model(tmp_path):
  """A Gemma3ForConditionalGeneration directory loads its language model (text logits equal transformers', the
  vision tower named as left out) and exports as Gemma3ForCausalLM; a transformers-4 config.json (rope_theta,
  rope_local_base_freq, rope_scaling, sliding_window_pattern) reads as the per-type one."""
  torch.manual_seed(0)
  text = CONFIGS['gemma3']()
  vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
  hf_model = transformers.Gemma3ForConditionalGeneration(
    transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
  with torch.no_grad():
    for p in hf_model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  hf_model.save_pretrained(tmp_path / 'mm', safe_serialization=True)
  with pytest.warns(UserWarning, match=r'ignored \d+ tensor\(s\) .*vision_tower'):
    model, params = load_hf(tmp_path / 'mm')
  assert compare(hf_model, model, params, 'gemma3') < 1e-4
  save_hf(model, params, tmp_path / 'out', read_hf_config(tmp_path / 'mm'))
  assert read_hf_config(tmp_path / 'out')['architectures'] == ['Gemma3ForCausalLM']
  reloaded = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / 'out').eval()
  assert compare(reloaded, model, params, 'gemma3') < 1e-4

  old = {k: v for k, v in read_hf_config(tmp_path / 'out').items() if k not in ('rope_parameters', 'layer_types')}
  old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={'type': 'linear', 'factor': 8.0},
             sliding_window_pattern=6)
  (tmp_path / 'out' / 'config.json').write_text(json.dumps(old))
  assert load_hf(tmp_path / 'out')[0].cfg == model.cfg


@pytest.mark.parametrize('kind, layers, written', [
  ('qwen2', {'use_sliding_window': True, 'max_window_layers': 1}, True),  # transformers derives layer_types ...
  ('qwen2', {'use_sliding_window': True, 'max_window_layers': 1}, False),  # ... which transformers 4 did not write
  ('qwen3', {'use_sliding_window': True, 'layer_types': ['sliding_attention', 'full_attention', 'sliding_attention']},
   True),
  ('olmo3', {'layer_types': ['full_attention', 'sliding_attention', 'sliding_attention']}, True),
])
def test_qwen_sliding_window_layers_are_read_per_layer(kind, layers, written, tmp_path):
  """Qwen2/Qwen3 and OLMo 3 with sliding-window layers (4 of the batch's 12 positions): `layer_types`, or
  without it Qwen's `use_sliding_window` from layer `max_window_layers` on; logits equal transformers' and export
  writes the same layer types back, which transformers reads as they were."""
  torch.manual_seed(0)
  config = CONFIGS[kind]()
  config = type(config)(**{**config.to_dict(), 'num_hidden_layers': 3, 'sliding_window': 4, 'layer_types': None,
                           **layers})
  hf_model = MODELS[kind](config).eval()
  hf_model.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  types = hf_model.config.layer_types
  assert types.count('sliding_attention') == 2
  source = tmp_path / 'hf' if written else edited_copy(tmp_path / 'hf', tmp_path / 'v4',
                                                       edit_config=lambda c: c.pop('layer_types'))
  model, params = load_hf(source)
  assert model.cfg.sliding_window == 4 and model.cfg.global_layer_indices == tuple(
    i for i, kind_ in enumerate(types) if kind_ == 'full_attention')
  assert compare(hf_model, model, params, kind) < 1e-4
  assert compare(hf_model, build_model(dataclasses.replace(model.cfg, sliding_window=0, global_every=0,
                                                           global_layers=())), params, kind) > 1e-3  # windows act
  save_hf(model, params, tmp_path / 'out')
  written_back = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert written_back['layer_types'] == types and written_back.get('use_sliding_window', True) is True  # Qwen's
  assert compare(MODELS[kind].from_pretrained(tmp_path / 'out').eval(), model, params, kind) < 1e-4


@pytest.mark.parametrize('kind, edit, message', [
  ('qwen2', {'layer_types': ['chunked_attention'] * 2}, r"layer_types \['chunked_attention'\] are not supported "
                                                        'when converting Qwen2ForCausalLM'),
  ('qwen3', {'attention_bias': True}, 'config.json attention_bias=True is not supported when converting Qwen3'),
  ('llama', {'layer_types': ['sliding_attention', 'full_attention']}, r"layer_types \['full_attention', "
                                                                      r"'sliding_attention'\] is not supported"),
  ('gpt_neox', {'attention_bias': False}, 'config.json attention_bias=False is not supported when converting GPTNeoX'),
  ('olmo3', {'rope_parameters': {'full_attention': {'rope_type': 'default', 'rope_theta': 1e4},
                                 'sliding_attention': {'rope_type': 'default', 'rope_theta': 5e5}}},
   'rope_parameters differ between layer types; Olmo3ForCausalLM converts one rotary setting for every layer'),
  ('gpt_neox', {'rope_parameters': {'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 1e4}},
   "rope type 'linear' is not supported when converting GPTNeoXForCausalLM"),
  ('mixtral', {'router_jitter_noise': 0.1}, 'router_jitter_noise=0.1 is not supported when converting Mixtral'),
  ('mixtral', {'num_experts_per_tok': 6}, r'model.moe.experts_per_token=6 must lie in \[1, model.moe.num_experts=5\]'),
])
def test_a_setting_the_model_cannot_honour_is_named(kind, edit, message, tmp_path):
  save_hf_model(kind, tmp_path / 'hf')
  with pytest.raises(ConfigError, match=message):
    load_hf(edited_copy(tmp_path / 'hf', tmp_path / 'edited', edit_config=lambda c: c.update(edit)))


def test_a_released_pythia_config_loads_and_exports_in_its_own_layout(tmp_path):
  """Pythia's files name the rotation `rotary_pct` and `rotary_emb_base` (no `rope_parameters`): the same model
  loads from them, and an export from them keeps that layout."""
  hf_model = save_hf_model('gpt_neox', tmp_path / 'hf')
  def released(config):
    rope = config.pop('rope_parameters')
    config.update(rotary_pct=rope['partial_rotary_factor'], rotary_emb_base=rope['rope_theta'], rope_scaling=None)
  model, params = load_hf(edited_copy(tmp_path / 'hf', tmp_path / 'released', edit_config=released))
  assert (model.cfg.rope.fraction, model.cfg.rope.theta, model.cfg.parallel_residual) == (0.25, 10000.0, True)
  assert compare(hf_model, model, params, 'gpt_neox') < 1e-4
  save_hf(model, params, tmp_path / 'out', json.loads((tmp_path / 'released' / 'config.json').read_text()))
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (written['rotary_pct'], written['rotary_emb_base']) == (0.25, 10000.0) and 'rope_parameters' not in written
  assert compare(transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / 'out').eval(), model, params,
                 'gpt_neox') < 1e-4


def test_bad_open_model_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
  from lm import cli
  save_hf_model('qwen2', tmp_path / 'hf')
  bad = edited_copy(tmp_path / 'hf', tmp_path / 'bad', edit_config=lambda c: c.update(layer_types=['full_attention']))
  capsys.readouterr()  # transformers' progress bars
  assert cli.main(['convert', '--from-hf', str(bad), '--to', str(tmp_path / 'run')]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'layer_types lists 1 layers, num_hidden_layers=2' in err
  assert not (tmp_path / 'run').exists()
  for overrides, message in ((['model.execution.attention_impl=tpu_splash'],
                              'model.execution.attention_impl=tpu_splash has no '
                              'model.sliding_window or model.attn_logit_softcap'),
                             (['model.sliding_window=512'], 'model.sliding_window=512 is larger than the context')):
    assert cli.main(['train', '--config', 'gemma2_tiny', f'train.run_dir={tmp_path / "train"}', *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / 'train').exists()


def test_each_open_architecture_exports_only_what_it_can_express(tmp_path):
  save_hf_model('qwen3', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  as_qwen2 = dataclasses.replace(model.cfg, family='qwen2')
  with pytest.raises(ConfigError, match=r'cannot export this qwen2 model as Qwen2ForCausalLM: model.qkv_bias=False '
                                        r'\(needs True\), model.qk_norm=True \(needs False\)'):
    save_hf(as_qwen2, params, tmp_path / 'out')
  assert not (tmp_path / 'out').exists()
  # OLMo 2's norms as Qwen3 (per-head query/key norms, pre-norm blocks); OLMo's clipping as Llama
  save_hf_model('olmo2', tmp_path / 'olmo2')
  model, params = load_hf(tmp_path / 'olmo2')
  with pytest.raises(ConfigError, match=r"as Qwen3ForCausalLM: model.qk_norm_scope='all_heads' \(needs 'head'\), "
                                        r"model.norm_position='post_branch' \(needs 'pre'\)"):
    save_hf(dataclasses.replace(model.cfg, family='qwen3'), params, tmp_path / 'out')
  save_hf_model('llama', tmp_path / 'llama')
  model, params = load_hf(tmp_path / 'llama')
  with pytest.raises(ConfigError, match=r'as LlamaForCausalLM: model.clip_qkv=8.0 \(needs 0.0\)$'):
    save_hf(dataclasses.replace(model.cfg, clip_qkv=8.0), params, tmp_path / 'out')
  # Mistral windows every layer: a global layer among windowed ones is Gemma 2's or Qwen's
  with pytest.raises(ConfigError, match=r'as MistralForCausalLM: model.global_layers=\(1,\) \(needs \(\)\)$'):
    save_hf(dataclasses.replace(model.cfg, family='mistral', sliding_window=4, global_layers=(1,)), params,
            tmp_path / 'out')
  # Gemma 3's two rotations as Llama, whose config.json gives every layer one
  with pytest.raises(ConfigError, match=r'as LlamaForCausalLM: model.rope.local_theta=10000.0 \(needs 0.0\)$'):
    save_hf(dataclasses.replace(model.cfg, rope=dataclasses.replace(model.cfg.rope, local_theta=1e4)), params,
            tmp_path / 'out')
  # GPT-OSS's sinks as Llama; a GPT-OSS without its clamped SwiGLU
  sunk = jax.tree.map(lambda a: a, params)
  for layer in (v for k, v in sunk['decoder'].items() if k.startswith('layers_')):
    layer['attention']['sinks'] = np.zeros(model.cfg.num_heads, np.float32)
  with pytest.raises(ConfigError, match=r'as LlamaForCausalLM: model.attention_sinks=True \(needs False\)$'):
    save_hf(dataclasses.replace(model.cfg, attention_sinks=True), sunk, tmp_path / 'out')
  save_hf_model('gpt_oss', tmp_path / 'gpt_oss')
  model, params = load_hf(tmp_path / 'gpt_oss')
  with pytest.raises(ConfigError, match=r"as GptOssForCausalLM: model.activation='swiglu' \(needs 'clamped_swiglu'\)$"):
    save_hf(dataclasses.replace(model.cfg, activation='swiglu', swiglu_limit=7.0), params, tmp_path / 'out')
  assert not (tmp_path / 'out').exists()


def test_routed_experts_load_from_transformers_fused_layout_and_their_aux_loss_is_transformers(tmp_path):
  """A Mixtral file holding the experts fused as transformers 5 keeps them in memory (`mlp.experts.gate_up_proj`,
  `down_proj`, `mlp.gate`) loads to the same params as the per-expert file save_pretrained writes; the imported
  model's balance loss (pooled over layers, padding left out) equals transformers' `aux_loss`."""
  hf_model = save_hf_model('mixtral', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  fused = {name: tensor.numpy() for name, tensor in hf_model.state_dict().items()}
  assert 'model.layers.1.mlp.experts.gate_up_proj' in fused
  shutil.copytree(tmp_path / 'hf', tmp_path / 'fused')
  save_file(fused, str(tmp_path / 'fused' / 'model.safetensors'))
  _, fused_params = load_hf(tmp_path / 'fused')
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fused_params), strict=True):
    np.testing.assert_array_equal(a, b)

  from lm.models import get_family
  ids, mask = batch()
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                      output_router_logits=True).aux_loss
  ours = get_family('mixtral').apply(model, params, {'inputs': ids, 'segment_ids': mask}, deterministic=True, rngs={})
  assert model.cfg.moe.balance_over == 'model' and model.cfg.moe.balance_loss == 0.001
  np.testing.assert_allclose(float(ours['aux_terms']['moe/balance_loss']), float(theirs), rtol=1e-5)


def test_routed_experts_export_only_as_an_architecture_that_expresses_them(tmp_path):
  save_hf_model('qwen2_moe', tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  with pytest.raises(ConfigError, match=r"as Qwen2MoeForCausalLM: model.moe.router='sigmoid' \(needs 'softmax'\), "
                                        r'model.moe.routed_scale=2.0 \(needs 1.0\)$'):
    save_hf(dataclasses.replace(model.cfg, moe=dataclasses.replace(model.cfg.moe, routed_scale=2.0, router='sigmoid')),
            params, tmp_path / 'o')
  with pytest.raises(ConfigError, match=r'as Qwen2ForCausalLM: model.moe=MoeConfig\(num_experts=5'):
    save_hf(dataclasses.replace(model.cfg, family='qwen2'), params, tmp_path / 'o')
  assert not (tmp_path / 'o').exists()


@pytest.mark.parametrize('kind', ['gpt2', 'llama'])
def test_mup_export_folds_the_multipliers_so_transformers_gives_the_same_logits(kind, tmp_path):
  """A μP model at width multiplier 4 (readout x 1/4, attention x sqrt(base head dim) / head dim): tied (GPT-2,
  folded into the final norm) and untied (Llama, into lm_head); the exported model's logits are ours."""
  save_hf_model(kind, tmp_path / 'hf')
  model, params = load_hf(tmp_path / 'hf')
  mup = build_model(dataclasses.replace(model.cfg, parametrization='mup', mup=MupConfig(base_width=8)))
  ids, mask = batch()
  ours = our_logits(mup, params, kind, ids, mask)
  assert relative_error(our_logits(model, params, kind, ids, mask), ours, mask) > 0.1  # μP's forward differs
  save_hf(mup, params, tmp_path / 'out')
  exported = MODELS[kind].from_pretrained(tmp_path / 'out').eval()
  error = relative_error(ours, hf_logits(exported, kind, ids, mask), mask)
  print(f'{kind} μP: relative logits error of the export {error:.2e}')
  assert error < 1e-4


def test_deepseek_v3_mtp_module_loads_as_model_mtp_and_exports_byte_for_byte(tmp_path):
  """A release's MTP module (`model.layers.{num_hidden_layers}.*`, which transformers drops on load): kept as
  `model.mtp` on import, every tensor written back unchanged, its copies of the embedding and output layer
  included; a copy that differs from the model's own is refused in one line."""
  hf_model = save_hf_model('deepseek_v3', tmp_path / 'hf')
  rng = np.random.default_rng(0)
  noise = lambda *shape: (0.1 * rng.normal(size=shape)).astype(np.float32)

  def add_mtp(t):  # layer 3, past the 3 of the stack: a routed block (layer 2's tensors, moved) and its own parts
    for name in [k for k in t if k.startswith('model.layers.2.')]:
      t[name.replace('model.layers.2.', 'model.layers.3.')] = t[name] + noise(*t[name].shape)
    d = t['model.norm.weight'].shape[0]
    for part in ('enorm', 'hnorm', 'shared_head.norm'):
      t[f'model.layers.3.{part}.weight'] = 1 + noise(d)
    t['model.layers.3.eh_proj.weight'] = noise(d, 2 * d)
    t['model.layers.3.embed_tokens.weight'] = t['model.embed_tokens.weight'].copy()
    t['model.layers.3.shared_head.head.weight'] = t['lm_head.weight'].copy()
  edited = edited_copy(tmp_path / 'hf', tmp_path / 'mtp', edit_tensors=add_mtp,
                       edit_config=lambda c: c.update(num_nextn_predict_layers=1))
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # no tensor left unread
    model, params = load_hf(edited)
  assert model.cfg.mtp.depth == 1
  eh_proj = load_file(str(edited / 'model.safetensors'))['model.layers.3.eh_proj.weight']
  np.testing.assert_array_equal(params['mtp_0']['embed_proj']['kernel'], eh_proj[:, :32].T)  # embedding first
  assert compare(hf_model, model, params, 'deepseek_v3') < 1e-4
  save_hf(model, params, tmp_path / 'out', read_hf_config(edited))
  assert_same_tensors(edited, tmp_path / 'out')
  assert read_hf_config(tmp_path / 'out')['num_nextn_predict_layers'] == 1

  def differ(t):
    t['model.layers.3.embed_tokens.weight'] += 1
  with pytest.raises(ConfigError, match=r'model.layers.3.embed_tokens.weight differs from the model\'s own') as e:
    load_hf(edited_copy(edited, tmp_path / 'differs', edit_tensors=differ))
  assert '\n' not in str(e.value)
