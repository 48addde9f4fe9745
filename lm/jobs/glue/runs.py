"""`lm finetune`: one GLUE task, all nine plus AX (`--task glue`), or a grid of settings (`--sweep`)."""
from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from etils import epath

from lm.config import ConfigError, parse_overrides
from lm.jobs.glue.data import SplitData, read_split, split_path
from lm.jobs.finetuning import load_tokenizer
from lm.jobs.glue.finetune import FineTuner, default_run_dir, encode_examples, finetune_config, task_head
from lm.jobs.glue.metrics import glue_score
from lm.jobs.glue.outputs import (
  EVAL_RESULTS,
  plot_curves,
  write_dev_predictions,
  write_eval_results,
  write_submission,
  zip_submission,
)
from lm.jobs.glue.tasks import AX, GLUE_ORDER, Task, get_task
from lm.report import format_lines
from lm.storage.run_dir import CHECKPOINTS
from lm.train.logging import read_metrics


@dataclass(frozen=True)
class Options:
  """What every task of one `lm finetune` shares."""
  data_dir: str | None
  init: str
  preset: str | None = None
  overrides: tuple[str, ...] = ()
  source: str = 'tsv'  # tsv (GLUE's files) | tfds (glue/<task>)
  epochs: float = 3.0


def _read(task: Task, split: str, options: Options, required: bool = True) -> SplitData | None:
  try:
    data = read_split(task, split, options.data_dir, options.source)
  except ConfigError:
    if required:
      raise
    print(f'note: {task.name} {split} not found; its predictions are not written', flush=True)
    return None
  if data.skipped:
    print(f'{task.name} {split}: skipped {data.skipped} malformed rows', flush=True)
  return data


def finetune_task(name: str, options: Options) -> dict[str, Any] | None:
  """Fine-tunes one task; writes its eval results, dev predictions, curves and submission files.
  MNLI's model also predicts AX when the diagnostic file is there. Returns {'task', 'step', 'metrics'}, or None
  when a SIGTERM stopped it (its state checkpointed for `--resume`)."""
  task = get_task(name)
  train = _read(task, 'train', options)
  dev = {s.name: _read(task, s.name, options) for s in task.splits_of('dev')}
  tests = [(task, s, _read(task, s.name, options, required=False)) for s in task.splits_of('test')]
  config = finetune_config(task, options.init, options.preset, list(options.overrides), len(train.examples),
                           options.epochs)
  tokenizer = load_tokenizer(config)
  head, max_len = task_head(config), config.data.seq_len
  target_len = head.target_length(task, tokenizer)
  encode = lambda data: encode_examples(head, task, tokenizer, data, max_len, target_len)
  print(f'{task.name}: {len(train.examples)} training examples, {config.train.steps} steps of '
        f'{config.train.global_batch}; outputs in {config.run_dir / task.name}', flush=True)
  tuner = FineTuner(config, task, encode(train), tokenizer, target_len)
  result = tuner.run(options.init, {split: encode(data) for split, data in dev.items()})
  if result is None:
    return None
  task_dir = config.run_dir / task.name
  write_eval_results(task_dir, task, result['step'], result['metrics'])
  for split, predictions in result['predictions'].items():
    write_dev_predictions(task_dir, task, split, dev[split].examples, predictions)
  plot_curves(task_dir, task, read_metrics(task_dir))
  if task.name == 'mnli':
    tests.append((AX, AX.splits[0], _read(AX, 'test', options, required=False)))
  tests = [(t, s, data) for t, s, data in tests if data is not None]
  if tests:
    params = tuner.best_params()
    for test_task, split, data in tests:
      write_submission(config.run_dir, split.submission, test_task, data.examples,
                       tuner.predict(params, encode_examples(head, test_task, tokenizer, data, max_len, target_len)))
  return {'task': task.name, 'step': result['step'], 'metrics': result['metrics'], 'run_dir': str(config.run_dir)}


def finetune_glue(options: Options) -> dict[str, Any] | None:
  """All nine tasks in GLUE's order (AX with MNLI's model), a summary table, and submission.zip; None when a
  SIGTERM stopped it."""
  if options.source == 'tsv':
    for name in GLUE_ORDER:  # fail before hours of training, not at the seventh task
      task = get_task(name)
      for split in task.splits_of('train') + task.splits_of('dev'):
        path = split_path(task, split, options.data_dir)
        if not path.is_file():
          raise ConfigError(f'--task glue needs every task\'s files, and {path} is missing; pass the directory '
                            f'GLUE\'s download script wrote, or fine-tune single tasks with --task')
  results = {}
  for name in GLUE_ORDER:
    results[name] = finetune_task(name, options)
    if results[name] is None:  # stopped by SIGTERM: `--resume` goes on from this task
      return None
  run_dir = epath.Path(results[GLUE_ORDER[0]]['run_dir'])
  summary = {'tasks': {name: r['metrics'] for name, r in results.items()},
             'score': glue_score({name: r['metrics'] for name, r in results.items()})}
  (run_dir / 'glue_summary.json').write_text(json.dumps(summary, indent=2) + '\n')
  if (run_dir / 'submission').exists():
    print(f'leaderboard files zipped in {zip_submission(run_dir)}', flush=True)
  print(format_table(summary), flush=True)
  return summary


def format_table(summary: dict[str, Any]) -> str:
  lines = [(name, ', '.join(f'{k} {100 * v:.1f}' for k, v in metrics.items()))
           for name, metrics in summary['tasks'].items()]
  return format_lines(lines + [('GLUE score', f'{100 * summary["score"]:.1f}')])


def parse_sweep(items: Sequence[str]) -> list[tuple[str, ...]]:
  """`['optim.learning_rate=2e-5,3e-5', 'train.seed=0,1']` -> every combination as override lists."""
  axes = []
  for item in items:
    key, sep, values = item.partition('=')
    if not sep or not values:
      raise ConfigError(f'--sweep {item!r} is not of the form key=v1,v2,... (e.g. optim.learning_rate=2e-5,3e-5)')
    parse_overrides([f'{key}={v}' for v in values.split(',')])  # each a valid override
    axes.append([f'{key}={v}' for v in values.split(',')])
  return list(itertools.product(*axes))


def sweep(names: Sequence[str], options: Options, grid: list[tuple[str, ...]]) -> dict[str, Any] | None:
  """Each grid point a run dir under the sweep's; per task the main metric's mean, std and best point.
  Points whose eval_results.json exists are finished: a rerun skips them, and resumes one it interrupted.
  None when a SIGTERM stopped it."""
  root = epath.Path(parse_overrides(list(options.overrides)).get('train', {}).get('run_dir')
                    or default_run_dir(options.init)) / 'sweep'
  runs: dict[str, list[tuple[str, float, dict[str, float]]]] = {name: [] for name in names}
  for point in grid:
    label = ','.join(item.split('.')[-1] for item in point)
    extra = tuple(point) + (f'train.run_dir={root / label}',)
    point_options = Options(**{**options.__dict__, 'overrides': tuple(options.overrides) + extra})
    for name in names:
      done = root / label / name / EVAL_RESULTS
      if done.exists():  # a finished point of an interrupted sweep
        print(f'{label} {name}: done, skipped', flush=True)
        metrics = json.loads(done.read_text())['metrics']
      else:
        started = (root / label / name / CHECKPOINTS).exists()  # a point the sweep was stopped in: resumed
        result = finetune_task(name, Options(**{**point_options.__dict__, 'overrides': point_options.overrides + (
          ('train.resume=true',) if started else ())}))
        if result is None:
          return None
        metrics = result['metrics']
      runs[name].append((label, metrics[get_task(name).main_metric], metrics))
  report = {}
  for name, points in runs.items():
    values = [v for _, v, _ in points]
    best = max(points, key=lambda p: p[1])
    report[name] = {'metric': get_task(name).main_metric, 'mean': statistics.fmean(values),
                    'std': statistics.stdev(values) if len(values) > 1 else 0.0, 'best': best[1],
                    'best_point': best[0], 'points': {label: metrics for label, _, metrics in points}}
  root.mkdir(parents=True, exist_ok=True)
  (root / 'sweep_results.json').write_text(json.dumps(report, indent=2) + '\n')
  print(format_lines([(name, f'{r["metric"]} mean {100 * r["mean"]:.1f} std {100 * r["std"]:.1f} best '
                             f'{100 * r["best"]:.1f} ({r["best_point"]})') for name, r in report.items()]), flush=True)
  return report
