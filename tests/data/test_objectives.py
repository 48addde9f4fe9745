"""MLM masking statistics, span corruption round trips, padding and target bytes of every objective."""
import numpy as np
import pytest

from lm.data.objectives import (
  CausalLM,
  MaskedLM,
  NextSentencePairs,
  Rows,
  SpanCorruption,
  corrupt_spans,
  mlm_mask,
  random_spans_noise_mask,
  regular_ids,
  span_lengths,
)

PAD, BOS, EOS, MASK, FIRST, VOCAB = 0, 1, 2, 3, 4, 260
SPECIAL = np.arange(FIRST)
REGULAR = regular_ids(VOCAB, SPECIAL)


def test_mlm_rates_over_100k_tokens():
  rng = np.random.default_rng(0)
  chosen = eligible = masked = randomised = kept = 0
  for _ in range(500):
    row = rng.integers(FIRST, VOCAB, size=256)
    row[rng.random(256) < 0.1] = PAD
    row[::37] = BOS
    row[5::41] = EOS
    inputs, weights = mlm_mask(row, rng, special=SPECIAL, regular=REGULAR, mask_id=MASK)
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
  a = mlm_mask(row, np.random.default_rng(5), special=SPECIAL, regular=REGULAR, mask_id=MASK)
  b = mlm_mask(row, np.random.default_rng(5), special=SPECIAL, regular=REGULAR, mask_id=MASK)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])


def test_special_ids_need_not_be_the_lowest():
  """GPT-2's <|endoftext|> is its last id: special ids anywhere are never chosen nor drawn."""
  special = np.array([0, 5, 259])
  regular = regular_ids(VOCAB, special)
  rng = np.random.default_rng(3)
  for _ in range(200):
    row = rng.choice([0, 5, 259, 7, 8, 9, 100], size=64)
    inputs, weights = mlm_mask(row, rng, special=special, regular=regular, mask_id=MASK)
    assert not np.any(np.isin(row[weights > 0], special))
    replaced = (weights > 0) & (inputs != MASK)
    assert not np.any(np.isin(inputs[replaced], special))


SENTINELS = np.array([511, 300, 420, 299] + list(range(600, 700)))  # any ids: the tokenizer's own, unordered


def reconstruct(inputs, targets, sentinels):
  is_sentinel = lambda t: t in set(sentinels.tolist())
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


def span_corruption(tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  return corrupt_spans(tokens, random_spans_noise_mask(len(tokens), 0.15, 3.0, rng), SENTINELS, EOS)


@pytest.mark.parametrize('length', [20, 113, 568])
def test_span_corruption_reconstructs_the_original(length):
  rng = np.random.default_rng(length)
  for _ in range(50):
    tokens = rng.integers(FIRST, 290, size=length)
    inputs, targets = span_corruption(tokens, rng)
    assert inputs[-1] == EOS and targets[-1] == EOS
    used = [t for t in targets if t in set(SENTINELS.tolist())]
    np.testing.assert_array_equal(used, SENTINELS[:len(used)])  # <extra_id_0>, <extra_id_1>, ... in order
    np.testing.assert_array_equal(reconstruct(inputs, targets, SENTINELS), tokens)


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
  inputs, targets = span_corruption(np.full(lengths.raw, 9), rng)
  assert len(inputs) == lengths.inputs and len(targets) == lengths.targets


@pytest.mark.long(0.2)
def test_next_sentence_pairs():
  rng = np.random.default_rng(0)
  n, seq = 400, 64
  tokens = rng.integers(FIRST, VOCAB, size=(n, seq)).astype(np.int32)
  rows = Rows(tokens, np.ones_like(tokens), np.tile(np.arange(seq), (n, 1)))
  objective = NextSentencePairs(MaskedLM(seq, special=SPECIAL, regular=REGULAR, mask_id=MASK), cls_id=BOS, sep_id=EOS)
  f = objective(rows, np.stack([np.zeros(n, int), np.arange(n), np.zeros(n, int)], 1))
  assert abs(f['nsp_labels'].mean() - 0.5) < 0.07
  for i in range(n):
    t, types = f['targets'][i], f['token_types'][i]
    sep = np.flatnonzero(types)[0] - 1  # [CLS] A [SEP] take type 0, B [SEP] type 1
    assert t[0] == BOS and t[sep] == EOS and t[-1] == EOS and np.all(types[sep + 1:] == 1)
    a, b = t[1:sep], t[sep + 1:-1]
    np.testing.assert_array_equal(a, tokens[i, :len(a)])
    if f['nsp_labels'][i] == 0:  # B is what follows A in its row
      np.testing.assert_array_equal(b, tokens[i, len(a):len(a) + len(b)])
    else:  # B is a run of another row
      others = [j for j in range(n) if j != i and any(np.array_equal(b, tokens[j, k:k + len(b)])
                                                       for k in range(seq - len(b) + 1))]
      assert others
    assert np.all(f['weights'][i][[0, sep, 63]] == 0), 'special tokens are never masked'


@pytest.mark.parametrize('make', [
  lambda: CausalLM(31),
  lambda: MaskedLM(32, special=SPECIAL, regular=REGULAR, mask_id=MASK),
  lambda: NextSentencePairs(MaskedLM(32, special=SPECIAL, regular=REGULAR, mask_id=MASK), cls_id=BOS, sep_id=EOS),
  lambda: SpanCorruption(28, SENTINELS, eos_id=EOS, pad_id=PAD),
], ids=['causal', 'mlm', 'nsp', 'spans'])
def test_padding_is_never_a_target_and_target_bytes_follow_the_targets(make):
  """A finite split's last row ends in padding (token 0, segment 0): never weighted. Each token here has
  1-3 bytes as a function of its id, so a target's bytes are known from the target alone (specials: 0)."""
  objective = make()
  rng = np.random.default_rng(0)
  n, length = 40, objective.row_len
  tokens = rng.integers(FIRST, 200, size=(n, length)).astype(np.int32)
  segment_ids = np.ones_like(tokens)
  real = rng.integers(0, length, size=n)  # every row but some full ones ends in padding
  real[::4] = length
  for i, r in enumerate(real):
    tokens[i, r:], segment_ids[i, r:] = PAD, 0
  bytes_of = lambda ids: np.where(ids >= FIRST, (ids - FIRST) % 3 + 1, 0)
  rows = Rows(tokens, segment_ids, np.tile(np.arange(length), (n, 1)), bytes_of(tokens))
  f = objective(rows, np.stack([np.zeros(n, int), np.arange(n), np.zeros(n, int)], 1))
  targets, weights = f['targets'], f['weights']
  sentinel = np.isin(targets, SENTINELS)
  np.testing.assert_array_equal(f['target_bytes'], np.where(sentinel, 0, bytes_of(targets)))
  if isinstance(objective, NextSentencePairs):  # pairs draw from other rows: no weight on any row's padding
    assert not (weights * (targets == PAD)).any()
  else:
    counted = (weights > 0).sum(1)
    for i, r in enumerate(real):
      if isinstance(objective, SpanCorruption):  # the real tokens alone are corrupted: targets hold their noise
        assert (counted[i] == 0) if r < 2 else (0 < counted[i] and np.isin(targets[i][weights[i] > 0],
                                                                           [*tokens[i, :r], *SENTINELS, EOS]).all())
      else:
        assert not weights[i, r:].any()
  assert weights.sum() > 0
  without = objective(Rows(tokens, segment_ids, rows.positions), np.stack([np.zeros(n, int), np.arange(n),
                                                                           np.zeros(n, int)], 1))
  assert 'target_bytes' not in without and all(np.array_equal(without[k], f[k]) for k in without)
