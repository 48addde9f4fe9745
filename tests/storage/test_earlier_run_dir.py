"""A run dir written before the second redesign keeps working: `tests/fixtures/llama_run` was written by lm at
37b9a8c (the command is in `llama_run_reference.json`: a small Llama with a moving average, stopped at step 4 of a
6-step schedule, checkpoints at 2 and 4), and the reference holds what that code gave: the straight run's steps 5
and 6, a sampled continuation, `lm eval` log-likelihoods (of the params and of their moving average) and `lm scaling collect
--evaluate`'s losses. Each command of today reads the directory and must give the same."""
import csv
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from lm import cli
from lm.parallel.mesh import one_device_mesh
from lm.jobs.pretraining import Pretraining
from lm.storage.convert.hf import load_hf
from lm.storage.run_dir import read_config
from lm.storage.source import ModelSource
from lm.train.logging import read_metrics
from tests.jobs.evals import releases

FIXTURES = Path(__file__).resolve().parents[1] / 'fixtures'
REFERENCE = json.loads((FIXTURES / 'llama_run_reference.json').read_text())


@pytest.fixture
def run(tmp_path):
  shutil.copytree(FIXTURES / 'llama_run', tmp_path / 'run')
  return tmp_path / 'run'


def _flat(records: dict) -> dict:
  return {f'{step}/{key}': value for step, values in records.items() for key, value in values.items()}


def _after_step_4(run_dir) -> dict:
  return {f'{r["step"]}/{k}': r[k] for r in read_metrics(run_dir) if r['step'] > 4
          for k in ('loss', 'val_loss', 'val_loss_ema') if k in r}


@pytest.mark.long(0.5)
def test_it_resumes_and_branches_to_the_straight_runs_steps(run, tmp_path):
  expected = _flat(REFERENCE['straight_steps_5_6'])
  branch = tmp_path / 'branch'
  config = read_config(run, [f'train.run_dir={branch}', f'train.branch_from={run}/checkpoints/2', 'train.steps=6'])
  Pretraining(config, jax.devices()[:1]).run()
  assert _after_step_4(branch) == pytest.approx(expected, rel=1e-6)
  config = read_config(run, [f'train.run_dir={run}', 'train.resume=true', 'train.steps=6'])
  Pretraining(config, jax.devices()[:1]).run()
  assert _after_step_4(run) == pytest.approx(expected, rel=1e-6)


@pytest.mark.long(0.5)
def test_eval_generate_convert_and_collect_read_it(run, tmp_path, capsys):
  data = tmp_path / 'data'
  releases.write_both(data, tmp_path / 'hf_layout')
  out = tmp_path / 'eval'  # the moving average: a view that reads the optimizer state
  assert cli.main(['eval', '--model', str(run), '--tasks', 'piqa', '--data-dir', str(data), '--limit', '4', '--ema',
                   '--out', str(out)]) == 0
  got = [json.loads(line)['loglikelihood'] for line in (out / 'piqa.jsonl').read_text().splitlines()]
  np.testing.assert_allclose(got, REFERENCE['eval_piqa_limit_4_loglikelihood_ema'], rtol=1e-5)

  capsys.readouterr()
  assert cli.main(['generate', '--run', str(run), '--prompt', 'def ', '--max-new-tokens', '16', '--temperature', '1.0',
                   '--seed', '0']) == 0
  assert capsys.readouterr().out == "--- 'def '\n" + REFERENCE['generate_def_16_temperature_1_seed_0']

  for step, source in ((4, run), (2, run / 'checkpoints' / '2')):  # the latest, or one checkpoint
    assert cli.main(['convert', '--from', str(source), '--to-hf', str(tmp_path / f'hf{step}')]) == 0
    exported = load_hf(tmp_path / f'hf{step}')[1]
    params = ModelSource(run, step=step).params(one_device_mesh())
    jax.tree.map(np.testing.assert_array_equal, exported, jax.device_get(params))
  assert any(jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), load_hf(tmp_path / 'hf2')[1],
                                          load_hf(tmp_path / 'hf4')[1])))

  points = tmp_path / 'points.csv'
  assert cli.main(['scaling', 'collect', str(run), '--evaluate', 'mesh.data=4', 'mesh.tensor=2', '--out',
                   str(points)]) == 0  # on the 8 test devices
  losses = {row['step']: float(row['loss']) for row in csv.DictReader(points.open())}
  assert losses == pytest.approx(REFERENCE['collect_evaluate_val_loss'], rel=1e-5)
