"""Loss-to-loss laws (Brandfonbrener et al. 2024, arXiv:2411.12925): one held-out set's loss as a shifted power law
of another's, L_y = K (L_x - E_x)^kappa + E_y, E_x and E_y each set's irreducible loss. As the paper fits them: E_x
and E_y from a Chinchilla law of each loss over the runs (their final points), then K and kappa by least squares of
log(L_y - E_y) on log(L_x - E_x) over every paired point (the same run and step); that is the first start of a
joint fit of all four by least squares on log L_y (L-BFGS-B, with a grid of other starts), which keeps the staged
floors' bias (each loss's Chinchilla fit is only near its irreducible loss) out of kappa."""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy import optimize

from lm.config import ConfigError
from lm.jobs.scaling.laws import fit_chinchilla
from lm.jobs.scaling.points import Points

NAMES = ('K', 'kappa', 'E_x', 'E_y')


def predict(law: dict[str, float], x: np.ndarray) -> np.ndarray:
  return law['K'] * np.maximum(np.asarray(x) - law['E_x'], 1e-12) ** law['kappa'] + law['E_y']


def fit_loss2loss(x: np.ndarray, y: np.ndarray, points: Points | None = None) -> dict[str, Any]:
  """K, kappa, E_x (below every L_x) and E_y (below every L_y), with the mean relative error of the fit; with
  `points` (the runs' sizes and tokens, row for row), starting from E_x and E_y of each loss's Chinchilla law."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if len(x) < 5:
    raise ConfigError(f'a loss-to-loss law has 4 parameters and the points number {len(x)}; collect 5 or more')
  starts = []
  if points is not None:  # the paper's staged fit, as the first start
    floors = [fit_chinchilla(Points(points.params, points.tokens, points.flops, loss, points.run, points.step).final()
                             )['params']['E'] for loss in (x, y)]
    floors = [min(e, loss.min() * (1 - 1e-3)) for e, loss in zip(floors, (x, y))]
    kappa, log_k = np.polyfit(np.log(x - floors[0]), np.log(y - floors[1]), 1)
    starts.append((float(np.exp(log_k)), float(np.clip(kappa, 0.06, 4.9)), *floors))
  bounds = [(1e-6, 1e3), (0.05, 5.0), (0.0, x.min() * (1 - 1e-6)), (0.0, y.min() * (1 - 1e-6))]

  def objective(theta: np.ndarray) -> float:
    return float(np.sum((np.log(predict(dict(zip(NAMES, theta)), x)) - np.log(y)) ** 2))

  starts += [(k, kappa, ex * x.min(), ey * y.min()) for k in (0.5, 1.0, 2.0) for kappa in (0.5, 1.0, 2.0)
             for ex in (0.0, 0.5, 0.9) for ey in (0.0, 0.5, 0.9)]
  best = min((optimize.minimize(objective, s, method='L-BFGS-B', bounds=bounds) for s in starts),
             key=lambda r: r.fun)
  law = dict(zip(NAMES, best.x.tolist()))
  error = np.abs(predict(law, x) - y) / y
  return {'law': 'loss2loss', 'params': law, 'points': len(x), 'mean_error': float(error.mean())}
