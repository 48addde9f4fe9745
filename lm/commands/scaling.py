"""`lm scaling sweep | coord-check | collect | fit | predict | plot | cbs` (`lm.jobs.scaling`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lm.commands.common import checked_config
from lm.config import ConfigError
from lm.jobs.scaling.points import PARAM_COLUMNS


def cmd_scaling_sweep(args: argparse.Namespace) -> int:
  from lm.report import format_lines
  from lm.jobs.scaling.sweep import (DEFAULT_SIZES, DEFAULT_TOKENS, parse_experts, parse_numbers, parse_sizes, plan,
                                     size_of, sweep, tokens_trained)
  base = checked_config(args)
  sizes = parse_sizes(args.sizes) if args.sizes else DEFAULT_SIZES
  budgets = parse_numbers(args.budgets, '--budgets') if args.budgets else ()
  tokens = parse_numbers(args.tokens, '--tokens') if args.tokens else (() if budgets else DEFAULT_TOKENS)
  rates = parse_numbers(args.lr_grid, '--lr-grid') if args.lr_grid else ()
  batches = parse_numbers(args.batch_grid, '--batch-grid') if args.batch_grid else ()
  if any(b != int(b) for b in batches):
    raise ConfigError(f'--batch-grid {args.batch_grid}: batches are whole rows (train.global_batch), e.g. 8,16,32')
  experts = parse_experts(args.experts) if args.experts else ()
  points = plan(base, sizes, tokens, budgets, args.evals, args.schedule, rates, experts, [int(b) for b in batches])
  print(format_lines([(p.label, f'N {size_of(p)}  D {p.tokens:,}  C {6 * p.active * p.tokens:.3g}  {p.steps} steps'
                       + (f' (the decay from step {p.branch_at})' if p.branch_at else '')) for p in points]),
        flush=True)
  trained, alone = tokens_trained(points)
  print(f'tokens to train: {trained:,} ({trained / alone:.0%} of the {alone:,} of independent runs)', flush=True)
  if not args.dry_run:
    sweep(base, args.out, points, args.evals)
    print(f'{len(points)} runs in {args.out}; next: lm scaling collect {args.out} --out points.csv', flush=True)
  return 0


def cmd_scaling_coord_check(args: argparse.Namespace) -> int:
  from lm.report import format_lines
  from lm.jobs.scaling.coord_check import coord_check, write_coord_check
  from lm.jobs.scaling.sweep import parse_numbers
  widths = [int(w) for w in parse_numbers(args.widths, '--widths')]
  result = coord_check(checked_config(args), widths, args.parametrization, args.lr, args.steps, args.seeds)
  png, data = write_coord_check(result, args.out)
  print(f'{args.parametrization}: slope of log mean|x| against log width, by step 0..{args.steps}', flush=True)
  print(format_lines([(group, '  '.join(f'{s:+.2f}' for s in slopes)) for group, slopes in result['slopes'].items()]))
  print(f'wrote {png} and {data}', flush=True)
  return 0


def cmd_scaling_collect(args: argparse.Namespace) -> int:
  from lm.jobs.scaling.collect import collect
  from lm.jobs.scaling.points import write_points
  runs = [item for item in args.runs if '=' not in item]
  overrides = [item for item in args.runs if '=' in item] + (args.evaluate or [])
  if overrides and args.evaluate is None:
    raise ConfigError(f'{overrides[0]}: overrides only apply with --evaluate (e.g. another eval set); drop them '
                      f'or add --evaluate')
  if bad := [item for item in overrides if '=' not in item]:
    raise ConfigError(f'--evaluate {bad[0]}: takes key=value overrides (e.g. data.paths=[held_out/*.txt]); put run '
                      f'dirs before --evaluate')
  tasks = None
  if args.tasks is not None:
    from lm.jobs.evals.run import Request, check_installed
    check_installed()
    names = tuple(t for t in args.tasks.split(',') if t)
    if not names:
      raise ConfigError('--tasks is empty; name harness tasks, e.g. --tasks hellaswag,piqa')
    if args.tasks_data_dir is not None and not args.tasks_data_dir.is_dir():
      raise ConfigError(f'--tasks-data-dir {args.tasks_data_dir} is not a directory')
    if args.tasks_limit is not None and args.tasks_limit < 1:
      raise ConfigError(f'--tasks-limit {args.tasks_limit} must be at least 1')
    tasks = Request(tasks=names, data_dir=args.tasks_data_dir, subset=args.tasks_limit)
  rows = collect(runs, args.evaluate is not None, overrides, tasks, args.eval, args.metric)
  write_points(args.out, rows)
  print(f'{len(rows)} points from {len({r["run"] for r in rows})} runs written to {args.out}', flush=True)
  return 0


def _fitted_curve(args: argparse.Namespace) -> tuple[dict, Any]:
  from lm.jobs.scaling.curves import fit_runs
  from lm.jobs.scaling.report import format_curve_fit
  return (fit_runs(args.points, args.form, args.metric or 'loss', args.bootstrap, args.paired, args.holdout == 'each'),
          format_curve_fit)


def _fitted_hparams(args: argparse.Namespace) -> tuple[dict, Any]:
  from lm.jobs.scaling.hparams import fit_points_file
  from lm.jobs.scaling.report import format_hparams
  width = 1 if args.by == 'compute' else 2
  if not args.target or len(args.target) % width or any(not x > 0 for x in args.target):
    raise ConfigError('--law hparams --by compute takes compute budgets, --target C [C ...]; --by nd pairs of N D, '
                      '--target N D [N D ...]' if args.target else '--law hparams needs --target: a compute budget '
                      'C (--by compute) or N D (--by nd) to give the learning rate and batch for')
  targets = [args.target[i:i + width] for i in range(0, len(args.target), width)]
  return fit_points_file(args.points, args.params, args.by, targets, args.bootstrap), format_hparams


def _fitted_data_constrained(args: argparse.Namespace) -> tuple[dict, Any]:
  from lm.jobs.scaling.points import read_column, read_points
  from lm.jobs.scaling.report import format_fit
  from lm.jobs.scaling.repeated import allocation, base_law, fit_data_constrained
  if len(args.allocate) % 2 or any(not x > 0 for x in args.allocate):
    raise ConfigError('--allocate takes pairs of positive C U (FLOPs and unique tokens), e.g. --allocate 1e22 25e9')
  base = base_law(args.base) if args.base else None
  result = fit_data_constrained(read_points(args.points, args.params), read_column(args.points, 'unique_tokens'),
                                base, args.bootstrap)
  result['allocations'] = [allocation(result, c, u)
                           for c, u in zip(args.allocate[::2], args.allocate[1::2])]
  if args.holdout:
    from lm.jobs.scaling.repeated import holdout_largest
    result['holdout'] = holdout_largest(read_points(args.points, args.params), read_column(args.points,
                                                                                          'unique_tokens'))
  return result, format_fit


def _fitted_loss2loss(args: argparse.Namespace) -> tuple[dict, Any]:
  import numpy as np

  from lm.jobs.scaling.loss2loss import fit_loss2loss, predict
  from lm.jobs.scaling.points import read_column, read_points
  from lm.jobs.scaling.report import format_fit
  if not args.y:
    raise ConfigError('--law loss2loss maps one held-out loss to another: name the second with --y (e.g. --y '
                      'val/code/loss; collect writes every data.evals set\'s columns)')
  x, y = read_column(args.points, args.x), read_column(args.points, args.y)
  points = read_points(args.points, args.params, args.x)
  result = {**fit_loss2loss(x, y, points), 'x': args.x, 'y': args.y}
  if args.holdout:
    params = points.params
    rest, held = params < params.max(), params == params.max()
    fitted = fit_loss2loss(x[rest], y[rest], points.take(np.flatnonzero(rest)))['params']
    error = np.abs(predict(fitted, x[held]) - y[held]) / y[held]
    result['holdout'] = {'params': float(params.max()), 'runs': [f'row {i + 2}' for i in np.flatnonzero(held)],
                         'predicted': predict(fitted, x[held]).tolist(), 'measured': y[held].tolist(),
                         'mean_error': float(error.mean()), 'max_error': float(error.max())}
  return result, format_fit


def _fitted_endpoints(args: argparse.Namespace) -> tuple[dict, Any]:
  """Chinchilla, Kaplan, IsoFLOP and the task law: one loss per run."""
  from lm.jobs.scaling.laws import fit
  from lm.jobs.scaling.points import read_column, read_points
  from lm.jobs.scaling.report import format_fit
  if any(not c > 0 for c in args.budget):
    raise ConfigError('--budget takes positive compute budgets in FLOPs, e.g. --budget 1e21 5.76e23')
  if args.law != 'task':
    from lm.jobs.scaling.laws import holdout_largest
    points = read_points(args.points, args.params)
    result = fit(points, args.law, args.bootstrap, args.budget)
    if args.holdout:
      result['holdout'] = holdout_largest(points, args.law)
    return result, format_fit
  from lm.jobs.scaling.laws import fit_task
  if not args.task:
    raise ConfigError('--law task fits one task: name it with --task (e.g. --task piqa) and its metric with '
                      '--metric (default acc)')
  if len(args.target) % 2 or any(not x > 0 for x in args.target):
    raise ConfigError('--target takes pairs of positive N D (params and tokens), e.g. --target 7e9 1.4e11')
  targets = list(zip(args.target[::2], args.target[1::2]))
  metric = args.metric or 'acc'
  result = fit_task(read_points(args.points, args.params, f'{args.task}/task_loss'),
                    read_column(args.points, f'{args.task}/{metric}'), targets, args.bootstrap)
  result.update(task=args.task, metric=metric)
  return result, format_fit


def cmd_scaling_fit(args: argparse.Namespace) -> int:
  if args.bootstrap < 0:
    raise ConfigError(f'--bootstrap {args.bootstrap} must be >= 0 (0: no intervals)')
  if args.holdout == 'largest' and args.law not in ('chinchilla', 'kaplan', 'data_constrained', 'loss2loss'):
    raise ConfigError(f'--holdout largest applies to chinchilla, kaplan, data_constrained and loss2loss, not --law '
                      f'{args.law}' + ('; a curve fit holds out each run: --holdout each' if args.law == 'curve' else ''))
  if args.holdout == 'each' and args.law != 'curve':
    raise ConfigError(f'--holdout each applies to --law curve, not --law {args.law}; the points laws hold out the '
                      f'largest size: --holdout largest')
  if args.paired and args.law != 'curve':
    raise ConfigError(f'--paired applies to --law curve, not --law {args.law}')
  if args.base and args.law != 'data_constrained':
    raise ConfigError(f'--base applies to --law data_constrained, not --law {args.law}')
  if args.law != 'curve':
    if len(args.points) != 1:
      raise ConfigError(f'--law {args.law} fits one points CSV, not {len(args.points)} files; whole curves of run '
                        f'dirs are --law curve')
    args.points = args.points[0]
  fitted = {'curve': _fitted_curve, 'hparams': _fitted_hparams, 'data_constrained': _fitted_data_constrained,
            'loss2loss': _fitted_loss2loss}
  result, formatter = fitted.get(args.law, _fitted_endpoints)(args)
  print(json.dumps(result, indent=2) if args.json else formatter(result))
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=2) + '\n')
  return 0


def _predicted(fit: dict, args: argparse.Namespace) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
  """(name, steps, predicted loss there, each resample's final loss) for the config as configured and, with
  --search, each combination after it; with --paired, each paired with that run's measured loss."""
  import numpy as np

  from lm.config import load_config
  from lm.jobs.scaling.curves import (curve_steps, model_of, paired, paired_steps, predict, schedule_rates,
                                      search_grid, updates_before)
  rows, metric, base = [], fit.get('metric', 'loss'), None
  for combo in [[]] + (search_grid(args.search) if args.search else []):
    config = load_config(args.config, [*args.overrides, *combo])
    _same_model(fit, model_of(config), args.config)
    if args.paired and base is None:
      base = _pairing_run(args.paired, config, fit)
    rates = schedule_rates(config)
    steps = curve_steps(rates, args.points) if base is None else paired_steps(base, metric, len(rates), args.points)
    updates = updates_before(metric, steps)
    law = (lambda params, at: predict(fit['form'], params, rates, at)) if base is None else \
        (lambda params, at: paired(fit['form'], params, rates, at, base))
    sampled = np.array([law(sample, updates[-1:])[0] for sample in fit.get('samples', [])])
    rows.append((' '.join(combo) or 'as configured', steps, law(fit['params'], updates), sampled))
  return rows


def _same_model(fit: dict, model: dict, source: str) -> None:
  if 'model' in fit and model != fit['model']:
    field = next(k for k in sorted(set(model) | set(fit['model'])) if model.get(k) != fit['model'].get(k))
    raise ConfigError(f'{source}: model.{field} is {model.get(field)}, the fitted runs\' is '
                      f'{fit["model"].get(field)}; a curve fit predicts the size it was fitted on')


def _pairing_run(run: str, config: Any, fit: dict) -> Any:
  """--paired RUN's measured curve, once its model, data, seed and batch are the config's (the same batches)."""
  from lm.jobs.scaling.curves import other_batches, run_curve
  from lm.storage.run_dir import read_config
  base, model = run_curve(run, fit.get('metric', 'loss'))
  _same_model(fit, model, run)
  if (differs := other_batches(config, read_config(run))):
    raise ConfigError(f'--paired {run} read other batches: its {differs[0]} is {differs[2]}, the config\'s '
                      f'{differs[1]}; pair with a run of the same data, seed and batch (the size\'s stable run)')
  return base


def cmd_scaling_predict(args: argparse.Namespace) -> int:
  import numpy as np

  from lm.jobs.scaling.curves import metric_name, resolved_pick, search_pick
  from lm.report import format_lines
  try:
    fit = json.loads(Path(args.fit).read_text())
  except (OSError, ValueError):
    fit = None
  if not isinstance(fit, dict) or fit.get('law') != 'curve':
    raise ConfigError(f'--fit {args.fit} is not a curve fit; write one with lm scaling fit RUN... --law curve '
                      f'--out {args.fit}')
  if args.points < 2:
    raise ConfigError(f'--points {args.points} must be at least 2')
  rows = _predicted(fit, args)
  what = metric_name(fit.get('metric', 'loss'))
  interval = lambda sampled: f' [{np.percentile(sampled, 2.5):.4f}, {np.percentile(sampled, 97.5):.4f}]' \
    if len(sampled) else ''
  if len(rows) == 1:
    print(format_lines([(f'step {s}', f'{value:.4f}') for s, value in zip(rows[0][1], rows[0][2])]))
    print(f'predicted final {what} (step {rows[0][1][-1]}, {fit["form"]}'
          f'{f", paired with {args.paired}" if args.paired else ""}): {rows[0][2][-1]:.4f}'
          f'{interval(rows[0][3])}', flush=True)
    return 0
  samples = len(fit.get('samples', []))
  finals = np.array([loss[-1] for _, _, loss, _ in rows])
  pick, wins = search_pick(finals, np.stack([sampled for *_, sampled in rows], 1) if samples else None)
  unresolved = resolved_pick(finals, pick, fit.get('holdout_error')) != pick
  pick = 0 if unresolved else pick
  print(format_lines([(name, f'{loss[-1]:.4f}{interval(sampled)}' + ('  best' if i == pick else ''))
                      for i, (name, _, loss, sampled) in enumerate(rows)]))
  lowest = min(range(len(rows)), key=lambda i: rows[i][2][-1])
  if unresolved:
    print(f'best: as configured (the lowest, {rows[lowest][0]}, is predicted {1 - finals[lowest] / finals[0]:.2%} '
          f'lower, within the {fit["holdout_error"]:.2%} the fit missed a run it left out by)', flush=True)
    return 0
  if pick == 0 and wins is not None:
    print(f'best: as configured (the lowest, {rows[lowest][0]}, beats it in {wins:.0%} of the fit\'s {samples} '
          f'resamples, short of 95%)', flush=True)
    return 0
  print(f'best: {rows[pick][0]} (predicted final {what} {rows[pick][2][-1]:.4f}'
        + (f'; beats the configured schedule in {wins:.0%} of the fit\'s {samples} resamples' if wins is not None
           else '')
        + (f'; {1 - finals[pick] / finals[0]:.2%} lower, beyond the {fit["holdout_error"]:.2%} the fit missed a run '
           f'it left out by' if 'holdout_error' in fit and pick else '') + ')', flush=True)
  return 0


def cmd_scaling_plot(args: argparse.Namespace) -> int:
  from lm.jobs.scaling.plot import plot
  from lm.jobs.scaling.points import loss_of, read_column, read_points, task_accuracies
  fit = None
  if args.fit:
    try:
      fit = json.loads(Path(args.fit).read_text())
    except (OSError, ValueError):
      fit = None
    if not isinstance(fit, dict) or not {'law', 'params'} <= fit.keys():
      raise ConfigError(f'--fit {args.fit} is not a fit written by lm scaling fit --out; write one with '
                        f'lm scaling fit {" ".join(args.points)} --out FIT.json')
  if sum(map(bool, (args.lr, args.suite, args.curves))) > 1:
    raise ConfigError('--lr, --suite and --curves are separate figures; pass one')
  if args.curves:
    from lm.jobs.scaling.plot import plot_curves
    if fit is None or fit['law'] != 'curve':
      raise ConfigError('--curves draws run dirs against a curve fit: pass --fit FIT.json from lm scaling fit RUN... '
                        '--law curve --out FIT.json')
    print(f'wrote {plot_curves(fit, args.points, args.out)}', flush=True)
    return 0
  if len(args.points) != 1:
    raise ConfigError(f'lm scaling plot draws one points CSV, not {len(args.points)} files; run dirs are for --curves')
  args.points = args.points[0]
  if args.lr:
    from lm.jobs.scaling.plot import plot_learning_rates
    best = plot_learning_rates(args.points, args.out)
    print('best learning rate by width: ' + ', '.join(f'{width} {lr:g}' for width, lr in best.items()))
    print(f'wrote {args.out}', flush=True)
    return 0
  tasks = task_accuracies(args.points)
  if args.suite:
    from lm.jobs.scaling.plot import plot_suite
    if fit is not None:
      raise ConfigError('--suite draws each size\'s checkpoints against tokens and compute, with no fit; drop --fit '
                        '(or plot the fit without --suite)')
    points = read_points(args.points, args.params)
    print(f'wrote {plot_suite(points, args.out, tasks, loss_of(args.points))}', flush=True)
    return 0
  if fit is not None and fit['law'] == 'task':  # the fitted metric, with its sigmoid
    column = f'{fit["task"]}/{fit["metric"]}'
    tasks = {k: v for k, v in tasks.items() if k.split('/')[0] != fit['task']}
    tasks[column] = (read_column(args.points, column), read_column(args.points, f'{fit["task"]}/task_loss'))
  print(f'wrote {plot(read_points(args.points, args.params), args.out, fit, tasks, loss_of(args.points))}',
        flush=True)
  return 0


def cmd_scaling_cbs(args: argparse.Namespace) -> int:
  from lm.jobs.scaling.cbs import Request, measure, table, write
  from lm.jobs.scaling.sweep import parse_numbers
  at = parse_numbers(args.at, '--at')
  multipliers = parse_numbers(args.multipliers, '--multipliers')
  if any(x != int(x) for x in (*at, *multipliers)):
    raise ConfigError(f'--at {args.at} --multipliers {args.multipliers}: steps and multipliers are whole numbers')
  out = args.out or f'{args.run.rstrip("/")}/cbs'
  request = Request(run=args.run.rstrip('/'), at=tuple(int(s) for s in at),
                    multipliers=tuple(int(k) for k in multipliers), tokens=int(float(args.tokens)), out=out,
                    lr_rule=args.lr_rule, tolerance=args.tolerance, metric=args.metric)
  result = measure(request)
  print(table(result), end='', flush=True)
  print(f'wrote {", ".join(map(str, write(result, out)))}', flush=True)
  return 0


def _sweep(scaling: argparse._SubParsersAction) -> None:
  sweep = scaling.add_parser('sweep', help='train a ladder of sizes x token budgets, or IsoFLOP budgets '
                                            '(resumable: finished runs are skipped)')
  sweep.add_argument('--config', default='gpt_tiny', help='the base preset or YAML every point starts from')
  sweep.add_argument('--out', required=True, help='the sweep directory: one run dir per point and sweep.json')
  sweep.add_argument('--sizes', default=None, metavar='WxL,...',
                     help='model widths x depths (head size kept), default 32x2,64x2,96x3,128x4,192x4')
  design = sweep.add_mutually_exclusive_group()
  design.add_argument('--tokens', default=None, metavar='D1,D2', help='token budgets (default 1e5,3e5,1e6)')
  design.add_argument('--budgets', default=None, metavar='C1,C2', help='IsoFLOP: compute budgets in FLOPs, '
                                                                       'each size at D = C/6N')
  sweep.add_argument('--experts', default=None, metavar='EXk[gG],...',
                     help='routed experts (a base whose family routes, e.g. moe_tiny): every size at each layout, '
                          'E x G experts of width d_ff/G, k x G per token (granularity G, default 1); IsoFLOP '
                          'budgets count active params')
  sweep.add_argument('--evals', type=int, default=4, help='evaluations (and checkpoints) per run')
  sweep.add_argument('--lr-grid', default=None, metavar='LR1,LR2',
                     help='peak learning rates: every point at each (learning-rate transfer; see plot --lr)')
  sweep.add_argument('--batch-grid', default=None, metavar='B1,B2',
                     help='global batches (rows): every point at each, its steps its tokens over the batch\'s '
                          '(the learning rate and batch for a budget: fit --law hparams)')
  sweep.add_argument('--schedule', choices=('cosine', 'wsd'), default='cosine',
                     help='cosine: each point its own run; wsd: warmup-stable-decay, each size one stable run with '
                          'each point a cooldown branched off it')
  sweep.add_argument('--dry-run', action='store_true', help='print the points and stop')
  sweep.add_argument('overrides', nargs='*', metavar='key.sub=value', help='applied to the base config')
  sweep.set_defaults(fn=cmd_scaling_sweep, joins_job=True)


def _coord_check(scaling: argparse._SubParsersAction) -> None:
  coord = scaling.add_parser('coord-check', help='mean |activation| of each layer group against width over a few '
                             'steps (Tensor Programs V): flat under mup')
  coord.add_argument('--config', default='gpt_tiny', help='the base preset or YAML (its d_model is the mup base)')
  coord.add_argument('--widths', default='64,128,256,512,1024', help='d_model of each model, comma-separated')
  coord.add_argument('--parametrization', choices=('mup', 'standard'), default='mup')
  coord.add_argument('--lr', type=float, default=3e-3, help='the (deliberately large) AdamW learning rate')
  coord.add_argument('--steps', type=int, default=3, help='optimizer steps on the one fixed batch')
  coord.add_argument('--seeds', type=int, default=3, help='initialisations averaged')
  coord.add_argument('--out', required=True, help='directory for coord_check.png and coord_check.json')
  coord.add_argument('overrides', nargs='*', metavar='key.sub=value', help='applied to the base config')
  coord.set_defaults(fn=cmd_scaling_coord_check)


def _collect(scaling: argparse._SubParsersAction) -> None:
  collect = scaling.add_parser('collect', help='run dirs -> points CSV (run, step, params, non_embedding_params, '
                                                'tokens, flops, flops_6nd, loss, loss_of)')
  collect.add_argument('runs', nargs='+', metavar='RUN_DIR', help='run dirs (and, with --evaluate, key=value '
                                                                  'overrides such as data.* for another eval set)')
  collect.add_argument('--out', required=True, help='the CSV to write')
  collect.add_argument('--evaluate', nargs='*', metavar='KEY=VALUE', default=None,
                       help='evaluate held-out loss from every checkpoint instead of reading metrics.jsonl, with '
                            'these overrides (e.g. data.* for another eval set)')
  collect.add_argument('--eval', metavar='NAME', help='the loss of this data.evals set (val/NAME/...) instead of '
                       'the validation split\'s')
  collect.add_argument('--metric', choices=('loss', 'bpb'), default='loss',
                       help='loss: nats per token; bpb: bits per UTF-8 byte (compares across tokenizers)')
  collect.add_argument('--tasks', metavar='T1,T2', help='add harness task columns (<task>/<metric>, <task>/task_loss): '
                       'the in-loop records of train.harness.tasks, else the checkpoint evaluated')
  collect.add_argument('--tasks-data-dir', type=Path, metavar='DIR', help='local task files, as lm eval --data-dir')
  collect.add_argument('--tasks-limit', type=int, metavar='N', help='N documents per task (as lm eval --subset N and '
                                                                    'train.harness.limit)')
  collect.set_defaults(fn=cmd_scaling_collect, joins_job=True)  # --evaluate runs on the job's devices


def _fit(scaling: argparse._SubParsersAction) -> None:
  fit = scaling.add_parser('fit', help='fit a scaling law to a points CSV (params,tokens,loss[,flops]), or whole '
                                      'loss curves to one size\'s run dirs (--law curve)')
  fit.add_argument('points', nargs='+', metavar='POINTS_OR_RUNS',
                   help='CSV of lm scaling collect, or any with params,tokens,loss columns; --law curve: run dirs')
  fit.add_argument('--law', choices=('chinchilla', 'kaplan', 'isoflop', 'task', 'curve', 'data_constrained', 'hparams',
                                     'loss2loss'),
                   default='chinchilla',
                   help='chinchilla: E + A/N^alpha + B/D^beta (approach 3); kaplan: power laws in N and on the '
                   'compute frontier; isoflop: parabolas per budget (approach 2); task: a task\'s loss in N and D, '
                   'then its accuracy as a sigmoid of that loss (Bhagia et al. 2024); curve: each step\'s training '
                   'loss from the learning rates before it (--form); data_constrained: Chinchilla\'s law with '
                   'repeated tokens and excess params decaying (Muennighoff et al. 2023; a unique_tokens column); '
                   'hparams: the near-optimal learning rate and batch as power laws (--by); loss2loss: one '
                   'held-out loss as a shifted power law of another (--x, --y; Brandfonbrener et al. 2024)')
  fit.add_argument('--x', default='val_loss', help='--law loss2loss: the column mapped from (default val_loss)')
  fit.add_argument('--y', default=None, help='--law loss2loss: the column mapped to, e.g. val/code/loss')
  fit.add_argument('--by', choices=('compute', 'nd'), default='compute',
                   help='--law hparams: in compute C (DeepSeek LLM) or in N and D (Step Law)')
  fit.add_argument('--allocate', type=float, nargs='+', default=[], metavar='C U',
                   help='--law data_constrained: the optimal params, tokens and epochs for compute C and U unique '
                        'tokens')
  fit.add_argument('--base', default=None, metavar='datablations|FIT.json',
                   help='--law data_constrained: keep this Chinchilla base and fit only R_D* and R_N* (datablations: '
                        'its C4 constants; or a fit --law chinchilla --out JSON); default: fitted to the runs that '
                        'saw each token once')
  fit.add_argument('--paired', default=None, metavar='RUN',
                   help='--law curve: one of the runs (a wsd ladder\'s stable run); every other run, on the same data, '
                        'seed and batch, is fitted on its loss\'s ratio to RUN\'s at the same steps, so the batches\' '
                        'own noise cancels')
  fit.add_argument('--form', choices=('mpl', 'tissue'), default='mpl',
                   help='--law curve: the multi-power law (Luo et al. 2025) or the momentum form (Tissue et al. 2024)')
  fit.add_argument('--task', help='--law task: the task (columns <task>/task_loss and <task>/<metric>)')
  fit.add_argument('--metric', help='--law task: the accuracy metric (default acc; e.g. acc_norm); --law curve: the '
                   'loss the curve follows, the training loss (default loss) or a held-out one at its evaluations '
                   '(val_loss, val/NAME/loss)')
  fit.add_argument('--target', type=float, nargs='+', default=[], metavar='N D',
                   help='--law task: models (params, tokens) to predict task loss and accuracy for; --law hparams: '
                        'compute budgets C (--by compute) or N D pairs (--by nd) to give the optimum for')
  fit.add_argument('--params', choices=tuple(PARAM_COLUMNS), default='total',
                   help='which N to fit (active: the params a token runs, for routed experts)')
  fit.add_argument('--bootstrap', type=int, default=0, metavar='N',
                   help='chinchilla, isoflop, task, hparams, curve, data_constrained: N resamples for 95%% intervals '
                   '(curve: of its parameters, and of what predict derives from them; data_constrained: of R_D*, '
                   'R_N* and each allocation)')
  fit.add_argument('--budget', type=float, nargs='+', default=[], metavar='C',
                   help='compute budgets (FLOPs) to give compute-optimal N, D and tokens per parameter for')
  fit.add_argument('--holdout', choices=('largest', 'each'), default=None,
                   help='largest (chinchilla, kaplan, data_constrained, loss2loss): fit again without the largest '
                        'size\'s runs and print how far its loss is from that fit\'s prediction; each (curve): each '
                        'run but --paired\'s left out in turn and predicted by a fit on the others (predict --search '
                        'then keeps the configured schedule unless a pick gains more than the largest miss)')
  fit.add_argument('--json', action='store_true', help='print the fit as JSON')
  fit.add_argument('--out', default=None, help='also write the JSON fit here (lm scaling plot --fit reads it)')
  fit.set_defaults(fn=cmd_scaling_fit)


def _predict(scaling: argparse._SubParsersAction) -> None:
  predict = scaling.add_parser('predict', help='a config\'s training-loss curve under its schedule, from a curve fit '
                                               '(lm scaling fit RUN... --law curve --out FIT)')
  predict.add_argument('--fit', required=True, help='the curve fit\'s JSON')
  predict.add_argument('--config', required=True, help='the preset or YAML whose schedule to predict')
  predict.add_argument('--search', nargs='+', default=None, metavar='KEY=V1,V2',
                       help='predict every combination (a bare key is optim.KEY, e.g. decay_fraction=0.1,0.2 '
                            'decay_shape=linear,sqrt) and name the lowest final loss')
  predict.add_argument('--paired', default=None, metavar='RUN',
                       help='a run on the same data, seed and batch (a wsd ladder\'s stable run): predict its '
                            'measured loss times the law\'s ratio of the config\'s schedule to its, so the batches\' '
                            'own noise cancels')
  predict.add_argument('--points', type=int, default=11, help='steps of the curve to print')
  predict.add_argument('overrides', nargs='*', metavar='key.sub=value', help='applied to the config')
  predict.set_defaults(fn=cmd_scaling_predict)


def _plot(scaling: argparse._SubParsersAction) -> None:
  plot = scaling.add_parser('plot', help='loss against compute, IsoFLOP profiles, compute-optimal N and D; or run '
                                        'dirs\' curves against a curve fit (--curves)')
  plot.add_argument('points', nargs='+', metavar='POINTS_OR_RUNS', help='points CSV; with --curves, run dirs')
  plot.add_argument('--out', required=True, help='the PNG to write')
  plot.add_argument('--fit', default=None, help='a fit of lm scaling fit --out, drawn over the points')
  plot.add_argument('--params', choices=tuple(PARAM_COLUMNS), default='total', help='which N to plot')
  plot.add_argument('--suite', action='store_true', help='a checkpoint suite\'s figure: loss and task accuracy '
                                                         'against tokens and compute, a line per model size')
  plot.add_argument('--curves', action='store_true', help='each run\'s measured training loss against step with '
                                                          'the curve fit\'s prediction (--fit of --law curve)')
  plot.add_argument('--lr', action='store_true', help='final loss against learning rate, a curve per width '
                                                      '(a sweep with --lr-grid)')
  plot.set_defaults(fn=cmd_scaling_plot)


def _cbs(scaling: argparse._SubParsersAction) -> None:
  cbs = scaling.add_parser('cbs', help='the critical batch size at a run\'s checkpoints: branches with k times the '
                                       'batch for the same tokens (Merrill et al. 2025)')
  cbs.add_argument('run', help='a run dir lm trained (its checkpoints hold the optimizer state)')
  cbs.add_argument('--at', required=True, help='checkpoint steps to branch at, e.g. 200,2000')
  cbs.add_argument('--multipliers', default='1,2,4,8', help='batch multipliers, from 1')
  cbs.add_argument('--tokens', required=True, help='tokens each branch trains, e.g. 2e6')
  cbs.add_argument('--lr-rule', choices=('sqrt', 'linear', 'none'), default='sqrt',
                   help='the learning rate times k^(1/2) (Adam), k, or unchanged')
  cbs.add_argument('--tolerance', type=float, default=0.01,
                   help='a batch is within the critical size while its loss is at most this much (relative) above '
                        'the smallest batch\'s')
  cbs.add_argument('--metric', choices=('val_loss', 'loss'), default='val_loss',
                   help='the held-out loss at the end, or the training loss over the last quarter of the steps')
  cbs.add_argument('--out', default=None, help='where the branches, cbs.json, cbs.md and cbs.png go (RUN/cbs)')
  cbs.set_defaults(fn=cmd_scaling_cbs)


def register(sub: argparse._SubParsersAction) -> None:
  scaling = sub.add_parser('scaling', help='scaling-law studies').add_subparsers(dest='action', required=True)
  for add in (_sweep, _coord_check, _collect, _fit, _predict, _plot, _cbs):
    add(scaling)
