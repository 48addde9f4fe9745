"""GPT-2 (`GPT2LMHeadModel`) <-> our `gpt` family.

HF stores Conv1D weights [in, out] and packs q, k, v into `c_attn`; the output layer is tied to
`wte` unless the checkpoint carries a different `lm_head.weight`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ExecutionConfig, ModelConfig
from lm.storage.convert.hf_config import check_exportable, hf_activation, our_activation, unsupported
from lm.storage.convert.tensors import Checkpoint, FusedQkvDecoder, Tensor

ARCHITECTURE = 'GPT2LMHeadModel'
DEFAULTS = {'vocab_size': 50257, 'n_positions': 1024, 'n_embd': 768, 'n_layer': 12, 'n_head': 12, 'n_inner': None,
            'activation_function': 'gelu_new', 'resid_pdrop': 0.1, 'embd_pdrop': 0.1, 'attn_pdrop': 0.1,
            'layer_norm_epsilon': 1e-5, 'initializer_range': 0.02, 'scale_attn_weights': True,
            'tie_word_embeddings': True}
PREFIX = 'transformer.'
DECODER = FusedQkvDecoder('h.', ('ln_1', 'attn.c_attn', 'attn.c_proj', 'ln_2', 'mlp.c_fc', 'mlp.c_proj'), 'ln_f',
                          'lm_head.weight', 'conv1d', ('conv1d', 'flat'))


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(ARCHITECTURE, hf, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)
  h = {**DEFAULTS, **hf}
  prefix = PREFIX if f'{PREFIX}wte.weight' in ckpt.names else ''  # GPT2Model-style files (the hub's gpt2) have none
  wte = ckpt.get(f'{prefix}wte.weight')
  same = None if wte is None else ckpt.same_as('lm_head.weight', wte)
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['n_embd'], num_layers=h['n_layer'], num_heads=h['n_head'],
    d_ff=h['n_inner'], max_len=h['n_positions'], position='learned', norm='layernorm',
    norm_eps=h['layer_norm_epsilon'], norm_position='pre',
    activation=our_activation(h['activation_function'], 'activation_function', ARCHITECTURE), use_bias=True,
    tie_embeddings=h['tie_word_embeddings'] if same is None else same, scale_attention=h['scale_attn_weights'],
    dropout=h['resid_pdrop'], attention_dropout=h['attn_pdrop'], init_std=h['initializer_range'],
    execution=ExecutionConfig(scan_layers=False))
  return cfg, rules(cfg, prefix)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='learned', norm='layernorm', norm_position='pre', use_bias=True,
                   resolved_head_dim=cfg.d_model // cfg.num_heads, resolved_kv_heads=cfg.num_heads)
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 'gpt2', 'vocab_size': cfg.vocab_size,
    'n_embd': cfg.d_model, 'n_layer': cfg.num_layers, 'n_head': cfg.num_heads, 'n_inner': cfg.d_ff,
    'n_positions': cfg.max_len, 'layer_norm_epsilon': cfg.norm_eps,
    'activation_function': hf_activation(cfg.activation, base.get('activation_function'), ARCHITECTURE),
    'scale_attn_weights': cfg.scale_attention, 'tie_word_embeddings': cfg.tie_embeddings,
    'resid_pdrop': cfg.dropout, 'attn_pdrop': cfg.attention_dropout, 'initializer_range': cfg.init_std}
  hf.setdefault('embd_pdrop', cfg.dropout)
  return hf, rules(cfg, PREFIX)


def rules(cfg: ModelConfig, prefix: str) -> list[Tensor]:
  return DECODER.rules(cfg, prefix, [Tensor(f'{prefix}wte.weight', ('token_embed/embedding',)),
                                     Tensor(f'{prefix}wpe.weight', ('position_embed/embedding',))])
