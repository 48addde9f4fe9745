"""Scaling points: one row per (run, evaluation) in a CSV that `lm scaling collect` writes and `fit` reads.

The minimal CSV has `params,tokens,loss`; `flops` is taken as 6ND when absent. Collected files also
carry `run, size` (the params as suites name sizes, 70.4M), `step, non_embedding_params, flops_6nd` and `loss_of`
(the record the loss is: val_loss, val_bpb, val/NAME/loss or val/NAME/bpb), the params one token runs
(`active_params`, `active_non_embedding_params`: the totals for a dense model) and the expert layout (`experts`,
`experts_per_token`, `granularity` = d_ff / expert width; 0 for a dense model), and with `collect --tasks` a
`<task>/<metric>` column per harness metric and `<task>/task_loss`.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lm.config import ConfigError

COLUMNS = ('run', 'size', 'step', 'params', 'non_embedding_params', 'active_params', 'active_non_embedding_params',
           'tokens', 'flops', 'flops_6nd', 'loss', 'loss_of', 'width', 'learning_rate', 'global_batch', 'batch_tokens',
           'unique_tokens', 'epochs', 'experts', 'experts_per_token', 'granularity')
PARAM_COLUMNS = {'total': 'params', 'non_embedding': 'non_embedding_params', 'active': 'active_params',
                 'active_non_embedding': 'active_non_embedding_params'}  # read_points' choices of N
REQUIRED = ('params', 'tokens', 'loss')


@dataclass(frozen=True)
class Points:
  """Arrays of equal length: parameters N (total or non-embedding, as chosen), tokens D, compute C, loss L."""
  params: np.ndarray
  tokens: np.ndarray
  flops: np.ndarray
  loss: np.ndarray
  run: tuple[str, ...]
  step: np.ndarray  # the evaluation's step within its run (0 when the CSV has no step column)

  def __len__(self) -> int:
    return len(self.loss)

  def take(self, rows: np.ndarray) -> Points:
    return Points(self.params[rows], self.tokens[rows], self.flops[rows], self.loss[rows],
                  tuple(self.run[i] for i in rows), self.step[rows])

  def final_rows(self) -> np.ndarray:
    """The rows of each run's last evaluation, in order (`final`'s; a column read apart takes them too)."""
    last: dict[str, int] = {}
    for i, (run, step) in enumerate(zip(self.run, self.step)):
      if run not in last or step >= self.step[last[run]]:
        last[run] = i
    return np.array(sorted(last.values()), int)

  def final(self) -> Points:
    """Each run's last evaluation: the one its schedule was fitted to (a point mid-way through a decaying
    schedule is no model trained for that many tokens). Rows without a run name are each their own run."""
    return self.take(self.final_rows())


def size_label(params: float) -> str:
  """70.4M, 1.01B: a model size as suites name theirs."""
  return f'{params / 1e9:.3g}B' if params >= 1e9 else f'{params / 1e6:.3g}M'


def read_points(path: str | Path, params: str = 'total', loss: str = 'loss') -> Points:
  """The CSV's points, N from `params` (a key of PARAM_COLUMNS: 'total' reads the params column) and L from the column
  `loss` (a task's `<task>/task_loss` for the task law); a ConfigError naming the file, the row and the fix for a
  missing column or a value that is not a positive number."""
  path = Path(path)
  if not path.is_file():
    raise ConfigError(f'{path} does not exist; write it with lm scaling collect RUN_DIRS... --out {path}')
  with path.open(newline='') as f:
    reader = csv.DictReader(f)
    columns = reader.fieldnames or []
    n_column = PARAM_COLUMNS[params]
    needed = (n_column, 'tokens', loss)
    missing = [c for c in needed if c not in columns]
    if missing:
      raise ConfigError(f'{path} has no column {", ".join(missing)} (it has: {", ".join(columns) or "nothing"}); '
                        f'a points CSV needs {",".join(needed)} (flops optional)')
    rows = list(reader)
  if not rows:
    raise ConfigError(f'{path} holds no points; collect some with lm scaling collect')
  values = {c: np.empty(len(rows)) for c in (*needed, 'flops')}
  for i, row in enumerate(rows):
    for column in needed + (('flops',) if row.get('flops') else ()):
      try:
        value = float(row[column])
      except (TypeError, ValueError):
        value = float('nan')
      if not value > 0 or not np.isfinite(value):
        raise ConfigError(f'{path} row {i + 2}: {column}={row[column]!r} is not a positive number; fix or drop '
                          f'that row')
      values[column][i] = value
    if not row.get('flops'):
      values['flops'][i] = 6 * values[n_column][i] * values['tokens'][i]
  steps = np.array([float(row.get('step') or 0) for row in rows])
  return Points(values[n_column], values['tokens'], values['flops'], values[loss],
                tuple(row.get('run') or f'row {i}' for i, row in enumerate(rows)), steps)


def read_column(path: str | Path, column: str) -> np.ndarray:
  """One numeric column of the CSV (e.g. a task's accuracy), row by row; a ConfigError naming what is missing."""
  with Path(path).open(newline='') as f:
    reader = csv.DictReader(f)
    if column not in (reader.fieldnames or []):
      tasks = [c for c in reader.fieldnames or [] if '/' in c]
      raise ConfigError(f'{path} has no column {column} (task columns: {", ".join(tasks) or "none"}); collect '
                        f'them with lm scaling collect RUN_DIRS --tasks ...')
    try:
      return np.array([float(row[column]) for row in reader])
    except ValueError as e:
      raise ConfigError(f'{path}: column {column} holds a value that is not a number ({e})') from None


def write_points(path: str | Path, rows: list[dict]) -> None:
  """Rows of COLUMNS, then any task columns, as CSV (the parent directory is made)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  extra = sorted({key for row in rows for key in row} - set(COLUMNS))
  with path.open('w', newline='') as f:
    writer = csv.DictWriter(f, COLUMNS + tuple(extra))
    writer.writeheader()
    writer.writerows(rows)


def loss_of(path: str | Path) -> str:
  """What the CSV's loss column holds (its first row's `loss_of`; val_loss when it has none)."""
  with Path(path).open(newline='') as f:
    first = next(csv.DictReader(f), None) or {}
  return first.get('loss_of') or 'val_loss'


def task_accuracies(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Per task of the CSV's task columns, the accuracy to plot (acc_norm where the task has it, else acc, as
  scaling papers plot them) and the task loss: `<task>/<metric>` -> (accuracy, task loss)."""
  with Path(path).open(newline='') as f:
    columns = csv.DictReader(f).fieldnames or []
  out = {}
  for task in dict.fromkeys(c.split('/')[0] for c in columns if c.endswith('/task_loss')):
    metric = next((f'{task}/{m}' for m in ('acc_norm', 'acc') if f'{task}/{m}' in columns), None)
    if metric is not None:
      out[metric] = (read_column(path, metric), read_column(path, f'{task}/task_loss'))
  return out
