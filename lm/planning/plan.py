"""`lm compile --plan`: search meshes, remat policies, microbatch counts and memory levers for a TPU slice.

Candidates are every split of the slice's chips into stage x data x fsdp x tensor (powers of two; the rules table
must shard the parameters evenly; stages where the stack is scanned, also over all the job's slices), each remat
policy, each power-of-two microbatch count that splits the batch evenly over the data-parallel devices, each
pipeline schedule the config can run (GPipe, 1F1B, circular with a layer a stage each repeat) and, where the chip's
host memory is known, with and without the levers
that move memory to the host: what the remat policy saves (`OFFLOADED`) and the optimizer state; with `int8`,
also with the projections' matmuls in int8 (which changes the numerics, so only when asked). Each candidate gets
- a memory estimate (`lm.assembly.accounting.estimate_memory`: the sharded state exactly, activations roughly),
  on the device and on the host, and
- a predicted step time, a roofline: compute is the model FLOPs plus what remat recomputes, at the chip's peak
  (int8's for int8 candidates); communication is the collective traffic per chip over its interconnect plus a
  latency per ring step of each collective. FSDP's weight gathers and gradient reduce-scatters, the data-parallel
  gradient all-reduce and the host transfers (offloaded activations out and back, the optimizer state in and out,
  over the chip's host link) overlap the compute (the step takes the largest); tensor parallelism's activation
  all-reduces sit between the layer's matmuls, and a pipeline's sends between its ticks (added). With stages, a
  device holds and gathers only its stage's weights, and the compute stretches by the schedule's bubble.
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
from lm.assembly.accounting import estimate_memory, offloaded_bytes, shard_bytes
from lm.assembly.state import HOST, offloaded
from lm.planning.compile import compile_report, on_slices
from lm.config import Config, ConfigError, PipelineConfig, Remat, checked, merge
from lm.parallel.chips import hbm_bytes, host_bytes, host_link_bytes_per_s, ici_bytes_per_s, peak_flops, \
  physical_topology, topology_devices
from lm.parallel.schedules import Table, table
from lm.report import format_bytes

# Share of a step's model FLOPs each remat policy adds by recomputing the forward pass (a third of the FLOPs):
# all of it (full); the MLP's first matmul and the attention core, about a third of it (projections); nothing
# but elementwise work (dots, none).
RECOMPUTE: dict[str, float] = {'none': 0.0, 'dots': 0.0, 'projections': 1 / 9, 'full': 1 / 3}
DCN_BYTES_PER_S = 50e9 / 8  # data-center network per chip, between slices
ESTIMATE_SLACK = 1.25  # compile candidates whose rough estimate is within this factor of HBM
MAX_MICROBATCHES = 64  # beyond this the repeated weight gathers and tiny matmuls do not pay for the memory saved
# What a candidate with `offload` keeps in host memory: all a remat policy saves by name.
OFFLOADED = {'full': ('layer_input',),
             'projections': ('query_proj', 'key_proj', 'value_proj', 'attention_out', 'mlp_out')}


@dataclasses.dataclass(frozen=True)
class Candidate:
  data: int
  fsdp: int
  tensor: int
  remat: str
  microbatches: int
  offload: bool = False  # what the remat policy saves (OFFLOADED) in host memory
  optimizer_offload: bool = False
  int8: bool = False
  stage: int = 1  # pipeline stages within a slice
  schedule: str = 'gpipe'
  repeats: int = 1
  stage_slices: int = 1  # slices the stages span (the job's slices over the data-center network: all, or none)

  @property
  def saved_on_host(self) -> tuple[str, ...]:
    return OFFLOADED[self.remat] if self.offload else ()

  def apply(self, config: Config) -> Config:
    pipeline = PipelineConfig(schedule=self.schedule, repeats=self.repeats)
    model = config.model.with_execution(remat=self.remat, offload=self.saved_on_host, pipeline=pipeline)
    slices = config.mesh.slices * config.mesh.stage_slices // self.stage_slices
    return dataclasses.replace(
      config, mesh=dataclasses.replace(config.mesh, data=self.data, fsdp=self.fsdp, tensor=self.tensor,
                                       stage=self.stage, stage_slices=self.stage_slices, slices=slices),
      model=dataclasses.replace(model, quantization='int8') if self.int8 else model,
      train=dataclasses.replace(config.train, microbatches=self.microbatches,
                                optimizer_offload=self.optimizer_offload))

  @property
  def levers(self) -> list[str]:
    """The memory and speed levers the candidate pulls, as config overrides."""
    return ([f'model.execution.offload=[{",".join(self.saved_on_host)}]'] if self.offload else []) + \
        (['train.optimizer_offload=true'] if self.optimizer_offload else []) + \
        (['model.quantization=int8'] if self.int8 else [])

  @property
  def stages(self) -> int:
    return self.stage * self.stage_slices

  @property
  def pipeline(self) -> list[str]:
    """Its pipeline as config overrides (none without stages)."""
    if self.stages == 1:
      return []
    return [f'mesh.stage={self.stage}', *([f'mesh.stage_slices={self.stage_slices}'] if self.stage_slices > 1 else []),
            f'model.execution.pipeline.schedule={self.schedule}',
            *([f'model.execution.pipeline.repeats={self.repeats}'] if self.repeats > 1 else [])]

  @property
  def overrides(self) -> str:
    return ' '.join([*self.pipeline, f'mesh.data={self.data} mesh.fsdp={self.fsdp} mesh.tensor={self.tensor} '
                     f'model.execution.remat={self.remat} train.microbatches={self.microbatches}', *self.levers])


@dataclasses.dataclass(frozen=True)
class Chip:
  """What the roofline needs of a device: peak FLOP/s, interconnect bytes/s, memory, and whether collectives run
  beside the compute (TPU and GPU DMA engines do; simulated CPU devices copy on the cores that compute). A
  collective over n devices takes n - 1 ring steps of `hop_seconds` each besides its bytes (1 us: an assumed
  interconnect hop with its synchronisation). Host memory and its link: None where unknown (no offloading)."""
  peak_flops: float
  ici_bytes_per_s: float
  hbm_bytes: int
  overlaps: bool = True
  hop_seconds: float = 1e-6
  int8_peak_flops: float | None = None
  host_bytes: int | None = None
  host_link_bytes_per_s: float | None = None

  @classmethod
  def of(cls, device: jax.Device) -> Chip:
    return cls(peak_flops(device), ici_bytes_per_s(device), hbm_bytes(device),
               int8_peak_flops=peak_flops(device, 'int8'), host_bytes=host_bytes(device),
               host_link_bytes_per_s=host_link_bytes_per_s(device))


def _powers_of_two(n: int) -> list[int]:
  return [2 ** i for i in range(int(math.log2(n)) + 1) if n % 2 ** i == 0]


def meshes(chips: int) -> Iterator[tuple[int, int, int]]:
  """(data, fsdp, tensor) with data * fsdp * tensor == chips, each a power of two."""
  for tensor in _powers_of_two(chips):
    for fsdp in _powers_of_two(chips // tensor):
      yield chips // tensor // fsdp, fsdp, tensor


def predict_seconds(assembly: Assembly, chip: Chip) -> dict[str, float]:
  """The roofline step time of `assembly`'s config on its mesh (see the module docstring), with its terms."""
  config, sizes = assembly.config, dict(assembly.mesh.shape)
  m, t = config.model, config.train
  chips = math.prod(sizes.values())
  data, fsdp, tensor, stages = sizes['data'] * sizes['slice'], sizes['fsdp'], sizes['tensor'], sizes['stage']
  tokens = t.global_batch * config.data.seq_len
  flops = assembly.flops_per_token() * tokens * (1 + RECOMPUTE[m.execution.remat])
  bubble = _schedule(config, stages).bubble() if stages > 1 else 0.0
  compute = flops / ((chip.int8_peak_flops if m.quantization == 'int8' else chip.peak_flops) * chips) / (1 - bubble)
  params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(assembly.abstract_params))
  column = params / tensor / stages  # the weights one tensor-parallel rank of a stage holds, gathered over fsdp
  fsdp_bytes = t.microbatches * 3 * column * (fsdp - 1) / fsdp  # gather forward and backward, reduce-scatter grads
  grads = column / fsdp
  ici_dp = sizes['data'] > 1
  dp_bytes = 2 * grads * (sizes['data'] - 1) / sizes['data'] if ici_dp else 0.0  # ring all-reduce in the slice
  dcn_bytes = 2 * grads * (sizes['slice'] - 1) / sizes['slice']  # over the data-parallel slices
  layers = assembly.family.num_blocks(m) / stages  # a device's
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
  sends = _stage_seconds(config, stages, chip, tokens_per_rank * m.d_model * act_bytes) if stages > 1 else 0.0
  host = _host_seconds(assembly, chip, tokens_per_rank)
  hidden = max(compute, weights, host) if chip.overlaps else compute + weights + host
  return {'compute': compute, 'weight_comm': weights, 'activation_comm': activations, 'host_transfer': host,
          'stage_sends': sends, 'bubble': bubble, 'step': hidden + activations + sends}


def _schedule(config: Config, stages: int) -> Table:
  p = config.model.execution.pipeline
  return table(p.schedule, stages, config.train.microbatches, p.repeats)


def _stage_seconds(config: Config, stages: int, chip: Chip, microbatch_bytes: float) -> float:
  """The busiest stage's sends a step (a microbatch's stage input a device each, forward or back), between the
  ticks, over the slice's interconnect or, for stages on other slices, the data-center network."""
  sends = max(_schedule(config, stages).stage_sends())
  rate = DCN_BYTES_PER_S if config.mesh.stage_slices > 1 else chip.ici_bytes_per_s
  return sends * (microbatch_bytes / rate + chip.hop_seconds)


def _host_seconds(assembly: Assembly, chip: Chip, tokens_per_rank: float) -> float:
  """Seconds a step's host transfers take over the chip's host link: each microbatch's offloaded activations out
  and back, the offloaded state in and out."""
  config = assembly.config
  tensor = dict(assembly.mesh.shape)['tensor']
  activations = config.train.microbatches * offloaded_bytes(config.model, int(tokens_per_rank), tensor)
  state = shard_bytes(offloaded(assembly.abstract_state, config.train), HOST)
  moved = 2 * (activations + state)
  return moved / chip.host_link_bytes_per_s if moved else 0.0


def _variants(base: Candidate, config: Config, chip: Chip, int8: bool) -> Iterator[Candidate]:
  """`base`'s mesh with each remat policy, microbatch count, lever (host levers where the host is known) and, on a
  mesh with stages, each schedule the config can run (circular with one layer a stage each repeat)."""
  host = (False, True) if chip.host_bytes else (False,)
  schedules = [('gpipe', 1), ('1f1b', 1)]
  if (repeats := config.model.num_layers // base.stages) > 1:
    schedules.append(('circular', repeats))
  for remat in typing.get_args(Remat):
    for micro in [m for m in _powers_of_two(config.train.global_batch) if m <= MAX_MICROBATCHES]:
      for schedule, repeats in schedules if base.stages > 1 else [('gpipe', 1)]:
        for offload in host if remat in OFFLOADED else (False,):
          for optimizer_offload in host:
            for quantized in (False, True) if int8 and chip.int8_peak_flops else (False,):
              yield dataclasses.replace(base, remat=remat, microbatches=micro, offload=offload,
                                        optimizer_offload=optimizer_offload, int8=quantized, schedule=schedule,
                                        repeats=repeats)


def _layouts(chips: int, num_slices: int, config: Config) -> Iterator[Candidate]:
  """Each split of a slice's chips into stage x data x fsdp x tensor (stages where the config pipelines: a scanned
  stack of at least that many layers), with the job's slices joined by data or, with stages, by more stages."""
  pipelines = config.model.execution.scan_layers
  for stage in _powers_of_two(chips) if pipelines else [1]:
    for stage_slices in sorted({1, num_slices}) if stage > 1 else [1]:
      if stage * stage_slices > config.model.num_layers:
        continue
      for data, fsdp, tensor in meshes(chips // stage):
        yield Candidate(data, fsdp, tensor, config.model.execution.remat, 1, stage=stage, stage_slices=stage_slices)


def candidates(config: Config, devices: list[jax.Device], chip: Chip, num_slices: int = 1, int8: bool = False
               ) -> list[dict[str, Any]]:
  """Every candidate that shards evenly and passes the config's checks, with its memory estimates (device, host)
  and predicted step time, fastest first."""
  out = []
  for base in _layouts(len(devices) // num_slices, num_slices, config):
    try:
      assembly = assemble(base.apply(config), devices)
    except ConfigError:  # the rules table cannot split some parameter over this mesh
      continue
    for c in _variants(base, config, chip, int8):
      try:
        variant = dataclasses.replace(assembly, config=checked(c.apply(config)))
        memory = estimate_memory(variant.config, offloaded(assembly.abstract_state, variant.config.train),
                                 assembly.mesh)
      except ConfigError:  # the microbatch does not split over the data-parallel devices, or the stages cannot run
        continue
      out.append({'candidate': c, 'estimate': memory['total (estimate)'], 'host': memory.get('host (estimate)', 0),
                  'predicted': predict_seconds(variant, chip)})
  # Ties (compute-bound candidates) go to the least recomputation, then fewer levers, then fewer microbatches.
  return sorted(out, key=lambda r: (r['predicted']['step'], RECOMPUTE[r['candidate'].remat],
                                    len(r['candidate'].levers), r['candidate'].microbatches))


def plan(config: Config, topology: str, top: int = 5, num_slices: int = 1, max_compiles: int | None = None,
         log: Callable[[str], None] = lambda _: None, int8: bool = False) -> dict[str, Any]:
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
  config = on_slices(config, num_slices)
  chip = Chip.of(devices[0])
  found = candidates(config, devices, chip, num_slices, int8)
  ratio: dict[Candidate, float] = {}  # the candidate at one microbatch -> smallest compiled memory / estimate
  key = lambda c: dataclasses.replace(c, microbatches=1)
  may_fit = lambda r: r['estimate'] * ratio.get(key(r['candidate']), 1 / ESTIMATE_SLACK) <= chip.hbm_bytes and \
      r['host'] / ESTIMATE_SLACK <= (chip.host_bytes or 0)
  log(f'{len(found)} candidates shard evenly, {sum(map(may_fit, found))} may fit by the estimate; '
      f'compiling the fastest')
  fitting, tried = [], []
  for r in found:
    if len(fitting) == top or len(tried) == (max_compiles or 3 * top):
      break
    if not may_fit(r):
      continue
    report = compile_report(r['candidate'].apply(config), topology, num_slices=num_slices)
    memory, host = report['memory_per_device']['total'], report['host_memory_per_device']['total']
    ratio[key(r['candidate'])] = min(ratio.get(key(r['candidate']), math.inf), memory / r['estimate'])
    row = {**r, 'memory': memory, 'host_memory': host, 'fits': report['fits'],
           'compile_seconds': report['compile_seconds'], 'cost_per_device': report.get('cost_per_device')}
    tried.append(row)
    log(f'  {r["candidate"].overrides}: predicted {r["predicted"]["step"]:.3f} s, '
        f'{format_bytes(memory)} per device' + (f' and {format_bytes(host)} of host memory' if host else '') +
        f', {"fits" if row["fits"] else "does not fit"}')
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
  model = {'execution': {'remat': c.remat, **({'offload': list(c.saved_on_host)} if c.offload else {})},
           **({'quantization': 'int8'} if c.int8 else {})}
  train = {'microbatches': c.microbatches, **({'optimizer_offload': True} if c.optimizer_offload else {})}
  mesh = {'data': c.data, 'fsdp': c.fsdp, 'tensor': c.tensor}
  if c.stages > 1:
    mesh.update(stage=c.stage, stage_slices=c.stage_slices)
    model['execution']['pipeline'] = {'schedule': c.schedule, 'repeats': c.repeats}
  values = merge(overrides, {'mesh': mesh, 'model': model, 'train': train})
  header = (f'# Written by `lm compile --plan` for {result["topology"]}: predicted step '
            f'{result["plan"][0]["predicted"]["step"]:.3f} s, {format_bytes(result["plan"][0]["memory"])} per device.\n'
            f'# Slice: {result["topology"]}\n')
  return header + yaml.safe_dump({'base': config_name, **values}, sort_keys=False)


def _stages_text(c: Candidate) -> str:
  """`-`, or `4 gpipe`, `8 (2 slices) 1f1b`, `4 circular x 8`."""
  if c.stages == 1:
    return '-'
  where = f' ({c.stage_slices} slices)' if c.stage_slices > 1 else ''
  return f'{c.stages}{where} {c.schedule}' + (f' x {c.repeats}' if c.repeats > 1 else '')


def format_plan(result: dict[str, Any]) -> str:
  lines = [f'{result["config"]} on {result["topology"]} ({result["chips"]} chips, '
           f'{format_bytes(result["hbm_per_device"])} HBM each): {result["candidates"]} candidates, '
           f'{result["compiled"]} compiled, {len(result["plan"])} fit; {result["seconds"]:.0f} s',
           '',
           '| rank | stages | data x fsdp x tensor | remat | microbatches | levers | predicted step | compute | '
           'weight comm | activation comm | stage sends | host transfer | memory/device | host memory/device |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for i, r in enumerate(result['plan'], 1):
    c, p = r['candidate'], r['predicted']
    lines.append(f'| {i} | {_stages_text(c)} | {c.data} x {c.fsdp} x {c.tensor} | {c.remat} | {c.microbatches} | '
                 f'{" ".join(c.levers) or "-"} | {p["step"]:.3f} s | {p["compute"]:.3f} s | '
                 f'{p["weight_comm"]:.3f} s | {p["activation_comm"]:.3f} s | {p["stage_sends"]:.3f} s | '
                 f'{p["host_transfer"]:.3f} s | {format_bytes(r["memory"])} | {format_bytes(r["host_memory"])} |')
  if result['plan']:
    lines += ['', f'lm compile --config {result["config"]} --topology {result["topology"]} '
                  f'{result["plan"][0]["candidate"].overrides}']
  return '\n'.join(lines)
