"""Packing through the grain pipeline: rows are the document stream cut in order; segments never cross documents."""
import numpy as np

from lm.data.objectives import CausalLM
from lm.data.pipeline import batch_dataset
from lm.data.sources import TextList
from lm.data.tokenizers import ByteTokenizer


def test_rows_reconstruct_documents_and_never_cross_them():
  rng = np.random.default_rng(0)
  texts = [''.join(rng.choice(list('abcdefgh '), size=n)) for n in [5, 40, 3, 17, 9, 60, 2, 33, 1, 25]]
  tok, seq = ByteTokenizer(), 16
  expected = [np.concatenate([[tok.bos_id], tok.encode(t), [tok.eos_id]]) for t in texts]
  stream = np.concatenate(expected)
  doc_of = np.repeat(np.arange(len(expected)), [len(e) for e in expected])
  batches = list(batch_dataset(TextList(texts), tok, CausalLM(seq), shuffle_seed=None, key_seed=0, global_batch=2,
                               streams=1))
  rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  inputs, targets, weights, seg, pos = (rows[k] for k in ('inputs', 'targets', 'weights', 'segment_ids', 'positions'))
  n = len(inputs)
  assert n == len(stream) // (seq + 1) // 2 * 2, 'every full row, in whole batches'
  # Rows of seq + 1 tokens cut the stream in order; inputs and targets are a row shifted by one.
  whole = np.concatenate([inputs, targets[:, -1:]], axis=1)
  np.testing.assert_array_equal(whole.reshape(-1), stream[:n * (seq + 1)])
  np.testing.assert_array_equal(targets, whole[:, 1:])
  for r in range(n):
    for s in np.unique(seg[r]):
      idx = np.where(seg[r] == s)[0]
      assert np.all(np.diff(idx) == 1), 'a segment is contiguous'
      np.testing.assert_array_equal(pos[r, idx], np.arange(len(idx)))  # restart at each document and row
      docs_here = doc_of[r * (seq + 1) + idx]
      assert len(set(docs_here)) == 1, 'a segment holds one document'
      starts_document = doc_of[r * (seq + 1) + idx[0] - 1] != docs_here[0] if r or idx[0] else True
      assert starts_document or idx[0] == 0, 'a new segment inside a row starts a new document'
      # Targets inside the segment continue the same document; the step over a boundary has weight 0.
      same_doc_target = doc_of[r * (seq + 1) + idx + 1] == docs_here[0]
      np.testing.assert_array_equal(weights[r, idx], same_doc_target.astype(np.float32))
  assert seg.min() >= 1, 'rows are fully packed: no padding'
