"""config.json conventions the HF converters share: activation names, unsupported settings, export checks.

Each converter module (`gpt2`, `bert`, `t5`, `llama`), named by its family record's `hf_converter`,
provides `ARCHITECTURE` (the transformers class), `load(hf_config, checkpoint) -> (ModelConfig, rules)`
(the family field is filled in by `lm.storage.convert.hf`) and
`save(model_config, flat_params, base_hf_config) -> (hf_config, rules)`.
"""
from __future__ import annotations

import functools
from typing import Any

from lm.config import ConfigError, MlaConfig, ModelConfig, MoeConfig

# transformers ACT2FN names -> ours, and back (the first HF name of each is the canonical one).
ACTIVATIONS = {'gelu': 'gelu', 'gelu_python': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh',
               'relu': 'relu', 'silu': 'silu', 'swish': 'silu'}
HF_ACTIVATIONS = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new', 'relu': 'relu', 'silu': 'silu'}
GATED = {'silu': 'swiglu', 'gelu': 'geglu', 'gelu_tanh': 'geglu_tanh', 'relu': 'reglu'}  # a gate's activation: ours


def our_activation(name: str, key: str, architecture: str) -> str:
  if name not in ACTIVATIONS:
    raise ConfigError(f'config.json {key}={name!r} is not supported for {architecture}; '
                      f'supported: {", ".join(sorted(ACTIVATIONS))}')
  return ACTIVATIONS[name]


def hf_activation(ours: str, base_name: Any, architecture: str) -> str:
  """HF name of activation `ours`, keeping the base config's spelling when it means the same."""
  if ours not in HF_ACTIVATIONS:
    raise ConfigError(f'cannot export model.activation={ours!r} as {architecture}; '
                      f'it supports: {", ".join(HF_ACTIVATIONS)}')
  return base_name if ACTIVATIONS.get(base_name) == ours else HF_ACTIVATIONS[ours]


def hf_gated_activation(ours: str, base_name: Any, architecture: str) -> str:
  """HF name of the gate's activation of our gated MLP `ours` (swiglu: silu), keeping the base config's spelling."""
  plain = {v: k for k, v in GATED.items()}
  if ours not in plain:
    raise ConfigError(f'cannot export model.activation={ours!r} as {architecture}; it supports the gated '
                      f'activations: {", ".join(plain)}')
  return hf_activation(plain[ours], base_name, architecture)


def hf_sizes(cfg: ModelConfig) -> dict[str, int]:
  """The size keys BERT's, GPT-NeoX's and the Llama layout's config.json spell alike."""
  return {'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model, 'intermediate_size': cfg.resolved_d_ff,
          'num_hidden_layers': cfg.num_layers, 'num_attention_heads': cfg.num_heads,
          'max_position_embeddings': cfg.max_len}


def unsupported(architecture: str, hf: dict, **allowed: Any) -> None:
  """ConfigError when a config.json setting has a value our models cannot reproduce."""
  for key, value in allowed.items():
    if hf.get(key, value) != value:
      raise ConfigError(f'config.json {key}={hf[key]!r} is not supported when converting {architecture} '
                        f'(only {value!r})')


# Settings only some architectures express: every other one refuses them unless its converter names them.
# (a dotted name reaches into a group: the windowed layers' own rotation is Gemma 3's)
RARELY_EXPRESSED = {'clip_qkv': 0.0, 'qk_norm_scope': 'head', 'global_every': 0, 'global_layers': (),
                    'moe': MoeConfig(), 'rope.local_theta': 0.0, 'attention_sinks': False, 'mla': MlaConfig(),
                    'rope.interleaved': False, 'rope.scale_logits': False}

SLIDING, FULL = 'sliding_attention', 'full_attention'  # config.json layer_types


def window_pattern(layer_types: list[str], n: int, architecture: str) -> dict[str, Any]:
  """`model.global_every` k when exactly the k-th, 2k-th, ... of the `n` layers are global (k = 1: all; 0: none),
  else `model.global_layers`; a ConfigError for a count other than n or a type other than sliding or full."""
  if len(layer_types) != n:
    raise ConfigError(f'config.json layer_types lists {len(layer_types)} layers, num_hidden_layers={n}; list one '
                      f'type per layer')
  if set(layer_types) - {SLIDING, FULL}:
    raise ConfigError(f'config.json layer_types {sorted(set(layer_types) - {SLIDING, FULL})} are not supported when '
                      f'converting {architecture} (only {SLIDING} and {FULL})')
  for every in (0, *range(1, n + 1)):
    if layer_types == [FULL if every and (i + 1) % every == 0 else SLIDING for i in range(n)]:
      return {'global_every': every}
  return {'global_layers': tuple(i for i, kind in enumerate(layer_types) if kind == FULL)}


def hf_layer_types(cfg: ModelConfig) -> list[str]:
  """config.json `layer_types` of a model: each layer global (full) or windowed (sliding)."""
  full = set(cfg.global_layer_indices) if cfg.sliding_window else set(range(cfg.num_layers))
  return [FULL if i in full else SLIDING for i in range(cfg.num_layers)]


def check_exportable(cfg: ModelConfig, architecture: str, **expected: Any) -> None:
  """ConfigError naming each model setting that the HF architecture cannot express."""
  expected = {**RARELY_EXPRESSED, **expected}
  value = lambda key: functools.reduce(getattr, key.split('.'), cfg)
  wrong = [f'model.{k}={value(k)!r} (needs {v!r})' for k, v in expected.items() if value(k) != v]
  if wrong:
    raise ConfigError(f'cannot export this {cfg.family} model as {architecture}: {", ".join(wrong)}')
