"""A LoRA run's frozen base, stored once: its checkpoints hold only the params that train (the adapters, a task head)
and an item naming the base they sit on (`train.init_from`, and the step it opened at); a restore reads the base
from there again, bit for bit what the run started from (the base never moves).

A 7B base is 13 GiB against its adapters' few MiB, and every checkpoint of every fine-tune would copy it. A run
without `train.init_from` (adapters on a random init) stores its params whole. Opening the base is
lm.storage.source's (the one way to open a model), which reads checkpoints itself and so registers its opener here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import traverse_util

from lm.config import LoraConfig
from lm.models import get_family
from lm.models.lora import frozen

BASE = 'base'  # the checkpoint item naming the base: {'source', 'step', 'view'}

# (train.init_from, its moving average?) -> the base item, as the source opens now
Identify = Callable[[str, bool], dict]
# (base item, the frozen params' abstract values (None elsewhere), scan_layers) -> those params, placed
Open = Callable[[dict, Any, bool], Any]
_registered: dict[str, Any] = {}


def register(identify: Identify, open_base: Open) -> None:
  _registered.update(identify=identify, open=open_base)


def _hook(name: str) -> Any:
  if name not in _registered:
    raise RuntimeError('a LoRA checkpoint\'s base opens through lm.storage.source; import it first')
  return _registered[name]


def left_to_base(params: Any, config: dict) -> Any | None:
  """Per param of a run under `config` (a config's dict), True where its checkpoints leave it to the base:
  `model.lora`'s frozen params, when the run started from `train.init_from`; None when they store all."""
  model, train = config['model'], config['train']
  if not model.get('lora', {}).get('rank') or not train.get('init_from'):
    return None
  return frozen(params, LoraConfig(rank=model['lora']['rank']), get_family(model['family']).per_sequence_params())


def identify(config: dict) -> dict:
  """The base item of a run under `config`: its `train.init_from` as it opens now."""
  return _hook('identify')(config['train']['init_from'], bool(config['train'].get('init_from_ema')))


def trained(params: Any, mask: Any) -> Any:
  """`params` without what `mask` leaves to the base (None there): what a checkpoint stores."""
  return jax.tree.map(lambda p, fixed: None if fixed else p, params, mask)


def of_base(abstract: Any, mask: Any) -> Any:
  """The abstract values of what `mask` leaves to the base (None elsewhere)."""
  return jax.tree.map(lambda a, fixed: a if fixed else None, abstract, mask)


def filled(restored: Any, base: dict, abstract: Any, mask: Any, scan_layers: bool) -> Any:
  """`restored` (a checkpoint's params, None where `mask` left them to the base) with the base's params, opened
  from the `base` item onto `abstract`'s shardings in the layer layout `scan_layers`."""
  params = _hook('open')(base, of_base(abstract, mask), scan_layers)
  flat = {k: v for k, v in traverse_util.flatten_dict(restored).items() if v is not None}
  flat.update({k: v for k, v in traverse_util.flatten_dict(params).items() if v is not None})
  return traverse_util.unflatten_dict(flat)

