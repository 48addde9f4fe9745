"""launch/slurm.py against a real SLURM (a throwaway single-node cluster on localhost, tests/launch/slurm_cluster.py):
a 2-task CPU job trains; a stop by SIGTERM, from the time limit or from `scancel --full`, checkpoints,
requeues and resumes with every step recorded once; a busy default coordinator port does not matter."""
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import one_device_env
from tests.launch.slurm_cluster import Cluster, missing

LAUNCH = Path(__file__).resolve().parents[2] / 'launch'
TINY = ['--config', 'gpt_tiny', 'model.d_model=64', 'model.num_layers=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=16', 'train.eval_batches=1', 'train.progress=false']

pytestmark = pytest.mark.skipif(bool(missing()), reason=f'SLURM is not installed here (no {", ".join(missing())}); '
                                f'.ci/run installs it (apt: slurmctld slurmd slurm-client munge)')


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  cluster = Cluster(tmp_path_factory.mktemp('slurm'))
  cluster.start()
  yield cluster
  cluster.stop()


def submit(cluster, cwd, name, *launcher_args, command, tasks=2):
  """Submits `tasks` tasks through launch/slurm.py with the venv not on PATH (the job must not need it); the
  job id."""
  env = {k: v for k, v in cluster.env.items() if k != 'VIRTUAL_ENV'}
  env['XLA_FLAGS'] = one_device_env()['XLA_FLAGS']  # one device a task, compiling as the suite does
  env['PATH'] = '/usr/local/bin:/usr/bin:/bin'
  done = subprocess.run([sys.executable, str(LAUNCH / 'slurm.py'), '--job-name', name, '--nodes', '1',
                         '--ntasks-per-node', str(tasks), *launcher_args, '--', 'lm', 'train', *command],
                        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  return re.search(r'Submitted batch job (\d+)', done.stdout)[1]


def steps(run_dir):
  return [json.loads(line)['step'] for line in (run_dir / 'metrics.jsonl').read_text().splitlines()
          if 'loss' in json.loads(line)]


def wait_for(path, pattern, cluster, job, timeout=180):
  """The first match of `pattern` in the file `path` (a task's log), waiting for it while the job runs."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    text = path.read_text() if path.exists() else ''
    if (found := re.search(pattern, text)):
      return found
    time.sleep(1)
  raise AssertionError(f'no {pattern!r} in {path} after {timeout} s; job {cluster.job(job)}\n{text[-2000:]}')


@pytest.mark.long(1)  # against real SLURM daemons: end to end
def test_a_two_task_cpu_job_trains_from_a_fresh_checkout_with_its_default_port_taken(cluster, tmp_path):
  next_job = int(subprocess.run(['scontrol', 'show', 'config'], env=cluster.env, capture_output=True,
                                text=True).stdout.split('NEXT_JOB_ID')[1].split('=')[1].split()[0])
  with socket.socket() as busy:  # JAX's own choice for that job: 61440 + job id % 4096
    busy.bind(('', 61440 + next_job % 4096))
    busy.listen()
    job = submit(cluster, tmp_path, 'two', '--time', '00:10:00',
                 command=[*TINY, 'train.steps=6', 'train.eval_every=3', 'train.log_every=1', 'train.run_dir=run'])
    assert int(job) == next_job
    fields = cluster.wait(job, {'COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL'}, timeout=300)
  logs = tmp_path / 'logs' / 'slurm'
  assert fields['JobState'] == 'COMPLETED', (fields, [p.read_text()[-1500:] for p in logs.iterdir()])
  assert fields['Restarts'] == '0'  # a run that ends by itself is not requeued
  assert '--gpus-per-node' not in (tmp_path / 'two.sbatch').read_text()
  assert steps(tmp_path / 'run') == [1, 2, 3, 4, 5, 6]
  first, second = (logs / f'two-{job}-0.out').read_text(), (logs / f'two-{job}-1.out').read_text()
  assert 'final val_loss' in first and 'name: gpt_tiny' in first  # process 0 prints the config and summary
  assert 'final val_loss' not in second and 'name: gpt_tiny' not in second


@pytest.mark.long(1.5)  # against real SLURM daemons: end to end
def test_scancel_full_checkpoints_requeues_and_resumes_to_the_last_step(cluster, tmp_path):
  job = submit(cluster, tmp_path, 'full', '--time', '00:10:00',
               command=[*TINY, 'train.steps=150', 'train.eval_every=150', 'train.log_every=10',
                        'train.checkpoint.every=1000', 'train.run_dir=run'])
  log = tmp_path / 'logs' / 'slurm' / f'full-{job}-0.out'
  wait_for(log, r'step 10 \| loss', cluster, job)
  subprocess.run(['scancel', '--signal=TERM', '--full', job], env=cluster.env, check=True)
  stopped = int(wait_for(log, r'stopped by SIGTERM after step (\d+); checkpoint saved, the job requeues', cluster,
                         job)[1])
  assert 10 <= stopped < 150
  wait_for(log, rf'resumed from \S+/{stopped}\b', cluster, job)
  fields = cluster.wait(job, {'COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT'}, timeout=300)
  assert fields['JobState'] == 'COMPLETED' and fields['Restarts'] == '1', fields
  recorded = steps(tmp_path / 'run')
  assert recorded == sorted(set(recorded)) and recorded[-1] == 150  # every step once, to the last


@pytest.mark.long(2.5)  # against real SLURM daemons: end to end
def test_the_time_limit_signal_checkpoints_and_requeues(cluster, tmp_path):
  """`--signal-seconds` before `--time`: SLURM signals the script, the tasks checkpoint, the job requeues and
  the next start resumes from that step (the run is longer than the limit: the test then cancels it). SLURM
  may signal up to 60 s early, so the limit leaves the tasks time to start before the earliest signal. One
  task (the test above has two stop at one step): the run trains flat out for a minute or two."""
  job = submit(cluster, tmp_path, 'limit', '--time', '00:03:00', '--signal-seconds', '60', tasks=1,
               command=[*TINY, 'train.steps=1000000', 'train.eval_every=1000000', 'train.log_every=10',
                        'train.checkpoint.every=1000000', 'train.run_dir=run'])
  log = tmp_path / 'logs' / 'slurm' / f'limit-{job}-0.out'
  try:
    stopped = int(wait_for(log, r'stopped by SIGTERM after step (\d+); checkpoint saved, the job requeues',
                           cluster, job, timeout=240)[1])
    wait_for(log, rf'resumed from \S+/{stopped}\b', cluster, job, timeout=120)
    resumed = wait_for(log, r'resumed from[\s\S]*?step (\d+) \| loss', cluster, job, timeout=120)
    assert stopped < int(resumed[1]) <= stopped + 10
  finally:
    subprocess.run(['scancel', job], env=cluster.env)
  # scancel cancels: the tasks checkpoint, but the job is not requeued again.
  fields = cluster.wait(job, {'CANCELLED', 'PENDING'}, timeout=120)
  assert fields['JobState'] == 'CANCELLED' and fields['Restarts'] == '1', fields
