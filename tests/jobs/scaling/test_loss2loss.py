"""Loss-to-loss laws (lm.jobs.scaling.loss2loss): a shifted power law between two held-out losses, recovered from
a simulated ladder, and predicting the largest size's second loss from the others."""
import json

import numpy as np
import pytest

from lm import cli
from lm.jobs.scaling.loss2loss import predict
from tests.jobs.scaling.test_laws import TRUE, grid_points

TRUTH = {'K': 1.3, 'kappa': 0.8, 'E_x': TRUE['E'], 'E_y': 2.1}  # E_x: the ladder's own irreducible loss


def write(path, points, y):
  path.write_text('run,params,tokens,loss,val_loss,val/code/loss\n' + ''.join(
    f'{r},{float(n)!r},{float(d)!r},{float(x)!r},{float(x)!r},{float(v)!r}\n'
    for r, n, d, x, v in zip(points.run, points.params, points.tokens, points.loss, y)))
  return str(path)


def test_a_ladder_of_two_losses_gives_back_the_law(tmp_path, capsys):
  """The 7 x 7 ladder's loss as L_x and K (L_x - E_x)^kappa + E_y as L_y, through `lm scaling fit --law loss2loss`:
  without noise every parameter to 1e-3; with 0.2% noise on both, the largest size's L_y, held out, predicted
  within 2% (kappa itself trades against the floors at this noise: it lands within 0.1)."""
  points = grid_points(0.0, 1)
  truth = TRUTH['K'] * (points.loss - TRUTH['E_x']) ** TRUTH['kappa'] + TRUTH['E_y']
  path = write(tmp_path / 'exact.csv', points, truth)
  assert cli.main(['scaling', 'fit', path, '--law', 'loss2loss', '--y', 'val/code/loss', '--json']) == 0
  fit = json.loads(capsys.readouterr().out)
  assert fit['params'] == pytest.approx(TRUTH, rel=1e-3), fit['params']
  np.testing.assert_allclose(predict(fit['params'], points.loss), truth, rtol=1e-4)

  points = grid_points(0.002, 1)
  rng = np.random.default_rng(2)
  y = (TRUTH['K'] * (points.loss - TRUTH['E_x']) ** TRUTH['kappa'] + TRUTH['E_y']) * (
    1 + 0.002 * rng.standard_normal(len(points.loss)))
  path = write(tmp_path / 'points.csv', points, y)
  assert cli.main(['scaling', 'fit', path, '--law', 'loss2loss', '--y', 'val/code/loss', '--holdout', 'largest',
                   '--out', str(tmp_path / 'fit.json')]) == 0
  fit = json.loads((tmp_path / 'fit.json').read_text())
  assert fit['params']['kappa'] == pytest.approx(TRUTH['kappa'], abs=0.1), fit['params']
  assert fit['holdout']['max_error'] < 0.02 and len(fit['holdout']['runs']) == 7, fit['holdout']
  assert cli.main(['scaling', 'fit', path, '--law', 'loss2loss']) == 2
  assert 'name the second with --y' in capsys.readouterr().err
