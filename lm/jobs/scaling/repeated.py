"""Repeated data: the data-constrained scaling law of Muennighoff et al. 2023 (arXiv:2305.16264).

U_D unique tokens seen over R_D = D/U_D - 1 extra epochs are worth D' = U_D + U_D R_D* (1 - e^(-R_D/R_D*)) fresh
ones; parameters beyond U_N (the compute-optimal size for U_D tokens) decay alike with R_N*; the loss is
Chinchilla's L = E + A/N'^alpha + B/D'^beta. The formulas and the optimal allocation's grid search are
huggingface/datablations's README's (Apache-2.0); its C4 constants are `DATABLATIONS`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from scipy import optimize

from lm.config import ConfigError
from lm.jobs.scaling.laws import HUBER_DELTA, fit_chinchilla
from lm.jobs.scaling.points import Points

# datablations's README: a, b, e = log A, log B, log E fitted on C4, alpha = beta tied; R_D*, R_N* on their runs.
NAMES = ('E', 'A', 'B', 'alpha', 'beta', 'R_D', 'R_N')
DATABLATIONS = {'E': float(np.exp(0.6254804)), 'A': float(np.exp(6.255414)), 'B': float(np.exp(7.3049974)),
                'alpha': 0.3526596, 'beta': 0.3526596, 'R_D': 15.387756, 'R_N': 5.309743}


def _g(law: dict[str, float]) -> float:
  return ((law['alpha'] * law['A']) / (law['beta'] * law['B'])) ** (1 / (law['alpha'] + law['beta']))


def params_for_tokens(law: dict[str, float], tokens: Any) -> Any:
  """U_N: the compute-optimal parameter count for `tokens` tokens (datablations's D_to_N)."""
  g = _g(law)
  return (np.asarray(tokens, np.float64) * g) ** (law['beta'] / law['alpha']) * g


def effective(unique: Any, repeats: Any, star: float) -> Any:
  """U + U R* (1 - e^(-R/R*)): what U unique tokens (or parameters) repeated R more times are worth."""
  return unique + unique * star * (1 - np.exp(-repeats / star))


def loss(law: dict[str, float], params: Any, tokens: Any, unique: Any) -> Any:
  """L(N, D, U) (datablations's `scaling_law`)."""
  params, tokens, unique = (np.asarray(x, np.float64) for x in (params, tokens, unique))
  repeats_d = np.maximum(tokens / unique - 1, 0)
  unique_n = np.minimum(params, params_for_tokens(law, unique))
  repeats_n = np.maximum(params / unique_n - 1, 0)
  return (law['E'] + law['A'] / effective(unique_n, repeats_n, law['R_N']) ** law['alpha']
          + law['B'] / effective(unique, repeats_d, law['R_D']) ** law['beta'])


def optimal_allocation(law: dict[str, float], flops: float, unique: float) -> dict[str, float]:
  """The lowest loss for compute C and U unique tokens, by datablations's grid around Chinchilla's optimum:
  D = D_opt x i, N = N_opt / i (and the reverse) for 500 i in [1.0001, 3]."""
  total = law['alpha'] + law['beta']
  n_base = _g(law) * (flops / 6) ** (law['beta'] / total)
  d_base = (flops / 6) ** (law['alpha'] / total) / _g(law)
  best = (np.inf, 0.0, 0.0)
  for i in np.linspace(1.0001, 3, 500):
    for d, n in ((d_base * i, n_base / i), (d_base / i, n_base * i)):
      value = float(loss(law, n, d, min(unique, d)))
      if value < best[0]:
        best = (value, d, n)
  value, tokens, params = best
  return {'flops': flops, 'unique_tokens': unique, 'loss': value, 'tokens': tokens, 'params': params,
          'epochs': tokens / unique}


BASE = ('E', 'A', 'B', 'alpha', 'beta')


def base_law(spec: str) -> dict[str, float]:
  """The Chinchilla base a fit keeps: 'datablations' (its C4 constants) or a `fit --law chinchilla --out` JSON."""
  import json
  from pathlib import Path
  if spec == 'datablations':
    return {k: DATABLATIONS[k] for k in BASE}
  path = Path(spec)
  try:
    fit = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ConfigError(f'--base {spec}: not datablations nor a readable JSON fit ({e.__class__.__name__}); write one '
                      f'with lm scaling fit POINTS --law chinchilla --out base.json') from None
  fit = fit if isinstance(fit, dict) else {}  # a JSON list or number is no fit either
  params = fit.get('params') if isinstance(fit.get('params'), dict) else {}
  if fit.get('law') != 'chinchilla' or any(k not in params for k in BASE):
    raise ConfigError(f'--base {spec} is no chinchilla fit (law {fit.get("law")!r}); write one with lm scaling fit '
                      f'POINTS --law chinchilla --out base.json')
  return {k: float(params[k]) for k in BASE}


def allocation(fit: dict[str, Any], flops: float, unique: float) -> dict[str, float]:
  """`optimal_allocation` of a fit's law, with 95% intervals of params, tokens and epochs over its bootstrap samples
  (`<key>_ci`) when it has them."""
  out = optimal_allocation(fit['params'], flops, unique)
  if fit.get('samples'):
    drawn = [optimal_allocation(s, flops, unique) for s in fit['samples']]
    out.update({f'{k}_ci': [float(np.percentile([d[k] for d in drawn], q)) for q in (2.5, 97.5)]
                for k in ('params', 'tokens', 'epochs')})
  return out


def misfit(law: dict[str, float], points: Points, unique: np.ndarray) -> float:
  """What the fit minimises: the Huber loss (delta HUBER_DELTA) of log L(N, D, U) - log loss, summed over points."""
  with np.errstate(all='ignore'):
    r = np.log(loss(law, points.params, points.tokens, unique)) - np.log(points.loss)
  if not np.all(np.isfinite(r)):
    return float('inf')
  return float(np.where(np.abs(r) <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum())


def _decays(final: Points, unique: np.ndarray, law: dict[str, float], names: Sequence[str]) -> dict[str, float]:
  """`law` with `names` (R_D and R_N, and the base's when it was fitted here) fitted by Nelder-Mead on their logs
  from a grid of R_D* and R_N* (the misfit can be flat along R_D* with more than one valley)."""
  def objective(theta: np.ndarray) -> float:
    return min(misfit({**law, **dict(zip(names, np.exp(theta)))}, final, unique) / HUBER_DELTA ** 2, 1e30)

  fixed = [np.log(law[k]) for k in names if k not in ('R_D', 'R_N')]
  starts = [np.array([*fixed, np.log(d), np.log(n)]) for d in (1.0, 5.0, 20.0, 100.0) for n in (1.0, 5.0, 20.0)]
  best = min((optimize.minimize(objective, s, method='Nelder-Mead', options={
    'xatol': 1e-9, 'fatol': 1e-12, 'maxiter': 20000, 'maxfev': 20000}) for s in starts), key=lambda r: r.fun)
  return {**law, **{k: float(v) for k, v in zip(names, np.exp(best.x))}}


def fit_data_constrained(points: Points, unique: np.ndarray, base: dict[str, float] | None = None,
                         bootstrap: int = 0, seed: int = 0) -> dict[str, Any]:
  """R_D* and R_N* fitted (Huber on log loss, as the base) to every run's final point, on a Chinchilla base fitted
  to the runs that saw each token at most once (or given); with `bootstrap`, refits on resampled runs (the base
  held) and 95% percentile intervals of R_D* and R_N* (`ci`, `samples`)."""
  rows = points.final_rows()
  final, unique = points.take(rows), np.asarray(unique, np.float64)[rows]
  if np.any(unique <= 0):
    raise ConfigError('unique_tokens must be positive in every row: the unique tokens each run could see')
  repeated = final.tokens > unique * (1 + 1e-9)
  if not repeated.any():
    raise ConfigError('no run repeats its data (tokens > unique_tokens): the decay of repeated tokens needs runs '
                      'over several epochs; train some with data.unique_tokens')
  names: Sequence[str] = ('R_D', 'R_N')
  if base is None:
    once = final.take(np.flatnonzero(~repeated))
    if len(once) < 5:
      raise ConfigError(f'{len(once)} runs saw each token once; the Chinchilla base needs 5 or more (or pass a '
                        f'base law: --base)')
    base = fit_chinchilla(once)['params']
    names = NAMES  # the base was fitted here: it is refined with the decays, on every run
  law = _decays(final, unique, dict(base), names)
  out: dict[str, Any] = {'law': 'data_constrained', 'params': law, 'points': len(final),
                         'repeated': int(repeated.sum())}
  if bootstrap:
    rng = np.random.default_rng(seed)
    drawn = [rng.integers(0, len(final), len(final)) for _ in range(bootstrap)]
    out['samples'] = [_decays(final.take(i), unique[i], law, ('R_D', 'R_N')) for i in drawn]
    out['ci'] = {k: [float(np.percentile([s[k] for s in out['samples']], q)) for q in (2.5, 97.5)]
                 for k in ('R_D', 'R_N')}
    out['bootstrap'] = bootstrap
  return out


def holdout_largest(points: Points, unique: np.ndarray) -> dict[str, Any]:
  """The law fitted without the largest size's runs, and its prediction of their final loss."""
  largest = points.params.max()
  keep, held = np.flatnonzero(points.params < largest), np.flatnonzero(points.params == largest)
  fitted = fit_data_constrained(points.take(keep), np.asarray(unique)[keep])['params']
  rows = held[points.take(held).final_rows()]
  final, u = points.take(rows), np.asarray(unique, np.float64)[rows]
  predicted = loss(fitted, final.params, final.tokens, u)
  error = np.abs(predicted - final.loss) / final.loss
  return {'params': float(largest), 'runs': list(final.run), 'predicted': predicted.tolist(),
          'measured': final.loss.tolist(), 'mean_error': float(error.mean()), 'max_error': float(error.max())}
