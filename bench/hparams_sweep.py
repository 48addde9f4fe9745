"""The learning rate and batch for a budget, measured on CPU: a gpt_tiny sweep of token budgets x peak learning rates
x batches (`lm scaling sweep --lr-grid --batch-grid`), collected and fitted by compute (`lm scaling fit --law hparams
--by compute`): each budget's optimum and the fitted exponents with bootstrap intervals, to a Markdown table and JSON.
With `--pairs`, each budget trains its own size (a model that grows with compute, as the published ladders' do)
instead of every budget one size. Rerunning skips the finished runs.

  python bench/hparams_sweep.py [--runs runs/hparams_sweep] [--sizes 64x2] [--tokens 1e5,3e5,1e6]
      [--pairs 32x2:1e5,64x2:3e5,128x2:1e6]
      [--lr-grid 5e-4,1e-3,2e-3,4e-3] [--batch-grid 1,2,4] [--bootstrap 200]
      [--out docs/results/hparams-sweep.md] [--json docs/results/hparams_sweep.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from lm import cli
from lm.jobs.scaling.hparams import deepseek, fit_points_file
from lm.report import write_json


def grids(points: str) -> list[str]:
  """Each budget's final held-out losses as a table of learning rate (rows) by batch (columns)."""
  from lm.jobs.scaling.points import read_column, read_points
  read = read_points(points)
  rows = read.final_rows()
  final = read.take(rows)
  tokens, loss = final.tokens, final.loss
  rate, batch = (read_column(points, c)[rows] for c in ('learning_rate', 'batch_tokens'))
  lines = []
  for budget in sorted(set(np.round(tokens, -4))):
    here = np.round(tokens, -4) == budget
    batches, rates = sorted(set(batch[here])), sorted(set(rate[here]))
    lines += [f'{budget:,.0f} tokens: final held-out loss', '',
              '| learning rate \\ batch (tokens) | ' + ' | '.join(f'{b:,.0f}' for b in batches) + ' |',
              '|---|' + '---|' * len(batches)]
    for r in rates:
      cells = [loss[here & (rate == r) & (batch == b)] for b in batches]
      lines.append(f'| {r:g} | ' + ' | '.join(f'{c[0]:.4f}' if len(c) else '' for c in cells) + ' |')
    lines.append('')
  return lines


def table(fit: dict, args: argparse.Namespace) -> str:
  """Each budget's optimum, then the laws with their intervals and what they say."""
  p, ci = fit['params'], fit.get('params_ci', {})
  interval = lambda key: f' [{ci[key][0]:.3f}, {ci[key][1]:.3f}]' if key in ci else ''
  def trend(key: str, sign: int, verb: str) -> str:
    """`verb` where the whole interval lies on that side of zero; in the estimate only where it does not."""
    if sign * p[key] <= 0:
      return f'does not {verb}'
    if key not in ci or all(sign * v > 0 for v in ci[key]):
      return f'{verb}s'
    return f'{verb}s in the estimate, but its interval includes no trend'

  lines = [
    '# The learning rate and batch for a budget, on CPU', '',
    (f'gpt_tiny, each budget at its own size ({args.pairs.replace(":", " at ")} tokens)' if args.pairs else
     f'gpt_tiny at sizes {args.sizes}, token budgets {args.tokens}') + f', peak learning rates {args.lr_grid}, batches '
    f'{args.batch_grid} sequences ({fit["points"]} runs): each budget\'s optimum is the vertex of a paraboloid of log '
    f'loss over its grid; the laws are least squares in logs over the budgets, 95% intervals from '
    f'{args.bootstrap} bootstrap resamples of each budget\'s runs.', '',
    '| budget C (FLOPs) | tokens | optimal learning rate | optimal batch (tokens) | DeepSeek LLM\'s rule |',
    '|---|---|---|---|---|']
  for o in fit['optima']:
    lr, batch = deepseek(o['flops'])
    lines.append(f'| {o["flops"]:.3g} | {o["tokens"]:,.0f} | {o["learning_rate"]:.4g} | {o["batch_tokens"]:,.0f} | '
                 f'{lr:.3g}, {batch:,.0f} |')
  lines += ['', f'- eta_opt = {p["lr_coef"]:.4g} C^{p["lr_C"]:.3f}{interval("lr_C")}: the optimal learning rate '
                f'{trend("lr_C", -1, "fall")} with compute.',
            f'- B_opt = {p["batch_coef"]:.4g} C^{p["batch_C"]:.3f}{interval("batch_C")} tokens: the optimal batch '
            f'{trend("batch_C", 1, "rise")} with compute.', '',
            *grids(f'{args.runs}/points.csv'),
            'Reproduce: `' + ' '.join(['python', *sys.argv]).replace(args.runs, 'runs/hparams_sweep') + '`', '']
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--runs', default='runs/hparams_sweep', help='the sweep\'s directory')
  parser.add_argument('--sizes', default='64x2')
  parser.add_argument('--tokens', default='1e5,3e5,1e6')
  parser.add_argument('--lr-grid', default='5e-4,1e-3,2e-3,4e-3')
  parser.add_argument('--batch-grid', default='1,2,4')
  parser.add_argument('--pairs', default='', help='SIZE:TOKENS,...: each budget at its own size (replaces --sizes and '
                                                  '--tokens)')
  parser.add_argument('--bootstrap', type=int, default=200)
  parser.add_argument('--out', default='docs/results/hparams-sweep.md')
  parser.add_argument('--json', default='docs/results/hparams_sweep.json')
  args = parser.parse_args()
  pairs = [pair.split(':') for pair in args.pairs.split(',')] if args.pairs else [(args.sizes, args.tokens)]
  dirs = [f'{args.runs}/{size}_{tokens}' if args.pairs else args.runs for size, tokens in pairs]
  sweeps = [['scaling', 'sweep', '--config', 'gpt_tiny', '--out', out, '--sizes', size, '--tokens', tokens,
             '--lr-grid', args.lr_grid, '--batch-grid', args.batch_grid] for out, (size, tokens) in zip(dirs, pairs)]
  points = f'{args.runs}/points.csv'
  for argv in (*sweeps, ['scaling', 'collect', *dirs, '--out', points]):
    if cli.main(argv):
      raise SystemExit(f'lm {" ".join(argv)} failed')
  fit = fit_points_file(points, by='compute', bootstrap=args.bootstrap)  # each run's final loss
  Path(args.out).write_text(table(fit, args))
  write_json(args.json, {'command': sys.argv, 'fit': fit})
  print(Path(args.out).read_text(), end='')


if __name__ == '__main__':
  main()
