"""Whole training-loss curves under any learning-rate schedule, from one size's runs.

Two forms, each predicting the training loss after n updates from the rates eta_0, eta_1, ... of the updates:
- the multi-power law (Luo et al. 2025, arXiv:2503.12811; thu-yao-01-luo/MultiPowerLaw):
    L(n) = L0 + A S1^-alpha - B sum_{k=1}^{n-1} (eta_{k-1} - eta_k) G(eta_k^-gamma S_k(n)),  G(x) = 1 - (1 + C x)^-beta,
  with S1 = sum_{i<n} eta_i (the warmup's area included) and S_k(n) = sum_{k<=i<n} eta_i;
- the momentum form of Tissue et al. 2024 (arXiv:2408.11029):
    L(n) = L0 + A S1^-alpha - C S2,  S2 = sum_{i=1}^{n-1} m_i,  m_i = lambda m_{i-1} + (eta_{i-1} - eta_i).
Both are fitted as the papers fit them: Huber (delta 1e-3) on log loss summed over the logged points of every
curve, here by L-BFGS-B on the logs of the positive parameters with exact gradients, from the MultiPowerLaw
repository's starting point (a power law of the loss in S1, then the loss drop's parameters). NumPy and SciPy only.
The papers' training losses average batches of half a million tokens or more; a small run's batch loss varies by
several percent from step to step (lm's CPU ladder: 5% a step, 4% over 5 steps), so a run's curve can follow a
held-out loss at its evaluations instead (`metric`), the same held-out rows every time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import optimize, signal, stats

from lm.config import ConfigError

HUBER_DELTA = 1e-3
FORMS = {'mpl': ('L0', 'A', 'alpha', 'B', 'C', 'beta', 'gamma'), 'tissue': ('L0', 'A', 'alpha', 'C', 'lambda')}
BOUNDS = {'L0': (1e-3, 1e3), 'A': (1e-4, 1e3), 'alpha': (0.01, 3.0), 'B': (1e-2, 1e5), 'C': (1e-4, 1e4),
          'beta': (0.01, 3.0), 'gamma': (0.01, 3.0)}  # where the fit searches (the papers' fits lie well inside)
LAMBDAS = (0.99, 0.995, 0.999, 0.9995)  # Tissue et al.'s decay factor: the fit keeps the best of these
CHUNK = 1 << 21  # points x rate changes held at once
COARSE = 512  # the fit's first pass merges a curve's rate changes into this many runs
REFINE = 40  # L-BFGS iterations on every change after it
BLOCKS = 40  # a bootstrap resamples each curve's residuals in about this many contiguous blocks


@dataclass(frozen=True)
class Curve:
  """One run's schedule and measured losses: `rates[i]` is update i's learning rate, `updates[j]` how many
  updates preceded the loss `loss[j]`."""
  name: str
  rates: np.ndarray
  updates: np.ndarray
  loss: np.ndarray
  base: Curve | None = None  # a run on the same batches: the curve is then fitted on its ratio to base's loss

  def __post_init__(self) -> None:
    if len(self.updates) != len(self.loss) or not len(self.loss):
      raise ConfigError(f'{self.name}: a curve needs losses, one per logged step')
    if self.updates.min() < 1 or self.updates.max() > len(self.rates):
      raise ConfigError(f'{self.name}: a loss after {self.updates.max()} updates lies beyond its schedule of '
                        f'{len(self.rates)} steps')

  @property
  def base_loss(self) -> np.ndarray:
    """base's measured loss after each of `updates` (`on_batches_of` keeps the updates it measured)."""
    return self.base.loss[np.searchsorted(self.base.updates, self.updates)]

  def on_batches_of(self, base: Curve) -> Curve:
    """This curve paired with `base`, a run that read the same batches in the same order, at the updates both
    measured."""
    both = np.isin(self.updates, base.updates)
    return dataclasses.replace(self, updates=self.updates[both], loss=self.loss[both], base=base)


def _areas(rates: np.ndarray) -> np.ndarray:
  """cum[n] = sum_{i<n} eta_i."""
  return np.concatenate([[0.0], np.cumsum(rates, dtype=np.float64)])


def _changes(rates: np.ndarray, most: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """The updates k whose rate differs from the one before, and each change eta_{k-1} - eta_k; with `most`, the
  changes merged into at most that many runs of consecutive ones, each at its last k (a fit's coarse pass)."""
  k = np.flatnonzero(np.diff(rates)) + 1
  drop = rates[k - 1] - rates[k]
  if most and len(k) > most:
    groups = np.arange(len(k)) * most // len(k)
    last = np.flatnonzero(np.diff(groups, append=most))
    drop, k = np.add.reduceat(drop, np.concatenate([[0], last[:-1] + 1])), k[last]
  return k, drop


def _loss_drop(rates: np.ndarray, updates: np.ndarray, C: float, beta: float, gamma: float, grads: bool = False,
               most: int | None = None):
  """sum_k (eta_{k-1} - eta_k) G(eta_k^-gamma S_k(n)) at each n of `updates`, over the k where the rate changes
  (`_changes`); with `grads`, also its derivatives in C, beta and gamma."""
  cum = _areas(rates)
  k, drop = _changes(rates, most)
  scale, log_rate = rates[k] ** -gamma, np.log(rates[k])
  out = np.zeros((4 if grads else 1, len(updates)))
  step = max(1, CHUNK // max(len(k), 1))
  for start in range(0, len(updates), step):
    n = updates[start:start + step]
    inside = k[None, :] < n[:, None]
    u = scale[None, :] * np.maximum(cum[n][:, None] - cum[k][None, :], 0.0)
    w = 1.0 + C * u
    w_beta = w ** -beta
    weighted = np.where(inside, drop[None, :], 0.0)
    out[0, start:start + step] = weighted @ np.ones(len(k)) - (weighted * w_beta).sum(1)
    if grads:
      common = weighted * beta * w_beta / w  # d G / d (C u)
      out[1, start:start + step] = (common * u).sum(1)  # d / dC
      out[2, start:start + step] = (weighted * w_beta * np.log(w)).sum(1)  # d / dbeta
      out[3, start:start + step] = -(common * C * u * log_rate[None, :]).sum(1)  # d / dgamma
  return out if grads else out[0]


def _momentum(rates: np.ndarray, updates: np.ndarray, lam: float) -> np.ndarray:
  """Tissue et al.'s S2 after each n of `updates`: the sum of m_1 .. m_{n-1}."""
  m = signal.lfilter([1.0], [1.0, -lam], np.concatenate([[0.0], rates[:-1] - rates[1:]]))
  return np.concatenate([[0.0], np.cumsum(m)])[updates]


def predict(form: str, params: dict[str, float], rates: np.ndarray, updates: np.ndarray) -> np.ndarray:
  """The form's training loss after each n of `updates` under the schedule `rates`."""
  rates, updates = np.asarray(rates, np.float64), np.asarray(updates)
  p = params
  base = p['L0'] + p['A'] * _areas(rates)[updates] ** -p['alpha']
  if form == 'mpl':
    return base - p['B'] * _loss_drop(rates, updates, p['C'], p['beta'], p['gamma'])
  return base - p['C'] * _momentum(rates, updates, p['lambda'])


def curve_steps(rates: np.ndarray, count: int) -> np.ndarray:
  """About `count` steps s, evenly from the first whose loss follows some rate above 0 to the last (the loss
  logged at step s follows s - 1 updates)."""
  first = int(np.argmax(_areas(rates)[1:] > 0)) + 2
  return np.unique(np.linspace(first, len(rates), count).round().astype(int))


def paired_steps(base: Curve, metric: str, last: int, count: int) -> np.ndarray:
  """About `count` of the steps at which `base` measured `metric`, up to and including `last`, which it must have."""
  measured = base.updates + (metric == 'loss')  # the steps they were logged at (updates_before inverted)
  measured = measured[measured <= last]
  if not len(measured) or measured[-1] != last:
    raise ConfigError(f'--paired {base.name} logged no {metric} at step {last}, the config\'s last; continue it to '
                      f'step {last} (lm train --config {base.name}/config.yaml train.steps={last} train.resume=true: '
                      f'a constant rate continues exactly)')
  return measured[np.unique(np.linspace(0, len(measured) - 1, count).round().astype(int))]


def paired(form: str, params: dict[str, float], rates: np.ndarray, updates: np.ndarray, base: Curve) -> np.ndarray:
  """The law's loss for `rates` after `updates`, paired with `base`, a run measured on the same batches in the same
  order: base's measured loss there times the law's ratio of the schedule's loss to base's. What the batches
  themselves add (a small batch's loss moves by several percent from step to step) is the same in both runs and
  cancels: the law predicts only how the schedule moves the loss from base's. `updates` must be among base's."""
  at = np.minimum(np.searchsorted(base.updates, updates), len(base.updates) - 1)
  if (missing := base.updates[at] != updates).any():
    raise ConfigError(f'{base.name} measured nothing after {updates[missing][0]} updates; pair at its own steps')
  measured = base.loss[at]
  return measured * predict(form, params, rates, updates) / predict(form, params, base.rates, updates)


def _huber(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  small = np.abs(r) <= HUBER_DELTA
  value = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA))
  return value, np.where(small, r, HUBER_DELTA * np.sign(r))


def _pred_parts(form: str, p: dict[str, float], rates: np.ndarray, updates: np.ndarray, most: int | None
                ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """The form's loss after each of `updates` and its derivative in each parameter."""
  s1 = _areas(rates)[updates]
  power = s1 ** -p['alpha']
  parts = {'L0': np.ones_like(s1), 'A': power, 'alpha': -p['A'] * power * np.log(s1)}
  pred = p['L0'] + p['A'] * power
  if form == 'mpl':
    drop, d_c, d_beta, d_gamma = _loss_drop(rates, updates, p['C'], p['beta'], p['gamma'], True, most)
    pred = pred - p['B'] * drop
    parts.update(B=-drop, C=-p['B'] * d_c, beta=-p['B'] * d_beta, gamma=-p['B'] * d_gamma)
  else:
    s2 = _momentum(rates, updates, p['lambda'])
    pred = pred - p['C'] * s2
    parts['C'] = -s2
  return pred, parts


def _objective(theta: np.ndarray, form: str, curves: Sequence[Curve], fixed: dict[str, float],
               most: int | None = None) -> tuple[float, np.ndarray]:
  """Summed Huber of log(pred) - log(loss), and its gradient in theta = the logs of the fitted parameters;
  scaled by 1/delta^2 so that L-BFGS sees O(1) numbers near the optimum. A curve with a `base` is fitted on its
  ratio to the base's measured loss at the same steps: log(pred / pred_base) - log(loss / loss_base)."""
  names = [n for n in FORMS[form] if n not in fixed]
  p = {**dict(zip(names, np.exp(theta))), **fixed}
  total, grad = 0.0, np.zeros(len(names))
  for c in curves:
    pred, parts = _pred_parts(form, p, c.rates, c.updates, most)
    if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
      return 1e30, np.zeros(len(names))
    residual, slopes = np.log(pred) - np.log(c.loss), {n: parts[n] / pred for n in names}
    if c.base is not None:
      base_pred, base_parts = _pred_parts(form, p, c.base.rates, c.updates, most)
      if not np.all(np.isfinite(base_pred)) or np.any(base_pred <= 0):
        return 1e30, np.zeros(len(names))
      residual = residual - np.log(base_pred) + np.log(c.base_loss)
      slopes = {n: slopes[n] - base_parts[n] / base_pred for n in names}
    value, slope = _huber(residual)
    total += value.sum()
    grad += np.array([(slope * slopes[n]).sum() * p[n] for n in names])
  return total / HUBER_DELTA ** 2, grad / HUBER_DELTA ** 2


def _start(curves: Sequence[Curve]) -> dict[str, float]:
  """The MultiPowerLaw repository's start: L0 near the lowest loss, A and alpha from a line through
  log(loss - min + 0.01) against log S1."""
  lowest = min(c.loss.min() for c in curves)
  x = np.concatenate([np.log(_areas(c.rates)[c.updates]) for c in curves])
  y = np.concatenate([np.log(c.loss - lowest + 0.01) for c in curves])
  line = stats.linregress(x, y)
  return {'L0': max(lowest - 0.1, 1e-3), 'A': float(np.exp(line.intercept)), 'alpha': max(-line.slope, 0.05)}


def _starts(curves: Sequence[Curve], form: str) -> list[tuple[dict[str, float], dict[str, float]]]:
  """The fit's starting points, each (params, fixed): the multi-power law's from three loss-drop scales, the
  momentum form's at each of LAMBDAS (fixed)."""
  start = _start(curves)
  if form == 'mpl':
    return [({**start, 'B': b, 'C': 1.0, 'beta': 0.5, 'gamma': 0.5}, {}) for b in (100.0, 300.0, 1000.0)]
  scale = max(float(c.rates.max()) for c in curves)
  return [({**start, 'C': 1.0 / scale}, {'lambda': lam}) for lam in LAMBDAS]


def fit_curves(curves: Sequence[Curve], form: str = 'mpl',
               starts: Sequence[tuple[dict[str, float], dict[str, float]]] = ()) -> dict[str, Any]:
  """The form's parameters fitted to every curve at once (one model size), with each curve's mean relative
  error; from `starts` ((params, fixed) pairs) if given."""
  if form not in FORMS:
    raise ConfigError(f'--form {form} is not a curve law; choose one of: {", ".join(FORMS)}')
  starts = starts or _starts(curves, form)
  best = None
  with np.errstate(all='ignore'):  # a trial point may overflow; its objective is then the largest
    for params, fixed in starts:  # the multi-power law's loss drop on at most COARSE merged changes a curve first
      names = [n for n in FORMS[form] if n not in fixed]
      bounds = [tuple(np.log(BOUNDS.get(n, (1e-8, 1e8)))) for n in names]
      theta = np.clip(np.log([params[n] for n in names]), *np.array(bounds).T)
      result = optimize.minimize(_objective, theta, args=(form, curves, fixed, COARSE), jac=True,
                                 method='L-BFGS-B', bounds=bounds, options={'maxiter': 2000})
      if best is None or result.fun < best[0]:
        best = (result.fun, result.x, fixed, bounds)
    _, theta, fixed, bounds = best
    if form == 'mpl':  # then every change, from there
      refined = optimize.minimize(_objective, theta, args=(form, curves, fixed), jac=True, method='L-BFGS-B',
                                  bounds=bounds, options={'maxiter': REFINE})
      best, theta = (refined.fun, refined.x, fixed, bounds), refined.x
  names = [n for n in FORMS[form] if n not in fixed]
  params = {**dict(zip(names, np.exp(theta).tolist())), **fixed}
  return {'law': 'curve', 'form': form, 'params': params, 'objective': float(best[0]),
          'curves': {c.name: relative_error(form, params, c) for c in curves}}


def _fitted_loss(form: str, params: dict[str, float], curve: Curve) -> np.ndarray:
  """The fit's loss at the curve's updates: the law's, or for a paired curve its base's measured loss times the
  law's ratio (what the fit compared the curve's loss with)."""
  pred = predict(form, params, curve.rates, curve.updates)
  return pred if curve.base is None else curve.base_loss * pred / predict(form, params, curve.base.rates,
                                                                          curve.updates)


def bootstrap_curves(curves: Sequence[Curve], fit: dict[str, Any], samples: int, seed: int = 0
                     ) -> list[dict[str, float]]:
  """`samples` refits of `fit` (fit_curves' on `curves`), each on the fit's curves times resampled residuals: each
  curve's log residuals (a paired curve's against its base) drawn with replacement in about BLOCKS contiguous blocks
  (a small batch's loss stays high or low over a few steps), each refit starting at the fit (the momentum form's
  lambda kept)."""
  rng = np.random.default_rng(seed)
  form, params = fit['form'], fit['params']
  fixed = {'lambda': params['lambda']} if form == 'tissue' else {}
  start = [({k: v for k, v in params.items() if k not in fixed}, fixed)]
  fitted = [(c, _fitted_loss(form, params, c)) for c in curves]
  out = []
  for _ in range(samples):
    drawn = []
    for curve, pred in fitted:
      residual = np.log(curve.loss) - np.log(pred)
      size = max(1, len(residual) // BLOCKS)
      first = rng.integers(0, len(residual) - size + 1, -(-len(residual) // size))
      resampled = np.concatenate([residual[i:i + size] for i in first])[:len(residual)]
      drawn.append(dataclasses.replace(curve, loss=pred * np.exp(resampled)))  # a paired curve keeps its base
    out.append(fit_curves(drawn, form, start)['params'])
  return out


def holdout_each(curves: Sequence[Curve], form: str) -> list[dict[str, Any]]:
  """Each curve but a base the others pair with, left out in turn: its final loss as a fit on the others predicts
  it (paired curves keep their base), against the measured one. The largest |error| is what the fit is known to
  miss by on a schedule it did not see (`resolved_pick`)."""
  bases = {id(c.base) for c in curves if c.base is not None}
  held = [i for i, c in enumerate(curves) if id(c) not in bases]
  if len(curves) < 2 or not held:
    raise ConfigError('--holdout each leaves one run out in turn and predicts it from the others: fit two or more '
                      'runs (the stable run and two cooldowns)')
  out = []
  for i in held:
    fit = fit_curves([c for j, c in enumerate(curves) if j != i], form)
    predicted, measured = float(_fitted_loss(form, fit['params'], curves[i])[-1]), float(curves[i].loss[-1])
    out.append({'run': curves[i].name, 'predicted': predicted, 'measured': measured,
                'error': predicted / measured - 1})
  return out


def resolved_pick(finals: np.ndarray, pick: int, error: float | None) -> int:
  """`pick` among `finals` (the configured schedule first), kept only where its predicted gain over the configured
  one exceeds `error`, the fit's largest relative error on a run it left out (`holdout_each`); else 0."""
  if error is None or pick == 0:
    return pick
  return pick if 1 - finals[pick] / finals[0] > error else 0


def search_pick(finals: np.ndarray, sampled: np.ndarray | None, level: float = 0.95) -> tuple[int, float | None]:
  """A search's pick among schedules (`finals`: each one's predicted final loss, the configured schedule first) and
  the share of the fit's resamples (`sampled`: resamples x schedules) in which it beats the configured one: the
  lowest prediction, kept only where it beats the configured schedule in `level` of the resamples, else the
  configured schedule (0)."""
  best = int(np.argmin(finals))
  if sampled is None or not len(sampled) or best == 0:
    return best, None
  wins = float(np.mean(sampled[:, best] < sampled[:, 0]))
  return (best if wins >= level else 0), wins


def relative_error(form: str, params: dict[str, float], curve: Curve) -> dict[str, float]:
  """The mean and largest |pred - loss| / loss over a curve's points, and its final loss against the
  prediction (a paired curve's: its base's loss times the law's ratio)."""
  pred = _fitted_loss(form, params, curve)
  error = np.abs(pred - curve.loss) / curve.loss
  return {'mean': float(error.mean()), 'max': float(error.max()), 'final_loss': float(curve.loss[-1]),
          'final_predicted': float(pred[-1])}


# ---------------------------------------------------------------- lm's runs and configs

def schedule_rates(config: Any) -> np.ndarray:
  """The learning rate of each of a config's `train.steps` updates, from its schedule (`lm.assembly.optim`), a batch
  ramp's factors included."""
  from lm.assembly.optim import learning_rate_schedule
  from lm.config import ramp_rates
  schedule = learning_rate_schedule(config.optim, config.train.steps, ramp_rates(config))
  steps = config.train.steps  # a constant schedule without warmup gives one number for every step
  return np.broadcast_to(np.asarray(schedule(np.arange(steps)), np.float64), (steps,)).copy()


def model_of(config: Any) -> dict[str, Any]:
  """What makes two runs the same size: the model section without how the step computes."""
  model = config.to_dict()['model']
  model.pop('execution', None)
  return model


def updates_before(metric: str, steps: np.ndarray) -> np.ndarray:
  """How many updates precede `metric` as logged at each of `steps`: the training loss of step s is its batch's
  before the step's update (s - 1), a held-out loss is evaluated after it (s)."""
  return steps - 1 if metric == 'loss' else steps


def metric_name(metric: str) -> str:
  """How reports name a curve's metric: 'training loss' for `loss`, a held-out one by its key."""
  return 'training loss' if metric == 'loss' else metric


def run_curve(run_dir: str, metric: str = 'loss') -> tuple[Curve, dict[str, Any]]:
  """A run's `metric` (the training loss, or a held-out loss such as val_loss at its evaluations) against the
  updates before it, on its schedule rebuilt from config.yaml and checked against the learning rates metrics.jsonl
  logged."""
  import json

  from etils import epath

  from lm.storage.run_dir import read_config
  config = read_config(run_dir)
  path = epath.Path(run_dir) / 'metrics.jsonl'
  records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
  logged = [r for r in records if 'loss' in r and 'step' in r]
  if not logged:
    raise ConfigError(f'{run_dir} has no training losses in metrics.jsonl; a curve fit needs a run lm train wrote')
  if any('learning_rate' not in r for r in logged):
    raise ConfigError(f'{run_dir}: metrics.jsonl has losses without learning rates (step '
                      f'{next(r["step"] for r in logged if "learning_rate" not in r)}); a curve fit needs each '
                      f'logged step\'s rate, as lm train logs it')
  rates = schedule_rates(config)
  steps = np.array([r['step'] for r in logged])
  logged_rates = np.array([r['learning_rate'] for r in logged])
  wrong = ~np.isclose(rates[np.minimum(steps, len(rates)) - 1], logged_rates, rtol=1e-5, atol=1e-12)
  if wrong.any():
    step = int(steps[wrong][0])
    raise ConfigError(f'{run_dir}: the rate logged at step {step} ({logged_rates[wrong][0]:.6g}) is not its '
                      f'schedule\'s ({rates[step - 1]:.6g}); the curve needs the schedule the run trained with')
  measured = [r for r in records if metric in r and 'step' in r and r['step'] <= len(rates)]
  if not measured:
    held = sorted({k for r in records for k in r if k == 'val_loss' or (k.startswith('val/') and k.endswith('/loss'))})
    raise ConfigError(f'{run_dir} logged no {metric}; fit --metric loss (the training loss)'
                      + (f' or one of its held-out losses: {", ".join(held)}' if held else ''))
  updates = updates_before(metric, np.array([r['step'] for r in measured]))
  keep = _areas(rates)[updates] > 0  # the laws start once some rate has been applied
  if not keep.any():
    raise ConfigError(f'{run_dir}: every logged {metric} precedes the first update with a rate above 0; log more '
                      f'steps')
  curve = Curve(str(run_dir), rates, updates[keep], np.array([r[metric] for r in measured])[keep])
  return curve, model_of(config)


def other_batches(config: Any, base: Any) -> tuple[str, Any, Any] | None:
  """Where `config` reads other batches than `base` (train.seed, train.global_batch, a data field): (field, config's
  value, base's), or None when both read the same batches in the same order."""
  import dataclasses
  fields = [('train', 'seed'), ('train', 'global_batch'), *(('data', f.name) for f in dataclasses.fields(config.data))]
  for section, name in fields:
    mine, its = getattr(getattr(config, section), name), getattr(getattr(base, section), name)
    if mine != its:
      return f'{section}.{name}', mine, its
  return None


def _paired_curves(curves: list[Curve], runs: Sequence[str], base_run: str) -> list[Curve]:
  """Every curve but base_run's on its ratio to base_run's (`Curve.on_batches_of`), once each run read base_run's
  batches and base_run measured its last step."""
  from lm.storage.run_dir import read_config
  if base_run not in runs:
    raise ConfigError(f'--paired {base_run} is not among the fitted runs; pair with one of them (the size\'s '
                      f'stable run)')
  base = curves[list(runs).index(base_run)]
  base_config, out = read_config(base_run), []
  for run, curve in zip(runs, curves):
    if run != base_run:
      if (differs := other_batches(read_config(run), base_config)):
        raise ConfigError(f'{run} read other batches than --paired {base_run}: its {differs[0]} is {differs[1]}, '
                          f'{base_run}\'s {differs[2]}; pair runs of the same data, seed and batch')
      if curve.updates[-1] not in base.updates:
        raise ConfigError(f'--paired {base_run} measured nothing where {run} ends ({curve.updates[-1]} updates); '
                          f'continue it there (lm train ... train.resume=true) or pair with a longer run')
      curve = curve.on_batches_of(base)
    out.append(curve)
  return out


def fit_runs(runs: Sequence[str], form: str, metric: str = 'loss', bootstrap: int = 0, paired: str | None = None,
             holdout: bool = False) -> dict[str, Any]:
  """One size's runs fitted together on `metric` (the training loss or a held-out loss), with `bootstrap` refits
  on resampled residuals (`samples`, and 95% intervals of the parameters); runs of different models are
  refused. With `paired` (one of `runs`), every other run is fitted on its loss's ratio to that run's at the same
  steps: runs that read the same batches share the batches' own noise, which the ratio cancels. With `holdout`,
  each run (but the paired one) predicted by a fit on the others (`holdout_each`)."""
  pairs = [run_curve(run, metric) for run in runs]
  first = pairs[0][1]
  for run, (_, model) in zip(runs, pairs):
    if model != first:
      field = next(k for k in sorted(set(first) | set(model)) if first.get(k) != model.get(k))
      raise ConfigError(f'{run} is another model than {runs[0]} (model.{field}: {model.get(field)} against '
                        f'{first.get(field)}); a curve fit takes one size\'s runs')
  curves = [c for c, _ in pairs]
  if paired:
    curves = _paired_curves(curves, runs, paired)
  fit = fit_curves(curves, form)
  fit.update(model=first, metric=metric, **({'paired': paired} if paired else {}))
  if holdout:
    fit['holdout'] = holdout_each(curves, form)
    fit['holdout_error'] = max(abs(h['error']) for h in fit['holdout'])
  if bootstrap:
    fit['samples'] = bootstrap_curves(curves, fit, bootstrap)
    fit['params_ci'] = {k: np.percentile([s[k] for s in fit['samples']], [2.5, 97.5]).tolist() for k in fit['params']}
  return fit


def search_grid(options: Sequence[str]) -> list[list[str]]:
  """`['optim.decay_fraction=0.1,0.2', 'optim.decay_shape=linear,sqrt']` -> every combination as overrides; a
  bare field name is read as an `optim.` one."""
  import itertools
  axes = []
  for option in options:
    key, sep, values = option.partition('=')
    if not sep or not values:
      raise ConfigError(f'--search {option}: write key=v1,v2 (e.g. decay_fraction=0.1,0.2,0.3)')
    key = key if '.' in key else f'optim.{key}'
    axes.append([f'{key}={v}' for v in values.split(',') if v])
  return [list(combo) for combo in itertools.product(*axes)]
