"""`lm train --profile START:COUNT` (and `lm finetune`): a trace of exactly those steps in RUN/profile/ that XProf
(TensorBoard's profile plugin) reads, a Perfetto trace beside it, and the same losses as an unprofiled run. The runs
are processes of their own without JAX_PLATFORMS, as a user's are: where libtpu is installed (the test extra), its
failed TPU backend would crash the tracer."""
import json
import os
import subprocess
import sys

import pytest

from lm import cli
from lm.train.logging import read_metrics
from lm.train.profiler import Profile
from tests.conftest import SMALL, one_device_env
from tests.jobs.glue import synthetic


def lm(*argv: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in one_device_env().items() if k != 'JAX_PLATFORMS'}
  done = subprocess.run([sys.executable, '-m', 'lm.cli', *argv], env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def traced_steps(profile_dir) -> list[int]:
  """The steps XProf's trace viewer finds in the run's one trace (its step annotations)."""
  from xprof.convert import raw_to_tool_data
  [trace] = list(profile_dir.glob('plugins/profile/*/*.xplane.pb'))
  assert list(trace.parent.glob('perfetto_trace.json.gz'))  # for ui.perfetto.dev
  data, _ = raw_to_tool_data.xspace_to_tool_data([str(trace)], 'trace_viewer', {})
  events = json.loads(data)['traceEvents']
  return sorted({int(e['args']['step_num']) for e in events if e.get('name', '').startswith('train ')
                 and 'step_num' in e.get('args', {})})


@pytest.mark.long(1)
def test_a_trace_holds_exactly_the_asked_steps_and_the_losses_are_unchanged(tmp_path):
  run, plain = tmp_path / 'run', tmp_path / 'plain'
  train = ['train', '--config', 'gpt_tiny', *SMALL, 'train.steps=8', 'train.log_every=4']
  done = lm(*train, f'train.run_dir={run}', '--profile', '4:3')
  assert f'profile of steps 4-6 in {run}/profile (tensorboard --logdir {run}/profile' in done.stdout
  assert traced_steps(run / 'profile') == [4, 5, 6]
  lm(*train, f'train.run_dir={plain}')
  loss = lambda d: [(r['step'], r['loss']) for r in read_metrics(d) if 'loss' in r]
  assert loss(run) == loss(plain) and len(loss(run)) == 8

  synthetic.write_rte(tmp_path / 'glue', train=64, dev=16, test=4)
  lm('finetune', '--task', 'rte', '--data-dir', str(tmp_path / 'glue'), '--init', str(run), '--profile', '2:2',
     f'train.run_dir={tmp_path / "ft"}', 'train.steps=4', 'train.eval_every=4', 'train.global_batch=8',
     'data.seq_len=32', 'train.progress=false')
  assert traced_steps(tmp_path / 'ft' / 'rte' / 'profile') == [2, 3]


@pytest.mark.parametrize('spec', ['1:3', '4', '4:0', 'a:b'])
def test_a_bad_profile_is_one_line(spec, tmp_path, capsys):
  assert cli.main(['train', '--config', 'gpt_tiny', f'train.run_dir={tmp_path}/run', '--profile', spec]) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and f'train.profile={spec} must be START:COUNT with START >= 2' in err
  assert not os.path.exists(tmp_path / 'run')


def test_the_trace_brackets_the_steps_and_never_a_first_step(capsys):
  """Started after step START-1 and stopped after the last asked step (or the run's end); a resumed run whose
  first step (which compiles) falls in the window traces nothing and says so."""
  profile = Profile('4:3', '/unused')
  profile.start(0, None, [])
  assert [s for s in range(1, 10) if profile.due(s, final=s == 9, stopping=False)] == [3]  # not tracing yet
  profile.tracing = True
  assert next(s for s in range(4, 10) if profile.due(s, final=s == 9, stopping=False)) == 6
  assert profile.due(5, final=True, stopping=False) and profile.due(4, final=False, stopping=True)
  resumed = Profile('4:3', '/unused')
  resumed.start(4, None, [])
  assert not any(resumed.due(s, final=False, stopping=False) for s in range(5, 10))
  assert 'step 5 is this process\'s first (it compiles the program); steps 4-6 are not traced' in capsys.readouterr().out
