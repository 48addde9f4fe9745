"""Learnable synthetic GLUE tasks written in GLUE's own file formats, for end-to-end fine-tuning tests.

Pair task (RTE's layout, labels entailment / not_entailment; or MRPC's, labels 1 / 0): is sentence B a
word-shuffle of A (entailment, 1), or made of other words (not_entailment, 0)? Neither sentence alone
tells: the model must compare them. Regression (STS-B's layout): B keeps k of A's three words, shuffled,
among others; the score is 5k/3.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# Few words, each seen often: a tiny byte-level model learns to match them across the pair in ~100 steps.
WORDS = ('cat', 'dog', 'sun', 'fly', 'big', 'red', 'owl', 'jam')
LENGTH = 3


def _sentence(words: list[str]) -> str:
  return ' '.join(words)


def _pair(rng: np.random.Generator, keep: int) -> tuple[str, str]:
  """A of LENGTH distinct words; B keeps `keep` of them and takes the rest from words not in A, shuffled."""
  order = rng.permutation(len(WORDS))
  a = [WORDS[i] for i in order[:LENGTH]]
  others = [WORDS[i] for i in order[LENGTH:]]
  b = list(rng.choice(a, keep, replace=False)) + list(rng.choice(others, LENGTH - keep, replace=False))
  return _sentence(a), _sentence([b[i] for i in rng.permutation(LENGTH)])


def shuffle_pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    positive = bool(rng.integers(2))
    a, b = _pair(rng, LENGTH if positive else 0)
    rows.append((a, b, 'entailment' if positive else 'not_entailment'))
  return rows


def overlap_scores(n: int, seed: int) -> list[tuple[str, str, float]]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    keep = int(rng.integers(LENGTH + 1))
    a, b = _pair(rng, keep)
    rows.append((a, b, 5.0 * keep / LENGTH))
  return rows


def write_rte(data_dir: Path, train: int = 2000, dev: int = 200, test: int = 20) -> None:
  """DIR/RTE/{train,dev,test}.tsv of the shuffle task."""
  folder = data_dir / 'RTE'
  folder.mkdir(parents=True, exist_ok=True)
  for split, n, seed in (('train', train, 0), ('dev', dev, 1), ('test', test, 2)):
    rows = shuffle_pairs(n, seed)
    if split == 'test':
      lines = ['index\tsentence1\tsentence2'] + [f'{i}\t{a}\t{b}' for i, (a, b, _) in enumerate(rows)]
    else:
      lines = ['index\tsentence1\tsentence2\tlabel'] + [f'{i}\t{a}\t{b}\t{y}' for i, (a, b, y) in enumerate(rows)]
    (folder / f'{split}.tsv').write_text('\n'.join(lines) + '\n')


def write_mrpc(data_dir: Path, train: int = 2000, dev: int = 200, test: int = 20) -> None:
  """DIR/MRPC/{train,dev,test}.tsv of the shuffle task in MRPC's five columns (label first, 1: a shuffle)."""
  folder = data_dir / 'MRPC'
  folder.mkdir(parents=True, exist_ok=True)
  for split, n, seed in (('train', train, 6), ('dev', dev, 7), ('test', test, 8)):
    rows = shuffle_pairs(n, seed)
    first = 'index' if split == 'test' else 'Quality'
    lines = [f'{first}\t#1 ID\t#2 ID\t#1 String\t#2 String']
    for i, (a, b, y) in enumerate(rows):
      lines.append(f'{i if split == "test" else int(y == "entailment")}\t{2 * i}\t{2 * i + 1}\t{a}\t{b}')
    (folder / f'{split}.tsv').write_text('\n'.join(lines) + '\n')


def write_stsb(data_dir: Path, train: int = 2000, dev: int = 200, test: int = 20) -> None:
  """DIR/STS-B/{train,dev,test}.tsv of the overlap-score task, in STS-B's 10 (test: 9) columns."""
  folder = data_dir / 'STS-B'
  folder.mkdir(parents=True, exist_ok=True)
  head = 'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2'
  for split, n, seed in (('train', train, 3), ('dev', dev, 4), ('test', test, 5)):
    rows = overlap_scores(n, seed)
    meta = lambda i: f'{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone'
    if split == 'test':
      lines = [head] + [f'{meta(i)}\t{a}\t{b}' for i, (a, b, _) in enumerate(rows)]
    else:
      lines = [head + '\tscore'] + [f'{meta(i)}\t{a}\t{b}\t{y:.3f}' for i, (a, b, y) in enumerate(rows)]
    (folder / f'{split}.tsv').write_text('\n'.join(lines) + '\n')
