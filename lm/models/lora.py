"""Low-rank adapters (`model.lora`; the adapters themselves are `lm.models.layers.DenseGeneral`'s): which params
train beside them, and the targets checked against the model's projections."""
from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from lm.config import ConfigError, LoraConfig, OptimConfig, lr_multipliers
from lm.models.layers import KERNEL_SCALE
from lm.models.moe import ADAPTED, EXPERTS, ROUTER
from lm.ops.int8 import quantize_kernel

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
  adapted = {path[:-1]: (leaf.shape, flat[(*path[:-1], 'lora_b')].shape) for path, leaf in flat.items()
             if path[-1] == 'lora_a'}
  target = lambda module: EXPERTS if module[-1].endswith(ADAPTED) else module[-1]
  missing = [t for t in lora.targets if not any(target(module) == t for module in adapted)]
  if missing:
    names = sorted({module[-1] for module in kernels if len(module) > 1 and module[-2] in ('attention', 'mlp')} |
                   ({EXPERTS} if any(path[-1] == ROUTER for path in flat) else set()))
    raise ConfigError(f'model.lora.targets {missing} name no projection of this model; its projections: '
                      f'{", ".join(names)}')
  if lora.dropout and EXPERTS in lora.targets:
    raise ConfigError(f'model.lora.dropout={lora.dropout} drops out the adapters\' input, which the experts\' '
                      f'adapters (joined to their kernels) do not have; set model.lora.dropout=0 or drop {EXPERTS}')
  for module, (a, b) in adapted.items():
    if target(module) == EXPERTS:  # A [(layers,) experts, in, rank], B [(layers,) experts, rank, out]
      width = min(a[-2], b[-1])
    else:  # A [*in, rank], B [rank, *out] of a kernel [*in, *out]
      ins = math.prod(a[:-1])
      width = min(ins, math.prod(kernels[module]) // ins)
    if lora.rank > width:
      raise ConfigError(f'model.lora.rank={lora.rank} is above the width of {"/".join(module)} ({width}); use a '
                        f'rank of at most {width}')


def quantized_base(have: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
  """A source's params by '/' name, with each kernel this model (`want`: its abstract params by name) stores as an
  int8 base (model.lora under model.quantization=int8) quantized from the source's float one, its scales beside."""
  out = dict(have)
  for name, target in want.items():
    kernel = name.removesuffix(KERNEL_SCALE) + 'kernel'
    if name.endswith('/' + KERNEL_SCALE) and name not in have and kernel in have:
      out[kernel], out[name] = quantize_kernel(have[kernel], target.shape)
  return out


def merged(params: Any, lora: LoraConfig) -> Any:
  """`params` with each adapter folded into its kernel (W + (alpha / rank) A B) and dropped, an int8 base's kernels
  given back in float32 (values x scales): the plain model that computes what the adapted one does (the merged
  export)."""
  flat = traverse_util.flatten_dict(params)
  out = {path: leaf for path, leaf in flat.items() if path[-1] not in (*ADAPTERS, KERNEL_SCALE)}
  for path, scales in flat.items():
    if path[-1] == KERNEL_SCALE:
      at = (*path[:-1], 'kernel')
      out[at] = out[at].astype(scales.dtype) * scales
  for path, a in flat.items():
    if path[-1] == 'lora_a':
      module, b = path[:-1], flat[(*path[:-1], 'lora_b')]
      if module[-1].endswith(ADAPTED):  # an expert kernel, beside its adapters' module
        at = (*module[:-1], module[-1].removesuffix(ADAPTED))
        update = jnp.einsum('...ir,...ro->...io', a, b)  # per expert (and layer, stacked)
      else:
        at = (*module, 'kernel')
        update = (a.reshape(-1, lora.rank) @ b.reshape(lora.rank, -1)).reshape(out[at].shape)
      out[at] = out[at] + lora.scale * update
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
