"""What a pipelined step runs (mesh.stage > 1), for `lm info` and `lm compile`: its schedule's ticks and bubble, the
microbatches a stage holds for their backward passes, and the bytes sent from stage to stage."""
from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh, NamedSharding

from lm.assembly.accounting import compute_bytes
from lm.config import Config
from lm.parallel.rules import spec_for, without
from lm.parallel.schedules import table
from lm.report import format_bytes


LINKS = {'ici': 'the slice\'s interconnect', 'dcn': 'the data-center network between slices'}


def stages_report(config: Config, mesh: Mesh) -> dict[str, Any] | None:
  """The pipeline's figures on `mesh`; None without stages. A microbatch's activation is one stage input (the
  residual stream of its rows, split over the stage's batch and sequence devices); each stage holds `in_flight` of
  them (with full remat, each of its layers' inputs) and sends at most `sent_bytes` a device a step."""
  stages = mesh.shape.get('stage', 1)
  if stages <= 1:
    return None
  p, m, cfg = config.model.execution.pipeline, config.train.microbatches, config.model
  tbl = table(p.schedule, stages, m, p.repeats)
  shape = (config.train.global_batch // m, config.data.seq_len, cfg.d_model)
  shard = NamedSharding(mesh, spec_for(('batch', 'length', 'embed'), shape, mesh, without('stage'))).shard_shape(shape)
  activation = math.prod(shard) * compute_bytes(cfg)
  return {'schedule': p.schedule, 'stages': stages, 'microbatches': m, 'repeats': p.repeats,
          'layers_per_stage': cfg.num_layers // (stages * p.repeats), 'ticks': len(tbl.ticks),
          'bubble': tbl.bubble(), 'in_flight': max(tbl.in_flight()), 'activation_bytes': activation,
          'sent_bytes': max(tbl.stage_sends()) * activation,
          'sent_over': 'dcn' if config.mesh.stage_slices > 1 else 'ici'}


def stages_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
  """The report's lines."""
  return [
    ('pipeline', f'{r["schedule"]}: {r["stages"]} stages x {r["repeats"]} repeat(s) of {r["layers_per_stage"]} '
                 f'layer(s), {r["microbatches"]} microbatches, {r["ticks"]} ticks'),
    ('pipeline bubble', f'{r["bubble"]:.1%} of the step (a backward pass costing two forward)'),
    ('pipeline in flight', f'{r["in_flight"]} microbatches a stage at most, each '
                           f'{format_bytes(r["activation_bytes"])} a device per layer input'),
    ('pipeline sends', f'{format_bytes(r["sent_bytes"])} a device a step at most, to the next stage and back, over '
                       f'{LINKS[r["sent_over"]]}'),
  ]
