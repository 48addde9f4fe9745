"""How a family fine-tunes on a sequence task (GLUE); each family record names one as its `task_head`.

Every head implements one interface (`TaskHead`): the config it needs (`num_labels`), one example's row
(`encode`), the training forward and loss (`apply`, `loss`) and prediction (`infer` on the device, `predict` on
the host). A `Classifier` reads a summary of the sequence (BERT's pooled [CLS], a decoder's last real token) into
`model.num_labels` scores, trained by cross-entropy over classes or squared error on one regression score.
`TextToText` (T5) trains the token loss on the label's name and predicts by decoding it greedily. The fine-tuning
job (`lm.jobs.glue.finetune`) drives any head alike and never asks which one it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.models.decode import ENCODER_DECODER, Sampling, decode_batch
from lm.ops.losses import cross_entropy, distillation, squared_error

if TYPE_CHECKING:
  from lm.data.tokenizers import Tokenizer

Batch = dict[str, jax.Array]
Features = dict[str, np.ndarray]
Label = int | float
# A decoded output that names no label: class -1 (never right), score -1.0 (T5's string_to_float default).
UNPARSEABLE = -1


class TaskText(Protocol):
  """What a head reads of a task (`lm.jobs.glue.tasks.Task`): its outputs, and its casting to text and back."""
  @property
  def regression(self) -> bool: ...
  @property
  def num_outputs(self) -> int: ...
  @property
  def t5_labels(self) -> tuple[str, ...]: ...
  def t5_input(self, texts: tuple[str, ...]) -> str: ...
  def t5_target(self, label: Label) -> str: ...
  def from_t5(self, text: str) -> Label | None: ...


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


class TaskHead:
  """The interface of a fine-tuning head. `params`: its top-level param modules, initialised fresh when the
  source model lacks them (or has another task's shapes)."""
  params: tuple[str, ...]

  def num_labels(self, task: TaskText) -> int:
    """`model.num_labels` for `task` (0: the model keeps its language-model outputs)."""
    raise NotImplementedError

  def target_length(self, task: TaskText, tokenizer: Tokenizer) -> int:
    """Decoder tokens a prediction needs (0: none)."""
    raise NotImplementedError

  def encode(self, tokenizer: Tokenizer, task: TaskText, texts: tuple[str, ...], label: Label | None, max_len: int,
             target_len: int) -> Features:
    """One example's fixed-length row, with its loss `weights` (`label` None: a test example)."""
    raise NotImplementedError

  def apply(self, model: nn.Module, params: Any, batch: Batch, *, deterministic: bool,
            rngs: dict[str, jax.Array]) -> jax.Array:
    """The training forward: what `loss` reads."""
    raise NotImplementedError

  def loss(self, outputs: jax.Array, batch: Batch, regression: bool) -> tuple[jax.Array, jax.Array]:
    """(sum of the loss over the batch, sum of its weights)."""
    raise NotImplementedError

  def soft_loss(self, outputs: jax.Array, teacher: jax.Array, batch: Batch, regression: bool, temperature: float,
                divergence: str) -> jax.Array:
    """The sum over the batch of the divergence of `outputs` from a teacher's (`train.distill`: soft labels): the
    KL of the softened distributions (`lm.ops.losses.distillation`)."""
    return distillation(outputs, teacher, batch['weights'], temperature, divergence)

  def infer(self, model: nn.Module, params: Any, batch: Batch, tokenizer: Tokenizer, target_len: int) -> jax.Array:
    """On the device, traceable: what `predict` turns into labels."""
    raise NotImplementedError

  def predict(self, inferred: np.ndarray, task: TaskText, tokenizer: Tokenizer) -> np.ndarray:
    """Class ids (UNPARSEABLE for an output that names no label) or regression scores."""
    raise NotImplementedError


@dataclass(frozen=True)
class Classifier(TaskHead):
  """Scores [batch, num_labels] of `[open] A [close] (B [close])`: with [CLS]/[SEP] for BERT (and token
  types 0 up to the first [SEP], 1 after), BOS/EOS for decoders, from the module's `classify` method. Batches
  carry `labels` and per-row `weights`."""
  params: tuple[str, ...]
  token_types: bool = False  # BERT's segment A/B embeddings

  def num_labels(self, task):
    return task.num_outputs

  def target_length(self, task, tokenizer):
    return 0

  def encode(self, tokenizer, task, texts, label, max_len, target_len):
    parts = truncate_longest_first([tokenizer.encode(t).tolist() for t in texts], max_len - 1 - len(texts))
    ids, types = [tokenizer.bos_id], [0]
    for i, part in enumerate(parts):
      ids += part + [tokenizer.eos_id]
      types += [i] * (len(part) + 1)
    tokens, segment_ids = pad_row(ids, max_len, tokenizer.pad_id)
    features = {'inputs': tokens, 'segment_ids': segment_ids, 'weights': np.float32(1.0)}
    if self.token_types:
      features['token_types'] = pad_row(types, max_len, 0)[0]
    return features

  def apply(self, model, params, batch, *, deterministic, rngs):
    kwargs = {'token_types': batch['token_types']} if self.token_types else {}
    return model.apply({'params': params}, batch['inputs'], segment_ids=batch['segment_ids'],
                       deterministic=deterministic, rngs=rngs, method='classify', **kwargs)

  def loss(self, outputs, batch, regression):
    """Squared error of the one score, or cross-entropy over the classes."""
    if regression:
      return squared_error(outputs[:, 0], batch['labels'], batch['weights'])
    nll, _, weight = cross_entropy(outputs, batch['labels'], batch['weights'])
    return nll, weight

  def soft_loss(self, outputs, teacher, batch, regression, temperature, divergence):
    """A regression score's squared error from the teacher's; classes' KL."""
    if regression:
      return squared_error(outputs[:, 0], jax.lax.stop_gradient(teacher[:, 0]), batch['weights'])[0]
    return super().soft_loss(outputs, teacher, batch, regression, temperature, divergence)

  def infer(self, model, params, batch, tokenizer, target_len):
    return self.apply(model, params, batch, deterministic=True, rngs={}).astype(jnp.float32)

  def predict(self, inferred, task, tokenizer):
    return inferred[:, 0].astype(np.float64) if task.regression else np.argmax(inferred, axis=-1)


@dataclass(frozen=True)
class TextToText(TaskHead):
  """An encoder-decoder reads the task's text and writes the label's name (T5's GLUE casting).

  Batches are those of span corruption: `inputs` ending in EOS, `decoder_inputs` (the targets shifted
  right behind the pad id, T5's decoder start), `targets` ending in EOS, token `weights`."""
  params: tuple[str, ...] = ()

  def num_labels(self, task):
    return 0

  def target_length(self, task, tokenizer):
    """The longest label name (STS-B: the 0.2 grid's scores), plus EOS."""
    names = task.t5_labels or [f'{x / 5:.1f}' for x in range(26)]
    return max(len(tokenizer.encode(name)) for name in names) + 1

  def encode(self, tokenizer, task, texts, label, max_len, target_len):
    source, target = task.t5_input(texts), '' if label is None else task.t5_target(label)
    inputs, segment_ids = pad_row(tokenizer.encode(source).tolist()[:max_len - 1] + [tokenizer.eos_id], max_len,
                                  tokenizer.pad_id)
    target_ids = tokenizer.encode(target).tolist()[:target_len - 1] + [tokenizer.eos_id]
    targets, decoder_segment_ids = pad_row(target_ids, target_len, tokenizer.pad_id)
    decoder_inputs = pad_row([tokenizer.pad_id] + target_ids[:-1], target_len, tokenizer.pad_id)[0]
    return {'inputs': inputs, 'segment_ids': segment_ids, 'decoder_inputs': decoder_inputs,
            'decoder_segment_ids': decoder_segment_ids, 'targets': targets,
            'weights': decoder_segment_ids.astype(np.float32)}

  def apply(self, model, params, batch, *, deterministic, rngs):
    return model.apply({'params': params}, batch['inputs'], batch['decoder_inputs'],
                       segment_ids=batch['segment_ids'], decoder_segment_ids=batch['decoder_segment_ids'],
                       deterministic=deterministic, rngs=rngs)

  def loss(self, outputs, batch, regression):
    nll, _, weight = cross_entropy(outputs, batch['targets'], batch['weights'])
    return nll, weight

  def infer(self, model, params, batch, tokenizer, target_len):
    """The greedily decoded label names [batch, target_len]: padding after EOS."""
    ids, _ = decode_batch(model, params, batch['inputs'], batch['segment_ids'], jax.random.key(0),
                          decoding=ENCODER_DECODER, max_new_tokens=target_len, sampling=Sampling(),
                          eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, decoder_start_id=tokenizer.pad_id)
    return ids

  def predict(self, inferred, task, tokenizer):
    eos = tokenizer.eos_id
    texts = [tokenizer.decode(row[:row.index(eos)] if eos in row else row) for row in inferred.tolist()]
    values = [task.from_t5(text) for text in texts]
    return np.asarray([UNPARSEABLE if v is None else v for v in values],
                      np.float64 if task.regression else np.int64)
