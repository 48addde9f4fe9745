"""Low-rank adapters (`model.lora`; the adapters themselves are `lm.models.layers.DenseGeneral`'s): which params
train beside them, and the targets checked against the model's projections."""
from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import jax
from flax import traverse_util

from lm.config import ConfigError, LoraConfig, OptimConfig, lr_multipliers

ADAPTERS = ('lora_a', 'lora_b')


def frozen(params: Any, lora: LoraConfig, trainable: Collection[str]) -> Any:
  """Per param, True where `model.lora` freezes it: all but the adapters and the top-level modules in `trainable`
  (a fine-tuning task head, which starts fresh); all False without adapters."""
  keep = lambda path: not lora.rank or path[-1].key in ADAPTERS or path[0].key in trainable
  return jax.tree_util.tree_map_with_path(lambda path, _: not keep(path), params)


def check_targets(params: Any, lora: LoraConfig) -> None:
  """ConfigError when a target names no projection (listing those the model has) or the rank is above a targeted
  projection's smaller side. `params`: the model's (abstract) params, adapters made."""
  if not lora.rank:
    return
  flat = traverse_util.flatten_dict(params)
  kernels = {path[:-1]: leaf.shape for path, leaf in flat.items() if path[-1] == 'kernel'}
  adapted = {path[:-1]: leaf.shape for path, leaf in flat.items() if path[-1] == 'lora_a'}
  missing = [t for t in lora.targets if not any(module[-1] == t for module in adapted)]
  if missing:
    names = sorted({module[-1] for module in kernels if len(module) > 1 and module[-2] in ('attention', 'mlp')})
    raise ConfigError(f'model.lora.targets {missing} name no projection of this model; its projections: '
                      f'{", ".join(names)}')
  for module, shape in adapted.items():
    ins = math.prod(shape[:-1])
    width = min(ins, math.prod(kernels[module]) // ins)
    if lora.rank > width:
      raise ConfigError(f'model.lora.rank={lora.rank} is above the width of {"/".join(module)} ({width}); use a '
                        f'rank of at most {width}')


def merged(params: Any, lora: LoraConfig) -> Any:
  """`params` with each adapter folded into its kernel (W + (alpha / rank) A B) and dropped: the plain model that
  computes what the adapted one does (the merged export)."""
  flat = traverse_util.flatten_dict(params)
  out = {path: leaf for path, leaf in flat.items() if path[-1] not in ADAPTERS}
  for path, a in flat.items():
    if path[-1] == 'lora_a':
      module = path[:-1]
      kernel, b = out[(*module, 'kernel')], flat[(*module, 'lora_b')]
      update = (a.reshape(-1, lora.rank) @ b.reshape(lora.rank, -1)).reshape(kernel.shape)
      out[(*module, 'kernel')] = kernel + lora.scale * update
  return traverse_util.unflatten_dict(out)


def check_multipliers(params: Any, lora: LoraConfig, optim: OptimConfig, trainable: Collection[str]) -> None:
  """ConfigError for an `optim.lr_multipliers` entry that matches only params `model.lora` freezes: a rate the
  optimizer could not honour."""
  if not lora.rank:
    return
  fixed = traverse_util.flatten_dict(frozen(params, lora, trainable), sep='/')
  trained = [path for path, f in fixed.items() if not f]
  for item, (pattern, _) in zip(optim.lr_multipliers, lr_multipliers(optim), strict=True):
    if not any(pattern.search(path) for path in trained):
      raise ConfigError(f'optim.lr_multipliers entry {item!r} matches only params model.lora freezes (what trains: '
                        f'the adapters lora_a, lora_b and a task head); drop it or match an adapter')
