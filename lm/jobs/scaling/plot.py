"""`lm scaling plot`: loss against compute with every run's curve, the frontier and the fitted law; IsoFLOP
curves with their parabolas; N_opt and D_opt against compute with the fitted power laws; each task's accuracy
against compute, and against its task loss with the task law's sigmoid (matplotlib, Agg). `plot_suite`: a
checkpoint suite's figure (Pythia's): loss and each task's accuracy against tokens and against compute, a line
per model size."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from lm.config import ConfigError
from lm.jobs.scaling import laws
from lm.jobs.scaling.points import Points, loss_of, size_label


def _law_curve(fit: dict[str, Any], flops: np.ndarray) -> np.ndarray | None:
  """The fitted law's loss along compute: L_opt(C) for chinchilla, (C_c/C)^alpha_C for kaplan."""
  if fit['law'] == 'chinchilla':
    return np.array([laws.compute_optimal(fit['params'], c)['loss'] for c in flops])
  if fit['law'] == 'kaplan' and 'alpha_C' in fit['params']:
    return (fit['params']['C_c'] / flops) ** fit['params']['alpha_C']
  return None


def _isoflop(points: Points, fit: dict[str, Any] | None) -> dict[str, Any] | None:
  """The IsoFLOP fit to draw: the given one, else one fitted here when every budget allows it."""
  if fit is not None and fit['law'] == 'isoflop':
    return fit
  try:
    return laws.fit_isoflop(points)
  except ConfigError:
    return None


def _runs(points: Points) -> list[np.ndarray]:
  """Each run's rows in order of compute."""
  rows = [np.array([i for i, r in enumerate(points.run) if r == run]) for run in dict.fromkeys(points.run)]
  return [r[np.argsort(points.flops[r])] for r in rows]


def loss_label(loss_of: str) -> str:
  """An axis label for a held-out record: val_loss -> 'validation loss (nats/token)', val/c4/bpb -> 'c4 bits per
  byte'."""
  name, metric = loss_of.split('/')[1:] if loss_of.startswith('val/') else ('validation', loss_of.removeprefix('val_'))
  return f'{name} ' + ('bits per byte' if metric.startswith('bpb') else 'loss (nats/token)')


def plot(points: Points, out: str | Path, fit: dict[str, Any] | None = None,
         tasks: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, loss_of: str = 'val_loss') -> Path:
  """`tasks`: column name (`<task>/<metric>`) -> (that accuracy, the task's task loss) per point; `loss_of`: the
  record the points' loss is (`lm.jobs.scaling.collect.loss_column`), for the axis labels."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  tasks = tasks or {}
  iso = _isoflop(points, fit) if fit is None or fit['law'] != 'task' else None
  optimal = fit is not None and fit['law'] == 'chinchilla' or iso is not None
  law_task = f'{fit["task"]}/{fit["metric"]}' if fit is not None and fit['law'] == 'task' else None
  panels = 1 + (iso is not None) + optimal + len(tasks) + (law_task in tasks)
  figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5), squeeze=False)
  axes = list(axes[0])
  _loss_panel(axes.pop(0), points, fit, loss_of)
  if iso is not None:
    _isoflop_panel(axes.pop(0), points, iso, loss_of, plt.cm.viridis(np.linspace(0, 0.9, len(iso['budgets']))))
  if optimal:
    _allocation_panel(axes.pop(0), points, fit, iso)
  for column, (accuracy, task_loss) in tasks.items():
    ax = axes.pop(0)
    for rows in _runs(points):
      ax.plot(points.flops[rows], accuracy[rows], '.-', color='tab:green', alpha=0.5, lw=1)
    ax.set(xscale='log', xlabel='compute C (FLOPs)', ylabel=column, title=f'{column} against compute')
    if column == law_task:
      ax = axes.pop(0)
      ax.plot(task_loss, accuracy, 'o', color='tab:green', ms=4, label='points')
      x = np.linspace(task_loss.min(), task_loss.max(), 100)
      ax.plot(x, laws.sigmoid(x, **{k: fit['params'][k] for k in laws.SIGMOID}), 'r--', label='sigmoid fit')
      ax.set(xlabel=f'{column.split("/")[0]} task loss (nats/byte)', ylabel=column, title='accuracy against task loss')
      ax.legend(fontsize='small')

  return _save(figure, out)


def _save(figure: Any, out: str | Path) -> Path:
  """Writes `figure` as a PNG at `out` (making its folder) and closes it."""
  import matplotlib.pyplot as plt
  figure.tight_layout()
  out = Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(out, dpi=110)
  plt.close(figure)
  return out


def plot_suite(points: Points, out: str | Path, tasks: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
               loss_of: str = 'val_loss') -> Path:
  """Loss and each task's accuracy (`tasks` as `plot`'s) against tokens and against compute, a line per run (a
  model size), coloured from the smallest to the largest."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  rows = sorted(_runs(points), key=lambda r: points.params[r[0]])
  colours = plt.cm.viridis(np.linspace(0, 0.9, len(rows)))
  metrics = [(loss_label(loss_of), points.loss)] + [(column, accuracy) for column, (accuracy, _) in
                                                    (tasks or {}).items()]
  figure, axes = plt.subplots(len(metrics), 2, figsize=(11, 4.2 * len(metrics)), squeeze=False)
  for (name, values), row_axes in zip(metrics, axes):
    for ax, (x, xlabel) in zip(row_axes, ((points.tokens, 'tokens D'), (points.flops, 'compute C (FLOPs)'))):
      for run, colour in zip(rows, colours):
        ax.plot(x[run], values[run], '.-', color=colour, lw=1.2, ms=4, label=size_label(points.params[run[0]]))
      ax.set(xscale='log', xlabel=xlabel, ylabel=name, title=f'{name} against {xlabel.split()[0]}')
      ax.legend(fontsize='small', title='size')
  return _save(figure, out)


def _loss_panel(ax: Any, points: Points, fit: dict[str, Any] | None, loss_of: str) -> None:
  """Each run's loss against compute, the frontier, and the fitted law."""
  for rows in _runs(points):
    ax.plot(points.flops[rows], points.loss[rows], '-', color='tab:blue', alpha=0.35, lw=1)
  edge = laws.frontier(points)
  ax.plot(points.flops[edge], points.loss[edge], 'k.-', lw=1.5, label='frontier')
  span = np.logspace(np.log10(points.flops.min()), np.log10(points.flops.max()) + 0.5, 100)
  curve = _law_curve(fit, span) if fit else None
  if curve is not None:
    ax.plot(span, curve, 'r--', label=f'{fit["law"]} fit')
  ax.set(xscale='log', xlabel='compute C (FLOPs)', ylabel=loss_label(loss_of), title='loss against compute')
  ax.legend()


def _isoflop_panel(ax: Any, points: Points, iso: dict[str, Any], loss_of: str, colours: Any) -> None:
  """Each budget's points against N, its parabola and its minimum."""
  for budget, rows, colour in zip(iso['budgets'], laws.budget_groups(points.flops), colours):
    n = points.params[rows]
    ax.plot(n, points.loss[rows], 'o', color=colour, ms=4, label=f'C {budget["flops"]:.2g}')
    x = np.linspace(np.log(n.min()), np.log(n.max()), 100)
    ax.plot(np.exp(x), np.polyval(budget['parabola'], x), '-', color=colour)
    ax.plot(budget['params_opt'], budget['loss_opt'], '*', color=colour, ms=10)
  ax.set(xscale='log', xlabel='parameters N', ylabel=loss_label(loss_of), title='IsoFLOP profiles')
  ax.legend(fontsize='small')


def _allocation_panel(ax: Any, points: Points, fit: dict[str, Any] | None, iso: dict[str, Any] | None) -> None:
  """Compute-optimal N and D against compute: the IsoFLOP minima and power laws, approach 3's curves and each
  --budget with its bootstrap interval."""
  budgets = [o['flops'] for o in fit.get('optimal', [])] if fit else []
  c = np.logspace(np.log10(points.flops.min()), max(np.log10(points.flops.max()) + 2, *np.log10(budgets or [1])), 50)
  if iso is not None:
    vertices = np.array([b['flops'] for b in iso['budgets']])
    ax.plot(vertices, [b['params_opt'] for b in iso['budgets']], 'o', color='tab:blue', label='IsoFLOP N_opt')
    ax.plot(vertices, [b['tokens_opt'] for b in iso['budgets']], 's', color='tab:orange', label='IsoFLOP D_opt')
    ax.plot(c, iso['params']['k_N'] * c ** iso['a'], ':', color='tab:blue', label=f'N ~ C^{iso["a"]:.2f}')
    ax.plot(c, iso['params']['k_D'] * c ** iso['b'], ':', color='tab:orange', label=f'D ~ C^{iso["b"]:.2f}')
  if fit is not None and fit['law'] == 'chinchilla':
    best = [laws.compute_optimal(fit['params'], x) for x in c]
    ax.plot(c, [o['params'] for o in best], '-', color='tab:blue', label=f'N_opt (approach 3, a={fit["a"]:.2f})')
    ax.plot(c, [o['tokens'] for o in best], '-', color='tab:orange', label=f'D_opt (b={fit["b"]:.2f})')
    for opt in fit.get('optimal', []):
      for key, colour in (('params', 'tab:blue'), ('tokens', 'tab:orange')):
        lo, hi = fit.get('ci', {}).get(f'{key}_opt@{opt["flops"]:g}', (opt[key], opt[key]))
        ax.errorbar(opt['flops'], opt[key], yerr=[[opt[key] - lo], [hi - opt[key]]], fmt='o', color=colour,
                    capsize=3)
  ax.set(xscale='log', yscale='log', xlabel='compute C (FLOPs)', ylabel='N, D', title='compute-optimal allocation')
  ax.legend(fontsize='small')


def final_losses_by_width(path: str | Path) -> dict[int, dict[float, float]]:
  """width -> {learning rate: the run's last loss} of a points CSV (a sweep with --lr-grid, collected)."""
  with Path(path).open(newline='') as f:
    rows = list(csv.DictReader(f))
  if not rows or not {'width', 'learning_rate', 'run', 'step', 'loss'} <= rows[0].keys():
    raise ConfigError(f'{path} has no width and learning_rate columns; collect it again with lm scaling collect')
  last: dict[str, dict[str, str]] = {}
  for row in rows:
    if row['run'] not in last or int(row['step']) > int(last[row['run']]['step']):
      last[row['run']] = row
  out: dict[int, dict[float, float]] = {}
  for row in last.values():
    out.setdefault(int(row['width']), {})[float(row['learning_rate'])] = float(row['loss'])
  if all(len(rates) < 2 for rates in out.values()):
    raise ConfigError(f'{path} holds one learning rate per width; sweep with --lr-grid (e.g. --lr-grid '
                      f'3e-4,1e-3,3e-3,1e-2) and collect that')
  return dict(sorted(out.items()))


def best_learning_rates(losses: dict[int, dict[float, float]]) -> dict[int, float]:
  """width -> the learning rate of its lowest finite final loss."""
  return {width: min((loss, lr) for lr, loss in rates.items() if np.isfinite(loss))[1]
          for width, rates in losses.items() if any(np.isfinite(v) for v in rates.values())}


def plot_learning_rates(path: str | Path, out: str | Path) -> dict[int, float]:
  """Final loss against peak learning rate, a curve per width with its best rate starred (Tensor Programs V's
  Figure 1); returns width -> best learning rate."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  losses = final_losses_by_width(path)
  best = best_learning_rates(losses)
  figure, ax = plt.subplots(figsize=(6, 4.5))
  colours = plt.cm.viridis(np.linspace(0, 0.9, len(losses)))
  for (width, rates), colour in zip(losses.items(), colours):
    lrs = sorted(rates)
    ax.plot(lrs, [rates[lr] for lr in lrs], 'o-', color=colour, ms=4, label=f'width {width}')
    if width in best:
      ax.plot(best[width], rates[best[width]], '*', color=colour, ms=12)
  ax.set(xscale='log', xlabel='peak learning rate', ylabel=loss_label(loss_of(path)),
         title='loss against learning rate, by width')
  ax.legend(fontsize='small')
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  plt.close(figure)
  return best


def plot_curves(fit: dict[str, Any], runs: list[str], out: str | Path) -> Path:
  """Each run's measured loss (the fit's metric) against step (points) with the curve fit's prediction under its
  schedule (a line), and the learning rate below; returns the PNG's path."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  from lm.jobs.scaling.curves import curve_steps, metric_name, predict, run_curve, updates_before
  metric = fit.get('metric', 'loss')
  label = metric_name(metric)
  shift = int(updates_before(metric, np.array([1]))[0]) - 1  # a step's updates, less the step
  figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
  colours = plt.cm.viridis(np.linspace(0, 0.9, len(runs)))
  for run, colour in zip(runs, colours):
    curve, _ = run_curve(run, metric)
    steps = curve_steps(curve.rates, len(curve.rates))
    name = Path(run).name
    top.plot(curve.updates - shift, curve.loss, '.', color=colour, ms=3, alpha=0.6, label=f'{name} measured')
    top.plot(steps, predict(fit['form'], fit['params'], curve.rates, steps + shift), '-', color=colour, lw=1.3,
             label=f'{name} {fit["form"]}')
    bottom.plot(np.arange(1, len(curve.rates) + 1), curve.rates, '-', color=colour, lw=1.2)
  top.set(ylabel=label, title=f'{label} and the {fit["form"]} curve fit')
  top.legend(fontsize='small')
  bottom.set(xlabel='step', ylabel='learning rate')
  return _save(figure, out)
