"""`lm compile --plan`: the candidate search, its roofline, and the plan it prints."""
import itertools
import json
import math

import pytest

from lm import cli
from lm.assembly import assemble
from lm.assembly.accounting import count_params
from lm.config import load_config
from lm.parallel.chips import topology_devices
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


def test_the_roofline_adds_each_collective_as_the_docstring_says():
  """fsdp 2 x tensor 2 x data 2 on 8 devices, 2 microbatches, full remat: each term by hand."""
  config = load_config('gpt_tiny', TINY + ['mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2', 'train.microbatches=2',
                                           'model.execution.remat=full'])
  assembly = assemble(config)
  chip = Chip(peak_flops=1e12, ici_bytes_per_s=1e9, hbm_bytes=2**30, hop_seconds=1e-3)
  got = predict_seconds(assembly, chip)
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


def test_candidates_cover_what_shards_evenly_and_come_fastest_first():
  import jax
  config = load_config('gpt_tiny', TINY)
  chip = Chip(peak_flops=1e12, ici_bytes_per_s=1e9, hbm_bytes=2**30)
  found = candidates(config, jax.devices(), chip)
  steps = [r['predicted']['step'] for r in found]
  assert steps == sorted(steps)
  seen = {r['candidate'] for r in found}
  # 4 heads: tensor 8 cannot split them; 16 rows over 8 data-parallel devices allow 1 or 2 microbatches.
  assert all(c.tensor <= 4 for c in seen)
  assert Candidate(8, 1, 1, 'full', 2) in seen and Candidate(8, 1, 1, 'full', 4) not in seen
  assert Candidate(2, 1, 4, 'none', 8) in seen  # 2 rows over 2 data-parallel devices
  assert len({(c.data, c.fsdp, c.tensor) for c in seen}) == sum(1 for m in meshes(8) if m[2] <= 4)
  assert all(math.isfinite(r['estimate']) and r['estimate'] > 0 for r in found)


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
