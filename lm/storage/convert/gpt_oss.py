"""GPT-OSS (`GptOssForCausalLM`, gpt-oss-20b and -120b) <-> our `gpt_oss` family: the Llama layout with biases on
every attention projection, a learned sink logit per query head (`self_attn.sinks`), windowed layers alternating with
global ones (`layer_types`), YaRN without truncation, and routed experts in every layer. The router has a bias and
takes a softmax over its top-k logits; each expert has biases and GPT-OSS's clamped SwiGLU (`swiglu_alpha`,
`swiglu_limit`), its gate and up projections interleaved in one tensor (`experts.gate_up_proj` [E, D, 2F]: gate in
the even columns).

The released checkpoints hold the experts in MXFP4 (`*_blocks`, `*_scales`); they load dequantized
(`lm.storage.convert.quantized.mxfp4_weight`) and export unquantized."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from lm.config import ConfigError, ModelConfig
from lm.storage.convert.hf_config import check_exportable, hf_layer_types, hf_sizes
from lm.storage.convert.llama import COMMON, Architecture, MoeNames, fused_experts, hf_rope, load_as
from lm.storage.convert.quantized import mxfp4_weight
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'GptOssForCausalLM'
QUANTIZED = ('mxfp4',)
# transformers' GptOssConfig defaults (gpt-oss-120b's shape)
DEFAULT_ROPE = {'rope_type': 'yarn', 'rope_theta': 150000.0, 'factor': 32.0, 'beta_fast': 32.0, 'beta_slow': 1.0,
                'truncate': False, 'original_max_position_embeddings': 4096}
DEFAULTS = {**COMMON, 'vocab_size': 201088, 'hidden_size': 2880, 'intermediate_size': 2880, 'num_hidden_layers': 36,
            'num_attention_heads': 64, 'num_key_value_heads': 8, 'head_dim': 64, 'max_position_embeddings': 131072,
            'rms_norm_eps': 1e-5, 'sliding_window': 128, 'num_local_experts': 128, 'num_experts_per_tok': 4,
            'router_aux_loss_coef': 0.001, 'swiglu_alpha': 1.702, 'swiglu_limit': 7.0}
GPT_OSS = Architecture(ARCHITECTURE, 'gpt_oss', DEFAULTS, {'attention_bias': True}, layer_windows=True, global_every=2,
                       moe=MoeNames('mlp', ('gate_proj', 'up_proj', 'down_proj'), 'num_local_experts',
                                    'intermediate_size', normalize=True))


# PEFT's target_parameters (lm.storage.convert.peft): gate and up interleaved in gate_up_proj
experts_in_memory = functools.partial(fused_experts, interleaved=True)


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  for name in sorted(ckpt.names):  # MXFP4 experts: read as the unquantized tensor of the same name
    if name.endswith('_blocks'):
      base = name[:-len('_blocks')]
      ckpt.derive(base, name, lambda blocks, scales=f'{base}_scales': mxfp4_weight(blocks, ckpt.require(
        scales, blocks.shape[:-1])))
  if not any(key in hf for key in ('rope_parameters', 'rope_scaling', 'rope_theta')):
    hf = {**hf, 'rope_parameters': DEFAULT_ROPE}
  cfg, _ = load_as(GPT_OSS, hf, ckpt)
  h = {**DEFAULTS, **hf}
  cfg = dataclasses.replace(cfg, use_bias=True, attention_sinks=True, activation='clamped_swiglu',
                            swiglu_alpha=float(h['swiglu_alpha']), swiglu_limit=float(h['swiglu_limit']))
  return cfg, rules(cfg)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  if not cfg.moe.num_experts:
    raise ConfigError(f'cannot export this {cfg.family} model as {ARCHITECTURE}: it routes every layer\'s MLP, and '
                      f'model.moe.num_experts=0; set model.moe')
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='rmsnorm', norm_position='pre', use_bias=True,
                   scale_attention=True, qk_norm=False, attn_logit_softcap=0.0, final_logit_softcap=0.0,
                   attention_sinks=True, activation='clamped_swiglu', norm_plus_one=False, scale_embeddings=False,
                   parallel_residual=False, attention_scale_dim=None, global_every=cfg.global_every,
                   global_layers=cfg.global_layers, moe=cfg.moe)
  hf: dict[str, Any] = {
    **{k: v for k, v in base.items() if k not in ('quantization_config', 'rope_scaling', 'rope_theta')},
    'architectures': [ARCHITECTURE], 'model_type': 'gpt_oss', **hf_sizes(cfg),
    'num_key_value_heads': cfg.resolved_kv_heads, 'head_dim': cfg.resolved_head_dim, 'rms_norm_eps': cfg.norm_eps,
    'hidden_act': 'silu', 'attention_bias': True, 'tie_word_embeddings': cfg.tie_embeddings,
    'attention_dropout': cfg.attention_dropout, 'initializer_range': cfg.init_std,
    'sliding_window': cfg.sliding_window or None, 'layer_types': hf_layer_types(cfg),
    'swiglu_alpha': cfg.swiglu_alpha, 'swiglu_limit': cfg.swiglu_limit}
  hf.update(hf_rope(cfg, {}))
  hf.update(GPT_OSS.moe.hf_config(dataclasses.replace(cfg.moe, expert_d_ff=cfg.moe.expert_d_ff or cfg.resolved_d_ff),
                                  cfg.num_layers, ARCHITECTURE, base))
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  out = [Tensor('model.embed_tokens.weight', ('token_embed/embedding',))]
  for i in range(cfg.num_layers):
    h, o = f'model.layers.{i}.', f'decoder/layers_{i}/'
    for x, name in zip('qkv', ('query', 'key', 'value')):
      out += dense(f'{h}self_attn.{x}_proj', f'{o}attention/{name}', 'linear')
    e = f'{h}mlp.experts.'
    out += [*dense(f'{h}self_attn.o_proj', f'{o}attention/out', 'linear', n_in=2),
            Tensor(f'{h}self_attn.sinks', (f'{o}attention/sinks',)),
            *norm(f'{h}input_layernorm', f'{o}attention_norm', bias=False),
            *norm(f'{h}post_attention_layernorm', f'{o}mlp_norm', bias=False),
            Tensor(f'{h}mlp.router.weight', (f'{o}mlp/router',), 'linear'),
            Tensor(f'{h}mlp.router.bias', (f'{o}mlp/router_logit_bias',)),
            Tensor(f'{e}gate_up_proj', (f'{o}mlp/wi_0', f'{o}mlp/wi_1'), 'interleaved'),
            Tensor(f'{e}gate_up_proj_bias', (f'{o}mlp/wi_0_bias', f'{o}mlp/wi_1_bias'), 'interleaved'),
            Tensor(f'{e}down_proj', (f'{o}mlp/wo',)), Tensor(f'{e}down_proj_bias', (f'{o}mlp/wo_bias',))]
  out += norm('model.norm', 'decoder/final_norm', bias=False)
  if not cfg.tie_embeddings:
    out.append(Tensor('lm_head.weight', ('lm_head/kernel',), 'linear'))
  return out
