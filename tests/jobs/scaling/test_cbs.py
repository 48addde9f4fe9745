"""`lm scaling cbs`: the critical batch size from branches with k times the batch for the same tokens; the same
command gives the same table, a late checkpoint's is at least an early one's, and what cannot be measured is one
line."""
import json

import jax.numpy as jnp
import pytest

from lm import cli
from lm.config import load_config
from lm.jobs.scaling.cbs import CBS_JSON, CBS_PLOT, CBS_TABLE
from lm.storage.checkpoint import Checkpointer
from tests.conftest import SMALL, built_once

# Batch 8 over the 8 devices at a constant rate, checkpoints kept at an early and a late step.
RUN = [*SMALL, 'mesh.data=-1', 'train.global_batch=8', 'train.steps=60', 'train.log_every=10', 'train.eval_batches=2',
       'optim.warmup_steps=5', 'optim.schedule=constant', 'train.checkpoint.at=[5,60]']
CBS = ['--at', '5,60', '--multipliers', '1,2,4', '--tokens', '1024']


def _measured(root):
  assert cli.main(['train', '--config', 'gpt_tiny', *RUN, f'train.run_dir={root}/run']) == 0
  assert cli.main(['scaling', 'cbs', f'{root}/run', *CBS, '--out', f'{root}/cbs']) == 0


@pytest.fixture(scope='module')
def measured():
  return built_once('cbs_measured', _measured)


@pytest.mark.long(0.5)
def test_the_same_command_gives_the_same_table_and_a_late_cbs_is_at_least_an_early_one(measured, tmp_path):
  assert cli.main(['scaling', 'cbs', f'{measured}/run', *CBS, '--out', f'{tmp_path}/again']) == 0
  assert (tmp_path / 'again' / CBS_TABLE).read_text() == (measured / 'cbs' / CBS_TABLE).read_text()
  assert (measured / 'cbs' / CBS_PLOT).stat().st_size > 0
  result = json.loads((measured / 'cbs' / CBS_JSON).read_text())
  early, late = result['steps']
  assert (early['at'], late['at']) == (5, 60) and late['cbs'] >= early['cbs']
  for at in result['steps']:  # every branch trained the same tokens, the batch times its steps
    assert [(row['batch'], row['steps'], row['tokens']) for row in at['rows']] == \
      [(8, 4, 1024), (16, 2, 1024), (32, 1, 1024)]
    rows = at['rows']
    within = [row['batch'] for row in rows if row['loss'] <= rows[0]['loss'] * 1.01]
    assert at['cbs'] == within[-1] and within == [row['batch'] for row in rows][:len(within)]


@pytest.mark.long(0.05)  # the measured run's cost is the test above's
@pytest.mark.parametrize('flags, message', [
  (['--at', '7'], 'holds no step 7 (it holds 5, 60)'),
  (['--at', '5', '--multipliers', '2,4'], 'give increasing whole multiples starting at 1'),
  (['--at', '5', '--tokens', '0'], '--tokens must be >= 1'),
])
def test_what_cannot_be_measured_is_one_line(measured, tmp_path, capsys, flags, message):
  assert cli.main(['scaling', 'cbs', f'{measured}/run', '--tokens', '1024', *flags, '--out', f'{tmp_path}/out']) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1, err
  assert not (tmp_path / 'out').exists()


def test_a_run_without_optimizer_state_is_one_line(tmp_path, capsys):
  config = load_config('gpt_tiny', [f'train.run_dir={tmp_path}'])
  (tmp_path / 'config.yaml').write_text(config.to_yaml())
  saved = Checkpointer(tmp_path / 'checkpoints', async_save=False)
  saved.save_params(3, {'w': jnp.zeros(2)}, config.to_dict())
  saved.close()
  assert cli.main(['scaling', 'cbs', str(tmp_path), '--at', '3', '--tokens', '1024']) == 2
  err = capsys.readouterr().err
  assert 'holds params only (an imported model), no optimizer state to branch' in err and err.count('\n') == 1

