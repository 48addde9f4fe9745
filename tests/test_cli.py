"""`lm info` and `lm train` end to end through the command line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lm import cli
from lm.train.logging import read_metrics
from tests.conftest import needs_libtpu, one_device_env


def test_info_json_reports_counts_flops_mesh_memory(capsys):
  assert cli.main(['info', '--config', 'gpt_tiny', '--json']) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['params']['total'] == 3_292_672
  assert report['params']['non_embedding'] == 3_292_672 - 264 * 256 - 256 * 256
  # 6 * (matmul weights incl. the tied output layer) + causal attention term.
  matmul = 4 * 12 * 256 * 256 + 264 * 256
  assert report['flops_per_token'] == 6 * matmul + 6 * 4 * 256 * 256
  assert report['mesh']['strategy'] == 'dp' and report['mesh']['data'] == 8  # data=-1 takes all 8 devices
  mem = report['memory_per_device']
  assert mem['params'] == 3_292_672 * 4 and mem['optimizer'] == 2 * mem['params'] + 2 * 4


@pytest.mark.long(0.2)
def test_train_command_runs_and_logs(tmp_path, capsys):
  argv = ['train', '--config', 'gpt_tiny', 'model.num_layers=1', 'model.d_model=32', 'model.num_heads=2',
          'data.seq_len=32', 'model.max_len=32', 'train.global_batch=8', 'train.steps=4', 'train.log_every=2',
          'train.eval_every=4', 'train.eval_batches=1', f'train.run_dir={tmp_path}/run']
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert 'model:' in out and 'final val_loss' in out
  losses = [r['loss'] for r in read_metrics(tmp_path / 'run') if 'loss' in r]
  assert len(losses) == 4 and np.all(np.isfinite(losses))
  capsys.readouterr()
  assert cli.main(argv + ['--resume']) == 0  # already at the last step: says so and stops at once
  assert 'run already complete at step 4 (train.steps=4)' in capsys.readouterr().out
  assert len([r for r in read_metrics(tmp_path / 'run') if 'loss' in r]) == 4


@pytest.mark.long(0.2)
def test_resume_from_the_command_line_continues_the_same_run(tmp_path):
  argv = ['train', '--config', 'gpt_tiny', 'model.num_layers=1', 'model.d_model=32', 'model.num_heads=2',
          'data.seq_len=32', 'model.max_len=32', 'train.global_batch=8', 'train.eval_every=2', 'train.eval_batches=1',
          'optim.warmup_steps=1', 'optim.decay_steps=4', 'train.progress=false']
  assert cli.main(argv + ['train.steps=4', f'train.run_dir={tmp_path}/straight']) == 0
  assert cli.main(argv + ['train.steps=2', f'train.run_dir={tmp_path}/resumed']) == 0
  assert cli.main(argv + ['train.steps=4', f'train.run_dir={tmp_path}/resumed', '--resume']) == 0
  straight, resumed = read_metrics(tmp_path / 'straight'), read_metrics(tmp_path / 'resumed')
  pick = lambda records: [(r['step'], r.get('loss'), r.get('val_loss')) for r in records]
  assert sorted(pick(resumed), key=str) == sorted(pick(straight), key=str) and len(straight) == 4 + 3


def test_resume_says_what_it_resumes(tmp_path, capsys):
  """--resume of a missing run dir stops (a typo should not start a new run); of an empty one it says it starts."""
  argv = ['train', '--config', 'gpt_tiny', 'model.num_layers=1', 'model.d_model=32', 'model.num_heads=2',
          'data.seq_len=32', 'model.max_len=32', 'train.global_batch=8', 'train.steps=1', 'train.eval_batches=0']
  assert cli.main(argv + [f'train.run_dir={tmp_path}/typo', '--resume']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'typo does not exist' in err and not (tmp_path / 'typo').exists()
  (tmp_path / 'empty').mkdir()
  assert cli.main(argv + [f'train.run_dir={tmp_path}/empty', '--resume']) == 0
  assert f'no checkpoint in {tmp_path}/empty/checkpoints; starting at step 0' in capsys.readouterr().out


@needs_libtpu
def test_commands_are_quiet_where_libtpu_is_installed_without_a_tpu():
  """A machine with the test extra (libtpu) but no TPU: JAX's TPU probe must not log errors before the answer."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(('TPU_', 'JAX_PLATFORMS', 'XLA_FLAGS'))}
  result = subprocess.run([sys.executable, '-m', 'lm.cli', 'info', '--config', 'gpt_tiny'], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stderr == '', result.stderr
  assert result.stdout.startswith('config ')


@pytest.mark.long(0.2)
def test_info_simulates_devices_and_reports_the_compiled_step(tmp_path):
  """`lm info --devices 4 --compile` plans on 4 simulated CPU devices (a fresh process, as a user runs it) and
  reports the compiled step's memory: the same figures as compiling that step here on 4 of the 8 devices."""
  import jax

  from lm.assembly import assemble
  from lm.planning.compile import compiled_memory
  from lm.config import load_config
  from lm.train.step import compile_train_step
  overrides = ['mesh.data=2', 'mesh.fsdp=2', 'model.num_layers=1', 'train.global_batch=8']
  env = one_device_env()
  result = subprocess.run([sys.executable, '-m', 'lm.cli', 'info', '--config', 'gpt_tiny', '--devices', '4',
                           '--compile', '--json', *overrides], env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report['mesh']['data'] == 2 and report['mesh']['fsdp'] == 2 and report['mesh']['strategy'] == 'dp+fsdp'
  here = compiled_memory(compile_train_step(assemble(load_config('gpt_tiny', overrides), jax.devices()[:4])))
  assert report['compiled_memory_per_device'] == here and here['arguments'] > 0


def test_info_plans_a_preset_on_the_chips_of_the_slice_its_header_names():
  """`lm info --config gpt3_175b`, no --devices: its header names v5p-1024 (512 chips), so the mesh it prints is the
  preset's own on 512 simulated devices, not an error about the host's one device."""
  result = subprocess.run([sys.executable, '-m', 'lm.cli', 'info', '--config', 'gpt3_175b', '--json'],
                          env=one_device_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  mesh = json.loads(result.stdout)['mesh']
  assert (mesh['devices'], mesh['data'], mesh['fsdp'], mesh['tensor']) == (512, 1, 64, 8)


def test_each_command_module_registers_its_own_commands_and_the_cli_gathers_them():
  """`lm.commands`: each module adds its commands' parsers; the cli's parser holds exactly their union, and the
  commands that run on devices join a multi-process job first (lm.distributed)."""
  import argparse

  from lm.commands import convert, data, evaluate, finetune, generate, planning, scaling, train
  owners = {}
  for module in (train, finetune, convert, planning, generate, evaluate, data, scaling):
    sub = argparse.ArgumentParser().add_subparsers()
    module.register(sub)
    owners.update({name: module.__name__ for name in sub.choices})
  parser = cli.build_parser()
  assert sorted(owners) == sorted(parser._subparsers._group_actions[0].choices)
  assert owners['eval'] == 'lm.commands.evaluate' and owners['compile'] == 'lm.commands.planning'
  joins = lambda argv: getattr(parser.parse_args(argv), 'joins_job', False)
  assert joins(['train']) and joins(['eval', '--model', 'x', '--tasks', 'piqa']) and joins(['info'])
  assert not joins(['report', 'x']) and not joins(['scaling', 'fit', 'points.csv'])
