"""`lm convert`: HF directory -> lm run directory (orbax params) -> HF directory, and exporting a trained run."""
import json

import jax
import numpy as np
import torch
import transformers

from lm import cli
from lm.checkpoint import Checkpointer
from lm.config import load_config
from lm.convert.hf import load_hf
from lm.convert.run_dir import restore_params
from lm.train.loop import Trainer
from tests.convert.test_hf import assert_same_tensors, save_hf_model


def test_convert_round_trip_through_a_run_dir(tmp_path, capsys):
  hf, run, out = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'out'
  save_hf_model('bert', hf)
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 0
  model, params = load_hf(hf)
  config = load_config(str(run / 'config.yaml'))
  assert config.model == model.cfg and config.train.run_dir == str(run) and config.data.seq_len == 32
  jax.tree.map(np.testing.assert_array_equal, restore_params(run, config), params)

  assert cli.main(['convert', '--to-hf', str(out), '--from', str(run)]) == 0
  assert_same_tensors(hf, out)
  assert json.loads((out / 'config.json').read_text()) == json.loads((hf / 'config.json').read_text())

  capsys.readouterr()
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 2
  assert cli.main(['convert', '--from-hf', str(hf)]) == 2
  err = capsys.readouterr().err.splitlines()
  assert 'already holds a model' in err[0] and 'needs --to RUN_DIR' in err[1]


def test_a_training_checkpoint_exports_to_transformers(small_config, tmp_path):
  """A scanned-layer GPT checkpointed by lm's train loop loads as GPT2LMHeadModel with the same logits."""
  config = small_config()
  trainer = Trainer(config, jax.devices()[:1], with_data=False)
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: (0.2 * rng.normal(size=a.shape)).astype(a.dtype), trainer.abstract_state)
  checkpoints = Checkpointer(config.run_dir / 'checkpoints', keep=1, async_save=False)
  checkpoints.save(7, state, {}, config.to_dict())
  checkpoints.close()
  (config.run_dir / 'config.yaml').write_text(config.to_yaml())
  assert cli.main(['convert', '--to-hf', str(tmp_path / 'hf'), '--from', str(config.run_dir)]) == 0

  hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'hf').eval()
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, size=(2, 16))
  with torch.no_grad():
    theirs = hf_model(torch.as_tensor(tokens)).logits.numpy()
  ours = np.asarray(trainer.model.apply({'params': state.params}, tokens))
  assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4
