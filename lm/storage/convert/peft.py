"""A run's low-rank adapters (`model.lora`) as a Hugging Face PEFT LoRA adapter: `adapter_config.json` and
`adapter_model.safetensors`, whose tensors PEFT names after the base model's modules
(`base_model.model.<module>.lora_A.weight` [rank, in], `.lora_B.weight` [out, rank]).

Each adapter goes with the HF tensor its kernel is (the family converter's rules), so the adapter loads onto the HF
model `--to-hf` writes without the adapters (`PeftModel.from_pretrained(base, DIR)`). A projection HF fuses with
others (GPT-2's `c_attn`, GPT-NeoX's `query_key_value`) has no adapter of its own there: refused, as is a trained
task head (PEFT's `modules_to_save`, not written yet); both export merged with `--to-hf`."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from lm.config import ConfigError, LoraConfig, ModelConfig
from lm.models import build_model, get_family
from lm.models.lora import ADAPTED, ADAPTERS
from lm.models.transformer import unstack_layers
from lm.storage.convert.hf import open_hf
from lm.storage.convert.tensors import Checkpoint, Tensor, param_shapes, read_params, write_tensors

ADAPTER_CONFIG, ADAPTER_WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'
PREFIX = 'base_model.model.'  # where PeftModel keeps the base model's modules


def save_peft(cfg: ModelConfig, params: Any, path: str | Path, base_model: str | None = None) -> Path:
  """Writes the adapters of `params` (a model with `cfg.lora`) as a PEFT LoRA adapter in directory `path`;
  `base_model`: what adapter_config.json names as its base (`base_model_name_or_path`)."""
  family = get_family(cfg.family)
  if not cfg.lora.rank:
    raise ConfigError('this model has no adapters (model.lora.rank=0): export it whole with --to-hf')
  params = jax.device_get(nn.unbox(params))
  if cfg.execution.scan_layers:
    params, cfg = unstack_layers(params), cfg.with_execution(scan_layers=False)
  heads = sorted(family.per_sequence_params() & set(params))
  if heads:
    raise ConfigError(f'the task head ({", ".join(heads)}) trained beside the adapters is not written into a PEFT '
                      f'adapter yet; export the merged model with --to-hf')
  flat = {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params, sep='/').items()}
  experts = sorted(k.removesuffix('/lora_a') for k in flat if k.endswith(f'{ADAPTED}/lora_a'))
  if experts:
    raise ConfigError(f'{experts[0]}: the routed experts\' adapters (model.lora.targets experts) are not written as '
                      f'a PEFT adapter yet; export the merged model with --to-hf')
  base = {k: v for k, v in flat.items() if k.rsplit('/', 1)[-1] not in ADAPTERS}
  converter = family.converter()
  _, rules = converter.save(dataclasses.replace(cfg, lora=LoraConfig()), base, {})
  adapters, targets = _adapter_rules(flat, rules, converter.ARCHITECTURE)
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(write_tensors(adapters, flat, np.float32), str(path / ADAPTER_WEIGHTS), metadata={'format': 'pt'})
  lora = cfg.lora
  config = {'peft_type': 'LORA', 'task_type': family.peft_task, 'r': lora.rank, 'lora_alpha': lora.alpha,
            'lora_dropout': lora.dropout, 'use_rslora': lora.rslora, 'target_modules': sorted(targets),
            'bias': 'none', 'fan_in_fan_out': False, 'modules_to_save': None, 'inference_mode': True,
            'base_model_name_or_path': base_model, 'init_lora_weights': True}
  (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + '\n')
  return path


def _adapter_rules(flat: dict[str, np.ndarray], rules: list[Tensor], architecture: str
                   ) -> tuple[list[Tensor], set[str]]:
  """PEFT's tensors of each adapter (A [*in, rank] as lora_A [rank, in], B [rank, *out] as lora_B [out, rank]),
  from the rule of the kernel it adapts; and the module names PEFT targets."""
  own = {rule.params[0]: rule for rule in rules if len(rule.params) == 1 and rule.index is None}
  out, targets = [], set()
  for key in sorted(k for k in flat if k.endswith('/lora_a')):
    module = key.removesuffix('/lora_a')
    rule = own.get(f'{module}/kernel')
    if rule is None or rule.layout != 'linear':
      raise ConfigError(f'{architecture} holds {module}/kernel fused with other projections, where PEFT has no '
                        f'adapter of its own for it; drop it from model.lora.targets or export merged with --to-hf')
    hf = rule.name.removesuffix('.weight')
    out += [Tensor(f'{PREFIX}{hf}.lora_A.weight', (key,), 'linear', rule.n_in),
            Tensor(f'{PREFIX}{hf}.lora_B.weight', (f'{module}/lora_b',), 'linear')]
    targets.add(hf)
  return out, _target_names(targets, {rule.name.rsplit('.', 1)[0] for rule in rules})


def _target_names(adapted: set[str], modules: set[str]) -> set[str]:
  """PEFT's target_modules for the HF modules `adapted`, of all the base's `modules`: each one's last name (q_proj),
  or where that also names a module left alone (BERT's MLM-head `dense` beside its layers'), its path after the layer
  index (attention.output.dense), which PEFT matches as a suffix."""
  others = modules - adapted
  names = set()
  for module in adapted:
    last = module.rsplit('.', 1)[-1]
    clash = any(other == last or other.endswith('.' + last) for other in others)
    names.add(re.split(r'\.\d+\.', module, maxsplit=1)[-1] if clash else last)
  return names


def is_adapter_dir(path: str | Path) -> bool:
  return (Path(path) / ADAPTER_CONFIG).is_file()


def _read_adapter_config(path: Path) -> tuple[dict, Path]:
  """(adapter_config.json, its base model's directory); ConfigError for what lm cannot load."""
  config = json.loads((path / ADAPTER_CONFIG).read_text())
  if config.get('peft_type') != 'LORA':
    raise ConfigError(f'{path}/{ADAPTER_CONFIG}: peft_type {config.get("peft_type")!r} is not supported; lm loads '
                      f'LORA adapters')
  unsupported = {k: config.get(k) for k in ('layers_to_transform', 'modules_to_save', 'rank_pattern',
                                            'alpha_pattern', 'use_dora') if config.get(k)}
  if config.get('bias', 'none') != 'none':
    unsupported['bias'] = config['bias']
  if unsupported:
    raise ConfigError(f'{path}/{ADAPTER_CONFIG}: {", ".join(f"{k}={v!r}" for k, v in unsupported.items())} is not '
                      f'supported; lm loads plain LoRA adapters on every layer, without trained biases or modules')
  base = Path(config.get('base_model_name_or_path') or '')
  if not (base / 'config.json').is_file():
    raise ConfigError(f'{path}/{ADAPTER_CONFIG}: base_model_name_or_path {str(base)!r} is not a Hugging Face model '
                      f'directory here; set it to the local directory of the base model')
  return config, base



def load_peft(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
  """(model with `model.lora`, float32 params) from a PEFT LoRA adapter directory and the HF base model its
  adapter_config.json names: the base's params as `load_hf` reads them, each adapter placed by the rule of the
  kernel it adapts; ConfigError for an adapter that does not fit that base."""
  path = Path(path)
  config, base = _read_adapter_config(path)
  cfg, ckpt, rules = open_hf(base)
  placed = _placed(path, rules, ckpt.architecture)
  lora = LoraConfig(rank=int(config['r']), alpha=float(config.get('lora_alpha', 8)),
                    dropout=float(config.get('lora_dropout') or 0.0),
                    targets=tuple(sorted({ours.rsplit('/', 1)[-1] for ours, _ in placed.values()})),
                    rslora=bool(config.get('use_rslora')))
  model = build_model(dataclasses.replace(cfg, lora=lora))
  shapes = param_shapes(model)
  adapter = lambda name: name.rsplit('/', 1)[-1] in ADAPTERS
  params = read_params(ckpt, rules, {k: v for k, v in shapes.items() if not adapter(k)})
  ckpt.warn_unused()
  tensors = [t for hf, (ours, rule) in placed.items()
             for t in (Tensor(f'{PREFIX}{hf}.lora_A.weight', (f'{ours}/lora_a',), 'linear', rule.n_in),
                       Tensor(f'{PREFIX}{hf}.lora_B.weight', (f'{ours}/lora_b',), 'linear'))]
  wanted = {k: v for k, v in shapes.items() if adapter(k)}
  missing = sorted(set(wanted) - {p for t in tensors for p in t.params})
  if missing:
    raise ConfigError(f'{path}: the adapter leaves {missing[0].removesuffix("/lora_a").removesuffix("/lora_b")} '
                      f'without adapters, where lm adapts every projection of a targeted name; target every layer')
  try:
    adapters = read_params(Checkpoint(path / ADAPTER_WEIGHTS, 'PEFT LoRA adapter'), tensors, wanted)
  except ConfigError as e:
    raise ConfigError(f'{path} is not an adapter of {base}: {e}') from None
  return model, traverse_util.unflatten_dict({**traverse_util.flatten_dict(params, sep='/'),
                                              **traverse_util.flatten_dict(adapters, sep='/')}, sep='/')


def _placed(path: Path, rules: list[Tensor], architecture: str) -> dict[str, tuple[str, Tensor]]:
  """Each module the adapter file adapts (PEFT's name, without its prefix) -> (our module, its kernel's rule)."""
  with safe_open(str(path / ADAPTER_WEIGHTS), framework='numpy') as f:
    names = list(f.keys())
  own = {rule.name.removesuffix('.weight'): rule for rule in rules
         if len(rule.params) == 1 and rule.index is None and rule.layout == 'linear'}
  placed = {}
  for name in names:
    match = re.fullmatch(rf'{re.escape(PREFIX)}(.+)\.lora_[AB]\.weight', name)
    if match is None or match[1] not in own:
      raise ConfigError(f'{path}: adapter tensor {name!r} adapts no projection lm holds apart in {architecture}; '
                        f'target the attention and MLP projections (q_proj, ..., down_proj)')
    placed[match[1]] = own[match[1]].params[0].removesuffix('/kernel'), own[match[1]]
  return placed


def base_of(path: str | Path) -> Path:
  """The local directory of the base model a PEFT adapter directory names."""
  return _read_adapter_config(Path(path))[1]
