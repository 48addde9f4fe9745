"""A train step on a mesh with stages pipelines the layer stack (`model.execution.pipeline`) over its
`train.microbatches` in one fill and drain (GPipe, circular), or by 1F1B with the loss taken in the last stage,
composed with the other mesh axes: its loss and every gradient equal the
one-device step's with the same microbatches (accumulated), whatever the stages' buffers hold before the first send
(NaN), routed experts' statistics and token counts included, also with a stage's weights gathered once (no all-gather
left in the loops); a run trained on 4 stages resumes on 1 and on 2 with the same losses; what the stages cannot run
is one line.
"""
import re
import shutil

import jax
import numpy as np
import pytest

from flax.traverse_util import flatten_dict

from lm.config import ConfigError, load_config
from lm.jobs.pretraining import Pretraining
from lm.parallel.pipeline import loss_taker, pipelining
from lm.parallel.chips import physical_topology, topology_devices
from lm.parallel.mesh import make_mesh
from lm.parallel.rules import sharding_context
from lm.parallel.schedules import table
from lm.train.logging import read_metrics
from lm.train.step import PretrainingLoss, _gradients, lay_out_sequences, make_train_step
from lm.planning.stages import stages_report
from tests.conftest import SMALL, computed_once, needs_libtpu

MICROBATCHES = 4
COMMON = ['model.num_layers=8', 'model.num_kv_heads=4', f'train.microbatches={MICROBATCHES}',
          'train.run_dir=/tmp/unused', 'model.execution.scan_layers=true']
MESHES = {  # (preset, mesh)
  'stage 4 x fsdp 2': ('llama_tiny', ['mesh.stage=4', 'mesh.fsdp=2']),
  'stage 2 x data 2 x tensor 2': ('llama_tiny', ['mesh.stage=2', 'mesh.data=2', 'mesh.tensor=2']),
  'stage 2 x sequence 2 x fsdp 2': ('llama_tiny', ['mesh.stage=2', 'mesh.sequence=2', 'mesh.fsdp=2']),
  # 7 layers: the stages run 2, 2, 2 and 1 (params replicated over the stages, as they do not split evenly)
  'stage 4 x fsdp 2, 7 layers': ('llama_tiny', ['mesh.stage=4', 'mesh.fsdp=2', 'model.num_layers=7']),
  # routed experts inside the stages: balance and z losses, and the token counts that move the selection biases
  'stage 2 x expert 2 x fsdp 2': ('moe_tiny', ['mesh.stage=2', 'mesh.expert=2', 'mesh.fsdp=2', 'model.num_layers=4',
                                               'model.moe.bias_rate=0.001', 'model.moe.balance_over=model']),
  # for 1F1B, whose stages take their own layers' balance loss: 2 dense layers (GPipe), then 4 routed ones (1F1B)
  'stage 2 x expert 2 x fsdp 2, dense first': ('moe_tiny', ['mesh.stage=2', 'mesh.expert=2', 'mesh.fsdp=2',
                                                            'model.num_layers=6', 'model.moe.first_dense=2',
                                                            'model.moe.bias_rate=0.001']),
}
SCHEDULES = {
  'gpipe': ['model.execution.pipeline.schedule=gpipe'],
  'circular': ['model.execution.pipeline.schedule=circular', 'model.execution.pipeline.repeats=2',
               'model.execution.remat=full'],
  'circular, gathered once': ['model.execution.pipeline.schedule=circular', 'model.execution.pipeline.repeats=2',
                              'model.execution.pipeline.gather_once=true'],
  # the loss taken in the last stage; dense models only (routed experts are refused)
  '1f1b': ['model.execution.pipeline.schedule=1f1b', 'model.execution.remat=full'],
}
# NaN in the buffers, on a case of each kind: bubbles with collectives inside a stage (ring attention), routed
# statistics, several bubbles a stage (4 stages)
NAN_FILLED = {('stage 4 x fsdp 2', 'gpipe'), ('stage 2 x sequence 2 x fsdp 2', 'gpipe'),
              ('stage 2 x expert 2 x fsdp 2', 'circular'), ('stage 2 x sequence 2 x fsdp 2', '1f1b')}


def runs(mesh: str, schedule: str) -> bool:
  if 'dense first' in mesh:
    return schedule == '1f1b'
  if schedule == '1f1b':  # not with balance_over=model
    return 'expert' not in mesh
  gathered = 'stage 2' in mesh and 'fsdp' in mesh
  return schedule == 'gpipe' or 'layers' not in mesh and (schedule == 'circular' or gathered)


# the fast tier: GPipe on the meshes without routed experts or a sequence axis (the costliest), and one 1F1B
FAST = lambda mesh, schedule: (schedule == 'gpipe' and not {'expert', 'sequence'} & set(mesh.split())
                               or (mesh, schedule) == ('stage 4 x fsdp 2', '1f1b'))
CASES = [pytest.param(mesh, schedule, marks=() if FAST(mesh, schedule) else pytest.mark.long(0.3))
         for mesh in MESHES for schedule in SCHEDULES if runs(mesh, schedule)]


def gradients(preset: str, overrides: list[str], devices: list, bubble: float = 0.0) -> dict:
  """The batch's loss sums and gradients, by the step's own code: pipelined over the stages (a mesh with them), or
  accumulated."""
  trainer = Pretraining(load_config(preset, SMALL + COMMON + overrides), devices)
  state, batch = trainer.init_state(), next(trainer.train_batches)
  loss = PretrainingLoss(trainer.assembly)
  grad_fn = jax.value_and_grad(loss, has_aux=True)

  @jax.jit
  def run(params, batch):
    with sharding_context(trainer.mesh):
      batch = lay_out_sequences(batch, trainer.mesh, trainer.config.data.seq_len)
      totals = loss.totals(batch)
      return _gradients(grad_fn, params, batch, jax.random.key(0), totals, MICROBATCHES,
                        stages=trainer.mesh.shape['stage'], bubble=bubble)
  grads, sums = jax.device_get(run(state.params, batch))
  return {'grads': grads, 'sums': sums}


def reference(preset: str, overrides: list[str]) -> dict:
  """One device's, the microbatches accumulated (shared by the meshes and schedules)."""
  same = [o for o in overrides if not o.startswith('mesh.')]
  return computed_once(re.sub(r'\W', '_', f'pipelined_step_reference_{preset}_{"_".join(same)}'),
                       lambda: gradients(preset, same, jax.devices()[:1]))


@pytest.mark.parametrize('mesh, schedule', CASES)
def test_the_pipelined_step_equals_the_accumulated_one(mesh, schedule):
  preset, overrides = MESHES[mesh]
  want = reference(preset, overrides)
  got = gradients(preset, overrides + SCHEDULES[schedule], jax.devices())
  for key, value in flatten_dict(want['sums'], sep='/').items():  # the token loss, and routed the aux terms, counts
    np.testing.assert_allclose(flatten_dict(got['sums'], sep='/')[key], value, rtol=1e-6, err_msg=key)
  flat = jax.tree_util.tree_flatten_with_path(want['grads'])[0]
  scale = max(np.abs(g).max() for _, g in flat)
  for (path, w), g in zip(flat, jax.tree.leaves(got['grads'])):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
  if (mesh, schedule) not in NAN_FILLED:
    return
  nan = gradients(preset, overrides + SCHEDULES[schedule], jax.devices(), bubble=float('nan'))
  for g, n in zip(jax.tree.leaves(got), jax.tree.leaves(nan)):
    np.testing.assert_array_equal(n, g)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_the_train_step_runs_its_microbatches_through_one_tick_loop(schedule):
  """The compiled step holds no accumulation loop, but GPipe's forward and backward tick loops, m + p - 1 ticks each,
  or 1F1B's one loop of the table's ticks with two stage-to-stage sends a tick."""
  config = load_config('llama_tiny', SMALL + COMMON + MESHES['stage 4 x fsdp 2'][1] + SCHEDULES[schedule])
  trainer = Pretraining(config, jax.devices())
  step = make_train_step(trainer.assembly, PretrainingLoss(trainer.assembly))
  text = step.lower(trainer.init_state(), next(trainer.train_batches)).compile().as_text()
  loops = re.findall(r'while\(.*body=(%[\w.-]+).*"known_trip_count":\{"n":"(\d+)"\}', text)
  trips = [int(n) for _, n in loops]
  assert MICROBATCHES not in trips, trips
  if schedule == 'gpipe':
    assert trips.count(MICROBATCHES + 4 - 1) == 2, trips
    return
  ticks = [body for body, n in loops if int(n) == len(table('1f1b', 4, MICROBATCHES).ticks)]
  assert len(ticks) == 1, loops
  assert re.search(rf'^{re.escape(ticks[0])} .*?^}}', text, re.M | re.S)[0].count('collective-permute(') == 2


@pytest.mark.parametrize('once, schedule', [(False, 'gpipe'), (True, 'gpipe'), (True, '1f1b')])
def test_gathering_once_takes_the_weights_all_gathers_out_of_the_loops(once, schedule):
  """Gathered once, a stage's fsdp-sharded weights are gathered before the tick loop (GPipe's two, 1F1B's one);
  else each layer's at each tick (inside the layers' loop, inside the tick loop)."""
  config = load_config('llama_tiny', SMALL + COMMON + ['mesh.stage=2', 'mesh.fsdp=4', 'model.num_layers=4',
                                                       f'model.execution.pipeline.gather_once={once}',
                                                       f'model.execution.pipeline.schedule={schedule}'])
  trainer = Pretraining(config, jax.devices())
  step = make_train_step(trainer.assembly, PretrainingLoss(trainer.assembly))
  text = step.lower(trainer.init_state(), next(trainer.train_batches)).compile().as_text()
  bodies = [re.search(rf'^{re.escape(body)} .*?^}}', text, re.M | re.S)[0]
            for body in re.findall(r'while\(.*body=(%[\w.-]+)', text)]
  gathers = [body.count('all-gather(') for body in bodies]
  assert (sum(gathers) == 0) == once, gathers


@pytest.mark.long(0.5)
def test_a_pipelined_run_resumes_on_other_stage_counts(tmp_path):
  run = lambda name, *extra: Pretraining(load_config('llama_tiny', SMALL + COMMON + [
    'train.steps=4', 'train.checkpoint.every=2', 'optim.decay_steps=4', 'train.global_batch=32', 'mesh.fsdp=-1',
    f'train.run_dir={tmp_path}/{name}', *extra]), jax.devices()).run()
  losses = lambda name: {r['step']: r['loss'] for r in read_metrics(tmp_path / name) if 'loss' in r}
  run('straight', 'mesh.stage=4')
  run('half', 'mesh.stage=4', 'train.steps=2')
  for stages in (1, 2):
    shutil.copytree(tmp_path / 'half', tmp_path / f'to_{stages}')
    run(f'to_{stages}', f'mesh.stage={stages}', 'train.resume=true')
    a, b = losses('straight'), losses(f'to_{stages}')
    assert sorted(b) == [1, 2, 3, 4]
    np.testing.assert_allclose([b[s] for s in (3, 4)], [a[s] for s in (3, 4)], rtol=1e-6)


@pytest.mark.parametrize('overrides, message', [
  (['mesh.stage=4', 'model.execution.pipeline.schedule=circular', 'model.execution.pipeline.repeats=3'],
   r'model.num_layers=8 cannot fill mesh.stage=4 x model.execution.pipeline.repeats=3 stages: each needs a layer'),
  (['mesh.stage=4', 'model.execution.pipeline.schedule=circular', 'model.execution.pipeline.repeats=2',
    'train.microbatches=2'], r'train.microbatches=2 is below mesh.stage=4: the circular schedule'),
  (['mesh.stage=2', 'model.execution.scan_layers=false'], r'mesh.stage=2 pipelines the scanned layer stack'),
  (['mesh.stage=2', 'model.execution.pipeline.repeats=2'], r'repeats=2 needs schedule=circular'),
  (['mesh.stage=2', 'train.noise_scale=true'], r'train.noise_scale=true needs each microbatch\'s own gradient'),
  (['mesh.stage=4', 'model.execution.pipeline.schedule=1f1b', 'train.microbatches=2'],
   r'train.microbatches=2 is below mesh.stage=4: 1f1b then holds as many microbatches as gpipe'),
  (['mesh.stage=2', 'model.execution.pipeline.schedule=1f1b', 'model.execution.pipeline.repeats=2'],
   r'repeats=2 needs schedule=circular \(1f1b passes the stages once\)'),
  (['mesh.stage_slices=0'], r'mesh.stage_slices=0 must be a positive number of TPU slices'),
  (['mesh.stage=4', 'mesh.stage_slices=4'], r'model.num_layers=8 cannot fill mesh.stage=4 x mesh.stage_slices=4 x '
                                            r'model.execution.pipeline.repeats=1 stages'),
])
def test_what_the_stages_cannot_run_is_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config('llama_tiny', SMALL + COMMON + overrides)


@pytest.mark.parametrize('preset, overrides, message', [
  ('t5_tiny', [], r'does not pipeline its two stacks over mesh.stage'),
  ('moe_tiny', ['model.moe.first_dense=1'], r'a run of 1 dense layer\(s\) \(model.moe\), pipelined on its own, '
                                            r'cannot fill mesh.stage=2'),
  ('moe_tiny', ['model.execution.pipeline.schedule=1f1b', 'train.microbatches=2', 'model.moe.balance_over=model'],
   r'model.moe.balance_over=model averages every layer\'s load before the loss, which 1f1b\'s stages cannot'),
  ('moe_tiny', ['model.execution.pipeline.schedule=1f1b', 'train.microbatches=2', 'model.num_layers=8',
                'model.moe.dense_layers=[2,3]'],
   r'schedule=1f1b runs routed layers \(model.moe\) only as the last run of the stack'),
  ('bert_tiny', ['model.execution.pipeline.schedule=1f1b', 'train.microbatches=2'],
   r'1f1b takes the loss in the last stage, which the bert family\'s stack cannot'),
])
def test_families_the_stages_cannot_run_are_one_line(preset, overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(preset, ['mesh.stage=2', 'model.execution.scan_layers=true', *overrides])


def test_a_1f1b_step_whose_loss_is_not_offered_is_one_line():
  """A job's own loss (DPO's, a classifier's) does not offer itself per microbatch: the stack cannot take it."""
  trainer = Pretraining(load_config('llama_tiny', SMALL + COMMON + ['mesh.stage=2', 'mesh.fsdp=4']), jax.devices())
  with sharding_context(trainer.mesh), pipelining(MICROBATCHES):
    assert loss_taker('gpipe') is None
    with pytest.raises(ConfigError, match=r'schedule=1f1b takes the loss in the last stage, and this job\'s loss '
                                          r'does not offer itself per microbatch'):
      loss_taker('1f1b')


@pytest.mark.parametrize('tpu', [False, pytest.param(True, marks=needs_libtpu)])
def test_stages_span_slices_their_slices_part_major(tpu):
  """`mesh.stage_slices=2` with 2 stages a slice: 4 stages, the first two on one slice (a simulated slice of 4 CPU
  devices, or a v5e:2x2 slice's compile-only devices), the next two on the other, so only the middle send crosses
  the data-center network; the pipeline figures say so."""
  config = load_config('llama_tiny', SMALL + COMMON + ['mesh.stage=2', 'mesh.stage_slices=2', 'mesh.fsdp=2'])
  devices = topology_devices(physical_topology('v5e:2x2'), 2) if tpu else jax.devices()
  mesh = make_mesh(config.mesh, devices)
  assert mesh.shape['stage'] == 4 and mesh.shape['slice'] == 1
  slice_of = (lambda d: d.slice_index) if tpu else (lambda d: devices.index(d) // 4)
  stage_slices = [{slice_of(d) for d in np.asarray(mesh.devices).take(s, axis=1).ravel()} for s in range(4)]
  assert stage_slices == [{0}, {0}, {1}, {1}], stage_slices
  assert stages_report(config, mesh)['sent_over'] == 'dcn'
