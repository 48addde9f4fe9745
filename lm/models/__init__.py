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
            rng: jax.Array | None = None) -> dict[str, jax.Array]:
  """Model outputs for a batch: 'logits' (every objective scores them against batch['targets'] with
  batch['weights']) and, for BERT batches with 'nsp_labels', 'nsp_logits'."""
  rngs = {'dropout': rng} if rng is not None else {}
  variables = {'params': params}
  family = model.cfg.family
  if family == 't5':
    return {'logits': model.apply(variables, batch['inputs'], batch['decoder_inputs'],
                                  segment_ids=batch.get('segment_ids'),
                                  decoder_segment_ids=batch.get('decoder_segment_ids'),
                                  deterministic=deterministic, rngs=rngs)}
  kwargs = dict(segment_ids=batch.get('segment_ids'), positions=batch.get('positions'), deterministic=deterministic)
  if family == 'bert':
    kwargs['token_types'] = batch.get('token_types')
    if 'nsp_labels' in batch:
      logits, nsp_logits = model.apply(variables, batch['inputs'], **kwargs, rngs=rngs, method=BERT.pretrain)
      return {'logits': logits, 'nsp_logits': nsp_logits}
  return {'logits': model.apply(variables, batch['inputs'], **kwargs, rngs=rngs)}
