"""launch/local.py: several local processes are one JAX job; they train like one process with all the devices."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / 'launch'
sys.path.insert(0, str(LAUNCH))
from local import free_port, process_env, resolve  # noqa: E402

from tests.conftest import one_device_env  # noqa: E402

LM = [sys.executable, '-m', 'lm.cli']
TINY = ['--config', 'gpt_tiny', 'model.d_model=64', 'model.num_layers=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=16', 'train.log_every=1', 'train.eval_batches=1', 'train.progress=false']


def clean_env(**extra):
  """The suite's environment without its 8 simulated devices (launch/local.py gives each process its own count),
  compiling as the suite does."""
  return one_device_env(JAX_PLATFORMS='cpu', **extra)


def records(run_dir):
  return [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines()]


@pytest.mark.long(1)
def test_two_processes_train_like_one_process_with_all_devices(tmp_path):
  """2 processes x 4 devices equal 1 process x 8 devices on the same mesh: every loss (1e-6) and the final
  params; the checkpoint then restores in one process on one device. The output holds no noise."""
  train = ['train', *TINY, 'train.steps=6', 'train.eval_every=3', 'mesh.data=2', 'mesh.fsdp=4']
  two = subprocess.run([sys.executable, str(LAUNCH / 'local.py'), '--processes', '2', '--devices-per-process', '4',
                        '--log-dir', str(tmp_path / 'logs'), '--', *LM, *train, f'train.run_dir={tmp_path}/two'],
                       env=clean_env(), capture_output=True, text=True, timeout=600)
  assert two.returncode == 0, two.stderr[-2000:]
  # The log is the run's: no gloo connection notices, no XLA resharding by full copies.
  logs = two.stdout + two.stderr + (tmp_path / 'logs' / 'process_1.log').read_text()
  assert 'final val_loss' in two.stdout
  assert 'Gloo' not in logs and 'peer ranks' not in logs and 'rematerialization' not in logs
  one = subprocess.run([*LM, *train, f'train.run_dir={tmp_path}/one'], capture_output=True, text=True, timeout=600,
                       env=clean_env(XLA_FLAGS=os.environ['XLA_FLAGS']))  # the suite's 8 devices
  assert one.returncode == 0, one.stderr[-2000:]
  a, b = records(tmp_path / 'one'), records(tmp_path / 'two')
  assert [r['step'] for r in a] == [r['step'] for r in b]
  for x, y in zip(a, b):
    key = 'loss' if 'loss' in x else 'val_loss'
    assert abs(x[key] - y[key]) <= 1e-6 * abs(x[key]), (x, y)

  check = f'''
import jax, numpy as np
from lm.parallel.mesh import one_device_mesh
from lm.storage.source import ModelSource
a, b = ModelSource("{tmp_path}/one").params(one_device_mesh()), ModelSource("{tmp_path}/two").params(one_device_mesh())
flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
print(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))
'''
  restored = subprocess.run([sys.executable, '-c', check], env=clean_env(), capture_output=True, text=True,
                            timeout=300)
  assert restored.returncode == 0, restored.stderr[-2000:]
  assert float(restored.stdout.strip().splitlines()[-1]) <= 1e-6


def test_a_failing_process_stops_the_others(tmp_path):
  script = 'import os, sys, time\nif os.environ["LM_PROCESS_ID"] == "1": sys.exit(3)\ntime.sleep(120)'
  start = time.monotonic()
  out = subprocess.run([sys.executable, str(LAUNCH / 'local.py'), '--processes', '3', '--log-dir', str(tmp_path),
                        '--', sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
  assert out.returncode == 3 and time.monotonic() - start < 60
  assert 'process 1 exited with status 3' in out.stderr


@pytest.mark.long(0.5)
def test_sigterm_to_one_process_checkpoints_the_same_step_everywhere(tmp_path):
  """The preemption notice reaches one host; every process saves the same step and exits 0."""
  port = free_port()
  command = [*LM, 'train', *TINY, 'train.steps=2000', 'train.eval_batches=0', 'train.checkpoint.every=10000',
             'mesh.data=2', 'mesh.fsdp=2', f'train.run_dir={tmp_path}/run']
  logs = [open(tmp_path / f'{i}.log', 'w') for i in range(2)]
  procs = [subprocess.Popen(command, env=process_env(i, 2, 2, port, tmp_path), stdout=logs[i], stderr=subprocess.STDOUT)
           for i in range(2)]
  try:
    deadline = time.monotonic() + 300
    while not ((tmp_path / 'run' / 'metrics.jsonl').exists() and
               len((tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()) >= 5):
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs), 'training did not start'
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for log in logs:
      log.close()
  stopped = [[line for line in (tmp_path / f'{i}.log').read_text().splitlines() if 'stopped by SIGTERM' in line]
             for i in range(2)]
  assert len(stopped[0]) == len(stopped[1]) == 1 and stopped[0] == stopped[1]
  step = int(stopped[0][0].split('after step ')[1].split(';')[0])
  assert sorted(p.name for p in (tmp_path / 'run' / 'checkpoints').iterdir()) == [str(step)]
  assert 0 < step < 2000


@pytest.mark.parametrize('kind', ['explicit', 'slurm'])
@pytest.mark.variants
def test_processes_find_each_other_from_explicit_settings_and_slurm(kind, tmp_path):
  """`lm.distributed.initialize` joins the job from LM_* settings, or from SLURM's variables (faked on localhost)."""
  port = free_port()
  script = ('import jax\nfrom lm.distributed import initialize\n'
            'print(initialize(), jax.process_count(), jax.device_count())')
  procs = []
  for i in range(2):
    if kind == 'explicit':
      env = process_env(i, 2, 2, port, tmp_path)
    else:  # JAX's SLURM detection: coordinator = the first node, port = job id % 4096 + 61440
      env = clean_env(XLA_FLAGS='--xla_force_host_platform_device_count=2', SLURM_JOB_ID=str(port),
                      SLURM_STEP_NODELIST='localhost', SLURM_NTASKS='2', SLURM_PROCID=str(i),
                      SLURM_LOCALID=str(i))
    procs.append(subprocess.Popen([sys.executable, '-c', script], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
    assert out.split() == [kind, '2', '4']


def test_lm_is_found_beside_python_when_the_venv_is_not_activated(monkeypatch, tmp_path):
  """`python launch/local.py -- lm train ...` with a venv's python but its bin/ not on PATH."""
  bin_dir = tmp_path / 'venv' / 'bin'
  bin_dir.mkdir(parents=True)
  (bin_dir / 'lm').write_text('#!/bin/sh\n')
  (bin_dir / 'lm').chmod(0o755)
  monkeypatch.setattr(sys, 'executable', str(bin_dir / 'python'))
  monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
  assert resolve(['lm', 'train', '--config', 'gpt_tiny']) == [str(bin_dir / 'lm'), 'train', '--config', 'gpt_tiny']
  with pytest.raises(SystemExit, match='launch: lmx is not on PATH nor beside .*; activate the venv'):
    resolve(['lmx', 'train'])
  assert resolve([sys.executable, '-m', 'lm.cli']) == [sys.executable, '-m', 'lm.cli']  # a path stays as given


def test_the_cluster_kind_comes_from_the_environment():
  from lm.config import ConfigError
  from lm.distributed import EXPLICIT, cluster
  explicit = dict(zip(EXPLICIT, ('localhost:1234', '2', '0')))
  assert cluster(explicit) == 'explicit' and cluster({**explicit, 'LM_NUM_PROCESSES': '1'}) is None
  with pytest.raises(ConfigError, match='missing LM_PROCESS_ID'):
    cluster({k: v for k, v in explicit.items() if k != 'LM_PROCESS_ID'})
  slurm = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n1', 'SLURM_NTASKS': '4', 'SLURM_PROCID': '0',
           'SLURM_LOCALID': '0'}
  assert cluster(slurm) == 'slurm' and cluster({**slurm, 'SLURM_NTASKS': '1'}) is None


@pytest.mark.long(1)
def test_a_hung_process_ends_the_job_naming_it_and_resume_continues(tmp_path):
  """Process 1 stopped (SIGSTOP) after step 8: process 0's watchdog ends the job within the timeout + 30 s, naming
  process 1 and the last step it completed (its heartbeat follows its steps); its stacks are on file; --resume
  continues from the last checkpoint."""
  run = tmp_path / 'run'
  train = [sys.executable, str(LAUNCH / 'local.py'), '--processes', '2', '--devices-per-process', '2', '--log-dir',
           str(tmp_path / 'logs'), '--', *LM, 'train', *TINY, 'train.eval_batches=0', 'train.checkpoint.every=4',
           'mesh.data=2', 'mesh.fsdp=2', 'train.hang_timeout_minutes=0.25', f'train.run_dir={run}']
  job = subprocess.Popen([*train, 'train.steps=2000'], env=clean_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not ((run / 'metrics.jsonl').exists() and len(records(run)) >= 8 and
               (run / 'heartbeats' / '1.json').exists()):
      assert time.monotonic() < deadline and job.poll() is None, 'training did not start'
      time.sleep(0.2)
    time.sleep(1.5)  # more than a watchdog tick: process 1 has seen its step 8 done
    os.kill(json.loads((run / 'heartbeats' / '1.json').read_text())['pid'], signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = job.communicate(timeout=120)
  finally:
    if job.poll() is None:
      job.kill()
  assert job.returncode == 75 and time.monotonic() - stopped < 15 + 30
  lines = [line for line in err.splitlines() if 'hung first' in line]
  assert lines and all('process 1 hung first (no heartbeat for' in line for line in lines), err[-2000:]
  last_step = json.loads((run / 'heartbeats' / '1.json').read_text())['step']
  assert last_step >= 8 and f'its last step was {last_step})' in lines[0], (last_step, lines[0])
  assert lines[0].startswith('lm: error: process 0 of 2: no step done in 0.25 minutes after step ')
  assert lines[-1].startswith('launch: process 0 exited with status 75 (its output is above): process 0 of 2: ')
  assert 'Thread MainThread' in (run / 'hang-0.txt').read_text()

  last = max(int(p.name) for p in (run / 'checkpoints').iterdir() if p.name.isdigit())
  resumed = subprocess.run([*train, f'train.steps={last + 2}', '--resume'], env=clean_env(), capture_output=True,
                           text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f'resumed from {run}/checkpoints/{last}' in resumed.stdout
  assert [r['step'] for r in records(run) if 'loss' in r] == list(range(1, last + 3))


def test_a_process_that_never_joins_is_one_line(tmp_path):
  """One of two processes started: after train.join_timeout_minutes it says so and exits STALLED."""
  from lm.distributed import STALLED
  import local
  assert local.STALLED == STALLED
  port = free_port()
  out = subprocess.run([*LM, 'train', '--config', 'gpt_tiny', 'train.join_timeout_minutes=0.05'],
                       env=process_env(1, 2, 1, port, tmp_path), capture_output=True, text=True, timeout=120)
  assert out.returncode == STALLED
  line = (f'process 1 of 2 (LM_COORDINATOR_ADDRESS=localhost:{port}): the job\'s other processes did not all join '
          f'within 0.05 minutes (train.join_timeout_minutes); start every process')
  assert out.stderr.startswith(f'lm: error: {line}') and out.stderr.count('\n') == 1
  assert (tmp_path / 'stalled.txt').read_text().startswith(line)  # what the launcher repeats


# `lm train` whose every process dies by SIGKILL before step DIE_AT + 1, once its local checkpoint of the step
# before (a multiple of 5) is on disk.
KILLED_AT = '''
import os, signal, sys, time
from pathlib import Path
import lm.train.loop as loop
from lm.cli import main
die_at, local = int(sys.argv[1]), Path(sys.argv[2])
take = loop.Trainer._take_step
def take_step(self, state, batches, done, *rest):
  if done == die_at + 1:
    saved, deadline = local / f'process_{os.environ["LM_PROCESS_ID"]}' / str(die_at - die_at % 5), time.time() + 120
    while not saved.exists() and time.time() < deadline:
      time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
  return take(self, state, batches, done, *rest)
loop.Trainer._take_step = take_step
sys.exit(main(sys.argv[3:]))
'''


@pytest.mark.long(1)
def test_the_local_tier_resumes_the_newest_step_every_process_holds(tmp_path):
  """2 processes, local checkpoints every 5 steps and persistent every 20, kill -9 after step 33: the resume takes
  the local step 30; after one process's local directory is deleted, the persistent step 20. Each resumed run's
  losses equal a straight run's."""
  def train(run, *extra, killed_at=None):
    local = tmp_path / f'{run}-local'
    head = [sys.executable, '-c', KILLED_AT, str(killed_at), str(local)] if killed_at else LM
    args = [*head, 'train', *TINY, 'train.eval_batches=0', 'train.steps=40', 'train.checkpoint.every=20',
            'mesh.data=2', 'mesh.fsdp=2', f'train.run_dir={tmp_path / run}', 'train.local_checkpoint_every=5',
            f'train.local_checkpoint_dir={local}', *extra]
    return subprocess.run([sys.executable, str(LAUNCH / 'local.py'), '--processes', '2', '--devices-per-process',
                           '2', '--log-dir', str(tmp_path / 'logs'), '--', *args], env=clean_env(),
                          capture_output=True, text=True, timeout=600)
  losses = lambda run: {r['step']: r['loss'] for r in records(tmp_path / run) if 'loss' in r}

  straight = train('straight')
  assert straight.returncode == 0, straight.stderr[-2000:]
  assert train('run', killed_at=33).returncode != 0
  assert sorted(losses('run')) == list(range(1, 34))
  again = train('run', '--resume', killed_at=33)  # from the local step 30, killed after 33 again
  assert f'resumed from {tmp_path}/run-local/process_0/30\n' in again.stdout, again.stdout[-2000:]
  assert losses('run') == {s: loss for s, loss in losses('straight').items() if s <= 33}

  shutil.rmtree(tmp_path / 'run-local' / 'process_1')  # a replaced host
  resumed = train('run', '--resume')
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f'resumed from {tmp_path}/run/checkpoints/20\n' in resumed.stdout
  assert 'local checkpoint 30 is not on process 1; resuming from the persistent tier' in resumed.stderr
  assert losses('run') == losses('straight')
  assert sorted(os.listdir(tmp_path / 'run-local' / 'process_1')) == ['40']
