"""The decoder-only causal LM module GPT and Llama share; their differences (positions, norms, MLP, tying) are
config fields. Its forward always gives the language model's outputs; `classify` gives a fine-tuned sequence
classifier's scores (the `Classifier` task head calls it)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.models.layers import DTYPES, DenseGeneral, Embed, LearnedPositions, LMHead, sinusoidal_positions
from lm.models.mtp import predict_ahead
from lm.models.parametrization import Init, readout_input
from lm.models.transformer import Readout, Stack, default_positions
from lm.ops.unembed import Unembedding
from lm.parallel.pipeline import loss_taker
from lm.parallel.rules import constrain


class CausalDecoder(nn.Module):
  """Tokens [batch, length] -> logits [batch, length, vocab].

  `decode=True` runs on the key/value cache (see `lm.models.decode`); `positions` then count real tokens.
  `unembed=False` returns the output layer unapplied (an `Unembedding`), for the tiled token loss.
  """
  cfg: ModelConfig

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               deterministic: bool = True, decode: bool = False, unembed: bool = True,
               ahead: Sequence[jax.Array] = ()) -> Any:
    """With `ahead` (each `model.mtp` depth's shifted inputs: `lm.models.mtp.look_ahead`), (the output, [each
    depth's output]); the depths' modules are made at init."""
    cfg = self.cfg
    if self.is_initializing() and cfg.mtp.depth and not decode:
      ahead = [tokens] * cfg.mtp.depth
    heads = self._decode(tokens, segment_ids, positions, deterministic, decode,
                         lambda x, embed: output_layer(cfg, embed, x), ahead)
    if not ahead:
      return heads.logits() if unembed else heads
    main, further = heads
    return (main, further) if not unembed else (main.logits(), [h.logits() for h in further])

  def classify(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """[batch, model.num_labels] scores from each row's last real token (a regression value when num_labels
    is 1). A classifier's params are made by this method: `score`, and no output layer (as HF's
    GPT2ForSequenceClassification and LlamaForSequenceClassification)."""
    return self._decode(tokens, segment_ids, None, deterministic, False,
                        lambda x, embed: last_token_scores(self.cfg, x, segment_ids))

  @nn.compact
  def _decode(self, tokens: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None,
              deterministic: bool, decode: bool, head: Callable[[jax.Array, Embed], Any],
              ahead: Sequence[jax.Array] = ()) -> Any:
    """`head(last hidden states, token embedding)`, called here so the layers it makes are this module's; with
    `ahead`, also each MTP depth's output layer (the same, on its states)."""
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.d_model, dtype=DTYPES[cfg.execution.dtype], param_dtype=DTYPES[cfg.param_dtype],
                  inits=Init(cfg), scale=cfg.embedding_scale, name='token_embed')
    x = embed(tokens)
    positions = default_positions(tokens) if positions is None else positions
    pos = embed_positions(cfg, positions)
    if pos is not None:
      x = x + pos
    x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
    x = constrain(x, ('batch', 'length', 'embed'))
    readout = None
    if not self.is_initializing() and loss_taker(cfg.execution.pipeline.schedule, decode):
      # 1F1B: the stack applies the output layer and takes the loss in its last stage (the outputs made here are
      # never read)
      outputs = head(x[:, :0], embed)
      readout = Readout(outputs.replace(hidden=None),
                        lambda p, h: {'logits': p.replace(hidden=readout_input(h, cfg))})
    x = Stack(cfg, causal=True, num_layers=cfg.num_layers, name='decoder')(
      x, segment_ids, deterministic=deterministic, decode=decode, positions=positions, readout=readout)
    if readout is not None:
      return outputs
    main = head(x, embed)
    if not ahead:
      return main
    further = predict_ahead(cfg, x, list(ahead), embed, segment_ids, positions, deterministic)
    return main, [main.replace(hidden=readout_input(h, cfg)) for h in further]


def embed_positions(cfg: ModelConfig, positions: jax.Array) -> jax.Array | None:
  """Absolute position encodings for `positions` [batch, length]; None for rotary (inside attention) or none."""
  if cfg.position == 'learned':
    return LearnedPositions(cfg.max_len, cfg.d_model, inits=Init(cfg), dtype=DTYPES[cfg.execution.dtype],
                            param_dtype=DTYPES[cfg.param_dtype], name='position_embed')(positions)
  if cfg.position == 'sinusoidal':
    return sinusoidal_positions(positions, cfg.d_model).astype(DTYPES[cfg.execution.dtype])
  return None


def output_layer(cfg: ModelConfig, embed: Embed, x: jax.Array) -> Unembedding:
  """The output layer on the last hidden states `x`: the embedding table when tied, else an `lm_head` layer;
  `.logits()` applies it, the token loss tiles it (`model.execution.loss_chunk`). Call from a compact method."""
  x = readout_input(x, cfg)
  if cfg.tie_embeddings:
    return embed.unembed(x, chunk=cfg.execution.loss_chunk, softcap=cfg.final_logit_softcap)
  return LMHead(cfg.vocab_size, dtype=DTYPES[cfg.execution.dtype], param_dtype=DTYPES[cfg.param_dtype],
                inits=Init(cfg), chunk=cfg.execution.loss_chunk,
                softcap=cfg.final_logit_softcap, name='lm_head')(x)


def last_token_scores(cfg: ModelConfig, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """The sequence classifier (HF GPT2ForSequenceClassification): a bias-free linear map of the hidden state
  [batch, length, embed] at each row's last real token -> [batch, num_labels]. Call from a compact method.

  The last token is found from the mask (segment id > 0), never from a token id: GPT-2 pads with EOS.
  """
  if segment_ids is None:
    last = jnp.full((x.shape[0],), x.shape[1] - 1)
  else:
    last = jnp.max(jnp.where(segment_ids > 0, jnp.arange(x.shape[1])[None], 0), axis=1)
  hidden = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  return DenseGeneral(cfg.num_labels, ('embed', None), dtype=DTYPES[cfg.execution.dtype],
                      param_dtype=DTYPES[cfg.param_dtype],
                      kernel_init=Init(cfg)('head', ('embed', None)), name='score')(hidden)
