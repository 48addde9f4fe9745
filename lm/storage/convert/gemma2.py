"""Gemma 2 (`Gemma2ForCausalLM`) <-> our `gemma2` family: the Llama layout with RMSNorm scaling by (1 + w), a norm
before and after each branch (`model.norm_position=sandwich`), embeddings times sqrt(d_model), GeGLU (tanh),
attention logits scaled by `query_pre_attn_scalar`^-0.5 and soft-capped (`attn_logit_softcapping`), output logits
soft-capped (`final_logit_softcapping`), and sliding-window layers among global ones as `layer_types` lists them
(every n-th global: `model.global_every`; any other pattern, any layer count: `model.global_layers`), the output
layer tied to the embedding."""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, ModelConfig
from lm.storage.convert.hf_config import (FULL, GATED, SLIDING, check_exportable, hf_gated_activation,
                                          hf_layer_types, hf_sizes, our_activation, unsupported, window_pattern)
from lm.storage.convert.llama import hf_rope, rope_fields
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'Gemma2ForCausalLM'
DEFAULTS = {'vocab_size': 256000, 'hidden_size': 2304, 'intermediate_size': 9216, 'num_hidden_layers': 26,
            'num_attention_heads': 8, 'num_key_value_heads': 4, 'head_dim': 256,
            'hidden_activation': 'gelu_pytorch_tanh', 'max_position_embeddings': 8192, 'rms_norm_eps': 1e-6,
            'initializer_range': 0.02, 'attention_dropout': 0.0,
            'query_pre_attn_scalar': 256, 'sliding_window': 4096, 'final_logit_softcapping': 30.0,
            'attn_logit_softcapping': 50.0, 'tie_word_embeddings': True}


def load(hf: dict, ckpt: Checkpoint, architecture: str = ARCHITECTURE) -> tuple[ModelConfig, list[Tensor]]:
  """`architecture`: the class named in messages (Gemma 3 reads its config through this)."""
  unsupported(architecture, hf, attention_bias=False, use_bidirectional_attention=None)
  h = {**DEFAULTS, **hf}
  n = h['num_hidden_layers']
  types = h.get('layer_types') or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]  # transformers' default
  pattern = window_pattern(list(types), n, architecture)
  window = h['sliding_window'] or 0 if pattern.get('global_every') != 1 else 0
  embed = ckpt.get('model.embed_tokens.weight')
  if embed is not None and ckpt.same_as('lm_head.weight', embed) is False:
    raise ConfigError(f'{ckpt.path} holds an lm_head.weight apart from the embedding; {architecture} ties them')
  heads = h['num_attention_heads']
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=n, num_heads=heads,
    num_kv_heads=h['num_key_value_heads'] or heads, head_dim=h['head_dim'] or h['hidden_size'] // heads,
    d_ff=h['intermediate_size'], max_len=h['max_position_embeddings'], position='rotary',
    **rope_fields(hf, architecture), norm='rmsnorm', norm_eps=h['rms_norm_eps'], norm_position='sandwich',
    norm_plus_one=True, activation=GATED[our_activation(h['hidden_activation'], 'hidden_activation', architecture)],
    use_bias=False, tie_embeddings=True, scale_embeddings=True, sliding_window=window,
    **(pattern if window else {}), attn_logit_softcap=h['attn_logit_softcapping'] or 0.0,
    final_logit_softcap=h['final_logit_softcapping'] or 0.0, attention_scale_dim=h['query_pre_attn_scalar'],
    dropout=0.0, attention_dropout=h['attention_dropout'], init_std=h['initializer_range'],
    execution=ExecutionConfig(scan_layers=False))
  return cfg, rules(cfg)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='rmsnorm', norm_position='sandwich', norm_plus_one=True,
                   use_bias=False, qkv_bias=False, qk_norm=False, tie_embeddings=True, scale_embeddings=True,
                   scale_attention=True, global_every=cfg.global_every, global_layers=cfg.global_layers)
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 'gemma2', **hf_sizes(cfg),
    'num_key_value_heads': cfg.resolved_kv_heads, 'head_dim': cfg.resolved_head_dim, 'rms_norm_eps': cfg.norm_eps,
    'hidden_activation': hf_gated_activation(cfg.activation, base.get('hidden_activation'), ARCHITECTURE),
    'attention_bias': False, 'tie_word_embeddings': True, 'attention_dropout': cfg.attention_dropout,
    'initializer_range': cfg.init_std, 'query_pre_attn_scalar': cfg.attention_scale_dim or cfg.resolved_head_dim,
    'sliding_window': cfg.sliding_window or None, 'attn_logit_softcapping': cfg.attn_logit_softcap or None,
    'final_logit_softcapping': cfg.final_logit_softcap or None,
    'layer_types': hf_layer_types(cfg)}
  hf.pop('hidden_act', None)
  hf.update(hf_rope(cfg, base))
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  out = [Tensor('model.embed_tokens.weight', ('token_embed/embedding',))]
  for i in range(cfg.num_layers):
    h, o = f'model.layers.{i}.', f'decoder/layers_{i}/'
    for x, name in zip('qkv', ('query', 'key', 'value')):
      out += dense(f'{h}self_attn.{x}_proj', f'{o}attention/{name}', 'linear', bias=False)
    out += [*dense(f'{h}self_attn.o_proj', f'{o}attention/out', 'linear', n_in=2, bias=False),
            *norm(f'{h}input_layernorm', f'{o}attention_norm', bias=False),
            *norm(f'{h}post_attention_layernorm', f'{o}attention_post_norm', bias=False),
            *dense(f'{h}mlp.gate_proj', f'{o}mlp/wi_0', 'linear', bias=False),
            *dense(f'{h}mlp.up_proj', f'{o}mlp/wi_1', 'linear', bias=False),
            *dense(f'{h}mlp.down_proj', f'{o}mlp/wo', 'linear', bias=False),
            *norm(f'{h}pre_feedforward_layernorm', f'{o}mlp_norm', bias=False),
            *norm(f'{h}post_feedforward_layernorm', f'{o}mlp_post_norm', bias=False)]
  return out + norm('model.norm', 'decoder/final_norm', bias=False)
