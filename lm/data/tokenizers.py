"""Tokenizers behind one interface; SentencePiece plugs in beside the byte tokenizer."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from lm.config import ConfigError


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int  # also BERT's [CLS]
  eos_id: int  # also BERT's [SEP]
  mask_id: int
  first_regular_id: int  # ids below this are special: never masked, never a random replacement

  def encode(self, text: str) -> np.ndarray: ...

  def decode(self, ids: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted past four specials (pad 0, bos 1, eos 2, mask 3): vocabulary 260."""
  pad_id, bos_id, eos_id, mask_id = 0, 1, 2, 3
  offset = first_regular_id = 4
  vocab_size = 256 + offset

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32) + self.offset

  def decode(self, ids: np.ndarray | list[int]) -> str:
    ids = np.asarray(ids, dtype=np.int64)
    data = (ids[ids >= self.offset] - self.offset).astype(np.uint8).tobytes()
    return data.decode('utf-8', errors='replace')


TOKENIZERS = {'byte': ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
  if name not in TOKENIZERS:
    raise ConfigError(f'data.tokenizer={name!r} is unknown; choose one of: {", ".join(TOKENIZERS)}')
  return TOKENIZERS[name]()
