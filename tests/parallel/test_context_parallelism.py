"""Context parallelism (`mesh.sequence`): training with the sequence split over devices (ring attention) equals
one device on rows of packed documents; what cannot split a sequence says so in one line."""
import importlib.util
import json
import re

import jax
import numpy as np
import pytest

from lm import cli
from lm.assembly import assemble
from lm.config import ConfigError
from lm.parallel.mesh import mesh_shape, strategy_name
from lm.parallel.rules import sharding_context
from lm.jobs.pretraining import Pretraining
from lm.train.step import PretrainingLoss, lay_out_sequences, lower_train_step
from tests.parallel.test_sharding import family_config, rel

MESHES = {'dp+cp': ['mesh.data=2', 'mesh.sequence=4'],
          'fsdp+cp+tp': ['mesh.fsdp=2', 'mesh.sequence=2', 'mesh.tensor=2']}


@pytest.fixture(scope='module')
def documents():
  """Short JSONL documents (1 to 4 words), so each 32-token row packs several; one path for every worker (the
  one-device references are shared, and the rows held out for validation follow a hash of the file's path)."""
  def build(root):
    rng = np.random.default_rng(0)
    words = 'the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo frogs'.split()
    lines = [json.dumps({'text': ' '.join(rng.choice(words, rng.integers(1, 5)))}) for _ in range(3000)]
    (root / 'docs.jsonl').write_text('\n'.join(lines) + '\n')
  from tests.conftest import built_once
  return built_once('context_parallel_documents', build)


def configured(family, tmp_path, documents, *overrides):
  return family_config(family, tmp_path, 'mesh.data=1', 'data.source=jsonl', f'data.paths=[{documents}/*.jsonl]',
                       'train.global_batch=8', 'train.eval_batches=0', *overrides)


def train(config, devices, steps):
  """The gradients of the first batch, then the losses of `steps` steps from it."""
  trainer = Pretraining(config, devices)
  a = trainer.assembly
  loss = PretrainingLoss(a)

  def grads(params, batch):  # as the train step computes them: batch laid out, then the loss's gradient
    with sharding_context(a.mesh):
      batch = lay_out_sequences(batch, a.mesh, config.data.seq_len)
      return jax.grad(lambda p: loss(p, batch, jax.random.key(0), loss.totals(batch))[0])(params)
  state, batch = trainer.init_state(), next(trainer.train_batches)
  first = jax.device_get(jax.jit(grads)(state.params, batch))
  losses = []
  for _ in range(steps):
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics['loss']))
    batch = next(trainer.train_batches)
  return first, losses, np.asarray(batch['segment_ids'])


@pytest.fixture(scope='module')
def one_device(tmp_path_factory, documents):
  """`train` of a family on one device, computed once for the whole suite."""
  from tests.conftest import computed_once

  def get(family):
    def compute():
      grads, losses, segments = train(configured(family, tmp_path_factory.mktemp(family), documents),
                                      jax.devices()[:1], 20)
      return {'grads': grads, 'losses': np.asarray(losses), 'segments': segments}
    result = computed_once(f'context_parallel_{family}', compute)
    return result['grads'], list(result['losses']), result['segments']
  return get


# Each family on one of the two meshes (all six pairings took 3 CPU-minutes; the ring is one code path): BERT's
# bidirectional rows and Llama's rotary, grouped-query attention on dp+cp, GPT's with fsdp and tensor beside it.
@pytest.mark.long(1)
@pytest.mark.parametrize('family, mesh', [('gpt', 'fsdp+cp+tp'), ('llama', 'dp+cp'), ('bert', 'dp+cp')])
def test_a_split_sequence_trains_as_one_device(family, mesh, tmp_path, documents, one_device, capfd):
  config = configured(family, tmp_path, documents, *MESHES[mesh])
  assert strategy_name(mesh_shape(config.mesh, 8)) == mesh
  grads, losses, segments = train(config, jax.devices(), 20)
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  want_grads, want_losses, _ = one_device(family)
  assert min(len(set(row)) for row in segments) >= 2  # every row packs documents (padding: tests/ops/attention/test_ring.py)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert rel(flat(grads), flat(want_grads)) < 1e-5
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
    if np.linalg.norm(want) > 1e-6:  # a gradient that is zero in exact arithmetic (a key bias) is float noise
      assert rel(got, want) < 1e-4, jax.tree_util.keystr(path)
  assert losses[0] == pytest.approx(want_losses[0], rel=1e-5)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-3)  # the sums' order differs; Adam amplifies it
  assert losses[-1] < losses[0] - 0.5


@pytest.mark.long(0.2)
def test_accumulation_and_remat_split_the_sequence_too(tmp_path, documents, one_device):
  config = configured('gpt', tmp_path, documents, *MESHES['dp+cp'], 'train.microbatches=2',
                      'model.execution.remat=full')
  grads, losses, _ = train(config, jax.devices(), 3)
  want_grads, want_losses, _ = one_device('gpt')
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert rel(flat(grads), flat(want_grads)) < 1e-5
  np.testing.assert_allclose(losses, want_losses[:3], rtol=1e-4)


@pytest.mark.long(1)
@pytest.mark.parametrize('family', ['gpt', 'bert'])
def test_flash_blocks_in_the_ring_train_as_one_device(family, tmp_path, documents, one_device):
  """`model.execution.attention_impl=flash` on a split sequence: each hop's blocks through our kernel (interpreted
  here), causal sub-blocks by the zig-zag layout (GPT) or whole blocks (BERT), against one device's XLA attention."""
  config = configured(family, tmp_path, documents, *MESHES['dp+cp'], 'model.execution.attention_impl=flash')
  grads, losses, _ = train(config, jax.devices(), 3)
  want_grads, want_losses, _ = one_device(family)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert rel(flat(grads), flat(want_grads)) < 1e-5
  np.testing.assert_allclose(losses, want_losses[:3], rtol=1e-4)


@pytest.mark.long(0.2)
def test_key_value_blocks_go_round_the_ring_and_no_device_gathers_the_sequence(small_config):
  """The compiled step passes blocks between neighbours (collective permutes); its per-device activation memory
  falls as the sequence splits further (attention's [length, length] scores above all), and so does its state:
  parameters and optimizer state shard over the sequence devices as over fsdp's."""
  temps, state = {}, {}
  for n in (1, 2, 4):
    a = assemble(small_config(f'mesh.sequence={n}', 'data.seq_len=256', 'model.max_len=256', 'train.global_batch=2'),
                 jax.devices()[:n])
    lowered = lower_train_step(a)
    assert ('collective_permute' in lowered.as_text()) == (n > 1)
    memory = lowered.compile().memory_analysis()
    temps[n], state[n] = memory.temp_size_in_bytes, memory.argument_size_in_bytes
  assert temps[4] < 0.7 * temps[2] < 0.7 * 0.7 * temps[1]
  assert state[4] < 0.3 * state[1] and state[2] < 0.55 * state[1]


@pytest.mark.parametrize('overrides, message', [
  (['mesh.sequence=2'], 't5 does not split its sequences over a mesh axis'),
  (['mesh.sequence=2', 'model.execution.attention_impl=tpu_flash'], 'auto, xla or flash (not tpu_flash)'),
  (['mesh.sequence=2', 'model.attention_dropout=0.1'],
   'ring attention with XLA blocks (mesh.sequence > 1) has no model.attention_dropout'),
  (['mesh.sequence=4', 'data.seq_len=36'], 'data.seq_len=36 does not split into 2 x mesh.sequence = 8 equal'),
])
def test_what_cannot_split_a_sequence_is_refused_in_one_line(overrides, message, tmp_path, capsys):
  preset = 't5_tiny' if 't5' in message else 'gpt_tiny'
  argv = ['train', '--config', preset, f'train.run_dir={tmp_path}/run', 'mesh.data=1', *overrides]
  assert cli.main(argv) != 0
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1
  assert not (tmp_path / 'run').exists()
  with pytest.raises(ConfigError, match=message.split(' (')[0]):
    assemble(family_config('t5' if 't5' in message else 'gpt', tmp_path, 'mesh.data=1', *overrides))


def test_glue_fine_tuning_takes_a_split_source_sequence_as_data_devices(tmp_path):
  """Task heads read fixed positions of a row ([CLS], the last token), which the split layout reorders."""
  from lm.jobs.glue.finetune import finetune_config
  from lm.jobs.glue.tasks import TASKS
  from lm.storage.run_dir import CONFIG
  (tmp_path / CONFIG).write_text(family_config('gpt', tmp_path, 'mesh.data=2', 'mesh.sequence=4').to_yaml())
  config = finetune_config(TASKS['rte'], str(tmp_path), None, [], num_train=100)
  assert (config.mesh.data, config.mesh.sequence) == (8, 1)
  with pytest.raises(ConfigError, match=r'GLUE fine-tuning does not split sequences over the mesh \(mesh.sequence=2\)'):
    finetune_config(TASKS['rte'], str(tmp_path), None, ['mesh.sequence=2', 'mesh.data=4'], num_train=100)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')
def test_auto_attention_on_a_tpu_slice_takes_the_ring_for_a_split_sequence(small_config):
  """`auto` means the flash kernel on TPU, but the ring where the sequence is split (lowered for v5e, not run)."""
  from lm.parallel.chips import topology_devices
  a = assemble(small_config('mesh.sequence=2', 'mesh.data=2', 'model.execution.attention_impl=auto'),
               topology_devices('v5e:2x2'))
  text = lower_train_step(a).as_text()
  assert 'collective_permute' in text and 'tpu_custom_call' not in text


@pytest.mark.long(0.5)
@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')
def test_flash_blocks_in_the_ring_compile_for_a_tpu_slice(small_config):
  """The flash ring through Mosaic: the kernel inside the ring's loop and its branches compiles for v5e, and the
  permutes overlap the kernels (each hop sends the next block while computing this one)."""
  from lm.parallel.chips import topology_devices
  a = assemble(small_config('mesh.sequence=4', 'model.execution.attention_impl=flash', 'data.seq_len=1024',
                            'model.max_len=1024'),
               topology_devices('v5e:2x2'))
  lowered = lower_train_step(a)
  text = lowered.as_text()
  assert 'collective_permute' in text and 'tpu_custom_call' in text
  compiled = lowered.compile()
  assert compiled.memory_analysis().temp_size_in_bytes > 0
  # The ring's loop bodies (the ones branching on the source shard) overlap communication with compute: in the
  # scheduled program, every collective-permute runs while a kernel call or a branch of them does.
  loops = [c for c in re.split(r'\n(?=\S.*\{\n)', compiled.as_text())
           if ' conditional(' in c and 'collective-permute-start' in c]
  assert len(loops) >= 2  # the forward ring and the backward one
  for body in loops:
    lines, starts, enclosed = body.splitlines(), {}, []
    for at, line in enumerate(lines):
      if start := re.match(r'\s*(?:ROOT )?%(\S+) = .*collective-permute-start\(', line):
        starts[start[1]] = at
      if (done := re.search(r'collective-permute-done\(.*?%(\S+?)[,)]', line)) and done[1] in starts:
        enclosed.append(sum('tpu_custom_call' in x or ' conditional(' in x for x in lines[starts[done[1]]:at]))
    assert enclosed and min(enclosed) > 0, (lines[0], enclosed)
