"""Console lines for a fitted law (`lm scaling fit` without --json)."""
from __future__ import annotations

from typing import Any

from lm.report import format_lines


def _interval(fit: dict[str, Any], key: str) -> str:
  ci = fit.get('ci', {}).get(key)
  return f'  [{ci[0]:.4g}, {ci[1]:.4g}]' if ci else ''


def format_fit(fit: dict[str, Any]) -> str:
  """The law's parameters (with 95% bootstrap intervals when fitted), exponents and compute-optimal sizes."""
  task = f' ({fit["task"]}, {fit["metric"]})' if 'task' in fit else ''
  lines = [('law', f'{fit["law"]}{task} on {fit["points"]} points')]
  lines += [(name, f'{value:.6g}{_interval(fit, name)}') for name, value in fit['params'].items()]
  for key in ('a', 'b'):
    if key in fit:
      lines.append((key, f'{fit[key]:.4f}{_interval(fit, key)}  (' +
                    ('N_opt' if key == 'a' else 'D_opt') + f' grows as C^{key})'))
  for budget in fit.get('budgets', []):
    lines.append((f'C {budget["flops"]:.3g}', f'N_opt {budget["params_opt"]:.4g}'
                                              f'{_interval(fit, "params_opt@" + format(budget["flops"], ".3g"))}, '
                                              f'D_opt {budget["tokens_opt"]:.4g}, '
                                              f'loss {budget["loss_opt"]:.4f} ({budget["points"]} runs)'))
  for point in fit.get('frontier', []):
    lines.append(('frontier', f'C {point["flops"]:.4g}  loss {point["loss"]:.4f}  {point["run"]}'))
  for opt in fit.get('optimal', []):
    lines.append((f'optimal at C {opt["flops"]:.3g}',
                  f'N {opt["params"]:.4g}, D {opt["tokens"]:.4g}, {opt["tokens_per_param"]:.1f} tokens/param'
                  + (f', loss {opt["loss"]:.4f}' if 'loss' in opt else '')))
  if 'holdout' in fit:
    h = fit['holdout']
    lines.append((f'held out N {h["params"]:.4g}', f'{len(h["runs"])} runs, loss predicted without them: mean error '
                                                 f'{h["mean_error"]:.2%}, largest {h["max_error"]:.2%}'))
  for a in fit.get('allocations', []):
    lines.append((f'C {a["flops"]:.3g}, U {a["unique_tokens"]:.3g}',
                  f'N {a["params"]:.4g}, D {a["tokens"]:.4g} ({a["epochs"]:.2f} epochs'
                  + (f', 95% {a["epochs_ci"][0]:.2f}-{a["epochs_ci"][1]:.2f}' if 'epochs_ci' in a else '')
                  + f'), loss {a["loss"]:.4f}'))
  for p in fit.get('predictions', []):
    at = f'{p["params"]:g},{p["tokens"]:g}'
    lines.append((f'N {p["params"]:.3g}, D {p["tokens"]:.3g}',
                  (f'task loss {p["task_loss"]:.4f}{_interval(fit, f"task_loss@{at}")}, '
                   f'accuracy {p["accuracy"]:.4f}{_interval(fit, f"accuracy@{at}")}')))
  return format_lines(lines)


def format_curve_fit(fit: dict[str, Any]) -> str:
  """A curve fit's parameters and each run's mean relative error and final loss against the fit's."""
  metric = fit.get('metric', 'loss')
  lines = [('law', f'curve ({fit["form"]}) on {len(fit["curves"])} runs'
                   + ('' if metric == 'loss' else f', their {metric}'))]
  ci = fit.get('params_ci', {})
  lines += [(name, f'{value:.6g}' + (f' [{ci[name][0]:.4g}, {ci[name][1]:.4g}]' if name in ci else ''))
            for name, value in fit['params'].items()]
  if ci:
    lines.append(('bootstrap', f'{len(fit["samples"])} refits on resampled residuals (95% intervals)'))
  for run, e in fit['curves'].items():
    lines.append((run, f'mean error {e["mean"]:.2%}, final loss {e["final_loss"]:.4f} (fit {e["final_predicted"]:.4f})'))
  for h in fit.get('holdout', []):
    lines.append((f'held out {h["run"]}', f'final loss {h["measured"]:.4f}, predicted by the others\' fit '
                                          f'{h["predicted"]:.4f} ({h["error"]:+.2%})'))
  return format_lines(lines)


def format_hparams(fit: dict[str, Any]) -> str:
  """The learning-rate and batch laws, and each target's optimum beside the published rule's."""
  lines = [('law', f'hparams by {fit["by"]}: {fit["near_optimal"]} near-optimal of {fit["points"]} runs '
                   f'(within {fit["band"]:.2%} of each of {fit["budgets"]} budgets\' best)')]
  lines += [(name, f'{value:.6g}') for name, value in fit['params'].items()]
  for t in fit['targets']:
    ci = lambda key: (f' [{t[key + "_ci"][0]:.3g}, {t[key + "_ci"][1]:.3g}]' if key + '_ci' in t else '')
    rules = [(name, t[key]) for key, name in (('deepseek', 'DeepSeek LLM'), ('step_law', 'Step Law'),
                                              ('porian', 'Porian et al.')) if key in t]
    lines.append((' '.join(f'{x:g}' for x in t['target']),
                  f'learning rate {t["learning_rate"]:.4g}{ci("learning_rate")}, batch {t["batch_tokens"]:.4g} '
                  f'tokens{ci("batch_tokens")} (' + '; '.join(f'{name}: {lr:.4g}, {batch:.4g} tokens'
                                                             for name, (lr, batch) in rules) + ')'))
  return format_lines(lines)
