"""Whole-curve predictions on lm's own ladder: on each size of a `lm scaling sweep --schedule wsd` ladder, a curve fit
(`lm scaling fit --law curve`) on the size's stable run and its smallest cooldown predicts every other cooldown's
final loss, for each form and each metric, alone and paired with the stable run's measured loss: the training loss
(the mean of the last 5 logged steps against the prediction's mean there) and the held-out loss at the final
evaluation. Beside them, the training loss's noise: the spread of 5-step means around the stable run's own fit. To a
Markdown table and JSON.

With --fit-paired, the cooldowns are fitted on their ratio to the stable run's loss (`fit --paired`).

  python bench/ladder_curves.py --ladder runs/ladder_wsd [--cooldowns 0] [--fit-paired] [--forms mpl,tissue]
      [--metrics loss,val_loss]
      [--out docs/results/ladder-curves.md] [--json docs/results/ladder_curves.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from lm.config import ConfigError
from lm.jobs.scaling.curves import Curve, fit_curves, fit_runs, paired, predict, run_curve
from lm.report import write_json

LAST = 5  # training losses averaged at the end


def final_error(form: str, params: dict, run: str, metric: str, stable: Curve) -> dict[str, float]:
  """The run's final `metric` (its last LAST training losses' mean, or its last evaluation) against the fit's, and
  against the fit's paired with the stable run (`lm scaling predict --paired`: its measured loss on the same batches
  times the law's ratio)."""
  curve, _ = run_curve(run, metric)
  count = LAST if metric == 'loss' else 1
  measured = float(curve.loss[-count:].mean())
  predicted = float(predict(form, params, curve.rates, curve.updates)[-count:].mean())
  row = {'measured': measured, 'predicted': predicted, 'error': (predicted - measured) / measured}
  try:  # the stable run measured the cooldown's steps: all its training losses, its evaluations at some
    matched = float(paired(form, params, curve.rates, curve.updates[-count:], stable).mean())
  except ConfigError:
    return row
  return {**row, 'paired': matched, 'paired_error': (matched - measured) / measured}


def noise(run: str) -> float:
  """The spread (std) of LAST-step means of the training loss around the run's own fit, past its first 100 steps."""
  curve, _ = run_curve(run)
  fit = fit_curves([curve], 'tissue')
  residual = np.log(curve.loss) - np.log(predict('tissue', fit['params'], curve.rates, curve.updates))
  return float(np.convolve(residual[100:], np.ones(LAST) / LAST, 'valid').std())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--ladder', required=True, help='a lm scaling sweep --schedule wsd directory')
  parser.add_argument('--forms', default='mpl,tissue')
  parser.add_argument('--metrics', default='loss,val_loss')
  parser.add_argument('--cooldowns', default='0', help='the budgets whose cooldowns are fitted (comma-separated), '
                                                       'from the smallest (0) up; the others are predicted')
  parser.add_argument('--fit-paired', action='store_true',
                      help='fit each cooldown on its ratio to the stable run\'s loss (lm scaling fit --paired)')
  parser.add_argument('--out', default='docs/results/ladder-curves.md')
  parser.add_argument('--json', default='docs/results/ladder_curves.json')
  args = parser.parse_args()
  ladder = Path(args.ladder)
  sweep = json.loads((ladder / 'sweep.json').read_text())
  sizes = sorted({p['label'].rsplit('_t', 1)[0] for p in sweep['points']}, key=lambda s: int(s[1:].split('_')[0]))
  rows = []
  for size in sizes:
    points = sorted((p for p in sweep['points'] if p['label'].startswith(size + '_t')), key=lambda p: p['tokens'])
    fitting = [int(i) for i in args.cooldowns.split(',')]
    fitted_on = [str(ladder / f'{size}_stable'), *(str(ladder / points[i]['label']) for i in fitting)]
    for metric in args.metrics.split(','):
      for form in args.forms.split(','):
        fit = fit_runs(fitted_on, form, metric, paired=fitted_on[0] if args.fit_paired else None)
        stable, _ = run_curve(fitted_on[0], metric)
        for point in (p for i, p in enumerate(points) if i not in fitting):
          rows.append({'size': size, 'metric': metric, 'form': form, 'run': point['label'], 'steps': point['steps'],
                       **final_error(form, fit['params'], str(ladder / point['label']), metric, stable)})
        print(rows[-1], flush=True)
  spread = {size: noise(str(ladder / f'{size}_stable')) for size in sizes}
  worst = {(m, f): max(abs(r['error']) for r in rows if r['metric'] == m and r['form'] == f)
           for m in args.metrics.split(',') for f in args.forms.split(',')}
  paired_worst = {(m, f): max(abs(r['paired_error']) for r in rows if r['metric'] == m and r['form'] == f
                              and 'paired' in r)
                  for m, f in worst if any('paired' in r for r in rows if r['metric'] == m and r['form'] == f)}
  write_json(args.json, {'command': sys.argv, 'rows': rows, 'noise': spread,
                         'worst': {f'{m} {f}': v for (m, f), v in worst.items()},
                         'paired_worst': {f'{m} {f}': v for (m, f), v in paired_worst.items()}})
  first = sorted((p for p in sweep['points'] if p['label'].startswith(sizes[0] + '_t')), key=lambda p: p['tokens'])
  decay = lambda p: f'a {p["steps"] - p["branch_at"]}-step decay at step {p["branch_at"]}'
  fitted = [first[int(i)] for i in args.cooldowns.split(',')]
  fitted_text = ('smallest cooldown' if args.cooldowns == '0' else f'cooldowns of budgets {args.cooldowns} (0 the '
                 f'smallest)') + f' ({", ".join(decay(p) for p in fitted)})'
  budgets = ','.join(f'{float(p["label"].rsplit("_t", 1)[1]):.0e}'.replace('e+0', 'e') for p in first)
  lines = ['# Whole-curve predictions on the CPU ladder', '',
           f'Measured on this 2-core CPU VM on {datetime.date.today()}, on the CPU ladder of [scaling-ladder.md]'
           f'(scaling-ladder.md) run with `lm scaling sweep --schedule wsd --evals 20 --tokens {budgets} --out '
           f'{args.ladder}` (20 '
           f'held-out evaluations a run). For each size, the curve law fitted on its stable run and its '
           f'{fitted_text}' + (' (each on its ratio to the stable run\'s loss at the same steps, `lm scaling fit '
                                '--paired`)' if args.fit_paired else '') + ' predicts the other cooldowns\' final '
           f'loss: the training loss as '
           f'the mean of the last {LAST} steps (against the prediction\'s mean there), and the held-out `val_loss` at '
           f'the last evaluation (a fit on the held-out loss). Error = (predicted - measured) / measured. Paired: '
           f'the stable run\'s own loss on the same batches (it trains to the largest budget\'s last step) times the '
           f'law\'s ratio of the cooldown\'s schedule to the stable one (`lm scaling predict --paired`), so what the '
           f'batches add cancels; - where the stable run did not evaluate at the cooldown\'s last step.', '',
           '| size | run | steps | metric | form | measured | predicted | error | paired | error |',
           '|---|---|---|---|---|---|---|---|---|---|']
  lines += [f'| {r["size"]} | {r["run"]} | {r["steps"]} | {r["metric"]} | {r["form"]} | {r["measured"]:.4f} | '
            f'{r["predicted"]:.4f} | {r["error"]:+.2%} | '
            + (f'{r["paired"]:.4f} | {r["paired_error"]:+.2%} |' if 'paired' in r else '- | - |') for r in rows]
  lines += ['', '| metric | form | largest error | paired: largest error |', '|---|---|---|---|']
  lines += [f'| {m} | {f} | {v:.2%} | ' + (f'{paired_worst[m, f]:.2%} |' if (m, f) in paired_worst else '- |')
            for (m, f), v in worst.items()]
  lines += ['', f'The training loss\'s own noise: {LAST}-step means scatter around each stable run\'s fit by '
            + ', '.join(f'{s} {v:.1%}' for s, v in spread.items()) + ' (one standard deviation): a batch of 2,048 '
            'byte tokens of this corpus (prose and code) varies more than the 2% asked of a prediction, so the '
            'training loss cannot show it; the held-out loss reads the same rows at every evaluation.' + (
              f' What the held-out fit misses is the fitting set\'s: its one decay is {decay(first[0])}, and the '
              f'largest budget\'s {decay(first[-1])}, so the decay\'s gain is extrapolated '
              f'{(first[-1]["steps"] - first[-1]["branch_at"]) / (first[0]["steps"] - first[0]["branch_at"]):.0f}-fold '
              f'in both.' if args.cooldowns == '0' else ''), '',
            'Reproduce: `' + ' '.join(['python', *sys.argv]) + '`', '']
  Path(args.out).write_text('\n'.join(lines))
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
