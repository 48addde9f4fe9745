"""T5 (Raffel et al. 2020) v1.0 and v1.1: RMSNorm, no biases, relative position bias, encoder-decoder."""
from __future__ import annotations

import flax.linen as nn
import jax

from lm.config import ConfigError, ModelConfig
from lm.data.objectives import EXTRA_IDS, SpanCorruption, span_lengths, span_sentinels
from lm.models.family import EncoderDecoder, check_vocabulary
from lm.models.layers import DTYPES, Embed, LearnedPositions, LMHead, sinusoidal_positions
from lm.models.parametrization import Init, readout_input
from lm.models.transformer import Stack, default_positions
from lm.ops.unembed import Unembedding
from lm.parallel.rules import constrain


class T5(nn.Module):
  """`__call__(inputs, decoder_inputs)` -> logits over the decoder positions.

  v1.0 vs v1.1 is config: ReLU vs gated-GELU MLP, tied (with the d_model^-0.5 rescale) vs untied
  output. `segment_ids` / `decoder_segment_ids` mark padding with 0. With `position` learned or
  sinusoidal instead of relative it is the encoder-decoder of Vaswani et al. (absolute positions
  added to both stacks' embeddings).
  """
  cfg: ModelConfig

  def setup(self) -> None:
    cfg = self.cfg
    common = dict(dtype=DTYPES[cfg.execution.dtype], param_dtype=DTYPES[cfg.param_dtype])
    self.token_embed = Embed(cfg.vocab_size, cfg.d_model, inits=Init(cfg), scale=cfg.embedding_scale, **common)
    self.encoder = Stack(cfg, causal=False, num_layers=cfg.num_layers)
    self.decoder = Stack(cfg, causal=True, num_layers=cfg.resolved_decoder_layers, cross=True)
    self.dropout = nn.Dropout(cfg.dropout)
    if cfg.position == 'learned':
      self.position_embed = LearnedPositions(cfg.max_len, cfg.d_model, inits=Init(cfg), **common)
    if not cfg.tie_embeddings:
      self.lm_head = LMHead(cfg.vocab_size, inits=Init(cfg),
                            chunk=cfg.execution.loss_chunk, **common)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    x = self.token_embed(tokens)
    if self.cfg.position == 'learned':
      x = x + self.position_embed(default_positions(tokens))
    elif self.cfg.position == 'sinusoidal':
      x = x + sinusoidal_positions(default_positions(tokens), self.cfg.d_model).astype(x.dtype)
    return x

  def encode(self, inputs: jax.Array, segment_ids: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    x = self.dropout(self._embed(inputs), deterministic=deterministic)
    x = self.encoder(constrain(x, ('batch', 'length', 'embed')), segment_ids, deterministic=deterministic)
    return self.dropout(x, deterministic=deterministic)

  def decode(self, encoded: jax.Array, decoder_inputs: jax.Array, segment_ids: jax.Array | None = None,
             decoder_segment_ids: jax.Array | None = None, deterministic: bool = True,
             decode: bool = False, unembed: bool = True) -> jax.Array | Unembedding:
    """Decoder logits given the encoder output (`unembed=False`: the output layer unapplied, for the tiled
    token loss); `decode=True` runs one step on the key/value cache."""
    if decode and self.cfg.position != 'relative':
      raise ValueError(f'cached decoding of an encoder-decoder needs relative positions, not '
                       f'model.position={self.cfg.position}')
    y = self.dropout(self._embed(decoder_inputs), deterministic=deterministic)
    y = self.decoder(constrain(y, ('batch', 'length', 'embed')), decoder_segment_ids, encoded, segment_ids,
                     deterministic=deterministic, decode=decode)
    y = readout_input(self.dropout(y, deterministic=deterministic), self.cfg)
    if self.cfg.tie_embeddings:
      head = self.token_embed.unembed(y if self.cfg.scale_embeddings else y * self.cfg.base_width ** -0.5,
                                      chunk=self.cfg.execution.loss_chunk)
    else:
      head = self.lm_head(y)
    return head.logits() if unembed else head

  def __call__(self, inputs: jax.Array, decoder_inputs: jax.Array, segment_ids: jax.Array | None = None,
               decoder_segment_ids: jax.Array | None = None, deterministic: bool = True, unembed: bool = True
               ) -> jax.Array | Unembedding:
    encoded = self.encode(inputs, segment_ids, deterministic)
    return self.decode(encoded, decoder_inputs, segment_ids, decoder_segment_ids, deterministic, unembed=unembed)


class T5Family(EncoderDecoder):
  name = 't5'
  module = T5
  hf_converter = 'lm.storage.convert.t5'

  def objective(self, config, tokenizer):
    check_vocabulary(config, tokenizer)
    m, seq_len = config.model, config.data.seq_len
    spans = span_lengths(seq_len).spans
    try:
      sentinels = span_sentinels(tokenizer, m.vocab_size, spans)
    except ValueError as e:
      raise ConfigError(f'span corruption of {seq_len}-token inputs {e}, but model.vocab_size={m.vocab_size}; '
                        f'raise model.vocab_size to at least {tokenizer.vocab_size + EXTRA_IDS} or use a '
                        f'tokenizer with <extra_id_N> tokens') from None
    return SpanCorruption(seq_len, sentinels=sentinels, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)

  def target_length(self, seq_len: int) -> int:
    return span_lengths(seq_len).targets


FAMILY = T5Family()
