"""Gemma 3 (`Gemma3ForCausalLM`, and the language model of `Gemma3ForConditionalGeneration`) <-> our `gemma3`
family: Gemma 2's layout (sandwich (1 + w) RMSNorms, embeddings times sqrt(d_model) tied to the output, GeGLU,
logits scaled by `query_pre_attn_scalar`^-0.5) with (1 + w) RMSNorms of each head's queries and keys, no soft-caps
(unless config.json sets them), and rotary settings per layer type: windowed layers at their own base wavelength,
unscaled (`model.rope.local_theta`, config.json's `sliding_attention`), global ones at `model.rope` (the
`full_attention` settings: 1e6, linear x 8 on 4B and larger). Windowed layers come five to a global one
(`layer_types`, or the older `sliding_window_pattern`).

A multimodal checkpoint's `text_config` and `language_model` tensors load (in transformers 5's layout,
`model.language_model.*`, or the one save_pretrained writes, `language_model.model.*`); its vision tower and
projector are left out, with a warning naming them. Export writes the text-only `Gemma3ForCausalLM`."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lm.config import ConfigError, ModelConfig, RopeConfig
from lm.storage.convert import gemma2
from lm.storage.convert.hf_config import FULL, SLIDING, check_exportable, hf_layer_types
from lm.storage.convert.llama import hf_rope, rope_fields
from lm.storage.convert.tensors import Checkpoint, Tensor, norm

ARCHITECTURE = 'Gemma3ForCausalLM'
ALSO_READS = ('Gemma3ForConditionalGeneration',)  # its language model
DEFAULTS = {**gemma2.DEFAULTS, 'vocab_size': 262208, 'max_position_embeddings': 131072, 'attn_logit_softcapping': None,
            'final_logit_softcapping': None, 'sliding_window_pattern': 6}
THETA = {FULL: 1e6, SLIDING: 1e4}  # transformers' defaults per layer type
# where a multimodal checkpoint keeps the language model's tensors: transformers 5's names, then save_pretrained's
PREFIXES = {'model.language_model.': 'model.', 'language_model.model.': 'model.', 'language_model.lm_head.': 'lm_head.'}


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  if 'text_config' in hf:  # Gemma3ForConditionalGeneration
    hf = hf['text_config'] or {}
    for name in sorted(ckpt.names):
      for prefix, ours in PREFIXES.items():
        if name.startswith(prefix):
          ckpt.derive(ours + name[len(prefix):], name, lambda a: a)
  if hf.get('use_bidirectional_attention'):
    raise ConfigError(f'config.json use_bidirectional_attention=true (an embedding model) is not supported when '
                      f'converting {ARCHITECTURE}; lm converts the causal language model')
  h = {**DEFAULTS, **hf}
  n = h['num_hidden_layers']
  every = h.get('_sliding_window_pattern') or h['sliding_window_pattern']
  types = {**h, 'layer_types': h.get('layer_types') or [SLIDING if (i + 1) % every else FULL for i in range(n)]}
  cfg, _ = gemma2.load({**types, 'use_bidirectional_attention': None, 'rope_parameters': None, 'rope_scaling': None},
                       ckpt, ARCHITECTURE)
  rope = _rope(h)
  if cfg.sliding_window and not cfg.global_layer_indices:  # every layer windowed (fewer than six)
    rope = rope.local()
  elif not cfg.sliding_window:  # every layer global
    rope = dataclasses.replace(rope, local_theta=0.0)
  return dataclasses.replace(cfg, qk_norm=True, rope=rope), rules(cfg)


def _rope(h: dict) -> RopeConfig:
  """`model.rope` from the per-type settings (transformers 5) or rope_theta, rope_local_base_freq and rope_scaling
  (transformers 4): the global layers' rotation, the windowed layers' unscaled base wavelength as `local_theta`."""
  params = h.get('rope_parameters') or {}
  if isinstance(params.get(FULL), dict):
    full, local = params[FULL], params.get(SLIDING) or {}
  else:
    full = {**(params or h.get('rope_scaling') or {}), 'rope_theta': h.get('rope_theta', THETA[FULL])}
    local = {'rope_theta': h.get('rope_local_base_freq', THETA[SLIDING])}
  if local.get('rope_type', local.get('type', 'default')) != 'default':
    raise ConfigError(f'config.json sliding_attention rope type {local.get("rope_type", local.get("type"))!r} is not '
                      f'supported when converting {ARCHITECTURE} (windowed layers rotate unscaled)')
  rope = rope_fields({**h, 'rope_parameters': {'rope_theta': THETA[FULL], **full}, 'rope_scaling': None},
                     ARCHITECTURE)['rope']
  return dataclasses.replace(rope, local_theta=float(local.get('rope_theta', THETA[SLIDING])))


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='rmsnorm', norm_position='sandwich', norm_plus_one=True,
                   use_bias=False, qkv_bias=False, qk_norm=True, tie_embeddings=True, scale_embeddings=True,
                   scale_attention=True, global_every=cfg.global_every, global_layers=cfg.global_layers,
                   **{'rope.local_theta': cfg.rope.local_theta})
  base = dict(base.get('text_config') or base)
  for key in ('rope_theta', 'rope_local_base_freq', 'rope_scaling', 'rope_parameters', 'sliding_window_pattern',
              '_sliding_window_pattern'):
    base.pop(key, None)
  # Gemma 2's writer, told of no query/key norms (checked above) and one rotation (written per type below)
  local = dataclasses.replace(cfg, qk_norm=False, rope=dataclasses.replace(cfg.rope, local_theta=0.0))
  hf, _ = gemma2.save(local, flat, base)
  full = hf_rope(local, {}, per_layer_type=True)['rope_parameters'][FULL]
  sliding = {'rope_type': 'default', 'rope_theta': cfg.rope.local_theta or cfg.rope.theta}
  hf.update({'model_type': 'gemma3_text', 'architectures': [ARCHITECTURE], 'layer_types': hf_layer_types(cfg),
             'rope_parameters': {FULL: full, SLIDING: sliding if cfg.rope.local_theta else full},
             'use_bidirectional_attention': False})
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  out = gemma2.rules(cfg)
  for i in range(cfg.num_layers):
    h, o = f'model.layers.{i}.self_attn.', f'decoder/layers_{i}/attention/'
    out += [*norm(f'{h}q_norm', f'{o}query_norm', bias=False), *norm(f'{h}k_norm', f'{o}key_norm', bias=False)]
  return out
