"""`model.execution.mlp_chunks`: the MLP over slices of the positions (a dense MLP's, or a dropless routed layer's
experts after routing) gives the whole MLP's loss and gradients under full remat, on the dense path's fsdp x sequence
x tensor mesh and on both expert paths (experts partitioned by XLA; expert parallelism), and the compiled step never
holds a [tokens, d_ff] intermediate whole: its widest MLP buffer is a quarter of the whole MLP's, or routed, that
plus each expert group's padding to whole tiles (on CPU, `tiled_matmul`: 1,024 token copies fill 2,048 padded rows
whole, 256 fill 1,280 in a quarter)."""
import re

import jax
import numpy as np
import pytest

from lm.config import ConfigError, load_config
from lm.jobs.pretraining import Pretraining
from lm.parallel.rules import sharding_context
from lm.train.step import PretrainingLoss
from tests.conftest import SMALL

# (preset, overrides, the MLP's width per device: the last axis of its activations)
CASES = {
  'dense': ('llama_tiny', ['model.num_kv_heads=2', 'model.d_ff=192', 'mesh.fsdp=2', 'mesh.sequence=2',
                           'mesh.tensor=2'], 192 // 2),
  'experts by XLA': ('moe_tiny', ['mesh.fsdp=8'], 176),
  'expert parallel': ('moe_tiny', ['mesh.fsdp=4', 'mesh.expert=2'], 176),
}


def compiled_step(case: str, chunks: int):
  preset, overrides, _ = CASES[case]
  config = load_config(preset, SMALL + overrides + ['model.execution.remat=full', 'mesh.data=1',
                                                    f'model.execution.mlp_chunks={chunks}',
                                                    'train.run_dir=/tmp/unused'])
  trainer = Pretraining(config, jax.devices())
  state, batch = trainer.init_state(), next(trainer.train_batches)
  loss = PretrainingLoss(trainer.assembly)

  @jax.jit
  def run(params, batch):
    with sharding_context(trainer.mesh):
      return jax.value_and_grad(loss, has_aux=True)(params, batch, jax.random.key(0), loss.totals(batch))
  return run.lower(state.params, batch).compile(), (state.params, batch)


def widest_mlp_buffer(compiled, width: int) -> int:
  """The most elements of any activation in the compiled program whose last axis is the MLP's `width`; the kernels
  ([..., d_model, width]) are left out."""
  shapes = [[int(d) for d in s.split(',')] for s in re.findall(r'[a-z]+\d*\[([\d,]+)\]', compiled.as_text())]
  return max(np.prod(s) for s in shapes if len(s) > 1 and s[-1] == width and s[-2] != 64)


@pytest.mark.parametrize('case', [c if c == 'dense' else pytest.param(c, marks=pytest.mark.long(0.2)) for c in CASES])
def test_mlp_in_chunks_equals_the_whole_mlp_and_holds_one_chunk(case):
  whole, args = compiled_step(case, 1)
  chunked, _ = compiled_step(case, 4)
  (value, sums), grads = jax.device_get(whole(*args))
  (c_value, c_sums), c_grads = jax.device_get(chunked(*args))
  np.testing.assert_allclose(c_value, value, rtol=1e-6)
  for key in sums:  # the token loss and, routed, the balance and z losses
    np.testing.assert_allclose(c_sums[key], sums[key], rtol=1e-6, err_msg=key)
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  scale = max(np.abs(g).max() for _, g in flat)
  for (path, g), c in zip(flat, jax.tree.leaves(c_grads)):
    np.testing.assert_allclose(c, g, rtol=1e-5, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path))
  width = CASES[case][2]
  # at least a device's share of the 16 x 32 tokens (k copies each, routed), whole
  assert widest_mlp_buffer(whole, width) >= 16 * 32 // 8 * width
  if case == 'dense':
    assert widest_mlp_buffer(chunked, width) * 4 == widest_mlp_buffer(whole, width)
  else:
    assert widest_mlp_buffer(chunked, width) <= 0.65 * widest_mlp_buffer(whole, width)


def test_mlp_chunks_below_one_is_one_line():
  with pytest.raises(ConfigError, match=r'model.execution.mlp_chunks=0 must be >= 1'):
    load_config('llama_tiny', ['model.execution.mlp_chunks=0'])
