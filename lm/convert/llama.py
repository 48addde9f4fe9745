"""Llama (`LlamaForCausalLM`) <-> our `llama` family.

HF linear weights are [out, in]; queries and keys are stored for the half-split rotary layout our
`rotary` uses, so they load unpermuted. RoPE settings come as `rope_parameters` (transformers 5)
or `rope_theta` / `rope_scaling` (transformers 4); only the default (unscaled) rotation is supported.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ConfigError, ModelConfig
from lm.convert.hf_config import check_exportable, hf_activation, our_activation, unsupported
from lm.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'LlamaForCausalLM'
DEFAULTS = {'vocab_size': 32000, 'hidden_size': 4096, 'intermediate_size': 11008, 'num_hidden_layers': 32,
            'num_attention_heads': 32, 'num_key_value_heads': None, 'head_dim': None, 'hidden_act': 'silu',
            'max_position_embeddings': 2048, 'rms_norm_eps': 1e-6, 'initializer_range': 0.02,
            'attention_dropout': 0.0, 'tie_word_embeddings': False}
GATED = {'silu': 'swiglu', 'gelu': 'geglu', 'gelu_tanh': 'geglu_tanh', 'relu': 'reglu'}


def rope_theta(hf: dict) -> float:
  """The rotary base of either config layout; scaled variants (linear, dynamic, llama3, yarn) are refused."""
  params = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind != 'default':
    raise ConfigError(f'config.json rope type {kind!r} is not supported when converting {ARCHITECTURE} '
                      f'(only the default, unscaled rotary positions)')
  return float(params.get('rope_theta', hf.get('rope_theta', 10000.0)))


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(ARCHITECTURE, hf, attention_bias=False, mlp_bias=False, pretraining_tp=1)
  h = {**DEFAULTS, **hf}
  embed = ckpt.get('model.embed_tokens.weight')
  same = None if embed is None else ckpt.same_as('lm_head.weight', embed)
  heads = h['num_attention_heads']
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=h['num_hidden_layers'], num_heads=heads,
    num_kv_heads=h['num_key_value_heads'] or heads, head_dim=h['head_dim'] or h['hidden_size'] // heads,
    d_ff=h['intermediate_size'], max_len=h['max_position_embeddings'], position='rotary', rope_theta=rope_theta(hf),
    norm='rmsnorm', norm_eps=h['rms_norm_eps'], norm_position='pre',
    activation=GATED[our_activation(h['hidden_act'], 'hidden_act', ARCHITECTURE)], use_bias=False,
    tie_embeddings=h['tie_word_embeddings'] if same is None else same, dropout=0.0,
    attention_dropout=h['attention_dropout'], init_std=h['initializer_range'], scan_layers=False)
  return cfg, rules(cfg)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='rmsnorm', norm_position='pre', use_bias=False,
                   scale_attention=True)
  plain = {v: k for k, v in GATED.items()}
  if cfg.activation not in plain:
    raise ConfigError(f'cannot export model.activation={cfg.activation!r} as {ARCHITECTURE}; it supports the gated '
                      f'activations: {", ".join(plain)}')
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 'llama', 'vocab_size': cfg.vocab_size,
    'hidden_size': cfg.d_model, 'intermediate_size': cfg.resolved_d_ff, 'num_hidden_layers': cfg.num_layers,
    'num_attention_heads': cfg.num_heads, 'num_key_value_heads': cfg.resolved_kv_heads,
    'head_dim': cfg.resolved_head_dim, 'max_position_embeddings': cfg.max_len, 'rms_norm_eps': cfg.norm_eps,
    'hidden_act': hf_activation(plain[cfg.activation], base.get('hidden_act'), ARCHITECTURE),
    'attention_bias': False, 'mlp_bias': False, 'tie_word_embeddings': cfg.tie_embeddings,
    'attention_dropout': cfg.attention_dropout, 'initializer_range': cfg.init_std}
  if 'rope_theta' in base:  # a transformers 4 config keeps its layout
    hf['rope_theta'] = cfg.rope_theta
  else:
    hf['rope_parameters'] = {**(base.get('rope_parameters') or {}), 'rope_theta': cfg.rope_theta,
                             'rope_type': 'default'}
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  out = [Tensor('model.embed_tokens.weight', ('token_embed/embedding',))]
  for i in range(cfg.num_layers):
    h, o = f'model.layers.{i}.', f'decoder/layers_{i}/'
    for x, name in zip('qkv', ('query', 'key', 'value')):
      out += dense(f'{h}self_attn.{x}_proj', f'{o}attention/{name}', 'linear', bias=False)
    out += [*dense(f'{h}self_attn.o_proj', f'{o}attention/out', 'linear', n_in=2, bias=False),
            *norm(f'{h}input_layernorm', f'{o}attention_norm', bias=False),
            *dense(f'{h}mlp.gate_proj', f'{o}mlp/wi_0', 'linear', bias=False),
            *dense(f'{h}mlp.up_proj', f'{o}mlp/wi_1', 'linear', bias=False),
            *dense(f'{h}mlp.down_proj', f'{o}mlp/wo', 'linear', bias=False),
            *norm(f'{h}post_attention_layernorm', f'{o}mlp_norm', bias=False)]
  out += norm('model.norm', 'decoder/final_norm', bias=False)
  if not cfg.tie_embeddings:
    out.append(Tensor('lm_head.weight', ('lm_head/kernel',), 'linear'))
  return out
