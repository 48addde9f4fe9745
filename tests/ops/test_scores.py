"""Continuation scores of given logits against a float64 NumPy computation."""
import numpy as np

from lm.ops.scores import continuation_scores


def test_scores_sum_the_continuations_log_probabilities_and_check_greedy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
  targets = rng.integers(0, 11, (3, 5))
  targets[2, 3:] = logits[2, 3:].argmax(-1)  # row 2: the continuation is the argmax everywhere
  weights = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 1, 1]], np.float32)
  got = continuation_scores(logits, targets, weights)
  x = logits.astype(np.float64)
  log_probs = x - x.max(-1, keepdims=True)
  log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
  picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(got['logprob'], (picked * weights).sum(-1), rtol=1e-6)
  np.testing.assert_array_equal(got['tokens'], [3, 1, 2])
  greedy = [all(x[r, t].argmax() == targets[r, t] for t in range(5) if weights[r, t]) for r in range(3)]
  np.testing.assert_array_equal(got['greedy'], greedy)
  assert greedy[2]
