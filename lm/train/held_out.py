"""Held-out evaluation of any params of an assembly: the loss and bits per byte of the validation split and of each
`data.evals` set. It builds no training stream and no Trainer, so `lm scaling collect` and the benchmarks use it
alone; pretraining runs it as a callback."""
from __future__ import annotations

import functools
import math
from typing import Any

import jax

from lm.assembly import Assembly
from lm.data.pipeline import Batches, held_out_batches, validation_batches
from lm.train.step import make_eval_step

Record = dict[str, Any]


class HeldOut:
  """`sets`: name -> batches of each `data.evals` set; `validation`: the run's own split (None when
  `train.eval_batches` is 0)."""

  def __init__(self, assembly: Assembly):
    config = self.config = assembly.config
    objective_for = functools.partial(assembly.family.objective, config)
    self.validation = validation_batches(config, assembly.mesh, objective_for)
    self.sets = held_out_batches(config, assembly.mesh, objective_for)
    self.eval_step = make_eval_step(assembly)

  def evaluate(self, params: Any, batches: Batches, num_batches: int) -> dict[str, float]:
    """{'loss': mean NLL per target token (nats), 'bpb': bits per UTF-8 byte of the text the targets stand for}
    over the first `num_batches` batches of a held-out set (-1: all), stopping at its padding."""
    sums: dict[str, float] = {}
    for batch in batches.first(num_batches):
      out = jax.device_get(self.eval_step(params, batch))
      if float(out['weight']) == 0:  # every stream is past its end: the set was read whole
        break
      sums = {key: sums.get(key, 0.0) + float(value) for key, value in out.items()}
    return {'loss': sums.get('nll', 0.0) / max(sums.get('weight', 0.0), 1.0),
            'bpb': sums.get('nll', 0.0) / math.log(2) / max(sums.get('bytes', 0.0), 1.0)}

  def __call__(self, params: Any, suffix: str = '') -> Record:
    """Every held-out set's metrics (+ `suffix`): the run's own split as val_loss and val_bpb, each `data.evals`
    set as val/NAME/loss and val/NAME/bpb."""
    count = self.config.train.eval_batches
    record = {} if self.validation is None else {
      f'val_{metric}{suffix}': value for metric, value in self.evaluate(params, self.validation, count).items()}
    for name, batches in self.sets.items():
      record.update({f'val/{name}/{metric}{suffix}': value
                     for metric, value in self.evaluate(params, batches, count).items()})
    return record
