"""GLUE metrics against scikit-learn and SciPy (test-only dependencies), their degenerate cases, task routing and
the GLUE score."""
import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from lm.jobs.glue.metrics import accuracy, f1, glue_score, matthews_corr, pearson, spearman, task_metrics
from lm.jobs.glue.tasks import TASKS

SEEDS = (0, 1, 2, 3)
N = 301


def classes(seed: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Predictions agreeing with the labels about two times in three, the rest random, over k classes."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, k, N)
  return np.where(rng.random(N) < 0.6, labels, rng.integers(0, k, N)), labels


def scores(seed: int, decimals: int | None) -> tuple[np.ndarray, np.ndarray]:
  """Correlated STS-B-like scores in [0, 5]; rounded to `decimals` they hold many ties."""
  rng = np.random.default_rng(seed)
  labels = rng.uniform(0, 5, N)
  predictions = np.clip(labels + rng.normal(0, 1.5, N), 0, 5)
  return (predictions, labels) if decimals is None else (predictions.round(decimals), labels.round(decimals))


def close(value: float, expected: float) -> None:
  assert value == pytest.approx(float(expected), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize('k', [2, 3])
@pytest.mark.parametrize('seed', SEEDS)
def test_classification_metrics_match_sklearn(seed, k):
  predictions, labels = classes(seed, k)
  close(accuracy(predictions, labels), accuracy_score(labels, predictions))
  close(matthews_corr(predictions, labels), matthews_corrcoef(labels, predictions))
  if k == 2:
    close(f1(predictions, labels), f1_score(labels, predictions))


@pytest.mark.parametrize('decimals', [None, 1, 0])
@pytest.mark.parametrize('seed', SEEDS)
def test_correlations_match_scipy(seed, decimals):
  predictions, labels = scores(seed, decimals)
  if decimals is not None:
    assert len(np.unique(predictions)) < N and len(np.unique(labels)) < N  # ties present
  close(pearson(predictions, labels), pearsonr(predictions, labels).statistic)
  close(spearman(predictions, labels), spearmanr(predictions, labels).statistic)


def test_class_ids_of_another_dtype():
  predictions, labels = classes(5, 3)
  close(matthews_corr(predictions.astype(np.int32), labels), matthews_corrcoef(labels, predictions))
  close(spearman(predictions, labels.astype(np.float32)), spearmanr(predictions, labels).statistic)


@pytest.mark.parametrize('constant', [0, 1])
def test_constant_predictions(constant):
  _, labels = classes(0, 2)
  predictions = np.full(N, constant)
  close(f1(predictions, labels), f1_score(labels, predictions, zero_division=0.0))
  close(matthews_corr(predictions, labels), matthews_corrcoef(labels, predictions))
  assert matthews_corr(predictions, labels) == 0.0
  assert f1(np.zeros(4), np.zeros(4)) == f1_score(np.zeros(4), np.zeros(4), zero_division=0.0) == 0.0
  assert pearson(predictions, labels) == pearson(labels, predictions) == spearman(predictions, labels) == 0.0


def test_constant_floats_are_no_correlation():
  """A constant whose mean is inexact (0.1 summed) still counts as constant."""
  assert pearson(np.full(7, 0.1), np.arange(7.0)) == spearman(np.full(7, 0.1), np.arange(7.0)) == 0.0


def test_nan_propagates():
  predictions, labels = scores(0, None)
  predictions[3] = np.nan
  assert np.isnan(pearson(predictions, labels)) and np.isnan(spearman(predictions, labels))


@pytest.mark.parametrize('metric', [accuracy, f1, matthews_corr, pearson, spearman])
def test_rejects_bad_shapes(metric):
  with pytest.raises(ValueError):
    metric(np.zeros(3), np.zeros(4))
  with pytest.raises(ValueError):
    metric(np.zeros(0), np.zeros(0))


@pytest.mark.parametrize('name', sorted(TASKS))
def test_task_metrics_keys(name):
  task = TASKS[name]
  dev = [s.name for s in task.splits_of('dev')]
  if task.regression:
    data = {split: scores(0, 1) for split in dev}
  else:
    data = {split: classes(0, len(task.labels)) for split in dev}
  result = task_metrics(task, {s: p for s, (p, _) in data.items()}, {s: y for s, (_, y) in data.items()})
  assert tuple(result) == task.metrics
  assert all(isinstance(v, float) and -1.0 <= v <= 1.0 for v in result.values())


def test_mnli_splits_routed():
  labels = np.arange(8) % 3
  right_first = lambda n: np.where(np.arange(8) < n, labels, (labels + 1) % 3)
  predictions = {'dev_matched': right_first(6), 'dev_mismatched': right_first(2)}
  result = task_metrics(TASKS['mnli'], predictions, {'dev_matched': labels, 'dev_mismatched': labels})
  assert result == {'accuracy_matched': 0.75, 'accuracy_mismatched': 0.25}


def test_glue_score():
  close(glue_score({'mrpc': {'f1': 0.8, 'accuracy': 0.6}, 'cola': {'matthews_corr': 0.5}}), 0.6)
  close(glue_score({'mnli': {'accuracy_matched': 0.9, 'accuracy_mismatched': 0.7}}), 0.8)
  with pytest.raises(ValueError):
    glue_score({})


def test_a_text_to_text_output_that_is_no_label_counts_wrong():
  from lm.models.task_heads import UNPARSEABLE
  rte = TASKS['rte']
  predicted = np.array([0, UNPARSEABLE, 1, UNPARSEABLE])
  labels = np.array([0, 0, 1, 0])
  assert task_metrics(rte, {'dev': predicted}, {'dev': labels})['accuracy'] == pytest.approx(0.5)
