"""Sharded training equals single-device training; FSDP splits the state 8 ways."""
import jax
import numpy as np
import pytest

from lm.assembly import assemble
from lm.parallel.mesh import mesh_shape, strategy_name
from lm.jobs.pretraining import Pretraining
from lm.train.step import compile_train_step

MESHES = {
  'dp': ['mesh.data=8'],
  'fsdp': ['mesh.fsdp=8'],
  'tp': ['mesh.tensor=8'],
  'fsdp_tp': ['mesh.fsdp=4', 'mesh.tensor=2'],
  'dp_fsdp_tp': ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'],
}


def run_steps(config, devices, steps=5):
  trainer = Pretraining(config, devices)
  state = trainer.init_state()
  losses = []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    losses.append(float(metrics['loss']))
  return losses, jax.device_get(state.params)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)


FAMILIES = {
  'gpt': ('gpt_tiny', []),
  'bert': ('bert_tiny', ['model.max_len=32']),
  't5': ('t5_tiny', ['model.num_decoder_layers=2', 'model.d_ff=128']),
  # 8 query heads sharing 2 key/value heads: tp=8 and dp_fsdp_tp (tensor=2... 8) cover KV heads fewer
  # than, and dividing, the tensor devices.
  'llama': ('llama_tiny', ['model.num_kv_heads=2', 'model.d_ff=192']),
  # Qwen3's per-head query/key norms, with a sliding window shorter than the rows and soft-capped logits
  'qwen3': ('qwen3_tiny', ['model.num_kv_heads=2', 'model.d_ff=192', 'model.sliding_window=8',
                           'model.attn_logit_softcap=5.0']),
}


def family_config(family, run_dir, *overrides):
  from lm.config import load_config
  from tests.conftest import SMALL
  preset, extra = FAMILIES[family]
  return load_config(preset, SMALL + extra + [f'train.run_dir={run_dir}'] + list(overrides))


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """(losses, params) of one device's run of a family with overrides, computed once for the whole suite."""
  from tests.conftest import computed_once

  def get(*overrides, family='gpt'):
    def compute():
      losses, params = run_steps(family_config(family, tmp_path_factory.mktemp('ref'), *overrides), jax.devices()[:1])
      return {'losses': np.asarray(losses), 'params': params}
    result = computed_once('sharding_' + '_'.join((family, *overrides)), compute)
    return list(result['losses']), result['params']
  return get


# Every mesh for GPT; for the other families (the same layers and rules table, their own attention, norms and
# heads) tensor parallelism over all 8 devices, which splits their heads, and the mesh with every axis.
CASES = [pytest.param(family, name, marks=() if family == 'gpt' else pytest.mark.long(0.2))  # the suite: every GPT mesh
         for family in FAMILIES for name in MESHES if family == 'gpt' or name in ('tp', 'dp_fsdp_tp')]


@pytest.mark.parametrize('family, name', CASES)
@pytest.mark.variants
def test_sharded_training_equals_one_device(family, name, tmp_path, reference, capfd):
  """... and XLA honours every sharding: no "involuntary full rematerialization" (a replicated copy of a
  tensor, which on a pod costs memory and bandwidth) while the step compiles."""
  config = family_config(family, tmp_path, 'mesh.data=1', *MESHES[name])
  assert strategy_name(mesh_shape(config.mesh, 8)) == name.replace('_', '+')
  losses, params = run_steps(config, jax.devices())
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  want_losses, want_params = reference(family=family)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert rel(flat(params), flat(want_params)) < 1e-5
  want_leaves = dict(jax.tree_util.tree_flatten_with_path(want_params)[0])
  for path, got in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:
      # Softmax ignores a shift shared by all keys, so this bias's true gradient is 0 and Adam
      # turns float noise into ~1e-7 updates; it stays ~0 on every mesh but is not comparable.
      assert np.abs(got).max() < 1e-5
      continue
    assert rel(got, want_leaves[path]) < 1e-5, name


@pytest.mark.long(0.5)
@pytest.mark.parametrize('mesh', [('mesh.data=8',), ('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')])
def test_dropout_is_the_same_on_any_mesh(small_config, reference, mesh):
  """Hidden and attention dropout draw the same masks on every mesh (the losses equal one device's), and they
  do drop something (the losses differ from a run without dropout)."""
  dropout = ('model.dropout=0.1', 'model.attention_dropout=0.1')
  losses, _ = run_steps(small_config(*mesh, *dropout), jax.devices(), steps=3)
  want_losses, _ = reference(*dropout)
  np.testing.assert_allclose(losses, want_losses[:3], rtol=1e-5)
  no_dropout, _ = reference()
  assert all(abs(a - b) > 1e-4 for a, b in zip(losses, no_dropout[:3]))


@pytest.mark.long(0.2)
def test_fsdp_splits_params_and_optimizer_state_eight_ways(tmp_path):
  # gpt_tiny's width: biases over the heads and mlp axes stay replicated, a share that falls as 1/d_model.
  from lm.config import load_config
  config = lambda *o: load_config('gpt_tiny', [f'train.run_dir={tmp_path}', 'mesh.data=1', *o])
  one = compile_train_step(assemble(config(), jax.devices()[:1])).memory_analysis()
  eight = compile_train_step(assemble(config('mesh.fsdp=8'), jax.devices())).memory_analysis()
  ratio = eight.argument_size_in_bytes / one.argument_size_in_bytes
  assert ratio <= 1 / 8 * 1.05, ratio


@pytest.mark.long(0.2)
def test_a_two_slice_mesh_trains_like_one_device(tmp_path, reference):
  """Data parallel across two (simulated) slices, fsdp and tensor within each: the slice axis enters through
  the rules table alone (the batch splits over slice x data x fsdp)."""
  config = family_config('gpt', tmp_path, 'mesh.slices=2', 'mesh.data=1', 'mesh.fsdp=2', 'mesh.tensor=2')
  assert strategy_name(mesh_shape(config.mesh, 8)) == 'multislice+fsdp+tp'
  losses, params = run_steps(config, jax.devices())
  want_losses, want_params = reference(family='gpt')
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert rel(flat(params), flat(want_params)) < 1e-5


@pytest.mark.parametrize('mesh', [('mesh.fsdp=8',), ('mesh.fsdp=4', 'mesh.tensor=2')])
@pytest.mark.variants
def test_initialisation_creates_each_shard_where_it_lives(tmp_path, mesh):
  """The compiled init function: its outputs carry the state's shardings, each device's output is its shards
  (about 1/8 of the state here), and its temporaries stay far below the whole params (it never builds the
  whole model on a device and slices it)."""
  from lm.assembly.accounting import shard_bytes
  from lm.assembly.state import make_init_fn
  from lm.config import load_config
  a = assemble(load_config('gpt_tiny', [f'train.run_dir={tmp_path}', 'mesh.data=1', *mesh]), jax.devices())
  compiled = make_init_fn(a.model, a.tx, a.shardings, a.config.data.seq_len).lower(
    jax.random.key(0)).compile()
  got, want = jax.tree.leaves(compiled.output_shardings), jax.tree.leaves(a.abstract_state)
  assert len(got) == len(want) and all(g.is_equivalent_to(w.sharding, w.ndim) for g, w in zip(got, want))
  stats = compiled.memory_analysis()
  whole = lambda tree: shard_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
  assert stats.output_size_in_bytes == pytest.approx(shard_bytes(a.abstract_state), rel=1e-3)
  assert stats.output_size_in_bytes < whole(a.abstract_state) / 7
  assert stats.temp_size_in_bytes < whole(a.abstract_params) / 4
