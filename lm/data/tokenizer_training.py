"""`lm tokenizer train`: a SentencePiece model trained on a data source, with the pieces our objectives use.

Ids 0-3 are pad, EOS, unknown and BOS; then `[MASK]` (masked LM) and, when asked, T5's
`<extra_id_0>` ... sentinels. Text is not normalised and unknown characters fall back to bytes,
so code and any Unicode round-trip exactly (`decode(encode(text)) == text`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal

from lm.config import ConfigError

SPECIALS = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=3)


REPORT_EVERY = 200_000  # lines between progress lines


def _lines(documents: Iterable[str], report: Callable[[str], None]) -> Iterator[str]:
  """Non-blank lines, with a progress line every REPORT_EVERY and when reading is done (training follows)."""
  count = 0
  for document in documents:
    for line in document.splitlines():
      if line.strip():
        count += 1
        if count % REPORT_EVERY == 0:
          report(f'read {count:,} lines')
        yield line
  report(f'read {count:,} lines; learning the pieces')


def train_sentencepiece(documents: Iterable[str], out: str | Path, *, vocab_size: int,
                        model_type: Literal['unigram', 'bpe'] = 'unigram', sentinels: int = 0,
                        max_lines: int = 2_000_000, report: Callable[[str], None] = lambda message: None) -> Path:
  """Trains on up to `max_lines` lines (a random sample when there are more); writes OUT.model and OUT.vocab.
  `report` gets progress lines while the text is read (SentencePiece itself is silent)."""
  import sentencepiece as spm
  if model_type not in ('unigram', 'bpe'):
    raise ConfigError(f'--model-type {model_type!r}: choose unigram or bpe')
  symbols = ['[MASK]'] + [f'<extra_id_{i}>' for i in range(sentinels)]
  floor = 256 + len(SPECIALS) + len(symbols) + 1  # byte fallback pieces, specials, one learned piece
  if vocab_size < floor:
    raise ConfigError(f'--vocab-size {vocab_size} leaves no room to learn pieces: byte fallback and the specials '
                      f'take {floor - 1}; use at least {floor}')
  prefix = str(out).removesuffix('.model')
  Path(prefix).parent.mkdir(parents=True, exist_ok=True)
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=_lines(documents, report), model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
      user_defined_symbols=symbols, normalization_rule_name='identity', remove_extra_whitespaces=False,
      byte_fallback=True, allow_whitespace_only_pieces=True, split_digits=True, input_sentence_size=max_lines,
      shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2, **SPECIALS)
  except RuntimeError as e:  # e.g. a vocabulary larger than the corpus supports
    raise ConfigError(f'sentencepiece could not train: {str(e).splitlines()[-1]}; lower --vocab-size or add text') \
      from None
  return Path(prefix + '.model')
