"""Model families: the one registry of family records (see `lm.models.family`)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from lm.config import ConfigError, ModelConfig
from lm.models import bert, gpt, llama, t5
from lm.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, bert.FAMILY, t5.FAMILY, llama.FAMILY)}


def get_family(name: str) -> Family:
  if name not in FAMILIES:
    raise ConfigError(f'model.family={name!r} is not supported; choose one of: {", ".join(FAMILIES)}')
  return FAMILIES[name]


def build_model(cfg: ModelConfig) -> nn.Module:
  return get_family(cfg.family).build(cfg)


def init_params(model: nn.Module, rng: jax.Array, length: int) -> Any:
  """Boxed (logically partitioned) params of `model`, from dummy inputs of `length` tokens."""
  return get_family(model.cfg.family).init(model, rng, length)
