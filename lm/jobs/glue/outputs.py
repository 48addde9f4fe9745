"""What a GLUE run writes, with the names scripts and the leaderboard read.

  <run_dir>/<task>/eval_results.json       {"task", "split": "dev", "step", "metrics": {...}}
  <run_dir>/<task>/dev_predictions.tsv     index, prediction, label (MNLI: dev_matched_/dev_mismatched_...)
  <run_dir>/<task>/curves.png              train loss and the dev metric against step
  <run_dir>/submission/<NAME>.tsv          index, prediction per test example (CoLA.tsv, MNLI-m.tsv, AX.tsv, ...)
"""
from __future__ import annotations

import json
import zipfile
from typing import Any, Sequence

import numpy as np
from etils import epath

from lm.jobs.glue.data import Example
from lm.jobs.glue.tasks import Task

SUBMISSION = 'submission'
EVAL_RESULTS = 'eval_results.json'


def label_text(task: Task, value: Any) -> str:
  """A class id or score as GLUE's files write it; a text-to-text output that was no label (-1) as class 0."""
  if task.regression:
    return f'{float(value):.3f}'
  return task.labels[int(value)] if int(value) >= 0 else task.labels[0]


def write_eval_results(task_dir: epath.Path, task: Task, step: int, metrics: dict[str, float]) -> None:
  record = {'task': task.name, 'split': 'dev', 'step': step, 'metrics': metrics}
  (task_dir / EVAL_RESULTS).write_text(json.dumps(record, indent=2) + '\n')


def predictions_file(split: str) -> str:
  return 'dev_predictions.tsv' if split == 'dev' else f'{split}_predictions.tsv'


def write_dev_predictions(task_dir: epath.Path, task: Task, split: str, examples: Sequence[Example],
                          predictions: np.ndarray) -> None:
  lines = ['index\tprediction\tlabel'] + [
    f'{ex.index}\t{label_text(task, p)}\t{label_text(task, ex.label)}' for ex, p in zip(examples, predictions)]
  (task_dir / predictions_file(split)).write_text('\n'.join(lines) + '\n')


def write_submission(run_dir: epath.Path, name: str, task: Task, examples: Sequence[Example],
                     predictions: np.ndarray) -> epath.Path:
  """`<run_dir>/submission/<name>.tsv`; STS-B scores clipped to [0, 5] as the leaderboard expects."""
  if task.regression:
    predictions = np.clip(predictions, 0.0, 5.0)
  out = run_dir / SUBMISSION
  out.mkdir(parents=True, exist_ok=True)
  lines = ['index\tprediction'] + [f'{ex.index}\t{label_text(task, p)}' for ex, p in zip(examples, predictions)]
  path = out / f'{name}.tsv'
  path.write_text('\n'.join(lines) + '\n')
  return path


def zip_submission(run_dir: epath.Path) -> epath.Path:
  """`<run_dir>/submission.zip` holding every leaderboard file at its top level, as GLUE's site takes it."""
  path = run_dir / f'{SUBMISSION}.zip'
  with path.open('wb') as raw, zipfile.ZipFile(raw, 'w', zipfile.ZIP_DEFLATED) as archive:
    for file in sorted((run_dir / SUBMISSION).glob('*.tsv')):
      archive.writestr(file.name, file.read_text())
  return path


def plot_curves(task_dir: epath.Path, task: Task, records: Sequence[dict[str, Any]]) -> None:
  """curves.png: the training loss and the dev main metric against step."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  metric = f'dev_{task.main_metric}'
  train = [(r['step'], r['loss']) for r in records if 'loss' in r]
  dev = [(r['step'], r[metric]) for r in records if metric in r]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  if train:
    left.plot(*zip(*train))
  left.set(xlabel='step', ylabel='train loss', title=f'{task.name}: training loss')
  if dev:
    right.plot(*zip(*dev), marker='o')
  right.set(xlabel='step', ylabel=task.main_metric, title=f'{task.name}: dev {task.main_metric}')
  fig.tight_layout()
  with (task_dir / 'curves.png').open('wb') as f:
    fig.savefig(f, format='png', dpi=100)
  plt.close(fig)
