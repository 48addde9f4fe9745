"""Today's open architectures train: a tiny Gemma 2 (sandwich (1 + w) norms, soft-capped attention and output
logits, a window in every other layer) and a tiny Qwen3 (query/key norms) learn the embedded corpus for 50 steps,
on one device and on a data x fsdp x tensor mesh, which gives the same losses; Gemma 2 also with its sequence split
over the mesh (ring attention with the window and soft-capping)."""
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.pretraining import Pretraining
from tests.conftest import SMALL

PRESETS = {'gemma2_tiny': ['model.sliding_window=8'],  # shorter than the 32-token rows
           'qwen3_tiny': []}
MESHES = {'gemma2_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'),
                          ('mesh.data=2', 'mesh.sequence=2', 'mesh.tensor=2')],
          'qwen3_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')]}


def losses(preset: str, devices: list, run_dir, *mesh: str) -> list[float]:
  config = load_config(preset, SMALL + PRESETS[preset] + ['train.steps=50', f'train.run_dir={run_dir}', *mesh])
  trainer = Pretraining(config, devices)
  state, out = trainer.init_state(), []
  for _ in range(50):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    out.append(float(metrics['loss']))
  return out


@pytest.mark.long(0.5)
@pytest.mark.parametrize('preset', list(PRESETS))
def test_fifty_steps_learn_and_a_mesh_equals_one_device(preset, tmp_path):
  one = losses(preset, jax.devices()[:1], tmp_path / 'one')
  print(preset, [round(x, 4) for x in one[::10]], one[-1])
  assert np.mean(one[-5:]) < one[0] - 1.0  # from ~ln(264) = 5.6 towards the corpus's byte statistics
  for i, mesh in enumerate(MESHES[preset]):
    np.testing.assert_allclose(losses(preset, jax.devices(), tmp_path / f'mesh{i}', *mesh), one, rtol=2e-4,
                               err_msg=str(mesh))
