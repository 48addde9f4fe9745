"""train.trackers=[wandb]: the W&B run (offline, read back from its own transaction log) follows a kill -9 and
--resume as one run whose history equals metrics.jsonl, each step once; a branch names its source; an unreachable
service is one warning line and training goes on."""
import json
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from lm.train.logging import read_metrics
from lm.train.timing import is_timing
from lm.train.trackers import transaction_log
from tests.conftest import SMALL, one_device_env

pytest.importorskip('wandb')

TRAIN = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.trackers=[wandb]',
         'train.eval_every=6', 'train.checkpoint.every=4', 'optim.decay_steps=12']


def env(**extra):
  return one_device_env(JAX_PLATFORMS='cpu', **extra)


def offline_runs(run_dir):
  """(run id, config, history rows) of each offline W&B run under RUN/wandb, oldest first."""
  runs = []
  for path in sorted(run_dir.glob('wandb/offline-run-*/run-*.wandb')):
    records = transaction_log(path)  # a killed process's may hold nothing but the file header
    runs_records = [r.run for r in records if r.WhichOneof('record_type') == 'run']
    config = {item.key: json.loads(item.value_json) for run in runs_records for item in run.config.update}
    history = [{item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof('record_type') == 'history']
    runs.append((path.stem.removeprefix('run-'), config, history))
  return runs


def by_step(rows, step_key):
  """Rows merged per step, timing figures and nulls left out (a redone step's wall-clock figures differ)."""
  merged = defaultdict(dict)
  for row in rows:
    merged[row[step_key]].update({k: v for k, v in row.items() if not k.startswith('_') and k != 'step' and
                                  not is_timing(k) and v is not None and k not in ('tokens_per_sec', 'mfu')})
  return dict(merged)


@pytest.mark.long(1.5)
def test_a_killed_and_resumed_run_is_one_wandb_run_and_a_branch_names_its_source(tmp_path):
  run = tmp_path / 'run'
  offline = env(WANDB_MODE='offline')
  proc = subprocess.Popen([*TRAIN, 'train.steps=12', f'train.run_dir={run}'], env=offline,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  # past checkpoint 4 (written: its asynchronous save may lag on a loaded machine), before 8
  while not (any(r.get('step', 0) >= 7 for r in read_metrics(run)) and (run / 'checkpoints' / '4').is_dir()):
    assert proc.poll() is None and time.monotonic() < deadline, 'the run ended before it could be killed'
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = subprocess.run([*TRAIN, 'train.steps=12', f'train.run_dir={run}', '--resume'], env=offline,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]

  runs = offline_runs(run)
  run_id = json.loads((run / 'wandb_run.json').read_text())['id']
  assert len(runs) == 2 and {r[0] for r in runs} == {run_id}  # one W&B run, in two offline segments
  steps = [row['_step'] for _, _, history in runs for row in history]
  assert steps == sorted(set(steps)), 'a step logged twice'
  assert by_step([row for _, _, history in runs for row in history], '_step') == by_step(read_metrics(run), 'step')
  assert runs[-1][1]['train']['steps'] == 12 and 'branched_from' not in runs[-1][1]

  branch = tmp_path / 'branch'
  branched = subprocess.run([*TRAIN, 'train.steps=10', f'train.run_dir={branch}', f'train.branch_from={run}/'
                             'checkpoints/8', 'optim.decay_steps=12'], env=offline, capture_output=True, text=True,
                            timeout=600)
  assert branched.returncode == 0, branched.stderr[-2000:]
  [(branch_id, config, history)] = offline_runs(branch)
  assert branch_id != run_id
  assert by_step(history, '_step') == by_step(read_metrics(branch), 'step')  # the source's records to step 8 too
  assert config['branched_from'] == {'run_dir': str(run), 'step': 8, 'wandb_id': run_id}


@pytest.mark.long(0.4)
def test_an_unreachable_service_is_one_warning_and_training_goes_on(tmp_path):
  out = subprocess.run([*TRAIN, 'train.steps=2', f'train.run_dir={tmp_path}'], capture_output=True, text=True,
                       timeout=300, env=env(WANDB_MODE='online', WANDB_BASE_URL='http://127.0.0.1:9',
                                            WANDB_API_KEY='a' * 40, WANDB_INIT_TIMEOUT='3'))
  assert out.returncode == 0, out.stderr[-2000:]
  warnings = [line for line in out.stderr.splitlines() if line.startswith('wandb:')]
  assert len(warnings) == 1 and warnings[0].startswith('wandb: starting the run failed (') and \
      warnings[0].endswith('training goes on without W&B'), out.stderr[-2000:]
  assert [r['step'] for r in read_metrics(tmp_path) if 'loss' in r] == [1, 2]
