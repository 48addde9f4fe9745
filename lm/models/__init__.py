"""Model families and the one place that maps a batch onto a family's call signature."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from lm.config import ModelConfig
from lm.models.gpt import GPT

FAMILIES: dict[str, type[nn.Module]] = {'gpt': GPT}


def build_model(cfg: ModelConfig) -> nn.Module:
  return FAMILIES[cfg.family](cfg)


def forward(model: nn.Module, params: Any, batch: dict[str, jax.Array], *, deterministic: bool = True,
            rng: jax.Array | None = None) -> jax.Array:
  """Logits for a batch; every objective reduces to (logits, batch['targets'], batch['weights'])."""
  rngs = {'dropout': rng} if rng is not None else {}
  return model.apply({'params': params}, batch['inputs'], segment_ids=batch.get('segment_ids'),
                     positions=batch.get('positions'), deterministic=deterministic, rngs=rngs)
