"""Whether `lm scaling predict --search` picks a decay that trains no worse: on one size of a `--schedule wsd` ladder,
a curve fit on its stable run and smallest cooldown (or the cooldowns `--cooldowns` names) predicts the largest
budget's final training loss under each decay (fraction x shape); the best is trained for real and compared with the
ladder's own run of that budget (the default decay), by the final held-out loss and the mean training loss of the
last logged steps. `--metric val_loss` fits the held-out loss at the runs' evaluations instead of the training loss.

  python bench/decay_search.py --ladder runs/ladder_wsd --size d64_l2 [--form mpl] [--metric loss|val_loss]
      [--cooldowns 0,1] [--fit-paired] [--seeds 3] [--search decay_fraction=0.1,0.2,0.3,0.5 decay_shape=linear,sqrt,cosine]
      [--out docs/results/decay-search.md] [--json docs/results/decay_search.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from lm.config import from_dict, merge, parse_overrides
from lm.jobs.scaling.curves import fit_runs, metric_name, predict, schedule_rates, search_grid, updates_before
from lm.report import write_json
from lm.train.logging import read_metrics

LAST = 5  # logged training losses averaged at the end


def measured(run_dir: Path) -> dict[str, float]:
  records = read_metrics(run_dir)
  losses = [r['loss'] for r in records if 'loss' in r]
  return {'loss_last': float(np.mean(losses[-LAST:])), 'val_loss': [r['val_loss'] for r in records
                                                                     if 'val_loss' in r][-1]}


def _trained(run: Path, config_of, overrides: list[str], seed: int) -> float:
  """The final held-out loss of `overrides` trained from `seed` (trained unless `run` exists)."""
  if not run.exists():
    from lm.jobs.pretraining import Pretraining
    Pretraining(config_of([*overrides, f'train.seed={seed}', f'train.run_dir={run}', 'train.resume=false'])).run()
  return measured(run)['val_loss']


def _seed_lines(seeds: list[dict]) -> list[str]:
  """Each seed's held-out losses and their difference; the mean difference beside the default's spread."""
  if len(seeds) < 2:
    return []
  diff = np.array([p['best'] - p['default'] for p in seeds]) / np.array([p['default'] for p in seeds])
  spread = np.std([p['default'] for p in seeds], ddof=1) / np.mean([p['default'] for p in seeds])
  lines = ['| train.seed | default: held-out | best: held-out | difference |', '|---|---|---|---|']
  lines += [f'| {p["seed"]} | {p["default"]:.4f} | {p["best"]:.4f} | {d:+.2%} |' for p, d in zip(seeds, diff)]
  error = diff.std(ddof=1) / np.sqrt(len(diff))
  return lines + ['', f'Mean difference {diff.mean():+.2%} (standard error {error:.2%}); the default\'s held-out loss '
                      f'varies by {spread:.2%} (one s.d.) from seed to seed.', '']


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--ladder', required=True, help='a lm scaling sweep --schedule wsd directory')
  parser.add_argument('--size', required=True, help='its size label, e.g. d64_l2')
  parser.add_argument('--form', choices=('mpl', 'tissue'), default='mpl')
  parser.add_argument('--metric', default='loss', help='the loss the curve follows: loss (training) or val_loss')
  parser.add_argument('--cooldowns', default='0', help='which budgets\' cooldowns to fit on (comma-separated), '
                                                       'from the smallest (0) up; the largest budget is predicted')
  parser.add_argument('--search', nargs='+', default=['decay_fraction=0.1,0.2,0.3,0.5',
                                                      'decay_shape=linear,sqrt,cosine'])
  parser.add_argument('--seeds', type=int, default=1, help='train the default and the best decay from this many '
                                                           'seeds (train.seed 0 is the ladder\'s), paired by seed')
  parser.add_argument('--fit-paired', action='store_true',
                      help='fit each cooldown on its ratio to the stable run\'s loss (lm scaling fit --paired)')
  parser.add_argument('--out', default='docs/results/decay-search.md')
  parser.add_argument('--json', default='docs/results/decay_search.json')
  args = parser.parse_args()
  ladder = Path(args.ladder)
  sweep = json.loads((ladder / 'sweep.json').read_text())
  points = sorted((p for p in sweep['points'] if p['label'].startswith(args.size + '_')), key=lambda p: p['tokens'])
  fitted_on = [str(ladder / f'{args.size}_stable'), *(str(ladder / points[int(i)]['label'])
                                                       for i in args.cooldowns.split(','))]
  fit = fit_runs(fitted_on, args.form, args.metric, paired=fitted_on[0] if args.fit_paired else None)
  target = points[-1]
  config_of = lambda extra: from_dict(merge(sweep['base'], parse_overrides([*target['overrides'], *extra])))
  rows = []
  for combo in [[]] + search_grid(args.search):
    rates = schedule_rates(config_of(combo))
    rows.append({'decay': ' '.join(combo) or 'as the ladder ran it', 'overrides': combo,
                 'predicted': float(predict(fit['form'], fit['params'], rates,
                                            updates_before(args.metric, np.array([len(rates)])))[-1])})
  best = min(rows[1:], key=lambda row: row['predicted'])
  default = measured(ladder / target['label'])
  trained = ladder / (target['label'] + ''.join(f'_{o.split("=")[1]}' for o in best['overrides']))  # per decay
  what = metric_name(args.metric)
  if not trained.exists():
    from lm.jobs.pretraining import Pretraining
    Pretraining(config_of([*best['overrides'], f'train.run_dir={trained}', 'train.resume=false'])).run()
  chosen = measured(trained)
  seeds = [{'seed': 0, 'default': default['val_loss'], 'best': chosen['val_loss']}]
  seeds += [{'seed': seed, 'default': _trained(ladder / f'{target["label"]}_seed{seed}', config_of, [], seed),
             'best': _trained(ladder / f'{trained.name}_seed{seed}', config_of, best['overrides'], seed)}
            for seed in range(1, args.seeds)]  # both decays again from other inits and data orders
  result = {'command': sys.argv, 'fitted_on': fitted_on, 'target': target['label'], 'form': args.form,
            'metric': args.metric,
            'predictions': rows, 'best': best['decay'], 'default_measured': default, 'best_measured': chosen,
            'seeds': seeds, 'no_worse': bool(np.mean([p['best'] - p['default'] for p in seeds]) <= 0)}
  write_json(args.json, result)
  lines = [f'# A decay chosen by `lm scaling predict --search`, trained for real', '',
           f'Measured on this 2-core CPU VM on {datetime.date.today()}, on the CPU ladder of [scaling-ladder.md]'
           f'(scaling-ladder.md) (`lm scaling sweep --schedule wsd --out runs/ladder_wsd`, `--evals 20` for a '
           f'held-out fit). The {args.form} curve law '
           f'fitted to the {what} of {", ".join(Path(r).name for r in fitted_on)} (the stable run and cooldowns'
           + (', each cooldown on its ratio to the stable run: `fit --paired`' if args.fit_paired else '') + ') '
           f'predicts '
           f'{target["label"]} ({target["steps"]} steps) under each decay; the best is trained for real beside the '
           f'ladder\'s own run of that budget (`optim.decay_fraction=0.2`, linear).', '',
           f'| decay | predicted final {what} |', '|---|---|']
  lines += [f'| {r["decay"]} | {r["predicted"]:.4f}{"  (best)" if r is best else ""} |' for r in rows]
  lines += ['', '| run | held-out loss | training loss, last 5 steps |', '|---|---|---|',
            f'| the ladder\'s (default decay) | {default["val_loss"]:.4f} | {default["loss_last"]:.4f} |',
            f'| {best["decay"]} | {chosen["val_loss"]:.4f} | {chosen["loss_last"]:.4f} |', '',
            *_seed_lines(seeds),
            f'The chosen decay is {"no worse than" if result["no_worse"] else "worse than"} the default on the '
            f'held-out loss' + (f', on average over {len(seeds)} seeds.' if len(seeds) > 1 else '.'), '',
            'Reproduce: `' + ' '.join(['python', *sys.argv]).replace(args.ladder, 'runs/ladder_wsd') + '`', '']
  Path(args.out).write_text('\n'.join(lines))
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
