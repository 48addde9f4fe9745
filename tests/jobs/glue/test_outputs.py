"""GLUE's file formats (labels as the leaderboard spells them) and sweep grids."""
import numpy as np
import pytest

from lm.config import ConfigError
from lm.jobs.glue.data import Example
from lm.jobs.glue.outputs import label_text, write_dev_predictions
from lm.jobs.glue.runs import parse_sweep
from lm.jobs.glue.tasks import TASKS


def test_labels_are_written_by_name_and_scores_with_three_decimals(tmp_path):
  mnli, stsb = TASKS['mnli'], TASKS['stsb']
  assert [label_text(mnli, i) for i in range(3)] == list(mnli.labels)
  assert label_text(mnli, -1) == mnli.labels[0]  # a text-to-text output that named no label
  assert label_text(stsb, 3.14159) == '3.142'
  examples = [Example(index=str(i), texts=('a', 'b'), label=label) for i, label in enumerate((0, 2))]
  write_dev_predictions(tmp_path, mnli, 'dev', examples, np.array([2, 2]))
  assert (tmp_path / 'dev_predictions.tsv').read_text().split('\n') == [
    'index\tprediction\tlabel', f'0\t{mnli.labels[2]}\t{mnli.labels[0]}', f'1\t{mnli.labels[2]}\t{mnli.labels[2]}', '']


def test_a_sweep_is_every_combination_of_its_values():
  assert parse_sweep(['optim.learning_rate=1e-5,2e-5', 'train.seed=0,1']) == [
    ('optim.learning_rate=1e-5', 'train.seed=0'), ('optim.learning_rate=1e-5', 'train.seed=1'),
    ('optim.learning_rate=2e-5', 'train.seed=0'), ('optim.learning_rate=2e-5', 'train.seed=1')]
  with pytest.raises(ConfigError, match='not of the form key=v1,v2'):
    parse_sweep(['train.seed'])
