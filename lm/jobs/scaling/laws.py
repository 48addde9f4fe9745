"""Fitting scaling laws to points: Chinchilla's parametric law (approach 3), Kaplan's power laws, IsoFLOP parabolas.

Forms and procedures as Hoffmann et al. 2022, Kaplan et al. 2020 and Besiroglu et al. 2024 give them
(see the scaling notes in the design docs). Everything is NumPy and SciPy: no devices are touched.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from scipy import optimize, special

from lm.config import ConfigError
from lm.jobs.scaling.points import Points

HUBER_DELTA = 1e-3  # Hoffmann et al.: Huber loss on log loss, summed over points
NAMES = ('E', 'A', 'B', 'alpha', 'beta')


# ---------------------------------------------------------------- Chinchilla, approach 3

def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray
               ) -> tuple[float, np.ndarray]:
  """Sum of Huber(log L_hat - log L) over points, with its gradient; theta = (a, b, e, alpha, beta) where
  A = e^a, B = e^b, E = e^e and log L_hat = logsumexp(a - alpha log N, b - beta log D, e). Scaled by
  1/delta^2 so that L-BFGS's tolerances see O(1) numbers near the optimum (the minimiser is unchanged)."""
  a, b, e, alpha, beta = theta
  terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
  log_pred = special.logsumexp(terms, axis=0)
  r = log_pred - log_l
  small = np.abs(r) <= HUBER_DELTA
  loss = np.where(small, 0.5 * r ** 2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
  slope = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
  w = np.exp(terms - log_pred)  # d log L_hat / d term
  grad = np.array([w[0] @ slope, w[1] @ slope, w[2] @ slope, -(w[0] * log_n) @ slope, -(w[1] * log_d) @ slope])
  return float(loss.sum()) / HUBER_DELTA ** 2, grad / HUBER_DELTA ** 2


def _starts(points: Points, count: int) -> list[np.ndarray]:
  """The `count` best starts of a grid over (alpha, beta) in [0.05, 2], each with E, A, B from non-negative
  least squares of L on (1, N^-alpha, D^-beta): far fewer L-BFGS runs than a grid over all five."""
  grid = np.arange(0.05, 2.0001, 0.05)
  log_n, log_d, log_l = np.log(points.params), np.log(points.tokens), np.log(points.loss)
  scored = []
  for alpha in grid:
    x = np.exp(-alpha * log_n)
    for beta in grid:
      y = np.exp(-beta * log_d)
      columns = np.stack([np.ones_like(x), x, y], axis=1)
      scale = columns.max(axis=0)
      coef = optimize.nnls(columns / scale, points.loss)[0] / scale
      coef = np.maximum(coef, 1e-12 * np.array([points.loss.min(), 1 / x.max(), 1 / y.max()]))
      theta = np.array([np.log(coef[1]), np.log(coef[2]), np.log(coef[0]), alpha, beta])
      scored.append((_objective(theta, log_n, log_d, log_l)[0], theta))
  scored.sort(key=lambda s: s[0])
  return [theta for _, theta in scored[:count]]


def _minimise(theta: np.ndarray, points: Points) -> tuple[float, np.ndarray]:
  args = (np.log(points.params), np.log(points.tokens), np.log(points.loss))
  result = optimize.minimize(_objective, theta, args=args, jac=True, method='L-BFGS-B',
                             options={'maxiter': 20000, 'maxfun': 40000, 'ftol': 1e-15, 'gtol': 1e-10})
  return float(result.fun), result.x


def _as_law(theta: np.ndarray) -> dict[str, float]:
  a, b, e, alpha, beta = theta
  return {'E': float(np.exp(e)), 'A': float(np.exp(a)), 'B': float(np.exp(b)), 'alpha': float(alpha),
          'beta': float(beta)}


def _exponents(law: dict[str, float]) -> tuple[float, float]:
  """(a, b): N_opt grows as C^a, D_opt as C^b."""
  total = law['alpha'] + law['beta']
  return law['beta'] / total, law['alpha'] / total


def compute_optimal(law: dict[str, float], flops: float) -> dict[str, float]:
  """N_opt, D_opt and L_opt for compute C = 6ND: G = (alpha A / (beta B))^(1/(alpha+beta)),
  N_opt = G (C/6)^a, D_opt = (C/6)^b / G."""
  a, b = _exponents(law)
  g = (law['alpha'] * law['A'] / (law['beta'] * law['B'])) ** (1 / (law['alpha'] + law['beta']))
  n, d = g * (flops / 6) ** a, (flops / 6) ** b / g
  loss = law['E'] + law['A'] / n ** law['alpha'] + law['B'] / d ** law['beta']
  return {'flops': flops, 'params': n, 'tokens': d, 'tokens_per_param': d / n, 'loss': loss}


def fit_chinchilla(points: Points, bootstrap: int = 0, budgets: Sequence[float] = (), starts: int = 8,
                   seed: int = 0) -> dict[str, Any]:
  """L(N, D) = E + A/N^alpha + B/D^beta by approach 3; with `bootstrap` resamples, 95% percentile intervals
  of every parameter, of a and b, and of each budget's N_opt and D_opt."""
  _enough(points, 5, 'chinchilla (E, A, B, alpha, beta)')
  best = min((_minimise(theta, points) for theta in _starts(points, starts)), key=lambda r: r[0])[1]
  law = _as_law(best)
  a, b = _exponents(law)
  out: dict[str, Any] = {'law': 'chinchilla', 'params': law, 'a': a, 'b': b, 'points': len(points),
                         'optimal': [compute_optimal(law, c) for c in budgets]}
  if bootstrap:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
      resampled = points.take(rng.integers(0, len(points), len(points)))
      fitted = _as_law(_minimise(best, resampled)[1])
      sample = {**fitted, **dict(zip(('a', 'b'), _exponents(fitted)))}
      for c in budgets:
        optimal = compute_optimal(fitted, c)
        sample[f'params_opt@{c:g}'], sample[f'tokens_opt@{c:g}'] = optimal['params'], optimal['tokens']
      samples.append(sample)
    out['ci'] = {key: [float(np.percentile([s[key] for s in samples], q)) for q in (2.5, 97.5)]
                 for key in samples[0]}
    out['bootstrap'] = bootstrap
  return out


# ---------------------------------------------------------------- Kaplan

def _power_law(x: np.ndarray, loss: np.ndarray) -> tuple[float, float]:
  """(alpha, x_c) of L = (x_c / x)^alpha by least squares in log-log."""
  slope, intercept = np.polyfit(np.log(x), np.log(loss), 1)
  alpha = -slope
  return float(alpha), float(np.exp(intercept / alpha))


def frontier(points: Points) -> np.ndarray:
  """Row indices of the compute frontier: the points no point of less or equal compute beats."""
  order = np.lexsort((points.loss, points.flops))
  rows, best = [], np.inf
  for i in order:
    if points.loss[i] < best:
      rows.append(i)
      best = points.loss[i]
  return np.array(rows, int)


def fit_kaplan(points: Points) -> dict[str, Any]:
  """L(N) = (N_c/N)^alpha_N on each size's best loss, and L(C) = (C_c/C)^alpha_C on the compute frontier."""
  sizes = np.unique(points.params)
  if len(sizes) < 2:
    raise ConfigError(f'kaplan fits L(N) across model sizes, and the points hold {len(sizes)}; add runs of '
                      f'at least two sizes')
  best = np.array([points.loss[points.params == n].min() for n in sizes])
  alpha_n, n_c = _power_law(sizes, best)
  edge = frontier(points)
  out: dict[str, Any] = {'law': 'kaplan', 'params': {'alpha_N': alpha_n, 'N_c': n_c}, 'points': len(points),
                         'frontier': [{'flops': float(points.flops[i]), 'loss': float(points.loss[i]),
                                       'run': points.run[i]} for i in edge]}
  if len(edge) >= 2 and len(np.unique(points.flops[edge])) >= 2:
    alpha_c, c_c = _power_law(points.flops[edge], points.loss[edge])
    out['params'].update(alpha_C=alpha_c, C_c=c_c, C_c_pf_days=c_c / 8.64e19)
  return out


# ---------------------------------------------------------------- IsoFLOP (approach 2)

def budget_groups(flops: np.ndarray, gap: float = 1.25) -> list[np.ndarray]:
  """Rows grouped by compute budget: sorted by C, a new group wherever C jumps by more than `gap`x (runs of
  one budget differ by the few percent the exact count adds to 6ND)."""
  order = np.argsort(flops)
  groups, current = [], [order[0]]
  for prev, i in zip(order, order[1:]):
    if flops[i] > gap * flops[prev]:
      groups.append(np.array(current))
      current = []
    current.append(i)
  groups.append(np.array(current))
  return groups


def _parabolas(points: Points, groups: Sequence[np.ndarray]) -> list[dict[str, Any]]:
  """Each budget's parabola of loss in log N and its vertex."""
  fits = []
  for rows in groups:
    n, loss = points.params[rows], points.loss[rows]
    c = float(np.exp(np.mean(np.log(points.flops[rows]))))
    if len(np.unique(n)) < 3:
      raise ConfigError(f'the budget near {c:.3g} FLOPs has {len(np.unique(n))} model sizes; an IsoFLOP parabola '
                        f'needs at least 3 (sweep more sizes per budget)')
    p2, p1, p0 = np.polyfit(np.log(n), loss, 2)
    if p2 <= 0:
      raise ConfigError(f'loss against log N at {c:.3g} FLOPs bends down, so it has no minimum; widen the range '
                        f'of sizes around the optimum')
    x = -p1 / (2 * p2)
    fits.append({'flops': c, 'params_opt': float(np.exp(x)), 'tokens_opt': float(c / (6 * np.exp(x))),
                 'loss_opt': float(p0 - p1 ** 2 / (4 * p2)), 'parabola': [float(p2), float(p1), float(p0)],
                 'points': len(rows)})
  return fits


def _allocation_laws(fits: list[dict[str, Any]]) -> tuple[float, float, float, float]:
  """(a, log k_N, b, log k_D) of N_opt = k_N C^a and D_opt = k_D C^b over the budgets' vertices."""
  c = np.array([f['flops'] for f in fits])
  a, log_k_n = np.polyfit(np.log(c), np.log([f['params_opt'] for f in fits]), 1)
  b, log_k_d = np.polyfit(np.log(c), np.log([f['tokens_opt'] for f in fits]), 1)
  return float(a), float(log_k_n), float(b), float(log_k_d)


def fit_isoflop(points: Points, budgets: Sequence[float] = (), bootstrap: int = 0, seed: int = 0) -> dict[str, Any]:
  """Per budget a parabola of loss in log N, its vertex N_opt(C); then N_opt = k_N C^a and D_opt = k_D C^b
  by least squares in log-log (D_opt = C / 6 N_opt). With `bootstrap`, each budget's runs resampled: 95%
  intervals of a, b, every vertex and each budget's optimum (resamples that leave a budget no parabola are
  dropped)."""
  groups = budget_groups(points.flops)
  fits = _parabolas(points, groups)
  if len(fits) < 2:
    raise ConfigError(f'isoflop regresses N_opt on compute across budgets, and the points hold {len(fits)}; '
                      f'sweep at least two budgets')
  a, log_k_n, b, log_k_d = _allocation_laws(fits)
  optimal = [{'flops': float(x), 'params': float(np.exp(log_k_n) * x ** a), 'tokens': float(np.exp(log_k_d) * x ** b),
              'tokens_per_param': float(np.exp(log_k_d - log_k_n) * x ** (b - a))} for x in budgets]
  out = {'law': 'isoflop', 'params': {'k_N': float(np.exp(log_k_n)), 'k_D': float(np.exp(log_k_d))},
         'a': a, 'b': b, 'budgets': fits, 'optimal': optimal, 'points': len(points)}
  if bootstrap:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
      try:
        again = _parabolas(points, [g[rng.integers(0, len(g), len(g))] for g in groups])
      except ConfigError:
        continue
      sa, sn, sb, sd = _allocation_laws(again)
      sample = {'a': sa, 'b': sb, **{f'params_opt@{f["flops"]:.3g}': s['params_opt'] for f, s in zip(fits, again)}}
      sample.update({f'params@{x:g}': float(np.exp(sn) * x ** sa) for x in budgets})
      sample.update({f'tokens@{x:g}': float(np.exp(sd) * x ** sb) for x in budgets})
      samples.append(sample)
    if samples:
      out['ci'] = {key: [float(np.percentile([s[key] for s in samples], q)) for q in (2.5, 97.5)]
                   for key in samples[0]}
      out['bootstrap'] = len(samples)
  return out


# ---------------------------------------------------------------- task accuracy (Bhagia et al. 2024)

SIGMOID = ('a', 'k', 'L0', 'b')


def sigmoid(loss: np.ndarray, a: float, k: float, L0: float, b: float) -> np.ndarray:
  """Accuracy from task loss: a / (1 + e^(-k (L - L0))) + b (k < 0: accuracy falls as the loss grows)."""
  return a / (1 + np.exp(-k * (loss - L0))) + b


def fit_sigmoid(loss: np.ndarray, accuracy: np.ndarray, start: dict[str, float] | None = None) -> dict[str, float]:
  """Least squares of `sigmoid`, from `start` or else from a grid of slopes (scaled to the losses' spread), the
  best of them."""
  spread = max(float(np.ptp(loss)), 1e-6)
  lo, hi = float(accuracy.min()), float(accuracy.max())
  starts = [np.array([max(hi - lo, 1e-3) * 1.2, k, float(np.median(loss)), lo - 0.1 * (hi - lo)])
            for k in -np.array([1, 2, 4, 8, 16, 32]) / spread] if start is None else [np.array(list(start.values()))]
  best = None
  for start_at in starts:
    fitted = optimize.least_squares(lambda t: sigmoid(loss, *t) - accuracy, start_at, method='lm', max_nfev=20000,
                                    xtol=1e-14, ftol=1e-14)
    if best is None or fitted.cost < best.cost:
      best = fitted
  return dict(zip(SIGMOID, (float(v) for v in best.x)))


def _predict(law: dict[str, float], curve: dict[str, float], params: float, tokens: float) -> tuple[float, float]:
  loss = law['E'] + law['A'] / params ** law['alpha'] + law['B'] / tokens ** law['beta']
  return float(loss), float(sigmoid(np.array(loss), **curve))


def fit_task(points: Points, accuracy: np.ndarray, targets: Sequence[tuple[float, float]] = (),
             bootstrap: int = 0, seed: int = 0) -> dict[str, Any]:
  """The two steps of Bhagia et al. 2024: task loss L(N, D) = E + A/N^alpha + B/D^beta fitted (approach 3) to each
  run's final point (`points.loss` holds the task loss), then accuracy as `sigmoid` of the task loss fitted to
  every point; each target (N, D) gets its predicted task loss and accuracy. With `bootstrap`, both steps are
  refitted on resampled points for 95% percentile intervals of the parameters and the predictions."""
  final = points.final()
  _enough(final, 5, 'the task law\'s first step (E, A, B, alpha, beta)')
  _enough(points, 4, 'the task law\'s second step (a, k, L0, b)')
  step1 = fit_chinchilla(final)
  law, curve = step1['params'], fit_sigmoid(points.loss, accuracy)
  predictions = [dict(zip(('params', 'tokens', 'task_loss', 'accuracy'), (n, d, *_predict(law, curve, n, d))))
                 for n, d in targets]
  out: dict[str, Any] = {'law': 'task', 'params': {**law, **curve}, 'points': len(points),
                         'predictions': predictions}
  if bootstrap:
    rng = np.random.default_rng(seed)
    first = np.array([law[k] for k in ('A', 'B', 'E')])
    theta = np.array([np.log(first[0]), np.log(first[1]), np.log(first[2]), law['alpha'], law['beta']])
    samples = []
    for _ in range(bootstrap):
      rows = rng.integers(0, len(points), len(points))
      final_rows = rng.integers(0, len(final), len(final))
      fitted = {**_as_law(_minimise(theta, final.take(final_rows))[1]),
                **fit_sigmoid(points.loss[rows], accuracy[rows], curve)}
      for n, d in targets:
        fitted[f'task_loss@{n:g},{d:g}'], fitted[f'accuracy@{n:g},{d:g}'] = _predict(
          fitted, {k: fitted[k] for k in SIGMOID}, n, d)
      samples.append(fitted)
    out['ci'] = {key: [float(np.percentile([s[key] for s in samples], q)) for q in (2.5, 97.5)]
                 for key in samples[0]}
    out['bootstrap'] = bootstrap
  return out


def holdout_largest(points: Points, law: str) -> dict[str, Any]:
  """The law fitted without the largest size's runs, and its prediction of their (final) loss: how far it
  extrapolates in N."""
  largest = points.params.max()
  rest = points.take(np.flatnonzero(points.params < largest))
  held = points.take(np.flatnonzero(points.params == largest))
  if len(np.unique(rest.params)) < 2:
    raise ConfigError(f'--holdout largest leaves {len(np.unique(rest.params))} size to fit; add runs of more sizes')
  if law == 'chinchilla':
    fitted, held = fit_chinchilla(rest.final())['params'], held.final()
    predicted = fitted['E'] + fitted['A'] / held.params ** fitted['alpha'] + fitted['B'] / held.tokens ** fitted['beta']
    measured, runs = held.loss, list(held.run)
  elif law == 'kaplan':
    fitted = fit_kaplan(rest)['params']
    measured, runs = np.array([held.loss.min()]), [held.run[int(np.argmin(held.loss))]]
    predicted = np.array([(fitted['N_c'] / largest) ** fitted['alpha_N']])
  else:
    raise ConfigError(f'--holdout applies to chinchilla, kaplan and data_constrained, not --law {law}')
  error = np.abs(predicted - measured) / measured
  return {'params': float(largest), 'runs': runs, 'predicted': predicted.tolist(), 'measured': measured.tolist(),
          'mean_error': float(error.mean()), 'max_error': float(error.max())}


def _enough(points: Points, count: int, what: str) -> None:
  if len(points) < count:
    raise ConfigError(f'{what} has {count} parameters but the points number {len(points)}; collect at least '
                      f'{count} points')


def fit(points: Points, law: str, bootstrap: int = 0, budgets: Sequence[float] = ()) -> dict[str, Any]:
  """`law` fitted to the points: Kaplan's to every evaluation (curves make the frontier), Chinchilla's and
  IsoFLOP's to each run's final one."""
  if law == 'chinchilla':
    return fit_chinchilla(points.final(), bootstrap, budgets)
  if law == 'kaplan':
    return fit_kaplan(points)
  if law == 'isoflop':
    return fit_isoflop(points.final(), budgets, bootstrap)
  raise ConfigError(f'--law {law} is not a law; choose chinchilla, kaplan or isoflop')
