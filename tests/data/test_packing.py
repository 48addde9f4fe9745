"""Packing into rows: shifts, segment ids, positions and weights reconstruct the documents."""
import numpy as np

from lm.data.objectives import CausalLM
from lm.data.packing import TokenStream
from lm.data.tokenizers import ByteTokenizer


def docs_of(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 259, size=n).astype(np.int32) for n in lengths]


def test_byte_tokenizer_round_trip():
  tok = ByteTokenizer()
  text = 'naïve café — 日本語 ok\n'
  ids = tok.encode(text)
  assert ids.min() >= tok.offset and ids.max() < tok.vocab_size == 260
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == text


def test_rows_reconstruct_documents_and_never_cross_them():
  docs = docs_of([5, 40, 3, 17, 9, 60, 2])
  stream = TokenStream.from_documents(docs, bos_id=1, eos_id=2)
  seq = 16
  n = stream.num_rows(seq + 1, overlap=1)
  assert n == (len(stream.tokens) - 1) // seq
  rows = CausalLM(seq)(stream, np.arange(n), np.zeros((n, 3), int))
  inputs, targets, weights = rows['inputs'], rows['targets'], rows['weights']
  seg, pos = rows['segment_ids'], rows['positions']
  # Concatenated rows are the stream (inputs) shifted by one (targets).
  np.testing.assert_array_equal(inputs.reshape(-1), stream.tokens[:n * seq])
  np.testing.assert_array_equal(targets.reshape(-1), stream.tokens[1:n * seq + 1])
  # Rebuild each document piece by piece from (segment, position) runs within rows.
  rebuilt = {}
  expected = [np.concatenate([[1], d, [2]]) for d in docs]
  doc_of = np.repeat(np.arange(len(expected)), [len(e) for e in expected])
  for r in range(n):
    for s in np.unique(seg[r]):
      idx = np.where(seg[r] == s)[0]
      assert np.all(np.diff(idx) == 1), 'a segment is contiguous'
      np.testing.assert_array_equal(pos[r, idx], np.arange(len(idx)))
      docs_here = doc_of[r * seq + idx]
      assert len(set(docs_here)) == 1, 'a segment holds one document'
      rebuilt.setdefault(docs_here[0], []).append(inputs[r, idx])
      # Targets inside the segment continue the same document; the step over a boundary has weight 0.
      same_doc_target = doc_of[r * seq + idx + 1] == docs_here[0]
      np.testing.assert_array_equal(weights[r, idx], same_doc_target.astype(np.float32))
  for i, pieces in rebuilt.items():
    full = np.concatenate(pieces)
    np.testing.assert_array_equal(full, expected[i][:len(full)])
  assert seg.min() >= 1, 'rows are fully packed: no padding'
