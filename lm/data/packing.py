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
  def from_documents(cls, docs: list[np.ndarray], bos_id: int, eos_id: int) -> 'TokenStream':
    """Each document becomes [bos] + tokens + [eos]; documents are concatenated in the given order."""
    pieces = [np.concatenate([[bos_id], d, [eos_id]]).astype(np.int32) for d in docs]
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


def causal_lm_rows(stream: TokenStream, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """Next-token prediction rows: inputs are stream[o:o+S], targets stream[o+1:o+S+1].

  A target from another document (the step over a boundary) gets weight 0.
  """
  tokens, offsets = stream.windows(rows, seq_len + 1, overlap=1)
  segment_ids, positions = stream.segments(offsets[:, :-1])
  docs = stream.doc_ids[offsets]
  return {
    'inputs': tokens[:, :-1],
    'targets': tokens[:, 1:],
    'weights': (docs[:, :-1] == docs[:, 1:]).astype(np.float32),
    'segment_ids': segment_ids,
    'positions': positions,
  }
