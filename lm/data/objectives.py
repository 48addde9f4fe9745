"""Pretraining objectives on packed rows: causal LM, BERT masked LM, T5 span corruption.

Each turns token windows into model features; every one ends as (inputs, targets, weights)
so one cross-entropy serves all three families. Randomness comes from an explicit
`np.random.Generator`, derived by the pipeline from (seed, epoch, row), so it is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lm.data.packing import TokenStream

Features = dict[str, np.ndarray]


class Objective(Protocol):
  """Turns stream rows into features. Rows are `row_len` tokens with stride `row_len - overlap`."""
  row_len: int
  overlap: int
  with_bos: bool  # whether documents in the stream open with BOS (span corruption joins them by EOS only)

  def __call__(self, stream: TokenStream, rows: np.ndarray, keys: np.ndarray) -> Features:
    """`keys` [n, k] ints seed one generator per row (seed, step, index in the global batch)."""
    ...


@dataclass(frozen=True)
class CausalLM:
  """Next-token prediction: inputs are stream[o:o+S], targets stream[o+1:o+S+1].

  A target from another document (the step over a boundary) gets weight 0.
  """
  seq_len: int

  @property
  def row_len(self) -> int:
    return self.seq_len + 1

  overlap = 1
  with_bos = True

  def __call__(self, stream: TokenStream, rows: np.ndarray, keys: np.ndarray) -> Features:
    tokens, offsets = stream.windows(rows, self.row_len, self.overlap)
    segment_ids, positions = stream.segments(offsets[:, :-1])
    docs = stream.doc_ids[offsets]
    return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
            'weights': (docs[:, :-1] == docs[:, 1:]).astype(np.float32),
            'segment_ids': segment_ids, 'positions': positions}


def mlm_mask(tokens: np.ndarray, rng: np.random.Generator, *, first_regular_id: int, vocab_size: int,
             mask_id: int, rate: float = 0.15, mask_frac: float = 0.8, random_frac: float = 0.1
             ) -> tuple[np.ndarray, np.ndarray]:
  """BERT masking of one row: choose round(rate * eligible) tokens; 80% -> [MASK], 10% random, 10% kept.

  Ids below `first_regular_id` (padding and special tokens) are never chosen; random replacements are
  regular ids. Returns (inputs, weights) with weight 1 exactly at the chosen positions.
  """
  eligible = np.flatnonzero(tokens >= first_regular_id)
  count = int(round(rate * len(eligible)))
  chosen = rng.permutation(eligible)[:count]
  roll = rng.random(count)
  inputs = tokens.copy()
  to_mask = chosen[roll < mask_frac]
  to_random = chosen[(roll >= mask_frac) & (roll < mask_frac + random_frac)]
  inputs[to_mask] = mask_id
  inputs[to_random] = rng.integers(first_regular_id, vocab_size, size=len(to_random))
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


def spans_to_sentinels(tokens: np.ndarray, mask: np.ndarray, first_sentinel: int) -> np.ndarray:
  """Each run of masked tokens becomes one sentinel: first_sentinel, first_sentinel - 1, ..."""
  prev = np.concatenate([[False], mask[:-1]])
  span_start = mask & ~prev
  sentinels = first_sentinel + 1 - np.cumsum(span_start)
  out = np.where(span_start, sentinels, tokens)
  return out[~mask | span_start]


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


def span_corruption(tokens: np.ndarray, rng: np.random.Generator, *, first_sentinel: int, eos_id: int,
                    noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of one raw window: inputs keep the text with a sentinel per dropped span,
  targets list each sentinel followed by the span it replaced; both end in EOS."""
  noise = random_spans_noise_mask(len(tokens), noise_density, mean_span_length, rng)
  inputs = spans_to_sentinels(tokens, noise, first_sentinel)
  targets = spans_to_sentinels(tokens, ~noise, first_sentinel)
  return np.append(inputs, eos_id), np.append(targets, eos_id)


@dataclass(frozen=True)
class MaskedLM:
  """BERT/RoBERTa masked LM on packed rows, masks drawn afresh each time a row is used (dynamic)."""
  seq_len: int
  first_regular_id: int
  vocab_size: int  # the tokenizer's: random replacements come from [first_regular_id, vocab_size)
  mask_id: int
  rate: float = 0.15
  overlap = 0
  with_bos = True

  @property
  def row_len(self) -> int:
    return self.seq_len

  def __call__(self, stream: TokenStream, rows: np.ndarray, keys: np.ndarray) -> Features:
    tokens, offsets = stream.windows(rows, self.row_len)
    segment_ids, positions = stream.segments(offsets)
    masked = [mlm_mask(row, np.random.default_rng(key), first_regular_id=self.first_regular_id,
                       vocab_size=self.vocab_size, mask_id=self.mask_id, rate=self.rate)
              for row, key in zip(tokens, keys, strict=True)]
    return {'inputs': np.stack([m[0] for m in masked]), 'targets': tokens,
            'weights': np.stack([m[1] for m in masked]), 'segment_ids': segment_ids, 'positions': positions}


@dataclass(frozen=True)
class NextSentencePairs:
  """BERT's original rows: [CLS] A [SEP] B [SEP] with token types 0/1, MLM on top, and an NSP label:
  0 when B is the text that follows A (half the time), 1 when B comes from a random place."""
  masked_lm: MaskedLM
  cls_id: int
  sep_id: int
  overlap = 0
  with_bos = True

  @property
  def row_len(self) -> int:
    return self.masked_lm.seq_len

  def __call__(self, stream: TokenStream, rows: np.ndarray, keys: np.ndarray) -> Features:
    seq_len = self.row_len
    budget = seq_len - 3
    tokens, _ = stream.windows(rows, seq_len)
    m = self.masked_lm
    out: dict[str, list] = {k: [] for k in ('inputs', 'targets', 'weights', 'token_types', 'nsp_labels')}
    for window, key in zip(tokens, keys, strict=True):
      rng = np.random.default_rng(key)
      a_len = int(rng.integers(1, budget))
      b_len = budget - a_len
      is_next = rng.random() < 0.5
      if is_next:
        b = window[a_len:a_len + b_len]
      else:
        start = int(rng.integers(0, len(stream.tokens) - b_len))
        b = stream.tokens[start:start + b_len]
      row = np.concatenate([[self.cls_id], window[:a_len], [self.sep_id], b, [self.sep_id]]).astype(np.int32)
      inputs, weights = mlm_mask(row, rng, first_regular_id=m.first_regular_id, vocab_size=m.vocab_size,
                                 mask_id=m.mask_id, rate=m.rate)
      out['inputs'].append(inputs)
      out['targets'].append(row)
      out['weights'].append(weights)
      out['token_types'].append(np.repeat(np.array([0, 1], np.int32), [a_len + 2, b_len + 1]))
      out['nsp_labels'].append(np.int32(0 if is_next else 1))
    features = {k: np.stack(v) for k, v in out.items()}
    features['segment_ids'] = np.ones((len(rows), seq_len), np.int32)
    features['positions'] = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (len(rows), seq_len)).copy()
    return features


@dataclass(frozen=True)
class SpanCorruption:
  """T5 span corruption of fixed raw windows (documents joined by EOS, as in the T5 paper)."""
  inputs_length: int
  first_sentinel: int
  eos_id: int
  decoder_start_id: int
  noise_density: float = 0.15
  mean_span_length: float = 3.0
  overlap = 0
  with_bos = False

  @property
  def lengths(self) -> SpanLengths:
    return span_lengths(self.inputs_length, self.noise_density, self.mean_span_length)

  @property
  def row_len(self) -> int:
    return self.lengths.raw

  def __call__(self, stream: TokenStream, rows: np.ndarray, keys: np.ndarray) -> Features:
    tokens, _ = stream.windows(rows, self.row_len)
    lengths = self.lengths
    n = len(tokens)
    inputs = np.zeros((n, self.inputs_length), np.int32)
    targets = np.zeros((n, lengths.targets), np.int32)
    for i, (row, key) in enumerate(zip(tokens, keys, strict=True)):
      x, y = span_corruption(row, np.random.default_rng(key), first_sentinel=self.first_sentinel,
                             eos_id=self.eos_id, noise_density=self.noise_density,
                             mean_span_length=self.mean_span_length)
      inputs[i, :len(x)], targets[i, :len(y)] = x, y
    decoder_inputs = np.concatenate([np.full((n, 1), self.decoder_start_id, np.int32), targets[:, :-1]], axis=1)
    return {'inputs': inputs, 'segment_ids': (inputs != 0).astype(np.int32),
            'decoder_inputs': decoder_inputs, 'targets': targets, 'weights': (targets != 0).astype(np.float32),
            'decoder_segment_ids': (targets != 0).astype(np.int32)}
