"""GPT-2 (Radford et al. 2019): learned positions, pre-LN blocks, GELU MLP, tied output, final norm."""
from __future__ import annotations

import flax.linen as nn
import jax

from lm.config import ModelConfig
from lm.models.family import DecoderOnly
from lm.models.layers import DTYPES, Embed
from lm.models.transformer import Stack, default_positions, embed_positions, last_token_scores, output_layer
from lm.ops.unembed import Unembedding
from lm.parallel.rules import constrain


class GPT(nn.Module):
  """Decoder-only causal LM: tokens [batch, length] -> logits [batch, length, vocab].

  `decode=True` runs on the key/value cache (see `lm.generate`); `positions` then count real tokens.
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
    x = embed(tokens)
    positions = default_positions(tokens) if positions is None else positions
    pos = embed_positions(cfg, positions)
    if pos is not None:
      x = x + pos
    x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
    x = constrain(x, ('batch', 'length', 'embed'))
    x = Stack(cfg, causal=True, num_layers=cfg.num_layers, name='decoder')(
      x, segment_ids, deterministic=deterministic, decode=decode, positions=positions)
    if cfg.num_labels:  # a fine-tuned sequence classifier
      return last_token_scores(cfg, x, segment_ids)
    head = output_layer(cfg, embed, x)
    return head.logits() if unembed else head


class GPTFamily(DecoderOnly):
  name = 'gpt'
  module = GPT
  hf_converter = 'lm.convert.gpt2'


FAMILY = GPTFamily()
