"""Where a run's time goes: the parts of each record, goodput across a kill -9 and a resume (the restart's
downtime and the steps done again), `lm report`, and a slow interval said when it happens."""
import json
import subprocess
import sys
import time

import pytest

from lm.train.callbacks import Interval
from lm.train.timing import Attempt, SlowSteps, account, read_attempts
from tests.conftest import SMALL, one_device_env

ZERO = {'startup': 0.0, 'device': 0.0, 'data': 0.0, 'checkpoint': 0.0, 'eval': 0.0, 'other': 0.0}


def line(t, step, **parts):
  return {'time': t, 'step': step, **ZERO, **parts}


def test_an_attempts_steps_past_the_next_ones_resume_point_are_recomputed_time():
  """Attempt 0 starts at 100, logs steps 10 (t 130) and 20 (t 150), dies; attempt 1 starts at 160 from step 10 and
  logs step 30 at 200. Counted: attempt 0 up to step 10 (30 s), attempt 1 whole (40 s); step 20's 20 s were
  recomputed, 10 s lost to the restart; wall 100 s."""
  first = Attempt(100.0, 0, [line(130.0, 10, startup=10.0, device=15.0, data=5.0),
                             line(150.0, 20, startup=10.0, device=30.0, data=5.0, checkpoint=5.0)])
  second = Attempt(160.0, 10, [line(200.0, 30, startup=8.0, device=30.0, eval=2.0)])
  summary = account([first, second])
  seconds = summary['seconds']
  assert summary['wall'] == 100.0 and summary['restarts'] == 1 and summary['recomputed_steps'] == 10
  assert (seconds['recomputed'], seconds['restart']) == (20.0, 10.0)
  assert (seconds['startup'], seconds['device'], seconds['data'], seconds['eval']) == (18.0, 45.0, 5.0, 2.0)
  assert sum(seconds.values()) == summary['wall'] and summary['goodput'] == 0.45


def test_a_slow_interval_is_said_when_it_happens(capsys):
  slow = SlowSteps(3.0)
  for step, seconds in ((2, 0.2), (4, 0.22), (6, 0.18), (8, 0.21), (10, 0.9)):
    record = {'step': step, 'time/device_s': seconds}
    slow.annotate(Interval([{'step': step - 1}, record], elapsed=seconds))
    assert record['time/per_step_s'] == seconds / 2
  # the median of 0.1, 0.11, 0.09 and 0.105 s is 0.1025 s
  assert capsys.readouterr().out == ('step 10: 0.45 s per step over the last 2, 4.4x the median 0.103 s of the '
                                     'intervals before\n')


@pytest.mark.long(1)
def test_a_killed_and_resumed_run_reports_its_lost_time_and_its_parts_add_up(tmp_path):
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.steps=60',
           'train.log_every=2', 'train.checkpoint.every=10', 'train.eval_every=20', f'train.run_dir={tmp_path}']
  began = time.time()
  first = subprocess.Popen(train, env=one_device_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 300
  while not any(a.lines and a.lines[-1]['step'] >= 26 for a in read_attempts(tmp_path)):
    assert first.poll() is None and time.time() < deadline, first.stderr.read().decode()[-2000:]
    time.sleep(0.05)
  first.kill()
  first.wait()
  lost_at = read_attempts(tmp_path)[0].lines[-1]['step']
  time.sleep(3)  # the restart's downtime
  resumed = subprocess.run(train + ['--resume'], env=one_device_env(), capture_output=True, text=True, timeout=600)
  ended = time.time()
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'resumed from' in resumed.stdout and '/checkpoints/20' in resumed.stdout
  shown = subprocess.run([sys.executable, '-m', 'lm.cli', 'report', str(tmp_path), '--json'], env=one_device_env(),
                         capture_output=True, text=True, timeout=300)
  report = json.loads(shown.stdout)
  seconds = report['seconds']
  print(report)
  assert report['steps'] == 60 and report['tokens'] == 60 * 16 * 32 and report['restarts'] == 1
  assert report['recomputed_steps'] == lost_at - 20 > 0 and seconds['recomputed'] > 0
  assert 3.0 <= seconds['restart'] < 3.0 + 10.0  # the sleep, and the interval the kill cut short
  assert sum(seconds.values()) == pytest.approx(report['wall'], rel=0.02)  # the parts make the wall time
  # the wall runs from the first process's start (by the test's own clock) to the last line, which the
  # resumed process wrote before its final save and exit
  attempts = read_attempts(tmp_path)
  assert attempts[0].start == pytest.approx(began, abs=1.5) and attempts[-1].last['time'] <= ended
  assert report['wall'] == pytest.approx(attempts[-1].last['time'] - attempts[0].start, rel=1e-6)
  assert report['goodput'] == pytest.approx(seconds['device'] / report['wall'])
  assert 0 < report['goodput'] < 1 and seconds['startup'] > seconds['device'] / 10  # two compiles
