"""`train.branch_from`: a cooldown branched off a stable run is the straight warmup-stable-decay run of its
budget, step for step and bit for bit; what cannot be branched is one line."""
import jax
import numpy as np
import pytest

from lm import cli
from lm.jobs.pretraining import Pretraining
from lm.storage.run_dir import read_config
from lm.train.branch import resolve_branch
from lm.train.logging import read_metrics

# 10 steps of WSD decaying over the last 4: steps 1-6 are warmup and peak, the same in a constant-rate run of 6.
WSD = ['optim.schedule=wsd', 'optim.decay_fraction=0.4', 'optim.decay_shape=sqrt', 'optim.min_lr_ratio=0',
       'train.ema_decay=0.9', 'train.eval_batches=0']
MESHES = {'1 device': ['mesh.data=1'], 'data x fsdp': ['mesh.data=2', 'mesh.fsdp=4']}


def trained(small_config, devices, *overrides):
  run = Pretraining(small_config(*WSD, *overrides), devices)
  run.run()
  return run


@pytest.mark.long(0.3)
@pytest.mark.fusion_emitters  # bit for bit between the constant-rate program and the WSD one
@pytest.mark.parametrize('mesh', ['1 device', 'data x fsdp'])
def test_a_branched_cooldown_is_the_straight_wsd_run_of_its_budget(small_config, tmp_path, mesh, capsys):
  devices = jax.devices()[:1] if mesh == '1 device' else jax.devices()
  straight = trained(small_config, devices, 'train.steps=10', f'train.run_dir={tmp_path}/straight', *MESHES[mesh])
  trained(small_config, devices, 'train.steps=6', 'optim.schedule=constant', f'train.run_dir={tmp_path}/stable',
          *MESHES[mesh])
  capsys.readouterr()
  branch = trained(small_config, devices, 'train.steps=10', f'train.run_dir={tmp_path}/branch',
                   f'train.branch_from={tmp_path}/stable', *MESHES[mesh])
  assert f'branched from {tmp_path}/stable/checkpoints/6' in capsys.readouterr().out
  # Its metrics hold the stable run's first 6 steps and its own 4: every loss the straight run's, exactly.
  losses = lambda run: [(r['step'], r['loss'], r['learning_rate']) for r in read_metrics(run) if 'loss' in r]
  assert losses(tmp_path / 'branch') == losses(tmp_path / 'straight') and len(losses(tmp_path / 'branch')) == 10
  for x, y in zip(jax.tree.leaves(straight.final_state), jax.tree.leaves(branch.final_state), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # params, Adam's moments, the moving average
  assert read_config(tmp_path / 'branch').train.branch_from == f'{tmp_path}/stable/checkpoints/6'

  assert read_config(tmp_path / 'branch').train.branch_from == f'{tmp_path}/stable/checkpoints/6'
  # Rerun as first written (branch_from=the stable run, whose latest might have moved on since), it resumes its own
  # checkpoints and keeps naming the one it branched from.
  again = small_config(*WSD, 'train.steps=10', f'train.run_dir={tmp_path}/branch', 'train.resume=true',
                       f'train.branch_from={tmp_path}/stable', *MESHES[mesh])
  assert resolve_branch(again).train.branch_from == f'{tmp_path}/stable/checkpoints/6'


@pytest.fixture(scope='module')
def stable():
  """A constant-rate run of 6 steps, checkpointing every step and keeping the latest and step 3 (checkpoint_at)."""
  from tests.conftest import SMALL, built_once

  def build(root):
    argv = ['train', '--config', 'gpt_tiny', *SMALL, *WSD, 'mesh.data=-1', 'train.steps=6', 'optim.schedule=constant',
            'train.checkpoint.every=1', 'train.checkpoint.keep=1', 'train.checkpoint.at=[3]', f'train.run_dir={root}/run']
    assert cli.main(argv) == 0
  return built_once('branch_stable', build) / 'run'


@pytest.mark.parametrize('overrides, message', [
  (['model.d_model=32'], 'differs in model.d_model)'),
  (['data.seq_len=16'], 'differs in data.seq_len)'),
  (['optim.learning_rate=1e-3'], 'differs in optim.learning_rate)'),
  (['train.seed=1'], 'differs in train.seed)'),
  (['train.steps=8', 'optim.decay_fraction=0.5'], 'learning rate differs from the source\'s from step 6'),
  (['train.steps=6'], 'starts at step 6, not before train.steps=6'),
  (['train.global_batch=24'], 'train.global_batch=24 must be a multiple of the source\'s 16'),
  (['BRANCH/checkpoints/4'], 'holds no step 4 (it holds 3, 6)'),
  (['BRANCH/nothing'], 'is neither a training run dir'),
  (['EMPTY'], 'holds no checkpoint yet; train it first'),
  (['train.init_from=BRANCH'], 'both set; choose one'),
])
def test_what_cannot_be_branched_is_one_line_and_writes_nothing(stable, tmp_path, capsys, overrides, message):
  from tests.conftest import SMALL
  (tmp_path / 'empty' / 'checkpoints').mkdir(parents=True)  # a run that never checkpointed
  source = [f'train.branch_from={o.replace("BRANCH", str(stable)).replace("EMPTY", str(tmp_path / "empty"))}'
            if o.startswith(('BRANCH', 'EMPTY')) else o.replace('BRANCH', str(stable)) for o in overrides]
  branch = [] if any(o.startswith('train.branch_from') for o in source) else [f'train.branch_from={stable}']
  argv = ['train', '--config', 'gpt_tiny', *SMALL, *WSD, 'mesh.data=-1', 'train.steps=10',
          f'train.run_dir={tmp_path}/branch',
          *branch, *source]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1, err
  assert not (tmp_path / 'branch').exists()
