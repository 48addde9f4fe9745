"""A run's low-rank adapters (`model.lora`) as a Hugging Face PEFT LoRA adapter: `adapter_config.json` and
`adapter_model.safetensors`, whose tensors PEFT names after the base model's modules
(`base_model.model.<module>.lora_A.weight` [rank, in], `.lora_B.weight` [out, rank]).

Each adapter goes with the HF tensor its kernel is (the family converter's rules), so the adapter loads onto the HF
model `--to-hf` writes without the adapters (`PeftModel.from_pretrained(base, DIR)`). Where HF fuses projections
(GPT-2's `c_attn`, GPT-NeoX's `query_key_value`) their adapters become one of the fused module's, of rank parts x
rank (`rank_pattern`, with the `alpha_pattern` that keeps the scale), B block-diagonal: what they compute, exactly.
The routed experts' adapters go to the fused parameters transformers 5 holds them in (`mlp.experts.gate_up_proj`,
`down_proj`) as PEFT's `target_parameters` adapters: per expert A side by side, B block-diagonal over gate and up
(or interleaved, as GPT-OSS's gate_up_proj). A fine-tune's task head, trained whole beside them, is written whole as
PEFT's `modules_to_save` of a SEQ_CLS adapter, named as the HF sequence classifier names it (`score`; BERT's
`bert.pooler.dense` and `classifier`): it loads onto `AutoModelForSequenceClassification` of the base."""
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
from lm.models.lora import ADAPTERS
from lm.models.moe import ADAPTED
from lm.models.transformer import unstack_layers
from lm.storage.convert.hf import open_hf
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, param_shapes, read_params, write_tensors

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
  flat = {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params, sep='/').items()}
  converter = family.converter()
  head = {k: flat.pop(k) for k in [k for k in flat if k.split('/', 1)[0] in heads]}
  experts = {k: flat.pop(k) for k in [k for k in flat if k.endswith('/lora_a') or k.endswith('/lora_b')]
             if k.rsplit('/', 2)[-2].endswith(ADAPTED)}
  if experts and not hasattr(converter, 'experts_in_memory'):
    raise ConfigError(f'{converter.ARCHITECTURE} has no routed experts to take the experts\' adapters '
                      f'(model.lora.targets experts); fine-tune a model.family whose architecture routes them '
                      f'(mixtral, qwen3_moe, deepseek_v3, ...)')
  base = {k: v for k, v in flat.items() if k.rsplit('/', 1)[-1] not in ADAPTERS}
  _, rules = converter.save(dataclasses.replace(cfg, lora=LoraConfig()), base, {})
  tensors, modules, ranks = _adapter_tensors(flat, rules, cfg.lora)
  if head:  # the HF sequence classifier's own names (a decoder's `score`, by default)
    named = getattr(converter, 'SEQUENCE_HEAD', dense('score', 'score', 'linear', bias=False))
    tensors.update({f'{PREFIX}{k}': v for k, v in write_tensors(named, head, np.float32).items()})
  parameters = _expert_tensors(experts, converter.experts_in_memory(cfg), tensors, ranks) if experts else []
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={'format': 'pt'})
  lora, names = cfg.lora, _target_names(set(modules), {rule.name.rsplit('.', 1)[0] for rule in rules})
  names.update({m: m for m in ranks if m not in names})  # the experts' parameters, by their whole names
  fused = {names[m]: r for m, r in ranks.items()}  # a fused projection's rank: its parts' adapters side by side
  config = {'peft_type': 'LORA', 'task_type': 'SEQ_CLS' if heads else family.peft_task, 'r': lora.rank,
            'lora_alpha': lora.alpha, 'lora_dropout': lora.dropout, 'use_rslora': lora.rslora,
            'target_modules': sorted(set(names.values())),
            'target_parameters': parameters or None,
            'bias': 'none', 'fan_in_fan_out': any(layout == 'conv1d' for layout in modules.values()),
            'rank_pattern': fused, 'alpha_pattern': {k: lora.scale * (r ** 0.5 if lora.rslora else r)
                                                     for k, r in fused.items()},
            'modules_to_save': heads or None, 'inference_mode': True, 'base_model_name_or_path': base_model,
            'init_lora_weights': True}
  (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + '\n')
  return path


def _adapter_tensors(flat: dict[str, np.ndarray], rules: list[Tensor], lora: LoraConfig
                     ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, int]]:
  """PEFT's tensors of the adapters (lora_A [rank, in], lora_B [out, rank]), each placed by the rule of the kernel
  it adapts; the HF modules adapted, with their weight's layout; and the rank of each fused one."""
  own = {rule.params[0]: rule for rule in rules if len(rule.params) == 1 and rule.index is None}
  fused = {p: rule for rule in rules if len(rule.params) > 1 and rule.index is None for p in rule.params}
  tensors, modules, ranks = {}, {}, {}
  for key in sorted(k for k in flat if k.endswith('/lora_a')):
    kernel = key.removesuffix('/lora_a') + '/kernel'
    rule = own.get(kernel) or fused.get(kernel)
    if rule is None:
      raise ConfigError(f'{kernel} is no tensor of the HF model; drop it from model.lora.targets or export merged '
                        f'with --to-hf')
    hf = rule.name.removesuffix('.weight')
    if hf in modules:  # a fused projection, written whole with its first adapted part
      continue
    if len(rule.params) > 1:
      a, b = _fused(rule, flat, lora.rank)
      ranks[hf] = a.shape[0]
    else:
      a, b = (write_tensors([Tensor('x', (key.removesuffix('lora_a') + name,), 'linear', n)], flat, np.float32)['x']
              for name, n in (('lora_a', rule.n_in), ('lora_b', 1)))
    tensors[f'{PREFIX}{hf}.lora_A.weight'], tensors[f'{PREFIX}{hf}.lora_B.weight'] = a, b
    modules[hf] = rule.layout
  return tensors, modules, ranks


def _expert_tensors(flat: dict[str, np.ndarray], in_memory: dict[str, tuple[str, int, bool]],
                    tensors: dict[str, np.ndarray], ranks: dict[str, int]) -> list[str]:
  """Adds PEFT's tensors of the routed experts' adapters (`flat`: ours, '<kernel>_lora/lora_a' [E, in, r] and
  lora_b [E, r, out]) to `tensors`, and the rank of each fused parameter to `ranks`; returns `target_parameters`.

  PEFT wraps the experts' module once per parameter, the first named innermost (`experts.base_layer.lora_A`), and
  computes each expert's update of an [E, out, in] parameter as B[:, :, e] @ A[e] from lora_A [E x R, in] (expert
  major) and lora_B [out, R x E] (expert minor)."""
  by_parameter: dict[str, list[tuple[int, str]]] = {}
  for key in sorted(k for k in flat if k.endswith('/lora_a')):
    kernel = key.removesuffix(f'{ADAPTED}/lora_a')
    name, part, _ = in_memory[kernel]
    by_parameter.setdefault(name, []).append((part, kernel))
  order = list(dict.fromkeys('.'.join(name.rsplit('.', 2)[-2:]) for name, _, _ in in_memory.values()))
  interleaved = {name: mixed for name, _, mixed in in_memory.values()}
  for name, parts in by_parameter.items():
    adapters = [(flat[f'{k}{ADAPTED}/lora_a'], flat[f'{k}{ADAPTED}/lora_b']) for _, k in sorted(parts)]
    a = np.concatenate([np.swapaxes(a, 1, 2) for a, _ in adapters], axis=1)  # [E, R, in]
    experts, rank = a.shape[:2]
    b = np.zeros((sum(b.shape[2] for _, b in adapters), rank, experts), np.float32)  # [out, R, E]
    for i, (_, part) in enumerate(adapters):  # each part's outputs: its block of rows, or every n-th row
      r, out = part.shape[1:]
      rows = slice(i, None, len(adapters)) if interleaved[name] else slice(i * out, (i + 1) * out)
      b[rows, i * r:(i + 1) * r] = part.transpose(2, 1, 0)
    module, parameter = name.rsplit('.', 1)
    inner = len(order) - 1 - order.index(f'{module.rsplit(".", 1)[-1]}.{parameter}')
    at = f'{PREFIX}{module}.{"base_layer." * inner}'
    tensors[f'{at}lora_A.weight'] = np.ascontiguousarray(a.reshape(experts * rank, -1))
    tensors[f'{at}lora_B.weight'] = np.ascontiguousarray(b.reshape(b.shape[0], -1))
    if len(adapters) > 1:
      ranks[name] = rank
  return order


def _fused(rule: Tensor, flat: dict[str, np.ndarray], rank: int) -> tuple[np.ndarray, np.ndarray]:
  """One adapter of the fused projection `rule` (GPT-2's c_attn, GPT-NeoX's query_key_value) computing what its
  parts' adapters do: their A side by side [parts x rank, in], B block-diagonal [out, parts x rank], each part's B
  laid out as the rule lays out its kernel (zeros for the others' outputs and for a part without adapters)."""
  parts = [p.removesuffix('/kernel') for p in rule.params if p.removesuffix('/kernel') + '/lora_a' in flat]
  a = np.concatenate([flat[f'{m}/lora_a'].reshape(-1, rank).T for m in parts])
  slabs = []
  for m in parts:
    b = {p: np.zeros((rank, *flat[p].shape[1:]), np.float32) for p in rule.params}
    b[f'{m}/kernel'] = flat[f'{m}/lora_b']
    hf = write_tensors([dataclasses.replace(rule, name='x')], b, np.float32)['x']
    slabs.append(hf.T if rule.layout == 'conv1d' else hf)  # conv1d writes [in, out]
  return np.ascontiguousarray(a), np.ascontiguousarray(np.concatenate(slabs, axis=1))


def _target_names(adapted: set[str], modules: set[str]) -> dict[str, str]:
  """PEFT's target_modules name of each HF module `adapted`, of all the base's `modules`: its last name (q_proj), or
  where that also names a module left alone (BERT's MLM-head `dense` beside its layers'), its path after the layer
  index (attention.output.dense), which PEFT matches as a suffix."""
  others = modules - adapted
  names = {}
  for module in adapted:
    last = module.rsplit('.', 1)[-1]
    clash = any(other == last or other.endswith('.' + last) for other in others)
    names[module] = re.split(r'\.\d+\.', module, maxsplit=1)[-1] if clash else last
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
                                            'alpha_pattern', 'use_dora', 'target_parameters') if config.get(k)}
  if config.get('bias', 'none') != 'none':
    unsupported['bias'] = config['bias']
  if unsupported:
    raise ConfigError(f'{path}/{ADAPTER_CONFIG}: {", ".join(f"{k}={v!r}" for k, v in unsupported.items())} is not '
                      f'supported; lm loads plain LoRA adapters of target_modules on every layer, without trained '
                      f'biases or modules')
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
