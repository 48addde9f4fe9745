"""`lm finetune --resume`: a fine-tune stopped by SIGTERM or killed (-9) and resumed ends as an uninterrupted one."""
import json
import os
import signal
import subprocess
import sys

import pytest

from lm import cli
from lm.train import loop
from lm.train.timing import is_timing
from tests.conftest import built_once
from tests.jobs.glue import synthetic
from tests.jobs.glue.test_finetune import QUIET, save_hf_bert

STEPS = ['train.steps=12', 'train.eval_every=4', 'train.log_every=1', 'train.global_batch=8', 'data.seq_len=32',
         'optim.learning_rate=1e-3']
OUTPUTS = ('eval_results.json', 'dev_predictions.tsv')


@pytest.fixture(scope='module')
def hf_bert():
  return built_once('glue_hf_bert', save_hf_bert)


@pytest.fixture(scope='module')
def glue_dir():
  return built_once('glue_mrpc', synthetic.write_mrpc)


def argv(glue_dir, hf_bert, run_dir, *extra: str) -> list[str]:
  return ['finetune', '--task', 'mrpc', '--data-dir', str(glue_dir), '--init', str(hf_bert), *STEPS, *QUIET,
          f'train.run_dir={run_dir}', *extra]


def stop_at(monkeypatch, step: int, sig: int = signal.SIGTERM) -> None:
  """The loop's train steps send `sig` to this process as they take their `step`-th step from now (over every
  loop built from now: a sweep's points one after the other)."""
  make, calls = loop.make_train_step, []

  def make_stopping(*args, **kwargs):
    step_fn = make(*args, **kwargs)

    def stopping(*a):
      calls.append(1)
      if len(calls) == step:
        os.kill(os.getpid(), sig)
      return step_fn(*a)
    return stopping
  monkeypatch.setattr(loop, 'make_train_step', make_stopping)


def records(run_dir):
  return [json.loads(line) for line in (run_dir / 'mrpc' / 'metrics.jsonl').read_text().splitlines()]


def assert_same_run(run_dir, straight_dir):
  for name in OUTPUTS:
    assert (run_dir / 'mrpc' / name).read_text() == (straight_dir / 'mrpc' / name).read_text(), name
  timeless = lambda d: [{k: v for k, v in r.items() if not is_timing(k)} for r in records(d)]
  assert timeless(run_dir) == timeless(straight_dir)  # every step's loss, learning rate, gradient norm, dev metric


@pytest.fixture(scope='module')
def straight(glue_dir, hf_bert):
  """The uninterrupted fine-tune, from the same init and data files as the resumed runs (a WordPiece vocabulary
  trained in another process may order its ties otherwise)."""
  def build(out):
    assert cli.main(argv(glue_dir, hf_bert, out)) == 0
  return built_once('glue_straight', build)


@pytest.mark.long(0.5)
def test_a_fine_tune_stopped_by_sigterm_resumes_to_the_same_results(glue_dir, hf_bert, straight, tmp_path,
                                                                       monkeypatch, capsys):
  """SIGTERM at step 6 (no evaluation or checkpoint is due there): the step is checkpointed and nothing is
  written as a result; `--resume` continues to the same eval_results.json, dev predictions, best step and
  per-step losses as the uninterrupted run."""
  out = tmp_path / 'run'
  stop_at(monkeypatch, 6)
  assert cli.main(argv(glue_dir, hf_bert, out)) == 0
  assert 'stopped by SIGTERM after step 6; checkpoint saved, continue with --resume' in capsys.readouterr().out
  assert [p.name for p in (out / 'mrpc' / 'checkpoints').iterdir()] == ['6']  # the recipe keeps the latest
  assert not (out / 'mrpc' / 'eval_results.json').exists()
  monkeypatch.undo()
  assert cli.main(argv(glue_dir, hf_bert, out, '--resume')) == 0
  assert f'resumed from {out / "mrpc" / "checkpoints"}/6' in capsys.readouterr().out
  assert_same_run(out, straight)
  logged = records(out)
  assert [r['step'] for r in logged if 'loss' in r] == list(range(1, 13))
  assert all(r['tokens_per_sec'] > 0 for r in logged if 'loss' in r)  # every step is a logging step here
  assert json.loads((out / 'mrpc' / 'eval_results.json').read_text())['step'] == \
    json.loads((straight / 'mrpc' / 'eval_results.json').read_text())['step']


@pytest.mark.long(0.2)
def test_a_killed_fine_tune_resumes_from_its_last_checkpoint(glue_dir, hf_bert, straight, tmp_path):
  """kill -9 at step 10 (in a process of its own): the resumed run starts from the last checkpoint that was
  written (step 8 or 4; none is half-used) and ends as the uninterrupted run."""
  out = tmp_path / 'run'
  code = (f'import signal, sys\nfrom lm import cli\nfrom tests.jobs.glue.test_resume import stop_at\n'
          f'class Patch:\n  def setattr(self, *a): setattr(*a)\n'
          f'stop_at(Patch(), 10, signal.SIGKILL)\nsys.exit(cli.main({argv(glue_dir, hf_bert, out)!r}))\n')
  killed = subprocess.run([sys.executable, '-c', code], check=False, capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert not (out / 'mrpc' / 'eval_results.json').exists()
  assert cli.main(argv(glue_dir, hf_bert, out, '--resume')) == 0
  assert_same_run(out, straight)


@pytest.mark.long(0.5)
def test_an_interrupted_sweep_resumes_the_point_it_stopped_in(glue_dir, hf_bert, tmp_path, monkeypatch, capsys):
  sweep = ['--sweep', 'train.seed=0,1']
  assert cli.main(argv(glue_dir, hf_bert, tmp_path / 'straight', *sweep)) == 0
  stop_at(monkeypatch, 12 + 6)  # the second point's step 6
  assert cli.main(argv(glue_dir, hf_bert, tmp_path / 'run', *sweep)) == 0
  assert not (tmp_path / 'run' / 'sweep' / 'sweep_results.json').exists()
  monkeypatch.undo()
  capsys.readouterr()
  assert cli.main(argv(glue_dir, hf_bert, tmp_path / 'run', *sweep)) == 0
  out = capsys.readouterr().out
  assert 'seed=0 mrpc: done, skipped' in out and 'sweep/seed=1/mrpc/checkpoints/6' in out
  assert_same_run(tmp_path / 'run' / 'sweep' / 'seed=1', tmp_path / 'straight' / 'sweep' / 'seed=1')
  results = [json.loads((tmp_path / d / 'sweep' / 'sweep_results.json').read_text()) for d in ('run', 'straight')]
  assert results[0] == results[1]
