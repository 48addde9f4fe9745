"""`model.execution.loss_chunk`: the tiled output layer and token loss give the untiled loss and gradients, for every
family's objective (causal LM, MLM with its output bias and NSP, span corruption; tied and untied output
layers), on 1 device and on a data x fsdp x tensor mesh (vocabulary sharded), with z-loss and a tile that does
not divide the length."""
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.parallel.rules import sharding_context
from lm.jobs.pretraining import Pretraining
from lm.train.step import PretrainingLoss
from tests.conftest import SMALL

FAMILIES = {'gpt_tiny': [], 'bert_tiny': ['model.max_len=32'], 't5_tiny': ['model.d_ff=128'],
            'llama_tiny': ['model.num_kv_heads=2', 'model.d_ff=192'],  # llama: an untied lm_head
            'gemma2_tiny': ['model.d_ff=192', 'model.final_logit_softcap=2.0']}  # a soft-cap acting on the logits
MESHES = {'1 device': [], '2x2x2': ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2']}


def loss_and_grads(preset: str, mesh: str, loss_chunk: int):
  overrides = SMALL + FAMILIES[preset] + MESHES[mesh] + [f'model.execution.loss_chunk={loss_chunk}',
                                                         'train.z_loss=1e-3',
                                                         'train.run_dir=/tmp/unused']
  trainer = Pretraining(load_config(preset, overrides), jax.devices()[:1] if mesh == '1 device' else jax.devices())
  state, batch = trainer.init_state(), next(trainer.train_batches)
  loss = PretrainingLoss(trainer.assembly)

  @jax.jit
  def run(params, batch):
    with sharding_context(trainer.mesh):
      (value, sums), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, jax.random.key(0),
                                                                    loss.totals(batch))
    return value, sums, grads, trainer.held_out.eval_step(params, batch)
  return jax.device_get(run(state.params, batch))


@pytest.mark.parametrize('mesh', MESHES)
@pytest.mark.parametrize('preset', [p if p == 'gpt_tiny' else pytest.param(p, marks=pytest.mark.long(0.2))
                                    for p in FAMILIES])  # the fast tier: GPT
@pytest.mark.variants
def test_tiled_loss_matches_untiled(preset, mesh):
  value, sums, grads, evaluated = loss_and_grads(preset, mesh, 0)
  t_value, t_sums, t_grads, t_evaluated = loss_and_grads(preset, mesh, 12)
  assert sums['z'] > 0
  np.testing.assert_allclose(t_value, value, rtol=1e-6)
  for key in sums:
    np.testing.assert_allclose(t_sums[key], sums[key], rtol=1e-6, err_msg=key)
  for key in evaluated:
    np.testing.assert_allclose(t_evaluated[key], evaluated[key], rtol=1e-6, err_msg=key)
  flat, t_flat = jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(t_grads)
  assert len(flat) == len(t_flat)
  # Float32 rounding relative to the largest gradient: some are zero in exact arithmetic (the attention key
  # bias: softmax ignores a constant per query), and both sides hold only rounding noise there.
  scale = max(np.abs(g).max() for _, g in flat)
  for (path, g), t in zip(flat, t_flat):
    np.testing.assert_allclose(t, g, rtol=1e-5, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))
