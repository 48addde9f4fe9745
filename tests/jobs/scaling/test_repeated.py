"""The data-constrained law (lm.jobs.scaling.repeated) against huggingface/datablations's README, and its fit."""
import json

import numpy as np
import pytest

from lm import cli
from lm.jobs.scaling.repeated import DATABLATIONS, loss, optimal_allocation


def test_the_formula_gives_the_datablations_readmes_values():
  """The README's Figure 1 models and its optimal allocation for 1e22 FLOPs and 25B unique tokens."""
  assert loss(DATABLATIONS, 6.34e9, 242e9, 25e9) == pytest.approx(2.2256440889984477, rel=1e-9)
  assert loss(DATABLATIONS, 8.67e9, 178e9, 25e9) == pytest.approx(2.2269634075087867, rel=1e-9)
  best = optimal_allocation(DATABLATIONS, 1e22, 25e9)
  assert best['tokens'] == pytest.approx(237336955477.55075, rel=1e-9)
  assert best['epochs'] == pytest.approx(9.49347821910203, rel=1e-9)
  assert best['params'] == pytest.approx(7022364735.879969, rel=1e-9)


@pytest.mark.long(0.4)
def test_a_refit_recovers_the_decay_constants(tmp_path, capsys):
  """`lm scaling fit --law data_constrained` on losses from the law (datablations's constants) with 0.2% noise,
  over unique budgets, epochs and sizes beyond the data's optimum: R_D* and R_N* refitted within 10%, the base
  fitted to the single-epoch runs and refined with them; the allocation it prints is the law's; and fitted without
  the largest size it predicts that size's runs within 2% of the law."""
  rng = np.random.default_rng(0)
  rows = [(n, u * e, u) for u in (1e9, 4e9, 1.6e10) for n in (1e8, 3e8, 1e9, 3e9, 1e10)
          for e in (1, 2, 4, 8, 16, 40)]
  n, d, u = (np.array(c, np.float64) for c in zip(*rows))
  observed = loss(DATABLATIONS, n, d, u) * (1 + 0.002 * rng.standard_normal(len(n)))
  points = tmp_path / 'points.csv'
  points.write_text('run,params,tokens,unique_tokens,loss\n' + ''.join(
    f'run{i},{float(n[i])!r},{float(d[i])!r},{float(u[i])!r},{float(observed[i])!r}\n' for i in range(len(n))))
  assert cli.main(['scaling', 'fit', str(points), '--law', 'data_constrained', '--allocate', '1e22', '25e9',
                   '--holdout', 'largest', '--out', str(tmp_path / 'fit.json')]) == 0
  fit = json.loads((tmp_path / 'fit.json').read_text())
  assert fit['params']['R_D'] == pytest.approx(DATABLATIONS['R_D'], rel=0.1), fit
  assert fit['params']['R_N'] == pytest.approx(DATABLATIONS['R_N'], rel=0.1), fit
  assert fit['allocations'][0] == optimal_allocation(fit['params'], 1e22, 25e9)
  held = fit['holdout']  # the 1e10-parameter runs, predicted by a fit without them
  largest = n == n.max()
  assert held['params'] == 1e10 and len(held['runs']) == largest.sum()
  np.testing.assert_allclose(held['predicted'], loss(DATABLATIONS, n[largest], d[largest], u[largest]), rtol=0.02)
  assert 'C 1e+22, U 2.5e+10' in capsys.readouterr().out

  (tmp_path / 'plain.csv').write_text('run,params,tokens,loss\nr,1e8,1e9,3.0\n')
  assert cli.main(['scaling', 'fit', str(tmp_path / 'plain.csv'), '--law', 'data_constrained']) == 2
  assert 'has no column unique_tokens' in capsys.readouterr().err
