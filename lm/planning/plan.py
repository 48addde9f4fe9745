"""`lm compile --plan`: search meshes, remat policies and microbatch counts for a TPU slice.

Candidates are every split of the slice's chips into data x fsdp x tensor (powers of two; the rules table must
shard the parameters evenly), each remat policy, and each power-of-two microbatch count that splits the batch
evenly over the data-parallel devices. Each candidate gets
- a memory estimate (`lm.assembly.accounting.estimate_memory`: the sharded state exactly, activations roughly), and
- a predicted step time, a roofline: compute is the model FLOPs plus what remat recomputes, at the chip's peak;
  communication is the collective traffic per chip over its interconnect plus a latency per ring step of each
  collective. FSDP's weight gathers and gradient reduce-scatters and the data-parallel gradient all-reduce
  overlap the compute (the step takes the larger); tensor parallelism's activation all-reduces sit between the
  layer's matmuls (added).
The candidates that may fit are compiled in order of predicted time until `top` of them fit; those are the plan,
with their compiled memory.
"""
from __future__ import annotations

import dataclasses
import math
import time
import typing
from collections.abc import Callable, Iterator
from typing import Any

import jax
import yaml

from lm.assembly import Assembly, assemble
from lm.assembly.accounting import estimate_memory
from lm.planning.compile import compile_report
from lm.config import Config, ConfigError, Remat, merge
from lm.parallel.chips import hbm_bytes, ici_bytes_per_s, peak_flops, physical_topology, topology_devices
from lm.report import format_bytes

# Share of a step's model FLOPs each remat policy adds by recomputing the forward pass (a third of the FLOPs):
# all of it (full); the MLP's first matmul and the attention core, about a third of it (projections); nothing
# but elementwise work (dots, none).
RECOMPUTE: dict[str, float] = {'none': 0.0, 'dots': 0.0, 'projections': 1 / 9, 'full': 1 / 3}
DCN_BYTES_PER_S = 50e9 / 8  # data-center network per chip, between slices
ESTIMATE_SLACK = 1.25  # compile candidates whose rough estimate is within this factor of HBM
MAX_MICROBATCHES = 64  # beyond this the repeated weight gathers and tiny matmuls do not pay for the memory saved


@dataclasses.dataclass(frozen=True)
class Candidate:
  data: int
  fsdp: int
  tensor: int
  remat: str
  microbatches: int

  def apply(self, config: Config) -> Config:
    return dataclasses.replace(
      config, mesh=dataclasses.replace(config.mesh, data=self.data, fsdp=self.fsdp, tensor=self.tensor),
      model=config.model.with_execution(remat=self.remat),
      train=dataclasses.replace(config.train, microbatches=self.microbatches))

  @property
  def overrides(self) -> str:
    return (f'mesh.data={self.data} mesh.fsdp={self.fsdp} mesh.tensor={self.tensor} model.execution.remat={self.remat} '
            f'train.microbatches={self.microbatches}')


@dataclasses.dataclass(frozen=True)
class Chip:
  """What the roofline needs of a device: peak FLOP/s, interconnect bytes/s, memory, and whether collectives run
  beside the compute (TPU and GPU DMA engines do; simulated CPU devices copy on the cores that compute). A
  collective over n devices takes n - 1 ring steps of `hop_seconds` each besides its bytes (1 us: an assumed
  interconnect hop with its synchronisation)."""
  peak_flops: float
  ici_bytes_per_s: float
  hbm_bytes: int
  overlaps: bool = True
  hop_seconds: float = 1e-6


def _powers_of_two(n: int) -> list[int]:
  return [2 ** i for i in range(int(math.log2(n)) + 1) if n % 2 ** i == 0]


def meshes(chips: int) -> Iterator[tuple[int, int, int]]:
  """(data, fsdp, tensor) with data * fsdp * tensor == chips, each a power of two."""
  for tensor in _powers_of_two(chips):
    for fsdp in _powers_of_two(chips // tensor):
      yield chips // tensor // fsdp, fsdp, tensor


def predict_seconds(assembly: Assembly, chip: Chip, num_slices: int = 1) -> dict[str, float]:
  """The roofline step time of `assembly`'s config on its mesh (see the module docstring), with its terms."""
  config, sizes = assembly.config, dict(assembly.mesh.shape)
  m, t = config.model, config.train
  chips = math.prod(sizes.values())
  data, fsdp, tensor = sizes['data'] * sizes['slice'], sizes['fsdp'], sizes['tensor']
  tokens = t.global_batch * config.data.seq_len
  flops = assembly.flops_per_token() * tokens * (1 + RECOMPUTE[m.execution.remat])
  compute = flops / (chip.peak_flops * chips)
  params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(assembly.abstract_params))
  column = params / tensor  # the weights one tensor-parallel rank holds, gathered over fsdp
  fsdp_bytes = t.microbatches * 3 * column * (fsdp - 1) / fsdp  # gather forward and backward, reduce-scatter grads
  grads = column / fsdp
  ici_dp = sizes['data'] > 1
  dp_bytes = 2 * grads * (sizes['data'] - 1) / sizes['data'] if ici_dp else 0.0  # ring all-reduce in the slice
  dcn_bytes = 2 * grads * (num_slices - 1) / num_slices
  layers = assembly.family.num_blocks(m)
  act_bytes = 2 if m.execution.dtype == 'bfloat16' else 4
  tokens_per_rank = tokens / t.microbatches / data / fsdp
  # Two all-reduces per layer forward (attention and MLP outputs), two backward, two more when full remat runs
  # the forward again (projections keeps the reduced outputs).
  reductions = 4 + (2 if m.execution.remat == 'full' else 0)
  tp_bytes = t.microbatches * layers * reductions * 2 * (tensor - 1) / tensor * tokens_per_rank * m.d_model * act_bytes
  # Ring steps: per layer and microbatch three FSDP collectives and `reductions` tensor all-reduces; one gradient
  # all-reduce per step.
  weight_hops = t.microbatches * layers * 3 * (fsdp - 1) + (sizes['data'] - 1)
  activation_hops = t.microbatches * layers * reductions * (tensor - 1)
  weights = (fsdp_bytes + dp_bytes) / chip.ici_bytes_per_s + dcn_bytes / DCN_BYTES_PER_S + \
      weight_hops * chip.hop_seconds
  activations = tp_bytes / chip.ici_bytes_per_s + activation_hops * chip.hop_seconds
  hidden = max(compute, weights) if chip.overlaps else compute + weights
  return {'compute': compute, 'weight_comm': weights, 'activation_comm': activations, 'step': hidden + activations}


def candidates(config: Config, devices: list[jax.Device], chip: Chip, num_slices: int = 1) -> list[dict[str, Any]]:
  """Every candidate that shards evenly, with its memory estimate and predicted step time, fastest first."""
  chips = len(devices) // num_slices
  remats = typing.get_args(Remat)
  out = []
  for data, fsdp, tensor in meshes(chips):
    base = Candidate(data, fsdp, tensor, config.model.execution.remat, 1)
    try:
      assembly = assemble(base.apply(config), devices)
    except ConfigError:  # the rules table cannot split some parameter over this mesh
      continue
    for remat in remats:
      for micro in [m for m in _powers_of_two(config.train.global_batch) if m <= MAX_MICROBATCHES]:
        c = dataclasses.replace(base, remat=remat, microbatches=micro)
        variant = dataclasses.replace(assembly, config=c.apply(config))
        try:
          memory = estimate_memory(variant.config, assembly.abstract_state, assembly.mesh)
        except ConfigError:  # the microbatch does not split over the data-parallel devices
          continue
        out.append({'candidate': c, 'estimate': memory['total (estimate)'],
                    'predicted': predict_seconds(variant, chip, num_slices)})
  # Ties (compute-bound candidates) go to the least recomputation, then fewer microbatches.
  return sorted(out, key=lambda r: (r['predicted']['step'], RECOMPUTE[r['candidate'].remat],
                                    r['candidate'].microbatches))


def plan(config: Config, topology: str, top: int = 5, num_slices: int = 1, max_compiles: int | None = None,
         log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Compiles the fastest-predicted candidates that may fit until `top` fit (or `max_compiles`, default 3 x top,
  have been compiled); returns those that fit, in that order (least recomputation, then fewest microbatches,
  breaking ties). Each row keeps the executable's own FLOPs and bytes (XLA's cost analysis) for reference: they
  are not the ranking's, since XLA counts a while loop's body once (with 4 microbatches it reports a quarter of
  the step's FLOPs).

  "May fit" learns from the compiles: a candidate is skipped when its estimate times the smallest ratio of
  compiled memory to estimate seen so far for its mesh and remat policy (at first 1 / ESTIMATE_SLACK) exceeds
  HBM: the estimate's error depends on both, hardly on the microbatch count.
  """
  start = time.perf_counter()
  devices = topology_devices(physical_topology(topology), num_slices)
  config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, slices=num_slices))
  d = devices[0]
  chip = Chip(peak_flops(d, config.model.quantization), ici_bytes_per_s(d), hbm_bytes(d))
  found = candidates(config, devices, chip, num_slices)
  ratio: dict[Candidate, float] = {}  # the candidate at one microbatch -> smallest compiled memory / estimate
  key = lambda c: dataclasses.replace(c, microbatches=1)
  may_fit = lambda r: r['estimate'] * ratio.get(key(r['candidate']), 1 / ESTIMATE_SLACK) <= chip.hbm_bytes
  log(f'{len(found)} candidates shard evenly, {sum(map(may_fit, found))} may fit by the estimate; '
      f'compiling the fastest')
  fitting, tried = [], []
  for r in found:
    if len(fitting) == top or len(tried) == (max_compiles or 3 * top):
      break
    if not may_fit(r):
      continue
    report = compile_report(r['candidate'].apply(config), topology, num_slices=num_slices)
    memory = report['memory_per_device']['total']
    ratio[key(r['candidate'])] = min(ratio.get(key(r['candidate']), math.inf), memory / r['estimate'])
    row = {**r, 'memory': memory, 'fits': report['fits'], 'compile_seconds': report['compile_seconds'],
           'cost_per_device': report.get('cost_per_device')}
    tried.append(row)
    log(f'  {r["candidate"].overrides}: predicted {r["predicted"]["step"]:.3f} s, '
        f'{format_bytes(memory)} per device, {"fits" if row["fits"] else "does not fit"}')
    if row['fits']:
      fitting.append(row)
  return {'config': config.name, 'topology': topology, 'chips': len(devices), 'hbm_per_device': chip.hbm_bytes,
          'candidates': len(found), 'compiled': len(tried), 'plan': fitting, 'seconds': time.perf_counter() - start}


def plan_json(result: dict[str, Any]) -> dict[str, Any]:
  """The plan with its candidates as plain dicts (for --json)."""
  rows = [{**{k: v for k, v in r.items() if k != 'candidate'}, 'candidate': dataclasses.asdict(r['candidate']),
           'overrides': r['candidate'].overrides} for r in result['plan']]
  return {**result, 'plan': rows}


def best_preset(result: dict[str, Any], config_name: str, overrides: dict[str, Any]) -> str:
  """A preset YAML of the best candidate: based on the config, with the overrides given and the plan's choice."""
  c = result['plan'][0]['candidate']
  values = merge(overrides, {'mesh': {'data': c.data, 'fsdp': c.fsdp, 'tensor': c.tensor},
                             'model': {'execution': {'remat': c.remat}}, 'train': {'microbatches': c.microbatches}})
  header = (f'# Written by `lm compile --plan` for {result["topology"]}: predicted step '
            f'{result["plan"][0]["predicted"]["step"]:.3f} s, {format_bytes(result["plan"][0]["memory"])} per device.\n'
            f'# Slice: {result["topology"]}\n')
  return header + yaml.safe_dump({'base': config_name, **values}, sort_keys=False)


def format_plan(result: dict[str, Any]) -> str:
  lines = [f'{result["config"]} on {result["topology"]} ({result["chips"]} chips, '
           f'{format_bytes(result["hbm_per_device"])} HBM each): {result["candidates"]} candidates, '
           f'{result["compiled"]} compiled, {len(result["plan"])} fit; {result["seconds"]:.0f} s',
           '',
           '| rank | data x fsdp x tensor | remat | microbatches | predicted step | compute | weight comm | '
           'activation comm | memory/device |',
           '|---|---|---|---|---|---|---|---|---|']
  for i, r in enumerate(result['plan'], 1):
    c, p = r['candidate'], r['predicted']
    lines.append(f'| {i} | {c.data} x {c.fsdp} x {c.tensor} | {c.remat} | {c.microbatches} | {p["step"]:.3f} s | '
                 f'{p["compute"]:.3f} s | {p["weight_comm"]:.3f} s | {p["activation_comm"]:.3f} s | '
                 f'{format_bytes(r["memory"])} |')
  if result['plan']:
    lines += ['', f'lm compile --config {result["config"]} --topology {result["topology"]} '
                  f'{result["plan"][0]["candidate"].overrides}']
  return '\n'.join(lines)
