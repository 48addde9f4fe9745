"""Resuming with other execution settings (layer layout, remat, attention kernel, compute dtype) continues the
same run; a checkpoint written by an earlier version of lm still resumes."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from lm.models.transformer import relayout
from lm.storage.run_dir import read_config
from lm.train.logging import read_metrics
from lm.jobs.pretraining import Pretraining

COMMON = ['train.steps=4', 'train.checkpoint.every=2', 'optim.decay_steps=4']
FIXTURE = Path(__file__).parent.parent / 'fixtures' / 'gpt_run'


def losses(run_dir):
  return {r['step']: r['loss'] for r in read_metrics(run_dir) if 'loss' in r}


@pytest.mark.parametrize('before, after, rtol, mesh', [
  ('model.execution.scan_layers=true', 'model.execution.scan_layers=false', 1e-5, 'mesh.fsdp=1'),
  ('model.execution.scan_layers=false', 'model.execution.scan_layers=true', 1e-5, 'mesh.fsdp=1'),
  # sharded params and moments
  ('model.execution.scan_layers=true', 'model.execution.scan_layers=false', 1e-5, 'mesh.fsdp=2'),
  ('model.execution.remat=none', 'model.execution.remat=full', 1e-5, 'mesh.fsdp=1'),
  ('model.execution.attention_block_q=128', 'model.execution.attention_block_q=16', 1e-5, 'mesh.fsdp=1'),
  ('model.execution.dtype=float32', 'model.execution.dtype=bfloat16', 2e-2, 'mesh.fsdp=1'),
])
@pytest.mark.long(1)
def test_resume_may_change_how_the_step_computes(small_config, tmp_path, capsys, before, after, rtol, mesh):
  devices = jax.devices()[:int(mesh.split('=')[1])]
  straight = Pretraining(small_config(*COMMON, before, mesh, f'train.run_dir={tmp_path}/a'), devices)
  straight.run()
  Pretraining(small_config(*COMMON, before, mesh, 'train.steps=2', f'train.run_dir={tmp_path}/b'), devices).run()
  capsys.readouterr()
  resumed = Pretraining(small_config(*COMMON, after, mesh, 'train.resume=true', f'train.run_dir={tmp_path}/b'), devices)
  resumed.run()
  key, old = before.split('=')
  assert f'written with other execution settings: {key}={old} -> {after.split("=")[1]}' in capsys.readouterr().out
  a, b = losses(tmp_path / 'a'), losses(tmp_path / 'b')
  assert sorted(b) == [1, 2, 3, 4] and b[4] != b[2]
  np.testing.assert_allclose([b[s] for s in (3, 4)], [a[s] for s in (3, 4)], rtol=rtol)
  assert int(resumed.final_state.step) == 4
  expected = relayout(straight.final_state.params, resumed.config.model.execution.scan_layers)
  flat_a, tree_a = jax.tree.flatten(expected)
  flat_b, tree_b = jax.tree.flatten(resumed.final_state.params)
  assert tree_a == tree_b
  for x, y in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=50 * rtol, atol=50 * rtol * 1e-2)


def test_the_layout_change_reaches_moments_inside_per_label_optimizer_states(small_config):
  """μP's param groups and the selection biases' fixed label (optax.multi_transform) keep the moments under a dict
  of labels: unrolling relays those out too (they stayed scanned, and a restore onto an unrolled run set the
  checkpoint aside as unrestorable), and scanning again restores the state's own tree; a stack with a dense first
  layer scans in two runs."""
  from lm.assembly import assemble
  from tests.models.test_moe import MOE
  config = small_config(*MOE, 'model.num_layers=3', 'model.moe.first_dense=1', 'model.moe.bias_rate=0.01',
                        'model.parametrization=mup', 'model.mup.base_width=32')
  state = assemble(config, jax.devices()[:1]).abstract_state
  unrolled = relayout(state, False)
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(unrolled.opt_state)[0]]
  assert any("['layers_2']" in path for path in paths)
  assert not [path for path in paths if "['layers_from_" in path or "['layers']" in path]
  assert jax.tree.structure(relayout(unrolled, True)) == jax.tree.structure(state)
  assert {k for k in state.params['decoder'] if 'layers' in k} == {'layers_from_0', 'layers_from_1'}


def test_resume_still_refuses_a_change_of_parameters(small_config, tmp_path):
  from lm.config import ConfigError
  Pretraining(small_config('train.steps=1'), jax.devices()[:1]).run()
  with pytest.raises(ConfigError, match=r'different model \(differs in model.num_kv_heads\)'):
    Pretraining(small_config('train.steps=2', 'train.resume=true', 'model.num_kv_heads=4',
                             'model.execution.dtype=bfloat16'),
            jax.devices()[:1]).run()


def test_a_run_directory_from_an_earlier_version_resumes(tmp_path):
  """`tests/fixtures/gpt_run` was written by lm at commit 13c7027, stopped at step 2 of 3:
    lm train --config gpt_tiny model.d_model=16 model.num_heads=2 model.num_layers=2 model.d_ff=64
      model.max_len=32 data.seq_len=32 train.global_batch=4 train.eval_batches=1 train.eval_every=1
      train.checkpoint.every=2 optim.warmup_steps=1 optim.decay_steps=3 mesh.data=1 train.steps=2
  `gpt_run_step3.json` holds step 3 of the same command run straight to train.steps=3. A change that can no
  longer resume old run directories, or resumes them differently, fails here."""
  run = tmp_path / 'gpt_run'
  shutil.copytree(FIXTURE, run)
  config = read_config(run, [f'train.run_dir={run}', 'train.resume=true', 'train.steps=3'])
  Pretraining(config, jax.devices()[:1]).run()
  expected = json.loads((FIXTURE.parent / 'gpt_run_step3.json').read_text())
  records = [r for r in read_metrics(run) if r['step'] == 3]
  got = {k: r[k] for r in records for k in ('loss', 'val_loss') if k in r}
  assert got == pytest.approx({k: expected[k] for k in ('loss', 'val_loss')}, rel=1e-5)
