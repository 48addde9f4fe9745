"""The engine's Scorer: contexts shared by several continuations, computed once, score as each pair in a row of
its own (the family's plain scoring path, itself checked against float64 in tests/models/test_scoring.py)."""
import jax
import numpy as np
import pytest

from lm.assembly import assemble
from lm.config import load_config
from lm.jobs.evals.engine import Scorer, bucket_length

SMALL = ['model.d_model=64', 'model.num_layers=2', 'model.num_heads=4', 'model.d_ff=128', 'model.max_len=64', 'data.seq_len=64',
         'train.global_batch=8', 'mesh.data=1']


def test_bucket_lengths_pad_by_half_at_most():
  assert [bucket_length(n, 256) for n in (1, 16, 17, 24, 25, 33, 48, 49, 97, 200, 300)] == \
    [16, 16, 24, 24, 32, 48, 48, 64, 128, 256, 256]
  assert all(n <= bucket_length(n, 1024) <= 1.5 * n for n in range(16, 1024))
  assert bucket_length(3, 64, shortest=4) == 4 and bucket_length(5, 64, shortest=4) == 6


@pytest.mark.long(0.3)
@pytest.mark.parametrize('preset', ['gpt_tiny', 't5_tiny'])  # a decoder's context row is one token shorter
def test_shared_contexts_score_as_pairs_alone(preset):
  assembly = assemble(load_config(preset, SMALL), jax.devices()[:1])  # meshes: test_scoring.py
  params = assembly.init_state().params
  rng = np.random.default_rng(0)
  words = lambda n: rng.integers(3, 250, n).tolist()
  pairs = []
  for choices, context in [(4, 7), (4, 1), (2, 30), (11, 5), (1, 9), (3, 60), (2, 12)]:  # 11 > 8 rows per call
    shared = words(context)
    pairs += [(shared, words(int(rng.integers(1, 9)))) for _ in range(choices)]  # the (3, 60) ones exceed 64
  shared, alone = Scorer(assembly, params, 0, batch_size=8, max_length=64), Scorer(assembly, params, 0, 8, 64)
  alone.shared_step = None
  got, want = shared(pairs), alone(pairs)
  assert shared.shared_step is not None
  np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
  assert [g[1] for g in got] == [w[1] for w in want]
  assert len({w[0] for w in want}) == len(pairs)  # every pair scored, none left at its placeholder
