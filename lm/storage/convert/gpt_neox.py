"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B) <-> our `gpt_neox` family.

HF linear weights are [out, in]. `query_key_value` fuses the three projections per head: its output axis holds,
head by head, that head's query, key and value (the `heads` layout). Queries and keys rotate in the half-split
layout our `rotary` uses, on the first `partial_rotary_factor` (older files: `rotary_pct`) of each head's features.
The output layer is `embed_out`. Released files hold the rotary settings as `rotary_pct` / `rotary_emb_base`;
transformers 5 writes them into `rope_parameters`: both load, and export keeps the base file's layout.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, ModelConfig, RopeConfig
from lm.storage.convert.hf_config import check_exportable, hf_activation, hf_sizes, our_activation, unsupported
from lm.storage.convert.tensors import Checkpoint, FusedQkvDecoder, Tensor

ARCHITECTURE = 'GPTNeoXForCausalLM'
# transformers' GPTNeoXConfig defaults (GPT-NeoX-20B's shape)
DEFAULTS = {'vocab_size': 50432, 'hidden_size': 6144, 'num_hidden_layers': 44, 'num_attention_heads': 64,
            'intermediate_size': 24576, 'hidden_act': 'gelu', 'attention_dropout': 0.0, 'hidden_dropout': 0.0,
            'max_position_embeddings': 2048, 'initializer_range': 0.02, 'layer_norm_eps': 1e-5,
            'tie_word_embeddings': False, 'use_parallel_residual': True}
PREFIX = 'gpt_neox.'
DECODER = FusedQkvDecoder('layers.', ('input_layernorm', 'attention.query_key_value', 'attention.dense',
                                      'post_attention_layernorm', 'mlp.dense_h_to_4h', 'mlp.dense_4h_to_h'),
                          'final_layer_norm', 'embed_out.weight', 'linear', ('heads', 'heads'))


def rope(hf: dict) -> RopeConfig:
  """The rotation of either config layout; only GPT-NeoX's default (unscaled) rotation is honoured."""
  params = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind != 'default':
    raise ConfigError(f'config.json rope type {kind!r} is not supported when converting {ARCHITECTURE} '
                      f'(only the default rotation)')
  return RopeConfig(theta=float(params.get('rope_theta', hf.get('rotary_emb_base', 10000.0))),
                    fraction=float(params.get('partial_rotary_factor', hf.get('rotary_pct', 0.25))))


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(ARCHITECTURE, hf, attention_bias=True)
  h = {**DEFAULTS, **hf}
  embed = ckpt.get(f'{PREFIX}embed_in.weight')
  same = None if embed is None else ckpt.same_as('embed_out.weight', embed)
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=h['num_hidden_layers'],
    num_heads=h['num_attention_heads'], d_ff=h['intermediate_size'], max_len=h['max_position_embeddings'],
    position='rotary', rope=rope(hf), norm='layernorm', norm_eps=h['layer_norm_eps'], norm_position='pre',
    activation=our_activation(h['hidden_act'], 'hidden_act', ARCHITECTURE), use_bias=True,
    parallel_residual=h['use_parallel_residual'], tie_embeddings=h['tie_word_embeddings'] if same is None else same,
    dropout=h['hidden_dropout'], attention_dropout=h['attention_dropout'], init_std=h['initializer_range'],
    execution=ExecutionConfig(scan_layers=False))
  return cfg, rules(cfg)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='layernorm', norm_position='pre', use_bias=True,
                   scale_attention=True, qk_norm=False, attn_logit_softcap=0.0, final_logit_softcap=0.0,
                   sliding_window=0, norm_plus_one=False, resolved_head_dim=cfg.d_model // cfg.num_heads,
                   resolved_kv_heads=cfg.num_heads)
  if cfg.rope.scaling != 'none':
    raise ConfigError(f'cannot export this {cfg.family} model as {ARCHITECTURE}: model.rope.scaling='
                      f'{cfg.rope.scaling!r} (needs \'none\')')
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 'gpt_neox', **hf_sizes(cfg),
    'layer_norm_eps': cfg.norm_eps, 'hidden_act': hf_activation(cfg.activation, base.get('hidden_act'), ARCHITECTURE),
    'use_parallel_residual': cfg.parallel_residual, 'attention_bias': True, 'tie_word_embeddings': cfg.tie_embeddings,
    'hidden_dropout': cfg.dropout, 'attention_dropout': cfg.attention_dropout, 'initializer_range': cfg.init_std}
  if 'rotary_pct' in base:  # a released file's layout
    hf.update(rotary_pct=cfg.rope.fraction, rotary_emb_base=cfg.rope.theta)
  else:
    hf['rope_parameters'] = {'rope_type': 'default', 'rope_theta': cfg.rope.theta,
                             'partial_rotary_factor': cfg.rope.fraction}
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  return DECODER.rules(cfg, PREFIX, [Tensor(f'{PREFIX}embed_in.weight', ('token_embed/embedding',))])
