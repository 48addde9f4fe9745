"""bench/plan_ranking.py, the check of `lm compile --plan`'s roofline on this host. Whether the measured steps
run in the predicted order is the benchmark's figure (README, "Choosing a mesh"), not a test: step times on a
shared host are no test's to assert."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bench'))
from plan_ranking import separated_pairs  # noqa: E402


def test_separated_pairs_are_those_far_enough_apart():
  assert separated_pairs([1.0, 1.2, 1.3, 2.0]) == [(0, 2), (0, 3), (1, 3), (2, 3)]  # 1.3 / 1.0 counts
