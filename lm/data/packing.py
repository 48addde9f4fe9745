"""Documents packed end to end into one token stream, cut into fixed-length rows.

Every row is fully used (no padding). Segment ids and positions restart at each document
boundary inside a row (and at the row start), so attention never crosses documents.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenStream:
  tokens: np.ndarray  # [n] token ids
  doc_ids: np.ndarray  # [n] index of the document each token belongs to
  doc_starts: np.ndarray  # [num_docs] offset of each document's first token

  @classmethod
  def from_documents(cls, docs: list[np.ndarray], bos_id: int | None, eos_id: int) -> 'TokenStream':
    """Each document becomes [bos] + tokens + [eos] (no bos when None), concatenated in the given order."""
    head = [] if bos_id is None else [bos_id]
    pieces = [np.concatenate([head, d, [eos_id]]).astype(np.int32) for d in docs]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    return cls(tokens=np.concatenate(pieces),
               doc_ids=np.repeat(np.arange(len(pieces), dtype=np.int32), lengths),
               doc_starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]))

  def num_rows(self, row_len: int, overlap: int = 0) -> int:
    """Rows of `row_len` tokens with stride `row_len - overlap` that fit in the stream."""
    return max(0, (len(self.tokens) - overlap) // (row_len - overlap))

  def windows(self, rows: np.ndarray, row_len: int, overlap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and stream offsets [len(rows), row_len] of the given rows."""
    offsets = np.asarray(rows, dtype=np.int64)[:, None] * (row_len - overlap) + np.arange(row_len)[None]
    return self.tokens[offsets], offsets

  def segments(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (1, 2, ... per row) and positions restarting at each document or row start."""
    docs = self.doc_ids[offsets]
    segment_ids = (docs - docs[:, :1] + 1).astype(np.int32)
    starts = np.maximum(self.doc_starts[docs], offsets[:, :1])
    return segment_ids, (offsets - starts).astype(np.int32)
