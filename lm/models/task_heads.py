"""How a family fine-tunes on a sequence task (GLUE); each family record names one as its `task_head`.

Two shapes. A `Classifier` reads a summary of the sequence (BERT's pooled [CLS], a decoder's last
real token) into `model.num_labels` scores, trained by cross-entropy over classes or squared error
on one regression score. `TextToText` (T5) trains the token loss on the label's name and predicts
by decoding it. A head lays out one example's tokens, runs the model and scores a batch; the
fine-tuning loop (`lm.glue.finetune`) does the rest alike for every family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import flax.linen as nn
import jax
import numpy as np

from lm.ops.losses import cross_entropy, squared_error

if TYPE_CHECKING:
  from lm.data.tokenizers import Tokenizer

Batch = dict[str, jax.Array]
Features = dict[str, np.ndarray]


def truncate_longest_first(parts: list[list[int]], budget: int) -> list[list[int]]:
  """Drops tokens one at a time from the end of the longest part until all fit in `budget`
  (BERT's `_truncate_seq_pair`; on a tie the later part loses one)."""
  parts = [list(p) for p in parts]
  while sum(map(len, parts)) > budget:
    longest = max(range(len(parts)), key=lambda i: (len(parts[i]), i))
    parts[longest].pop()
  return parts


def pad_row(ids: list[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, segment ids: 1 real, 0 padding) of one row right-padded to `length`."""
  tokens = np.full(length, pad_id, np.int32)
  segment_ids = np.zeros(length, np.int32)
  tokens[:len(ids)], segment_ids[:len(ids)] = ids, 1
  return tokens, segment_ids


@dataclass(frozen=True)
class Classifier:
  """Scores [batch, num_labels] of `[open] A [close] (B [close])`: with [CLS]/[SEP] for BERT (and token
  types 0 up to the first [SEP], 1 after), BOS/EOS for decoders. Batches carry `labels` and per-row `weights`."""
  params: tuple[str, ...]  # the head's top-level param modules: initialised fresh when the source lacks them
  method: str | None = None  # the module method giving scores; None: `__call__`
  token_types: bool = False  # BERT's segment A/B embeddings
  kind: ClassVar[Literal['classifier', 'text_to_text']] = 'classifier'

  def encode(self, tokenizer: Tokenizer, texts: tuple[str, ...], max_len: int) -> Features:
    parts = truncate_longest_first([tokenizer.encode(t).tolist() for t in texts], max_len - 1 - len(texts))
    ids, types = [tokenizer.bos_id], [0]
    for i, part in enumerate(parts):
      ids += part + [tokenizer.eos_id]
      types += [i] * (len(part) + 1)
    tokens, segment_ids = pad_row(ids, max_len, tokenizer.pad_id)
    features = {'inputs': tokens, 'segment_ids': segment_ids}
    if self.token_types:
      features['token_types'] = pad_row(types, max_len, 0)[0]
    return features

  def apply(self, model: nn.Module, params: Any, batch: Batch, *, deterministic: bool,
            rngs: dict[str, jax.Array]) -> jax.Array:
    kwargs = {'token_types': batch['token_types']} if self.token_types else {}
    return model.apply({'params': params}, batch['inputs'], segment_ids=batch['segment_ids'],
                       deterministic=deterministic, rngs=rngs, method=self.method, **kwargs)

  def loss(self, outputs: jax.Array, batch: Batch, regression: bool) -> tuple[jax.Array, jax.Array]:
    """(sum of per-example losses, sum of weights): squared error of the one score, or cross-entropy."""
    if regression:
      return squared_error(outputs[:, 0], batch['labels'], batch['weights'])
    nll, _, weight = cross_entropy(outputs, batch['labels'], batch['weights'])
    return nll, weight

  def predict(self, outputs: np.ndarray, regression: bool) -> np.ndarray:
    return outputs[:, 0].astype(np.float64) if regression else np.argmax(outputs, axis=-1)


@dataclass(frozen=True)
class TextToText:
  """An encoder-decoder reads the task's text and writes the label's name (T5's GLUE casting).

  Batches are those of span corruption: `inputs` ending in EOS, `decoder_inputs` (the targets shifted
  right behind the pad id, T5's decoder start), `targets` ending in EOS, token `weights`."""
  params: tuple[str, ...] = ()
  kind: ClassVar[Literal['classifier', 'text_to_text']] = 'text_to_text'

  def encode_pair(self, tokenizer: Tokenizer, source: str, target: str, max_len: int, target_len: int) -> Features:
    inputs, segment_ids = pad_row(tokenizer.encode(source).tolist()[:max_len - 1] + [tokenizer.eos_id], max_len,
                                  tokenizer.pad_id)
    target_ids = tokenizer.encode(target).tolist()[:target_len - 1] + [tokenizer.eos_id]
    targets, decoder_segment_ids = pad_row(target_ids, target_len, tokenizer.pad_id)
    decoder_inputs = pad_row([tokenizer.pad_id] + target_ids[:-1], target_len, tokenizer.pad_id)[0]
    return {'inputs': inputs, 'segment_ids': segment_ids, 'decoder_inputs': decoder_inputs,
            'decoder_segment_ids': decoder_segment_ids, 'targets': targets,
            'weights': decoder_segment_ids.astype(np.float32)}

  def apply(self, model: nn.Module, params: Any, batch: Batch, *, deterministic: bool,
            rngs: dict[str, jax.Array]) -> jax.Array:
    return model.apply({'params': params}, batch['inputs'], batch['decoder_inputs'],
                       segment_ids=batch['segment_ids'], decoder_segment_ids=batch['decoder_segment_ids'],
                       deterministic=deterministic, rngs=rngs)

  def loss(self, outputs: jax.Array, batch: Batch, regression: bool) -> tuple[jax.Array, jax.Array]:
    nll, _, weight = cross_entropy(outputs, batch['targets'], batch['weights'])
    return nll, weight


TaskHead = Classifier | TextToText
