"""Tokenizers behind one interface: bytes, SentencePiece models and Hugging Face tokenizers.

`data.tokenizer` names one: `byte`; `sentencepiece:PATH` (a .model file); or `hf:PATH`, a
`tokenizer.json` or an HF model directory holding tokenizer.json, vocab.txt (WordPiece),
vocab.json + merges.txt (byte-level BPE) or spiece.model. Special ids (pad, BOS/[CLS], EOS/[SEP],
[MASK], T5's <extra_id_N> sentinels) come from the tokenizer's own vocabulary and files.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lm.config import ConfigError, check_tokenizer_spec


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int  # opens a document; BERT's [CLS]
  eos_id: int  # ends a document; BERT's [SEP]
  mask_id: int | None  # masked LM's replacement token, if the vocabulary has one
  special_ids: np.ndarray  # sorted: never masked, never drawn as a random replacement

  def encode(self, text: str) -> np.ndarray: ...

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """`encode(text)` and each token's UTF-8 byte count (`token_bytes`): what bits per byte divide by."""
    ...

  def decode(self, ids: np.ndarray | list[int]) -> str: ...

  def sentinel_ids(self, count: int) -> np.ndarray | None:
    """Ids of <extra_id_0> ... <extra_id_{count-1}>, or None when the vocabulary has too few."""
    ...


def token_bytes(starts: np.ndarray, total: int) -> np.ndarray:
  """Each token's share of a text's `total` UTF-8 bytes, from the byte offsets where tokens start: a token owns
  the bytes from its start to the next token's (the last to the end, the first from 0), so the counts add up
  to the text's length whatever the tokenizer drops or merges (SentencePiece's normalised spaces, byte pieces
  of one character, specials: 0)."""
  if len(starts) == 0:
    return np.zeros(0, np.int32)
  starts = np.maximum.accumulate(np.clip(starts, 0, total))
  starts[0] = 0
  return np.diff(np.append(starts, total)).astype(np.int32)


class ByteTokenizer:
  """UTF-8 bytes shifted past four specials (pad 0, bos 1, eos 2, mask 3): vocabulary 260."""
  pad_id, bos_id, eos_id, mask_id = 0, 1, 2, 3
  offset = 4
  vocab_size = 256 + offset
  special_ids = np.arange(offset)

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32) + self.offset

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = self.encode(text)
    return ids, np.ones(len(ids), np.int32)

  def decode(self, ids: np.ndarray | list[int]) -> str:
    ids = np.asarray(ids, dtype=np.int64)
    data = (ids[(ids >= self.offset) & (ids < self.vocab_size)] - self.offset).astype(np.uint8).tobytes()
    return data.decode('utf-8', errors='replace')

  def sentinel_ids(self, count: int) -> np.ndarray | None:
    return None


def _lookup(ids: dict[str, int], *names: str | None) -> int | None:
  for name in names:
    if name is not None and name in ids:
      return ids[name]
  return None


class _Vocabulary:
  """What SentencePiece and HF tokenizers share: specials resolved from token strings."""
  pad_id: int
  bos_id: int
  eos_id: int
  mask_id: int | None
  special_ids: np.ndarray
  vocab_size: int
  _sentinels: dict[int, int]

  def _resolve(self, where: str, ids: dict[str, int], special: set[int], *, pad: Any, bos: Any, eos: Any,
               mask: Any) -> None:
    """Sets the special ids from candidate token strings (first found wins)."""
    bos_id, eos_id = _lookup(ids, *bos), _lookup(ids, *eos)
    if eos_id is None:
      raise ConfigError(f'tokenizer {where} has no end-of-document token (looked for {", ".join(filter(None, eos))}); '
                        f'use a vocabulary with one')
    self.bos_id = eos_id if bos_id is None else bos_id  # vocabularies without BOS (T5) separate by EOS alone
    self.eos_id = eos_id
    pad_id = _lookup(ids, *pad)
    self.pad_id = eos_id if pad_id is None else pad_id
    self.mask_id = _lookup(ids, *mask)
    self._sentinels = {int(name[10:-1]): i for name, i in ids.items()
                       if name.startswith('<extra_id_') and name.endswith('>') and name[10:-1].isdigit()}
    special |= {self.pad_id, self.bos_id, self.eos_id, *self._sentinels.values()}
    if self.mask_id is not None:
      special.add(self.mask_id)
    self.special_ids = np.array(sorted(special), np.int64)

  def sentinel_ids(self, count: int) -> np.ndarray | None:
    if any(n not in self._sentinels for n in range(count)):
      return None
    return np.array([self._sentinels[n] for n in range(count)], np.int64)


class SentencePieceTokenizer(_Vocabulary):
  """A SentencePiece model: specials from its pad/bos/eos/unk ids, control and user-defined pieces."""

  def __init__(self, path: str | Path):
    import sentencepiece as spm
    self.path = str(path)
    self.processor = spm.SentencePieceProcessor(model_file=self.path)
    sp = self.processor
    self.vocab_size = sp.get_piece_size()
    ids = {sp.id_to_piece(i): i for i in range(self.vocab_size)}
    named = {'pad': sp.pad_id(), 'bos': sp.bos_id(), 'eos': sp.eos_id()}
    for role, i in named.items():
      if i >= 0:
        ids[f'<lm {role}>'] = i
    special = {i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)}
    self._resolve(f'sentencepiece:{path}', ids, special, pad=('<lm pad>',), bos=('<lm bos>',),
                  eos=('<lm eos>', '</s>'), mask=('[MASK]', '<mask>'))
    self._special = frozenset(self.special_ids.tolist())

  def __reduce__(self) -> tuple:  # rebuilt from the file in grain worker processes
    return SentencePieceTokenizer, (self.path,)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.processor.encode(text), np.int32)

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    pieces = self.processor.encode(text, return_type='proto').pieces  # begin: a byte offset into `text`
    return (np.array([p.id for p in pieces], np.int32),
            token_bytes(np.array([p.begin for p in pieces], np.int64), len(text.encode('utf-8'))))

  def decode(self, ids: np.ndarray | list[int]) -> str:
    ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and int(i) not in self._special]
    return self.processor.decode(ids)


def _token_string(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


class HFTokenizer(_Vocabulary):
  """A Hugging Face tokenizer (the `tokenizers` library), from tokenizer.json or the classic vocabulary files."""

  def __init__(self, path: str | Path):
    self.path = str(path)
    path = Path(path)
    self.tokenizer, directory = _load_hf(path)
    settings: dict[str, Any] = {}
    for name in ('special_tokens_map.json', 'tokenizer_config.json'):
      if (directory / name).is_file():
        settings.update(json.loads((directory / name).read_text()))
    token = lambda key: _token_string(settings.get(key))
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    ids = self.tokenizer.get_vocab(with_added_tokens=True)
    special = {i for i, added in self.tokenizer.get_added_tokens_decoder().items() if added.special}
    special |= {i for key in ('unk_token', 'cls_token', 'sep_token') if (i := _lookup(ids, token(key))) is not None}
    self._resolve(f'hf:{path}', ids, special, pad=(token('pad_token'), '[PAD]', '<pad>'),
                  bos=(token('bos_token'), token('cls_token'), '<s>', '[CLS]', '<|endoftext|>'),
                  eos=(token('eos_token'), token('sep_token'), '</s>', '[SEP]', '<|endoftext|>'),
                  mask=(token('mask_token'), '[MASK]', '<mask>'))

  def __reduce__(self) -> tuple:
    return HFTokenizer, (self.path,)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = self.tokenizer.encode(text, add_special_tokens=False)
    char_to_byte = np.cumsum([0] + [len(c.encode('utf-8')) for c in text])  # offsets count characters
    starts = char_to_byte[np.array([start for start, _ in encoding.offsets], np.int64)]
    return np.asarray(encoding.ids, np.int32), token_bytes(starts, int(char_to_byte[-1]))

  def encode_with_offsets(self, text: str, add_special_tokens: bool = False
                          ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The ids and each token's (start, end) characters in `text`; `add_special_tokens`: with those the
    tokenizer's post-processor adds (as transformers' tokenizer call does by default)."""
    encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return np.asarray(encoding.ids, np.int32), [tuple(o) for o in encoding.offsets]

  def decode(self, ids: np.ndarray | list[int]) -> str:
    return self.tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)


def _load_hf(path: Path) -> tuple[Any, Path]:
  """(a `tokenizers.Tokenizer`, the directory of its settings files) from a file or a model directory."""
  import tokenizers
  if path.is_file() and path.suffix == '.json':
    return tokenizers.Tokenizer.from_file(str(path)), path.parent
  if (path / 'tokenizer.json').is_file():
    return tokenizers.Tokenizer.from_file(str(path / 'tokenizer.json')), path
  if (path / 'vocab.txt').is_file():
    settings = path / 'tokenizer_config.json'
    lowercase = json.loads(settings.read_text()).get('do_lower_case', True) if settings.is_file() else True
    wordpiece = tokenizers.BertWordPieceTokenizer(str(path / 'vocab.txt'), lowercase=lowercase)
    return wordpiece._tokenizer, path  # noqa: SLF001  (the implementation classes wrap a Tokenizer)
  if (path / 'vocab.json').is_file() and (path / 'merges.txt').is_file():
    bpe = tokenizers.ByteLevelBPETokenizer(str(path / 'vocab.json'), str(path / 'merges.txt'))
    return bpe._tokenizer, path  # noqa: SLF001
  raise ConfigError(f'data.tokenizer=hf:{path}: no tokenizer.json, vocab.txt or vocab.json + merges.txt there; '
                    f'pass an HF model directory or a tokenizer.json')


# Text whose encoding tells tokenizers apart: cases, digits, whitespace runs, punctuation, accents, CJK, emoji.
PROBE = ('The quick brown fox jumps over the lazy dog. THE QUICK 0123456789 3.14159 $1,000,000\n\tdef f(x): '
         'return x ** 2  # comment\n\n  naïve café résumé Übermaß 東京 日本語 🙂 <extra_id_0> [MASK] </s>')


def fingerprint(tokenizer: Tokenizer) -> str:
  """A hash of how `tokenizer` encodes (its vocabulary size, special ids and the probe's ids and byte counts):
  equal for the same tokenizer wherever its files lie, different for another."""
  ids, nbytes = tokenizer.encode_with_bytes(PROBE)
  facts = [tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id,
           np.asarray(tokenizer.special_ids).tolist(), np.asarray(ids).tolist(), np.asarray(nbytes).tolist()]
  return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer `data.tokenizer` names; a ConfigError naming the path when it cannot be read."""
  check_tokenizer_spec(spec)
  if spec == 'byte':
    return ByteTokenizer()
  kind, _, path = spec.partition(':')
  if not Path(path).exists():
    raise ConfigError(f'data.tokenizer={spec}: {path} does not exist; train one with lm tokenizer train or '
                      f'point at an existing {"SentencePiece model" if kind == "sentencepiece" else "HF tokenizer"}')
  if kind == 'sentencepiece' or (kind == 'hf' and (Path(path) / 'spiece.model').is_file()
                                 and not (Path(path) / 'tokenizer.json').is_file()):
    return SentencePieceTokenizer(Path(path) / 'spiece.model' if kind == 'hf' else path)
  return HFTokenizer(path)
