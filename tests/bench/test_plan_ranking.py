"""bench/plan_ranking.py, the check of `lm compile --plan`'s roofline on this host: candidate meshes whose predicted
step times are 1.3x or more apart run in the predicted order."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bench'))
from plan_ranking import SEPARATED, separated_pairs  # noqa: E402


def test_separated_pairs_are_those_far_enough_apart():
  assert separated_pairs([1.0, 1.2, 1.3, 2.0]) == [(0, 2), (0, 3), (1, 3), (2, 3)]  # 1.3 / 1.0 counts


@pytest.mark.long(2)
def test_the_roofline_orders_candidates_it_separates_as_they_run(tmp_path):
  """Five meshes of a widened gpt_tiny on 8 simulated devices, compiled as a user's run would be (full XLA
  optimisation: the suite's level 0 would time another program), timed in interleaved rounds."""
  out = tmp_path / 'ranking.json'
  env = {**os.environ, 'XLA_FLAGS': ''}
  done = subprocess.run([sys.executable, str(ROOT / 'bench/plan_ranking.py'), '--rounds', '3', '--steps', '2',
                         '--out', str(out)], env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads(out.read_text())['rows']
  predicted, measured = [r['predicted_s'] for r in rows], [r['measured_s'] for r in rows]
  assert measured == [min(r['step_times_s']) for r in rows] and all(len(r['step_times_s']) == 6 for r in rows)
  pairs = separated_pairs(predicted)
  assert len(pairs) >= 2, f'the candidates no longer spread out: predicted {predicted}'
  wrong = [(rows[i]['candidate'], rows[j]['candidate']) for i, j in pairs
           if (measured[i] < measured[j]) != (predicted[i] < predicted[j])]
  assert not wrong, f'predicted >= {SEPARATED}x apart but measured the other way round: {wrong}; ' \
                    f'predicted {predicted}, measured {measured}'
