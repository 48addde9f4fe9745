"""GLUE's metrics in NumPy, defined as scikit-learn and SciPy compute them (only the tests import those), and the
GLUE score.

Predictions and labels are 1-D arrays of class ids, or of scores for STS-B. Results are fractions in [0, 1] and
correlations in [-1, 1], not percent.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from numpy.typing import ArrayLike

from lm.jobs.glue.tasks import Task


def _pair(predictions: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
  p, y = np.asarray(predictions), np.asarray(labels)
  if p.ndim != 1 or p.shape != y.shape or not len(p):
    raise ValueError(f'predictions {p.shape} and labels {y.shape} must be non-empty vectors of one length')
  return p, y


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
  """The fraction predicted exactly."""
  p, y = _pair(predictions, labels)
  return float(np.mean(p == y))


def f1(predictions: ArrayLike, labels: ArrayLike) -> float:
  """F1 of class 1, 2 TP / (predicted + true positives); 0.0 when there are none (sklearn's zero_division=0)."""
  p, y = _pair(predictions, labels)
  positives = np.sum(p == 1) + np.sum(y == 1)
  return float(2 * np.sum((p == 1) & (y == 1)) / positives) if positives else 0.0


def matthews_corr(predictions: ArrayLike, labels: ArrayLike) -> float:
  """Matthews correlation over every class seen (the multiclass form of sklearn's matthews_corrcoef); 0.0 when
  undefined, i.e. when either side is constant (as sklearn)."""
  p, y = _pair(predictions, labels)
  _, ids = np.unique(np.concatenate([y, p]), return_inverse=True)
  k, n = int(ids.max()) + 1, len(y)
  confusion = np.bincount(ids[:n] * k + ids[n:], minlength=k * k).reshape(k, k).astype(np.float64)  # [true, pred]
  true, predicted = confusion.sum(axis=1), confusion.sum(axis=0)
  denominator = np.sqrt((n * n - predicted @ predicted) * (n * n - true @ true))
  return float((np.trace(confusion) * n - true @ predicted) / denominator) if denominator else 0.0


def pearson(predictions: ArrayLike, labels: ArrayLike) -> float:
  """Pearson's r; 0.0 when either side is constant (undefined there: counted as no correlation); nan when either
  holds a nan (as scipy)."""
  p, y = (a.astype(np.float64) for a in _pair(predictions, labels))
  if np.isnan(p).any() or np.isnan(y).any():
    return float('nan')
  if np.all(p == p[0]) or np.all(y == y[0]):
    return 0.0
  p, y = p - p.mean(), y - y.mean()
  return float(np.clip(p @ y / (np.sqrt(p @ p) * np.sqrt(y @ y)), -1.0, 1.0))


def _ranks(x: np.ndarray) -> np.ndarray:
  """1-based ranks, tied values sharing their mean rank; nan stays nan."""
  _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
  ends = np.cumsum(counts)
  return np.where(np.isnan(x), np.nan, ((ends - counts + 1 + ends) / 2)[inverse])


def spearman(predictions: ArrayLike, labels: ArrayLike) -> float:
  """Spearman's rho: Pearson's r of the ranks, ties sharing their mean rank (as scipy.stats.spearmanr); 0.0 when
  either side is constant, nan when either holds a nan (as pearson)."""
  p, y = _pair(predictions, labels)
  return pearson(_ranks(p), _ranks(y))


_METRICS: dict[str, Callable[[ArrayLike, ArrayLike], float]] = {
  'accuracy': accuracy, 'f1': f1, 'matthews_corr': matthews_corr, 'pearson': pearson, 'spearman': spearman}


def task_metrics(task: Task, predictions: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> dict[str, float]:
  """`task.metrics`, from predictions and labels keyed by dev split: 'dev', or for MNLI 'dev_matched' (giving
  accuracy_matched) and 'dev_mismatched' (accuracy_mismatched)."""
  out = {}
  for key in task.metrics:
    if key.startswith('accuracy_'):
      metric, split = accuracy, 'dev' + key.removeprefix('accuracy')
    else:
      metric, split = _METRICS[key], 'dev'
    out[key] = metric(predictions[split], labels[split])
  return out


def glue_score(results: dict[str, dict[str, float]]) -> float:
  """GLUE's score: each task's metrics averaged (MRPC, QQP, STS-B and MNLI report two), then the unweighted mean
  over tasks. `results`: task name -> its metrics."""
  if not results or not all(results.values()):
    raise ValueError('the GLUE score needs at least one task, each with metrics')
  return float(np.mean([np.mean(list(metrics.values())) for metrics in results.values()]))
