"""`lm compile --plan`: the candidate search, its roofline, and the plan it prints."""
import itertools
import json
import math

import jax
import pytest

from lm import cli
from lm.assembly import assemble
from lm.assembly.accounting import count_params
from lm.config import load_config
from lm.parallel.chips import topology_devices
from lm.parallel.schedules import table
from lm.planning.plan import Candidate, Chip, candidates, meshes, predict_seconds
from tests.conftest import needs_libtpu

TINY = ['model.d_model=64', 'model.num_heads=4', 'model.d_ff=256', 'model.num_layers=2', 'data.seq_len=64',
        'model.max_len=64', 'train.global_batch=16', 'model.execution.dtype=bfloat16',
        'model.execution.scan_layers=true']


def test_meshes_are_every_power_of_two_split_of_the_chips():
  powers = [2 ** i for i in range(7)]
  expected = {(d, f, t) for d, f, t in itertools.product(powers, repeat=3) if d * f * t == 64}
  found = list(meshes(64))
  assert len(found) == len(set(found)) and set(found) == expected


def roofline(overrides: list[str]) -> tuple:
  """gpt_tiny's assembly with full remat on `overrides`' mesh, and its roofline on a chip of round figures."""
  assembly = assemble(load_config('gpt_tiny', TINY + ['model.execution.remat=full', *overrides]))
  return assembly, predict_seconds(assembly, Chip(peak_flops=1e12, ici_bytes_per_s=1e9, hbm_bytes=2**30,
                                                  hop_seconds=1e-3))


def test_the_roofline_adds_each_collective_as_the_docstring_says():
  """fsdp 2 x tensor 2 x data 2 on 8 devices, 2 microbatches, full remat: each term by hand."""
  assembly, got = roofline(['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2', 'train.microbatches=2'])
  tokens = 16 * 64
  compute = assembly.flops_per_token() * tokens * (4 / 3) / (1e12 * 8)
  param_bytes = 4 * count_params(assembly.abstract_params)['total']  # float32 params
  column = param_bytes / 2
  # 2 microbatches x 3 FSDP collectives x 2 layers, one ring step each; one ring step of the gradient all-reduce.
  weights = (2 * 3 * column * 1 / 2 + 2 * (column / 2) * 1 / 2) / 1e9 + (2 * 3 * 2 + 1) * 1e-3
  # 2 layers x (4 + 2 recomputed) all-reduces x 2 microbatches, each moving 2 (t-1)/t of its bf16 activations.
  per_rank_tokens = tokens / 2 / 2 / 2
  activations = 2 * 2 * 6 * 2 * (1 / 2) * per_rank_tokens * 64 * 2 / 1e9 + 2 * 2 * 6 * 1e-3
  assert got['compute'] == pytest.approx(compute, rel=1e-12)
  assert got['weight_comm'] == pytest.approx(weights, rel=1e-12)
  assert got['activation_comm'] == pytest.approx(activations, rel=1e-12)
  assert got['step'] == pytest.approx(max(compute, weights) + activations, rel=1e-12)


def test_the_roofline_of_a_pipeline_adds_its_bubble_and_sends():
  """stage 2 x fsdp 2 x data 2, GPipe over 4 microbatches: the compute stretched by the bubble (1/5), a stage's
  weights gathered and reduced, each device's gradients all-reduced over data, and the busiest stage's sends (a
  microbatch's bf16 stage input a device each, one ring step each) added."""
  assembly, got = roofline(['mesh.stage=2', 'mesh.data=2', 'mesh.fsdp=2', 'train.microbatches=4'])
  tokens = 16 * 64
  bubble = (2 - 1) / (4 + 2 - 1)
  compute = assembly.flops_per_token() * tokens * (4 / 3) / (1e12 * 8) / (1 - bubble)
  column = 4 * count_params(assembly.abstract_params)['total'] / 2  # a stage's float32 params
  # 4 microbatches x 3 FSDP collectives x 1 layer of the stage, one ring step each; the gradient all-reduce.
  weights = (4 * 3 * column / 2 + 2 * (column / 2) / 2) / 1e9 + (4 * 3 + 1) * 1e-3
  # either stage sends each microbatch once: the first forward, the last its gradient back
  sends = max(table('gpipe', 2, 4).stage_sends())
  microbatch = tokens / 4 / 2 / 2 * 64 * 2  # a microbatch's rows over data x fsdp, d_model, bf16
  assert got['bubble'] == pytest.approx(bubble) and got['compute'] == pytest.approx(compute, rel=1e-12)
  assert got['weight_comm'] == pytest.approx(weights, rel=1e-12)
  assert got['stage_sends'] == pytest.approx(sends * (microbatch / 1e9 + 1e-3), rel=1e-12) and sends == 4
  assert got['step'] == pytest.approx(max(compute, weights) + got['activation_comm'] + got['stage_sends'],
                                      rel=1e-12)


def test_the_roofline_counts_host_transfers_and_the_int8_peak():
  """Offloaded layer inputs and optimizer state: each microbatch's bf16 layer inputs (tokens x layers x d_model x 2
  bytes per rank) go out and back, the optimizer state's shard in and out, over the host link; the largest of
  compute, weight traffic and host transfers sets the step. int8 compute runs at the int8 peak."""
  from lm.assembly.state import offloaded
  config = load_config('gpt_tiny', TINY + ['mesh.data=2', 'mesh.fsdp=4', 'train.microbatches=2',
                                           'model.execution.remat=full', 'model.execution.offload=[layer_input]',
                                           'train.optimizer_offload=true', 'model.quantization=int8'])
  assembly = assemble(config)
  chip = Chip(peak_flops=1e12, ici_bytes_per_s=1e9, hbm_bytes=2**30, int8_peak_flops=4e12, host_bytes=2**30,
              host_link_bytes_per_s=1e6)
  got = predict_seconds(assembly, chip)
  tokens_per_rank = 16 * 64 / 2 / 2 / 4  # a microbatch's rows over data x fsdp
  layer_inputs = 2 * tokens_per_rank * 2 * 64 * 2  # 2 microbatches x tokens x 2 layers x d_model x bf16
  moments = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize  # this device's shards
                for a in jax.tree.leaves(assembly.abstract_state.opt_state))
  assert offloaded(assembly.abstract_state, config.train) == assembly.abstract_state
  assert got['host_transfer'] == pytest.approx(2 * (layer_inputs + moments) / 1e6, rel=1e-3)
  assert got['compute'] == pytest.approx(assembly.flops_per_token() * 16 * 64 * (4 / 3) / (4e12 * 8), rel=1e-12)
  assert got['step'] == pytest.approx(max(got['compute'], got['weight_comm'], got['host_transfer']) +
                                      got['activation_comm'], rel=1e-12)


def test_offloading_moves_the_saved_activations_from_the_device_estimate_to_the_host():
  from lm.assembly.accounting import estimate_memory
  common = TINY + ['mesh.data=8', 'model.execution.remat=full']
  plain, off = (load_config('gpt_tiny', common + extra) for extra in ([], ['model.execution.offload=[layer_input]']))
  a = assemble(plain)
  before, after = estimate_memory(plain, a.abstract_state, a.mesh), estimate_memory(off, a.abstract_state, a.mesh)
  layer_inputs = 16 // 8 * 64 * 2 * 64 * 2  # rows per device x tokens x layers x d_model x bf16
  assert 'host (estimate)' not in before and after['host (estimate)'] == layer_inputs
  assert before['total (estimate)'] - after['total (estimate)'] == layer_inputs


def test_candidates_cover_what_shards_evenly_and_come_fastest_first():
  config = load_config('gpt_tiny', TINY)
  chip = Chip(peak_flops=1e12, ici_bytes_per_s=1e9, hbm_bytes=2**30)
  found = candidates(config, jax.devices(), chip)
  steps = [r['predicted']['step'] for r in found]
  assert steps == sorted(steps)
  staged = {r['candidate'] for r in found if r['candidate'].stages > 1}
  seen = {r['candidate'] for r in found} - staged
  # 2 layers: 2 stages at most, each schedule with at least as many microbatches as stages (circular needs 2 layers
  # a stage); none with one microbatch
  assert {c.stage for c in staged} == {2} and {c.schedule for c in staged} == {'gpipe', '1f1b'}
  assert Candidate(4, 1, 1, 'full', 2, stage=2, schedule='1f1b') in staged
  assert all(c.microbatches >= 2 for c in staged if c.schedule == '1f1b')
  # 4 heads: tensor 8 cannot split them; 16 rows over 8 data-parallel devices allow 1 or 2 microbatches.
  assert all(c.tensor <= 4 for c in seen)
  assert Candidate(8, 1, 1, 'full', 2) in seen and Candidate(8, 1, 1, 'full', 4) not in seen
  assert Candidate(2, 1, 4, 'none', 8) in seen  # 2 rows over 2 data-parallel devices
  assert len({(c.data, c.fsdp, c.tensor) for c in seen}) == sum(1 for m in meshes(8) if m[2] <= 4)
  assert all(math.isfinite(r['estimate']) and r['estimate'] > 0 for r in found)
  assert not any(c.levers for c in seen)  # a chip whose host memory is unknown: no offloading
  hosted_chip = Chip(1e12, 1e9, 2**30, int8_peak_flops=2e12, host_bytes=2**30, host_link_bytes_per_s=1e9)
  hosted = {r['candidate'] for r in candidates(config, jax.devices(), hosted_chip, int8=True)
            if r['candidate'].stages == 1}
  assert Candidate(8, 1, 1, 'full', 2, offload=True, optimizer_offload=True, int8=True) in hosted
  assert Candidate(8, 1, 1, 'projections', 1, offload=True) in hosted
  assert not any(c.offload for c in hosted if c.remat in ('none', 'dots'))  # they save nothing by name
  # each candidate of before, with and without the optimizer state offloaded and int8; full and projections also
  # with and without their saved tensors offloaded
  assert len(hosted) == sum(4 * (2 if c.remat in ('full', 'projections') else 1) for c in seen)


@needs_libtpu
def test_stages_across_slices_build_a_mesh_where_no_product_of_physical_axes_gives_an_axis():
  """2 stages a slice over 4 v5p-256 slices (4x4x8 chips) leave fsdp 64, which no product of 4, 4 and 8 makes:
  the slice's axes split (the planner met this layout when searching gpt3_175b over 4 slices)."""
  from lm.config import MeshConfig
  from lm.parallel.chips import physical_topology
  from lm.parallel.mesh import make_mesh
  mesh = make_mesh(MeshConfig(stage=2, data=1, fsdp=64, tensor=1, stage_slices=4),
                   topology_devices(physical_topology('v5p-256'), 4))
  assert (mesh.shape['stage'], mesh.shape['fsdp']) == (8, 64)
  slices = [{d.slice_index for d in mesh.devices.take(s, axis=1).ravel()} for s in range(8)]
  assert slices == [{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}]  # consecutive stages share a slice


@needs_libtpu
@pytest.mark.long(1)
def test_plan_lists_compiled_candidates_that_fit_ranked_by_prediction(tmp_path, capsys):
  """`--plan --json --write`: the fitting candidates, ranked by the roofline, each compiled memory within
  HBM; the best written as a preset (naming the slice) that `lm compile` takes as written and finds fitting."""
  preset = tmp_path / 'best.yaml'
  assert cli.main(['compile', '--config', 'gpt_tiny', '--topology', 'v5e-4', '--plan', '--plan-top', '2', '--json',
                   '--write', str(preset), *TINY]) == 0
  result = json.loads(capsys.readouterr().out)
  rows = result['plan']
  assert len(rows) == 2 and result['compiled'] >= 2 and result['chips'] == 4
  steps = [r['predicted']['step'] for r in rows]
  assert steps == sorted(steps) and all(r['fits'] and r['memory'] <= result['hbm_per_device'] for r in rows)
  best = rows[0]
  assert best['cost_per_device']['flops'] > 0  # the executable's own count, kept for reference
  config = load_config(str(preset))
  c = best['candidate']
  assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.model.execution.remat,
          config.train.microbatches) == \
      (c['data'], c['fsdp'], c['tensor'], c['remat'], c['microbatches'])
  assert config.model.d_model == 64 and config.train.global_batch == 16  # the overrides given ride along
  assert cli.main(['compile', '--config', str(preset), '--json']) == 0  # its header names v5e-4
  assert json.loads(capsys.readouterr().out)['fits']
  assert len(topology_devices('v5e:2x2')) == 4
