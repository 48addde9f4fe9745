"""The learning rate and batch for a budget: power laws of the near-optimal peak learning rate and batch size.

From a grid of runs (`lm scaling sweep --lr-grid ... --batch-grid ...`), each run's final loss; each budget's (a
compute budget, or an (N, D) pair) optimum is the vertex of a paraboloid of log loss over its grid of rates and
batches (noise in the few runs nearest the best moves it far less than it moves the best run), or, on a grid too
small for one, the mean of its near-optimal runs, those within `band` of the best loss (DeepSeek LLM's 0.25%,
arXiv:2401.02954; Step Law's |L/L_min - 1| < 0.0025, arXiv:2503.04715). Least squares in logs over the budgets'
optima gives
- by compute (DeepSeek LLM): eta_opt = a C^b, B_opt = c C^d;
- by N and D (Step Law): eta_opt = a N^b D^c, B_opt = d D^e,
with B in tokens per step. Bootstrap resamples of the near-optimal runs give 95% intervals of each target's optimum.
The published rules are built in to compare against, as formulas (`PUBLISHED`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lm.config import ConfigError
from lm.jobs.scaling.laws import budget_groups

BAND = 0.0025


def deepseek(flops: float) -> tuple[float, float]:
  """DeepSeek LLM (arXiv:2401.02954, eq. 1): eta_opt = 0.3118 C^-0.1250, B_opt = 0.2920 C^0.3271 tokens."""
  return 0.3118 * flops ** -0.1250, 0.2920 * flops ** 0.3271


def step_law(params: float, tokens: float) -> tuple[float, float]:
  """Step Law (arXiv:2503.04715): eta_opt = 1.79 N^-0.713 D^0.307, B_opt = 0.58 D^0.571 tokens."""
  return 1.79 * params ** -0.713 * tokens ** 0.307, 0.58 * tokens ** 0.571


def porian(params: float) -> tuple[float, float]:
  """Porian et al. 2024 (arXiv:2406.19146), AdamW at 2,048-token sequences: eta_opt = 0.0047 (N / 108M)^-1/3,
  B_opt = 160 (N / 108M)^2/3 sequences (as OLMo-core's ladder transcribes them), returned in tokens."""
  scale = params / 108e6
  return 0.0047 * scale ** (-1 / 3), 2048 * 160 * scale ** (2 / 3)


PUBLISHED = {'deepseek': deepseek, 'step_law': step_law, 'porian': porian}


def near_optimal(groups: Sequence[np.ndarray], loss: np.ndarray, band: float = BAND) -> np.ndarray:
  """The rows within `band` of their group's lowest loss."""
  return np.concatenate([g[loss[g] <= loss[g].min() * (1 + band)] for g in groups])


def _vertex(group: np.ndarray, loss: np.ndarray, rate: np.ndarray, batch: np.ndarray, band: float
            ) -> tuple[float, float]:
  """A budget's optimal rate and batch: the vertex of a paraboloid of log loss in (log rate, log batch) fitted to
  all its runs, where the grid spans three or more of each and the fit is a bowl with its vertex inside the grid;
  else the geometric mean of its near-optimal runs (within `band` of the best)."""
  x, y, z = np.log(rate[group]), np.log(batch[group]), np.log(loss[group])
  if len(np.unique(x)) >= 3 and len(np.unique(y)) >= 3:
    c = _solve(np.column_stack([x, y, x * x, y * y, x * y]), z)
    hessian = np.array([[2 * c[3], c[5]], [c[5], 2 * c[4]]])
    if np.all(np.linalg.eigvalsh(hessian) > 0):
      vx, vy = np.linalg.solve(hessian, -c[1:3])
      if x.min() <= vx <= x.max() and y.min() <= vy <= y.max():
        return float(np.exp(vx)), float(np.exp(vy))
  near = group[loss[group] <= loss[group].min() * (1 + band)]
  return float(np.exp(np.log(rate[near]).mean())), float(np.exp(np.log(batch[near]).mean()))


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """Least squares of y on [1, x...] (logs): the intercept and slopes."""
  design = np.column_stack([np.ones(len(y)), x])
  return np.linalg.lstsq(design, y, rcond=None)[0]


def _laws(by: str, params: np.ndarray, tokens: np.ndarray, flops: np.ndarray, rate: np.ndarray,
          batch: np.ndarray) -> dict[str, float]:
  if by == 'compute':
    (lr_a, lr_b), (b_c, b_d) = _solve(np.log(flops), np.log(rate)), _solve(np.log(flops), np.log(batch))
    return {'lr_coef': float(np.exp(lr_a)), 'lr_C': float(lr_b), 'batch_coef': float(np.exp(b_c)),
            'batch_C': float(b_d)}
  lr_a, lr_n, lr_d = _solve(np.column_stack([np.log(params), np.log(tokens)]), np.log(rate))
  b_c, b_d = _solve(np.log(tokens), np.log(batch))
  return {'lr_coef': float(np.exp(lr_a)), 'lr_N': float(lr_n), 'lr_D': float(lr_d), 'batch_coef': float(np.exp(b_c)),
          'batch_D': float(b_d)}


def optimum(law: dict[str, float], target: Sequence[float]) -> tuple[float, float]:
  """(eta_opt, B_opt in tokens) of a law at a target: (C,) by compute, (N, D) by N and D."""
  if 'lr_C' in law:
    (c,) = target
    return law['lr_coef'] * c ** law['lr_C'], law['batch_coef'] * c ** law['batch_C']
  n, d = target
  return law['lr_coef'] * n ** law['lr_N'] * d ** law['lr_D'], law['batch_coef'] * d ** law['batch_D']


def fit_hparams(params: np.ndarray, tokens: np.ndarray, flops: np.ndarray, loss: np.ndarray, rate: np.ndarray,
                batch: np.ndarray, by: str = 'compute', targets: Sequence[Sequence[float]] = (), bootstrap: int = 0,
                band: float = BAND, seed: int = 0) -> dict[str, Any]:
  """The power laws of the optimal learning rate and batch over the budgets (one final loss per run), each target's
  optimum, with `bootstrap` resamples of each budget's runs for 95% intervals."""
  for values, what, flag in ((batch, 'batch size', '--batch-grid'), (rate, 'learning rate', '--lr-grid')):
    if len(np.unique(values)) < 2:
      raise ConfigError(f'--law hparams needs runs at two or more of each: every run has {what} {values[0]:g}; '
                        f'sweep a grid of them (lm scaling sweep {flag} ...)')
  if by == 'compute':
    groups = budget_groups(flops)
  else:
    pairs = {}
    for i, key in enumerate(zip(np.round(np.log(params), 3), np.round(np.log(tokens), 3))):
      pairs.setdefault(key, []).append(i)
    groups = [np.array(g) for g in pairs.values()]
  enough = 2 if by == 'compute' else 3
  if len(groups) < enough:
    raise ConfigError(f'--law hparams --by {by} needs {enough} or more budgets; the runs make {len(groups)}')
  rows = near_optimal(groups, loss, band)
  vertices = [_vertex(g, loss, rate, batch, band) for g in groups]
  first = np.array([g[0] for g in groups])
  columns = (params[first], tokens[first], flops[first], np.array([v[0] for v in vertices]),
             np.array([v[1] for v in vertices]))
  law = _laws(by, *columns)
  out: dict[str, Any] = {'law': 'hparams', 'by': by, 'params': law, 'points': len(loss), 'budgets': len(groups),
                         'near_optimal': len(rows), 'band': band, 'targets': [],
                         'optima': [{'params': float(n), 'tokens': float(d), 'flops': float(c), 'learning_rate': lr,
                                     'batch_tokens': b} for n, d, c, lr, b in zip(*columns)]}
  samples = []
  if bootstrap:  # the runs resampled within each budget, each budget's optimum found again
    rng = np.random.default_rng(seed)
    for _ in range(bootstrap):
      picked = [g[rng.integers(0, len(g), len(g))] for g in groups]
      try:
        again = [_vertex(g, loss, rate, batch, band) for g in picked]
        samples.append(_laws(by, *columns[:3], np.array([v[0] for v in again]), np.array([v[1] for v in again])))
      except np.linalg.LinAlgError:
        continue
  if samples:  # 95% intervals of each coefficient and exponent
    out['params_ci'] = {k: np.percentile([s[k] for s in samples], [2.5, 97.5]).tolist() for k in law}
  for target in targets:
    lr, b = optimum(law, target)
    entry = {'target': list(target), 'learning_rate': lr, 'batch_tokens': b}
    if samples:
      values = np.array([optimum(s, target) for s in samples])
      entry['learning_rate_ci'] = np.percentile(values[:, 0], [2.5, 97.5]).tolist()
      entry['batch_tokens_ci'] = np.percentile(values[:, 1], [2.5, 97.5]).tolist()
    if by == 'compute':
      entry['deepseek'] = list(deepseek(target[0]))
    else:
      entry['step_law'] = list(step_law(*target))
      entry['porian'] = list(porian(target[0]))
    out['targets'].append(entry)
  return out


def fit_points_file(path: str, params: str = 'total', by: str = 'compute', targets: Sequence[Sequence[float]] = (),
                    bootstrap: int = 0) -> dict[str, Any]:
  """`fit_hparams` on a points CSV's final point of each run, with its learning_rate and batch_tokens columns."""
  from lm.jobs.scaling.points import read_column, read_points
  points = read_points(path, params)
  rows = points.final_rows()
  final = points.take(rows)
  rate, batch = (read_column(path, c)[rows] for c in ('learning_rate', 'batch_tokens'))
  return fit_hparams(final.params, final.tokens, final.flops, final.loss, rate, batch, by, targets, bootstrap)
