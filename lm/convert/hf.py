"""Hugging Face model directories <-> our models: `load_hf` reads one, `save_hf` writes one back.

A directory holds `config.json` and a single `model.safetensors`. Supported: each family record's
converter (`Family.hf_converter`): GPT2LMHeadModel (our `gpt`), BertForMaskedLM (`bert`),
T5ForConditionalGeneration (`t5`, v1.0 and v1.1, in the transformers 5 and 4 layouts) and
LlamaForCausalLM (`llama`). Loaded models are float32 with unrolled layers (`layers_0`, ...);
`save_hf` of a loaded model reproduces every tensor of a transformers-5 checkpoint exactly and
writes tied weights once, as `save_pretrained` does. Reads with NumPy only; torch is not needed.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from lm.config import ConfigError, ModelConfig
from lm.convert.tensors import Checkpoint, param_shapes, read_params, write_tensors
from lm.models import FAMILIES, build_model, get_family, logical_axes
from lm.models.family import Family
from lm.models.parametrization import fold, standard
from lm.models.transformer import unstack_layers

DTYPES = {'float32': np.float32, 'float16': np.float16, 'bfloat16': jnp.bfloat16}


def read_hf_config(path: str | Path) -> dict[str, Any]:
  """The parsed `config.json` of HF model directory `path`."""
  file = Path(path) / 'config.json'
  if not file.is_file():
    raise ConfigError(f'{file} not found; pass a Hugging Face model directory holding config.json and '
                      f'model.safetensors (save_pretrained(dir, safe_serialization=True) writes both)')
  try:
    hf = json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f'{file} is not valid JSON ({e}); fix or re-save it') from None
  if not isinstance(hf, dict):
    raise ConfigError(f'{file} must hold a JSON object of settings, not {type(hf).__name__}')
  return hf


def architectures() -> dict[str, Family]:
  """HF architecture name -> the family whose converter reads and writes it."""
  return {f.converter().ARCHITECTURE: f for f in FAMILIES.values() if f.hf_converter}


def _family(hf: dict, where: Path) -> Family:
  names = hf.get('architectures') or []
  known = architectures()
  supported = ', '.join(known)
  if not names:
    raise ConfigError(f'{where}/config.json names no "architectures"; set it to one of: {supported}')
  if names[0] not in known:
    raise ConfigError(f'architecture {names[0]!r} in {where}/config.json is not supported; '
                      f'supported architectures: {supported}')
  return known[names[0]]


def _open(path: Path) -> tuple[ModelConfig, Checkpoint, Any]:
  """(model config, the open weights file, the converter's tensor rules) of HF directory `path`."""
  hf = read_hf_config(path)
  family = _family(hf, path)
  weights = path / 'model.safetensors'
  if not weights.is_file():
    sharded = ' (sharded checkpoints are not supported)' if (path / 'model.safetensors.index.json').exists() else ''
    raise ConfigError(f'{weights} not found{sharded}; write the weights as one safetensors file with '
                      f'save_pretrained(dir, safe_serialization=True, max_shard_size="100GB")')
  converter = family.converter()
  ckpt = Checkpoint(weights, converter.ARCHITECTURE)
  cfg, rules = converter.load(hf, ckpt)
  return dataclasses.replace(cfg, family=family.name), ckpt, rules


def hf_model_config(path: str | Path) -> ModelConfig:
  """The model config of HF directory `path` (only the safetensors header is read)."""
  return _open(Path(path))[0]


def load_hf(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
  """(model, float32 params) from a HF directory; `model.apply({'params': params}, ...)` gives its logits."""
  cfg, ckpt, rules = _open(Path(path))
  model = build_model(cfg)
  params = read_params(ckpt, rules, param_shapes(model))
  ckpt.warn_unused()
  return model, params


def save_hf(model: nn.Module | ModelConfig, params: dict[str, Any], path: str | Path,
            hf_config: dict[str, Any] | None = None) -> Path:
  """Writes `config.json` and `model.safetensors` for `params` into directory `path`.

  `hf_config` (e.g. the original config.json) supplies the fields our config does not describe
  (token ids, dtype, ...); the architecture fields always come from the model config.
  """
  cfg = model.cfg if isinstance(model, nn.Module) else model
  params = jax.device_get(nn.unbox(params))
  if cfg.scan_layers:
    params, cfg = unstack_layers(params), dataclasses.replace(cfg, scan_layers=False)
  if cfg.parametrization != 'standard':  # HF models know no μP multipliers: fold them into the weights
    params = fold(params, logical_axes(build_model(cfg)), cfg, get_family(cfg.family).readout_norm)
    cfg = standard(cfg)
  flat = {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params, sep='/').items()}
  expected = param_shapes(build_model(cfg))
  wrong = [f'{k} missing' for k in sorted(set(expected) - set(flat))] + [f'{k} unexpected' for k in sorted(
    set(flat) - set(expected))] or [f'{k} {flat[k].shape} != {s}' for k, s in expected.items() if flat[k].shape != s]
  if wrong:
    raise ConfigError(f'params do not match the model config ({", ".join(wrong[:3])}); pass the config '
                      f'the params were trained with')
  hf, rules = get_family(cfg.family).converter().save(cfg, flat, dict(hf_config or {}))
  if 'torch_dtype' not in hf:
    hf.setdefault('dtype', 'float32')
  dtype_name = hf.get('dtype') or hf['torch_dtype']
  if dtype_name not in DTYPES:
    raise ConfigError(f'cannot write HF dtype {dtype_name!r}; choose one of: {", ".join(DTYPES)}')
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  weights = path / 'model.safetensors'
  save_file(write_tensors(rules, flat, DTYPES[dtype_name]), str(weights), metadata={'format': 'pt'})
  umask = os.umask(0)
  os.umask(umask)
  weights.chmod(0o666 & ~umask)  # safetensors writes 0600; give it the mode any other file gets
  (path / 'config.json').write_text(json.dumps(hf, indent=2, sort_keys=True) + '\n')
  return path
