"""Training with our flash kernel follows the XLA reference, for every family on a 2x2x2 mesh, GPT on 1 device
(and Llama's grouped key/value heads on more tensor devices than it has of them): 10 steps, compile-bound."""
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL

FAMILIES = {'gpt_tiny': [], 'bert_tiny': ['model.max_len=32'], 't5_tiny': ['model.d_ff=128'],
            'llama_tiny': ['model.num_kv_heads=2', 'model.d_ff=192']}
MESHES = {'1 device': [], '2x2x2': ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'],
          'tensor 4': ['mesh.data=2', 'mesh.tensor=4']}
# One device (the kernel called directly) for GPT; every family on 2x2x2 (through shard_map, with its own
# masks, segments and biases), Llama also on tensor 4.
CASES = [('gpt_tiny', '1 device')] + [(preset, '2x2x2') for preset in FAMILIES] + [('llama_tiny', 'tensor 4')]


def losses(preset, overrides, devices, steps=10):
  config = load_config(preset, SMALL + FAMILIES[preset] + overrides + ['train.run_dir=/tmp/unused'])
  trainer = Pretraining(config, devices)
  state, out = trainer.init_state(), []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    out.append(float(metrics['loss']))
  return np.array(out)


@pytest.mark.long(1)
@pytest.mark.parametrize('preset, mesh', CASES)
def test_flash_training_matches_xla(preset, mesh):
  devices = jax.devices()[:1] if mesh == '1 device' else jax.devices()
  xla = losses(preset, MESHES[mesh] + ['model.execution.attention_impl=xla'], devices)
  flash = losses(preset, MESHES[mesh] + ['model.execution.attention_impl=flash'], devices)
  assert xla[-1] < xla[0] - 0.5
  np.testing.assert_allclose(flash, xla, rtol=2e-5)
