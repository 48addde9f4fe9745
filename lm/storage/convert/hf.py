"""Hugging Face model directories <-> our models: `load_hf` reads one, `save_hf` writes one back.

A directory holds `config.json` and `model.safetensors` (or shards named by `model.safetensors.index.json`,
as save_pretrained writes checkpoints over 5GB). Supported: each family record's
converter (`Family.hf_converter`): GPT2LMHeadModel (our `gpt`), BertForMaskedLM (`bert`),
T5ForConditionalGeneration (`t5`, v1.0 and v1.1, in the transformers 5 and 4 layouts), LlamaForCausalLM
(`llama`: 2, 3, 3.1, 3.2), MistralForCausalLM (`mistral`), Qwen2ForCausalLM (`qwen2`: 2, 2.5),
Qwen3ForCausalLM (`qwen3`), Gemma2ForCausalLM (`gemma2`), Gemma3ForCausalLM (`gemma3`, and the language
model of Gemma3ForConditionalGeneration), GPTNeoXForCausalLM (`gpt_neox`: Pythia),
OlmoForCausalLM (`olmo`), Olmo2ForCausalLM (`olmo2`), Olmo3ForCausalLM (`olmo3`), and the mixtures of experts
MixtralForCausalLM (`mixtral`), Qwen2MoeForCausalLM (`qwen2_moe`), Qwen3MoeForCausalLM (`qwen3_moe`) and
OlmoeForCausalLM (`olmoe`). Loaded
models are float32 with unrolled layers (`layers_0`, ...); `save_hf` of a loaded model reproduces every tensor of
a transformers-5 checkpoint exactly and writes tied weights once, as `save_pretrained` does. Reads with NumPy only;
torch is not needed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from lm.config import ConfigError, LoraConfig, ModelConfig, MtpConfig
from lm.storage.convert.tensors import Checkpoint, param_shapes, read_params, write_tensors
from lm.models import FAMILIES, build_model, get_family, logical_axes
from lm.models.family import Family
from lm.models.lora import merged
from lm.models.parametrization import fold, standard
from lm.models.transformer import unstack_layers

DTYPES = {'float32': np.float32, 'float16': np.float16, 'bfloat16': jnp.bfloat16}
WEIGHTS, INDEX = 'model.safetensors', 'model.safetensors.index.json'
MAX_SHARD_BYTES = 5 * 2 ** 30  # transformers' save_pretrained default (5GB) splits larger checkpoints


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
  """HF architecture name -> the family whose converter reads it (and writes its `ARCHITECTURE`; `ALSO_READS`
  names the classes it only reads, such as a multimodal checkpoint's language model)."""
  return {name: f for f in FAMILIES.values() if f.hf_converter
          for name in (f.converter().ARCHITECTURE, *getattr(f.converter(), 'ALSO_READS', ()))}


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


def open_hf(path: Path) -> tuple[ModelConfig, Checkpoint, Any]:
  """(model config, the open weights file, the converter's tensor rules) of HF directory `path`."""
  hf = read_hf_config(path)
  family = _family(hf, path)
  converter = family.converter()
  _check_quantization(hf, path, converter)
  ckpt = _checkpoint(path, converter.ARCHITECTURE)
  cfg, rules = converter.load(hf, ckpt)
  return dataclasses.replace(cfg, family=family.name), ckpt, rules


def _check_quantization(hf: dict, path: Path, converter: Any) -> None:
  """A quantized checkpoint loads only where its converter dequantizes that format (`QUANTIZED`: quant_method
  names, `lm.storage.convert.quantized`)."""
  method = (hf.get('quantization_config') or {}).get('quant_method')
  handled = getattr(converter, 'QUANTIZED', ())
  if method and method not in handled:
    raise ConfigError(f'{path}/config.json: quantization_config quant_method {method!r} is not handled when converting '
                      f'{converter.ARCHITECTURE} (handled: {", ".join(handled) or "none"}); load an unquantized '
                      f'checkpoint, or dequantize this one first')


def _checkpoint(path: Path, architecture: str) -> Checkpoint:
  """The weights of HF directory `path`: `model.safetensors`, or the shards its `model.safetensors.index.json`
  maps each tensor to."""
  weights, index = path / WEIGHTS, path / INDEX
  if weights.is_file():
    return Checkpoint(weights, architecture)
  if not index.is_file():
    raise ConfigError(f'{weights} (or a sharded {INDEX}) not found; write the weights with '
                      f'save_pretrained(dir, safe_serialization=True)')
  try:
    weight_map = json.loads(index.read_text())['weight_map']
    shards = {name: path / file for name, file in weight_map.items()}
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f'{index} is not a safetensors index (a JSON "weight_map" of tensor names to files: '
                      f'{type(e).__name__} {e}); re-save the model with save_pretrained') from None
  absent = sorted({str(f.name) for f in shards.values() if not f.is_file()})
  if absent:
    raise ConfigError(f'{index} names shard(s) {", ".join(absent[:3])} not found in {path}; copy every shard')
  return Checkpoint(index, architecture, shards)


def hf_model_config(path: str | Path) -> ModelConfig:
  """The model config of HF directory `path` (only the safetensors header is read)."""
  return open_hf(Path(path))[0]


def load_hf(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
  """(model, float32 params) from a HF directory; `model.apply({'params': params}, ...)` gives its logits."""
  cfg, ckpt, rules = open_hf(Path(path))
  model = build_model(cfg)
  params = read_params(ckpt, rules, param_shapes(model))
  ckpt.warn_unused()
  return model, params


def save_hf(model: nn.Module | ModelConfig, params: dict[str, Any], path: str | Path,
            hf_config: dict[str, Any] | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
  """Writes `config.json` and `model.safetensors` for `params` into directory `path`; weights over
  `max_shard_bytes` go into shards `model-0000i-of-0000n.safetensors` with the index transformers reads.

  `hf_config` (e.g. the original config.json) supplies the fields our config does not describe
  (token ids, dtype, ...); the architecture fields always come from the model config.
  """
  cfg = model.cfg if isinstance(model, nn.Module) else model
  params = jax.device_get(nn.unbox(params))
  if cfg.execution.scan_layers:
    params, cfg = unstack_layers(params), cfg.with_execution(scan_layers=False)
  if cfg.parametrization != 'standard':  # HF models know no μP multipliers: fold them into the weights
    params = fold(params, logical_axes(build_model(cfg)), cfg, get_family(cfg.family).readout_norm)
    cfg = standard(cfg)
  if cfg.lora.rank:  # HF models know no adapters: fold them into their kernels
    params, cfg = merged(params, cfg.lora), dataclasses.replace(cfg, lora=LoraConfig())
  converter = get_family(cfg.family).converter()
  if cfg.mtp.depth and not getattr(converter, 'MTP', False):  # a training aid the architecture has no place for
    warnings.warn(f'{converter.ARCHITECTURE} has no multi-token prediction modules: the {cfg.mtp.depth} '
                  f'model.mtp module(s) are left out of {path}', stacklevel=2)
    params = {k: v for k, v in params.items() if not k.startswith('mtp_')}
    cfg = dataclasses.replace(cfg, mtp=MtpConfig())
  flat = {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params, sep='/').items()}
  expected = param_shapes(build_model(cfg))
  wrong = [f'{k} missing' for k in sorted(set(expected) - set(flat))] + [f'{k} unexpected' for k in sorted(
    set(flat) - set(expected))] or [f'{k} {flat[k].shape} != {s}' for k, s in expected.items() if flat[k].shape != s]
  if wrong:
    raise ConfigError(f'params do not match the model config ({", ".join(wrong[:3])}); pass the config '
                      f'the params were trained with')
  hf, rules = converter.save(cfg, flat, dict(hf_config or {}))
  if 'torch_dtype' not in hf:
    hf.setdefault('dtype', 'float32')
  dtype_name = hf.get('dtype') or hf['torch_dtype']
  if dtype_name not in DTYPES:
    raise ConfigError(f'cannot write HF dtype {dtype_name!r}; choose one of: {", ".join(DTYPES)}')
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = write_tensors(rules, flat, DTYPES[dtype_name])
  shards = _shards(tensors, max_shard_bytes)
  umask = os.umask(0)
  os.umask(umask)
  for name, shard in shards.items():
    save_file(shard, str(path / name), metadata={'format': 'pt'})
    (path / name).chmod(0o666 & ~umask)  # safetensors writes 0600; give it the mode any other file gets
  if len(shards) > 1:
    index = {'metadata': {'total_size': sum(a.nbytes for a in tensors.values())},
             'weight_map': {tensor: name for name, shard in shards.items() for tensor in shard}}
    (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + '\n')
  (path / 'config.json').write_text(json.dumps(hf, indent=2, sort_keys=True) + '\n')
  return path


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> dict[str, dict[str, np.ndarray]]:
  """File name -> its tensors: one `model.safetensors`, or consecutive runs of tensors of at most `max_bytes`
  each (a bigger tensor alone), named as save_pretrained names them."""
  groups: list[dict[str, np.ndarray]] = [{}]
  for name, a in tensors.items():
    if groups[-1] and sum(x.nbytes for x in groups[-1].values()) + a.nbytes > max_bytes:
      groups.append({})
    groups[-1][name] = a
  if len(groups) == 1:
    return {WEIGHTS: groups[0]}
  return {f'model-{i:05d}-of-{len(groups):05d}.safetensors': g for i, g in enumerate(groups, 1)}
