"""Pretraining objectives on packed rows: causal LM, BERT masked LM (and NSP pairs), T5 span corruption.

Each turns a batch of packed rows (`Rows`) into model features; every one ends as (inputs, targets,
weights) so one cross-entropy serves all families. Rows that carry each token's UTF-8 byte count (validation)
also give `target_bytes`, the bytes each target stands for (bits per byte); padding (the zero tail of a
finite split's last row, segment id 0) never gets weight. Randomness comes from one `np.random.Generator`
per row, seeded by the pipeline from (seed, the row's first record, its offset in that record), so
a row is masked the same way wherever and whenever it is built (any process count, after resume).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

Features = dict[str, np.ndarray]


@dataclass(frozen=True)
class Rows:
  """Packed rows [n, row_len]: documents concatenated, then split into rows (see `lm.data.pipeline`).

  Segment ids number the documents of a row from 1 (0 would be padding); positions restart at each
  document and at the row start, so attention never crosses documents.
  """
  tokens: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  token_bytes: np.ndarray | None = None  # each token's UTF-8 bytes (`Tokenizer.encode_with_bytes`)


class Objective(Protocol):
  """Turns packed rows of `row_len` tokens into features."""
  row_len: int
  with_bos: bool  # whether documents open with BOS (span corruption joins them by EOS only)

  def __call__(self, rows: Rows, keys: np.ndarray) -> Features:
    """`keys` [n, k] ints seed one generator per row."""
    ...


@dataclass(frozen=True)
class CausalLM:
  """Next-token prediction: inputs are row[:-1], targets row[1:]; a target from another document gets weight 0."""
  seq_len: int
  with_bos = True

  @property
  def row_len(self) -> int:
    return self.seq_len + 1

  def __call__(self, rows: Rows, keys: np.ndarray) -> Features:
    tokens, seg = rows.tokens, rows.segment_ids
    features = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
                'weights': ((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0)).astype(np.float32),
                'segment_ids': seg[:, :-1], 'positions': rows.positions[:, :-1]}
    if rows.token_bytes is not None:
      features['target_bytes'] = rows.token_bytes[:, 1:]
    return features


def regular_ids(vocab_size: int, special_ids: np.ndarray) -> np.ndarray:
  """The ids masked LM may choose and draw as random replacements: all but the specials."""
  return np.setdiff1d(np.arange(vocab_size), special_ids).astype(np.int32)


def mlm_mask(tokens: np.ndarray, rng: np.random.Generator, *, special: np.ndarray, regular: np.ndarray,
             mask_id: int, rate: float = 0.15, mask_frac: float = 0.8, random_frac: float = 0.1,
             real: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """BERT masking of one row: choose round(rate * eligible) tokens; 80% -> [MASK], 10% random, 10% kept.

  `special` ids (padding, [CLS], [SEP], ...) are never chosen; random replacements are drawn from
  `regular` ids; nor are positions where `real` is False (padding). Returns (inputs, weights) with weight 1
  exactly at the chosen positions.
  """
  eligible = np.flatnonzero(~np.isin(tokens, special) & (True if real is None else real))
  count = int(round(rate * len(eligible)))
  chosen = rng.permutation(eligible)[:count]
  roll = rng.random(count)
  inputs = tokens.copy()
  to_mask = chosen[roll < mask_frac]
  to_random = chosen[(roll >= mask_frac) & (roll < mask_frac + random_frac)]
  inputs[to_mask] = mask_id
  inputs[to_random] = regular[rng.integers(0, len(regular), size=len(to_random))]
  weights = np.zeros(tokens.shape, np.float32)
  weights[chosen] = 1.0
  return inputs, weights


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """Lengths of a uniformly random split of `num_items` into `num_segments` non-empty runs."""
  first = np.concatenate([[0], rng.permutation(np.arange(num_items - 1) < num_segments - 1)]).astype(np.int64)
  return np.bincount(np.cumsum(first), minlength=num_segments)


def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
  """T5's noise mask: alternating non-noise / noise spans, starting with non-noise (Raffel et al. 2020)."""
  num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
  num_spans = max(int(round(num_noise / mean_span_length)), 1)
  noise_lengths = _random_segmentation(num_noise, num_spans, rng)
  keep_lengths = _random_segmentation(length - num_noise, num_spans, rng)
  interleaved = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)
  starts = np.zeros(length, bool)
  starts[np.cumsum(interleaved)[:-1]] = True
  return np.cumsum(starts) % 2 == 1


def spans_to_sentinels(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
  """Each run of masked tokens becomes one sentinel: sentinels[0] for the first run, sentinels[1] ..."""
  prev = np.concatenate([[False], mask[:-1]])
  span_start = mask & ~prev
  out = np.where(span_start, sentinels[np.maximum(np.cumsum(span_start) - 1, 0)], tokens)
  return out[~mask | span_start]


EXTRA_IDS = 100  # T5's sentinels: <extra_id_0> ... <extra_id_99>


def span_sentinels(tokenizer: Any, model_vocab: int, count: int = EXTRA_IDS) -> np.ndarray:
  """Ids of <extra_id_0> ... <extra_id_{count-1}>: the tokenizer's own when it has them, else T5's
  convention for a plain vocabulary of V ids: <extra_id_N> is V + 99 - N, so the model's vocabulary
  must hold V + 100 ids (T5's 32000-piece SentencePiece model: 32099 - N, as in its checkpoints)."""
  own = tokenizer.sentinel_ids(count)
  if own is not None:
    return own
  if count > EXTRA_IDS or tokenizer.vocab_size + EXTRA_IDS > model_vocab:
    raise ValueError(f'needs T5\'s {EXTRA_IDS} sentinel ids above the tokenizer\'s {tokenizer.vocab_size} '
                     f'(this row length uses {count})')
  return tokenizer.vocab_size + EXTRA_IDS - 1 - np.arange(count)


@dataclass(frozen=True)
class SpanLengths:
  raw: int  # tokens taken from the stream per example
  inputs: int  # encoder length after corruption (with EOS)
  targets: int  # decoder length (with EOS)
  spans: int


def span_lengths(inputs_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> SpanLengths:
  """The longest raw window whose corrupted inputs (plus EOS) fit `inputs_length` (T5's random_spans_helper)."""
  def lengths(raw: int) -> tuple[int, int, int]:
    noise = min(max(int(round(raw * noise_density)), 1), raw - 1)
    spans = max(int(round(noise / mean_span_length)), 1)
    return raw - noise + spans + 1, noise + spans + 1, spans
  raw = 2
  while lengths(raw + 1)[0] <= inputs_length:
    raw += 1
  inputs, targets, spans = lengths(raw)
  return SpanLengths(raw=raw, inputs=inputs, targets=targets, spans=spans)


def corrupt_spans(tokens: np.ndarray, noise: np.ndarray, sentinels: np.ndarray, eos_id: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of one raw window and its noise mask: inputs keep the text with a sentinel per dropped
  span, targets list each sentinel followed by the span it replaced; both end in EOS."""
  inputs = spans_to_sentinels(tokens, noise, sentinels)
  targets = spans_to_sentinels(tokens, ~noise, sentinels)
  return np.append(inputs, eos_id), np.append(targets, eos_id)


@dataclass(frozen=True, eq=False)
class MaskedLM:
  """BERT/RoBERTa masked LM on packed rows, masks drawn afresh each time a row is used (dynamic)."""
  seq_len: int
  special: np.ndarray = field(repr=False)  # the tokenizer's special ids
  regular: np.ndarray = field(repr=False)  # `regular_ids` of the tokenizer
  mask_id: int
  rate: float = 0.15
  with_bos = True

  @property
  def row_len(self) -> int:
    return self.seq_len

  def __call__(self, rows: Rows, keys: np.ndarray) -> Features:
    masked = [mlm_mask(row, np.random.default_rng(key), special=self.special, regular=self.regular,
                       mask_id=self.mask_id, rate=self.rate, real=seg != 0)
              for row, seg, key in zip(rows.tokens, rows.segment_ids, keys, strict=True)]
    features = {'inputs': np.stack([m[0] for m in masked]), 'targets': rows.tokens,
                'weights': np.stack([m[1] for m in masked]), 'segment_ids': rows.segment_ids,
                'positions': rows.positions}
    if rows.token_bytes is not None:
      features['target_bytes'] = rows.token_bytes
    return features


@dataclass(frozen=True)
class NextSentencePairs:
  """BERT's original rows: [CLS] A [SEP] B [SEP] with token types 0/1, MLM on top, and an NSP label:
  0 when B is the text that follows A in its row (half the time), 1 when B comes from another row."""
  masked_lm: MaskedLM
  cls_id: int
  sep_id: int
  with_bos = True

  @property
  def row_len(self) -> int:
    return self.masked_lm.seq_len

  def __call__(self, rows: Rows, keys: np.ndarray) -> Features:
    seq_len, n = self.row_len, len(rows.tokens)
    budget = seq_len - 3
    m = self.masked_lm
    out: dict[str, list] = {k: [] for k in ('inputs', 'targets', 'weights', 'token_types', 'nsp_labels',
                                            'target_bytes')}
    for i, key in enumerate(keys):
      rng = np.random.default_rng(key)
      a_len = int(rng.integers(1, budget))
      b_len = budget - a_len
      is_next = n == 1 or rng.random() < 0.5  # a lone row has nowhere else to draw B from
      other, start = (i, a_len) if is_next else ((i + 1 + int(rng.integers(n - 1))) % n,
                                                 int(rng.integers(0, seq_len - b_len + 1)))
      # Where each position of the pair comes from in the flattened rows; [CLS] and the [SEP]s from nowhere.
      source = np.concatenate([[0], i * seq_len + np.arange(a_len), [0],
                               other * seq_len + np.arange(start, start + b_len), [0]])
      special = np.zeros(seq_len, bool)
      special[[0, a_len + 1, seq_len - 1]] = True
      row = np.where(special, np.where(np.arange(seq_len) == 0, self.cls_id, self.sep_id),
                     rows.tokens.reshape(-1)[source]).astype(np.int32)
      inputs, weights = mlm_mask(row, rng, special=m.special, regular=m.regular, mask_id=m.mask_id, rate=m.rate,
                                 real=special | (rows.segment_ids.reshape(-1)[source] != 0))
      out['inputs'].append(inputs)
      out['targets'].append(row)
      out['weights'].append(weights)
      if rows.token_bytes is not None:
        out['target_bytes'].append(np.where(special, 0, rows.token_bytes.reshape(-1)[source]).astype(np.int32))
      out['token_types'].append(np.repeat(np.array([0, 1], np.int32), [a_len + 2, b_len + 1]))
      out['nsp_labels'].append(np.int32(0 if is_next else 1))
    features = {k: np.stack(v) for k, v in out.items() if v}
    features['segment_ids'] = np.ones((n, seq_len), np.int32)
    features['positions'] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len)).copy()
    return features


@dataclass(frozen=True, eq=False)
class SpanCorruption:
  """T5 span corruption of fixed raw windows (documents joined by EOS, as in the T5 paper).

  `sentinels` holds the ids of <extra_id_0>, <extra_id_1>, ... for as many spans as a row has.
  """
  inputs_length: int
  sentinels: np.ndarray = field(repr=False)
  eos_id: int
  pad_id: int  # pads inputs and targets, and starts the decoder (T5's convention)
  noise_density: float = 0.15
  mean_span_length: float = 3.0
  with_bos = False

  @property
  def lengths(self) -> SpanLengths:
    return span_lengths(self.inputs_length, self.noise_density, self.mean_span_length)

  @property
  def row_len(self) -> int:
    return self.lengths.raw

  def __call__(self, rows: Rows, keys: np.ndarray) -> Features:
    lengths = self.lengths
    n = len(rows.tokens)
    inputs = np.full((n, self.inputs_length), self.pad_id, np.int32)
    targets = np.full((n, lengths.targets), self.pad_id, np.int32)
    target_bytes = np.zeros((n, lengths.targets), np.int32)
    input_len, target_len = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, key in enumerate(keys):
      real = int(np.count_nonzero(rows.segment_ids[i]))  # a finite split's last row: real tokens, then padding
      if real < 2:  # nothing to corrupt: an all-padding example
        continue
      noise = random_spans_noise_mask(real, self.noise_density, self.mean_span_length, np.random.default_rng(key))
      x, y = corrupt_spans(rows.tokens[i, :real], noise, self.sentinels, self.eos_id)
      inputs[i, :len(x)], targets[i, :len(y)] = x, y
      input_len[i], target_len[i] = len(x), len(y)
      if rows.token_bytes is not None:
        target_bytes[i, :len(y) - 1] = spans_to_sentinels(rows.token_bytes[i, :real], ~noise, np.zeros_like(y))
    real_input = np.arange(self.inputs_length)[None] < input_len[:, None]
    real_target = np.arange(lengths.targets)[None] < target_len[:, None]
    decoder_inputs = np.concatenate([np.full((n, 1), self.pad_id, np.int32), targets[:, :-1]], axis=1)
    features = {'inputs': inputs, 'segment_ids': real_input.astype(np.int32), 'decoder_inputs': decoder_inputs,
                'targets': targets, 'weights': real_target.astype(np.float32),
                'decoder_segment_ids': real_target.astype(np.int32)}
    if rows.token_bytes is not None:
      features['target_bytes'] = target_bytes
    return features
