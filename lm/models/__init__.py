"""Model families and the one place that maps a batch onto a family's call signature."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.models.bert import BERT
from lm.models.gpt import GPT
from lm.models.t5 import T5

FAMILIES: dict[str, type[nn.Module]] = {'gpt': GPT, 'bert': BERT, 't5': T5}


def build_model(cfg: ModelConfig) -> nn.Module:
  return FAMILIES[cfg.family](cfg)


def init_params(model: nn.Module, rng: jax.Array, length: int) -> Any:
  """Boxed (logically partitioned) params from dummy inputs of `length` tokens."""
  tokens = jnp.zeros((1, length), jnp.int32)
  args = (tokens, tokens) if model.cfg.family == 't5' else (tokens,)
  return model.init({'params': rng, 'dropout': rng}, *args)['params']


def forward(model: nn.Module, params: Any, batch: dict[str, jax.Array], *, deterministic: bool = True,
            rng: jax.Array | None = None) -> jax.Array:
  """Logits for a batch; every objective reduces to (logits, batch['targets'], batch['weights'])."""
  rngs = {'dropout': rng} if rng is not None else {}
  variables = {'params': params}
  if model.cfg.family == 't5':
    return model.apply(variables, batch['inputs'], batch['decoder_inputs'], segment_ids=batch.get('segment_ids'),
                       decoder_segment_ids=batch.get('decoder_segment_ids'), deterministic=deterministic, rngs=rngs)
  return model.apply(variables, batch['inputs'], segment_ids=batch.get('segment_ids'),
                     positions=batch.get('positions'), deterministic=deterministic, rngs=rngs)
