"""Llama (Touvron et al. 2023): pre-RMSNorm decoder, rotary positions, SwiGLU MLP, grouped-query
attention (Llama 2 70B), no biases, untied output. The shape lives in the config; this file composes it."""
from __future__ import annotations

import flax.linen as nn
import jax

from lm.config import Config, ConfigError, ModelConfig
from lm.models.family import DecoderOnly
from lm.models.layers import DTYPES, Embed
from lm.models.transformer import Stack, default_positions, last_token_scores, output_layer
from lm.ops.unembed import Unembedding
from lm.parallel.rules import constrain


class Llama(nn.Module):
  """Decoder-only causal LM with positions only inside attention: tokens [batch, length] -> logits.

  `positions` (default 0, 1, ...) rotate queries and keys; with `decode=True` they count real tokens.
  With `model.num_labels` > 0 it is a sequence classifier: scores [batch, num_labels] from the last real token.
  `unembed=False` returns the output layer unapplied (an `Unembedding`), for the tiled token loss.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               deterministic: bool = True, decode: bool = False, unembed: bool = True) -> jax.Array | Unembedding:
    cfg = self.cfg
    dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype, init_std=cfg.init_std,
                  scale=cfg.embedding_scale, name='token_embed')
    x = nn.Dropout(cfg.dropout)(embed(tokens), deterministic=deterministic)
    x = constrain(x, ('batch', 'length', 'embed'))
    x = Stack(cfg, causal=True, num_layers=cfg.num_layers, name='decoder')(
      x, segment_ids, deterministic=deterministic, decode=decode,
      positions=default_positions(tokens) if positions is None else positions)
    if cfg.num_labels:  # a fine-tuned sequence classifier
      return last_token_scores(cfg, x, segment_ids)
    head = output_layer(cfg, embed, x)
    return head.logits() if unembed else head


class LlamaFamily(DecoderOnly):
  name = 'llama'
  module = Llama
  hf_converter = 'lm.convert.llama'

  def validate(self, config: Config) -> None:
    if config.model.position not in ('rotary', 'none'):
      raise ConfigError(f'a llama model has no position table: model.position={config.model.position!r} would be '
                        f'ignored; use model.position=rotary')


FAMILY = LlamaFamily()
