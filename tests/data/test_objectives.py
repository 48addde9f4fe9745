"""MLM masking statistics and span corruption round trips."""
import numpy as np
import pytest

from lm.data.objectives import mlm_mask, random_spans_noise_mask, span_corruption, span_lengths

PAD, BOS, EOS, MASK, FIRST, VOCAB = 0, 1, 2, 3, 4, 260


def test_mlm_rates_over_100k_tokens():
  rng = np.random.default_rng(0)
  chosen = eligible = masked = randomised = kept = 0
  for _ in range(500):
    row = rng.integers(FIRST, VOCAB, size=256)
    row[rng.random(256) < 0.1] = PAD
    row[::37] = BOS
    row[5::41] = EOS
    inputs, weights = mlm_mask(row, rng, first_regular_id=FIRST, vocab_size=VOCAB, mask_id=MASK)
    pick = weights > 0
    assert np.all(row[pick] >= FIRST), 'special and padding tokens are never chosen'
    np.testing.assert_array_equal(inputs[~pick], row[~pick])
    eligible += np.sum(row >= FIRST)
    chosen += pick.sum()
    masked += np.sum(inputs[pick] == MASK)
    changed = pick & (inputs != MASK) & (inputs != row)
    assert np.all(inputs[changed] >= FIRST)
    randomised += changed.sum()
    kept += np.sum(pick & (inputs == row))
  assert eligible > 100_000
  assert abs(chosen / eligible - 0.15) < 0.005
  assert abs(masked / chosen - 0.8) < 0.01
  # A random replacement equals the original 1 time in 256; count those as random, not kept.
  random_share = randomised / chosen / (1 - 1 / (VOCAB - FIRST))
  assert abs(random_share - 0.1) < 0.01
  assert abs(1 - masked / chosen - random_share - 0.1) < 0.01


def test_mlm_is_reproducible_from_the_generator():
  row = np.arange(FIRST, FIRST + 200)
  a = mlm_mask(row, np.random.default_rng(5), first_regular_id=FIRST, vocab_size=VOCAB, mask_id=MASK)
  b = mlm_mask(row, np.random.default_rng(5), first_regular_id=FIRST, vocab_size=VOCAB, mask_id=MASK)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])


def reconstruct(inputs, targets, first_sentinel, num_sentinels):
  is_sentinel = lambda t: first_sentinel - num_sentinels < t <= first_sentinel
  spans, current = {}, None
  for t in targets[:-1]:
    if is_sentinel(t):
      current = spans.setdefault(t, [])
    else:
      current.append(t)
  out = []
  for t in inputs[:-1]:
    out.extend(spans[t] if is_sentinel(t) else [t])
  return np.array(out)


@pytest.mark.parametrize('length', [20, 113, 568])
def test_span_corruption_reconstructs_the_original(length):
  rng = np.random.default_rng(length)
  sentinel = 511
  for _ in range(50):
    tokens = rng.integers(FIRST, 300, size=length)
    inputs, targets = span_corruption(tokens, rng, first_sentinel=sentinel, eos_id=EOS)
    assert inputs[-1] == EOS and targets[-1] == EOS
    np.testing.assert_array_equal(reconstruct(inputs, targets, sentinel, 100), tokens)


def test_span_statistics_match_the_settings():
  rng = np.random.default_rng(1)
  noise = spans = total = 0
  for _ in range(300):
    mask = random_spans_noise_mask(568, 0.15, 3.0, rng)
    assert not mask[0], 'T5 starts with a kept span'
    noise += mask.sum()
    spans += np.sum(mask & ~np.concatenate([[False], mask[:-1]]))
    total += len(mask)
  assert abs(noise / total - 0.15) < 0.015
  assert abs(noise / spans - 3.0) < 0.3


def test_span_lengths_fit_t5_defaults():
  # T5: 512 input tokens come from 568 raw tokens, with 114 target tokens.
  lengths = span_lengths(512)
  assert (lengths.raw, lengths.inputs, lengths.targets) == (568, 512, 114)
  rng = np.random.default_rng(0)
  inputs, targets = span_corruption(np.full(lengths.raw, 9), rng, first_sentinel=999, eos_id=EOS)
  assert len(inputs) == lengths.inputs and len(targets) == lengths.targets


def test_next_sentence_pairs():
  from lm.data.objectives import MaskedLM, NextSentencePairs
  from lm.data.packing import TokenStream
  rng = np.random.default_rng(0)
  docs = [rng.integers(FIRST, VOCAB, size=n) for n in rng.integers(50, 400, size=60)]
  stream = TokenStream.from_documents(docs, bos_id=BOS, eos_id=EOS)
  objective = NextSentencePairs(MaskedLM(64, first_regular_id=FIRST, vocab_size=VOCAB, mask_id=MASK),
                                cls_id=BOS, sep_id=EOS)
  n = 400
  rows = np.arange(n) % stream.num_rows(64)
  f = objective(stream, rows, np.stack([np.zeros(n, int), np.zeros(n, int), np.arange(n)], 1))
  assert abs(f['nsp_labels'].mean() - 0.5) < 0.07
  for i in range(n):
    t, types = f['targets'][i], f['token_types'][i]
    sep = np.flatnonzero(types)[0] - 1  # [CLS] A [SEP] take type 0, B [SEP] type 1
    assert t[0] == BOS and t[sep] == EOS and t[-1] == EOS and np.all(types[sep + 1:] == 1)
    a, b = t[1:sep], t[sep + 1:-1]
    window, _ = stream.windows(rows[i:i + 1], 64)
    np.testing.assert_array_equal(a, window[0, :len(a)])
    if f['nsp_labels'][i] == 0:  # B is what follows A in the corpus
      np.testing.assert_array_equal(b, window[0, len(a):len(a) + len(b)])
    assert np.all(f['weights'][i][[0, sep, 63]] == 0), 'special tokens are never masked'
