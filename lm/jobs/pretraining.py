"""`lm train`: pretraining with the family's objective on the config's data, through the one loop.

Builds the assembly, the training and held-out batches, and the callbacks (loss and bits per byte of the
validation split and each `data.evals` set at step 0, every `train.eval_every` steps, at `train.eval_at` and at the
end; lm-eval-harness tasks (`train.harness.tasks`) every `train.harness.every` steps and at the end; with
`data.mixture`, the tokens of each source every `train.log_every` steps; the latest checkpoint every
`train.checkpoint.every` steps, at the end and at a SIGTERM), then hands them to `lm.train.loop.Trainer`.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import jax

from lm.assembly import assemble
from lm.assembly.state import TrainState
from lm.config import Config, ConfigError
from lm.data.mixture import Mixture
from lm.data.pipeline import stream_layout, training_batches
from lm.train.branch import branch_state, resolve_branch
from lm.train.init_from import initial_state
from lm.train.callbacks import Callback, Evaluate, Record
from lm.train.distill import open_teacher
from lm.train.loop import Trainer
from lm.train.held_out import HeldOut
from lm.train.step import PretrainingLoss


class Pretraining:
  """The assembly (mesh, model, sharded abstract state), data and loop of one Config."""

  def __init__(self, config: Config, devices: Sequence[jax.Device] | None = None):
    self.config = config = resolve_branch(config)  # the checkpoint a branch starts from, named; its batch ramp
    self.assembly = assemble(config, devices)
    self.mesh, self.model = self.assembly.mesh, self.assembly.model
    # The loop first: its step checks the batch against the mesh, before any batch is laid out on it.
    self.loop = Trainer(self.assembly, PretrainingLoss(self.assembly, open_teacher(self.assembly)),
                        run_dir=config.run_dir)
    objective_for = functools.partial(self.assembly.family.objective, config)
    self.tokenizer, self.train_batches = training_batches(config, self.mesh, objective_for)
    self.held_out = HeldOut(self.assembly)  # the validation split and data.evals
    self.task_evals = self._task_evals()  # before the run dir is written: a bad task name stops here

  @property
  def train_step(self):
    return self.loop.train_step

  @property
  def stopped_at(self) -> int | None:
    return self.loop.stopped_at

  @property
  def final_state(self) -> TrainState | None:
    return self.loop.final_state

  def init_state(self) -> TrainState:
    return self.assembly.init_state()

  def _mixture_tokens(self) -> list[Callback]:
    """With `data.mixture`: the tokens each source has given, as data/NAME/tokens, every `train.log_every` steps."""
    mixture, batch = Mixture.of(self.config.data), self.config.train.global_batch
    if mixture is None:
      return []
    row_len = self.assembly.family.objective(self.config, self.tokenizer).row_len
    _, streams = stream_layout(batch, self.config.data.streams, 0, jax.process_count())
    return [Evaluate(lambda _, step: {f'data/{name}/tokens': tokens for name, tokens in
                                      mixture.tokens(step, streams, batch // streams, row_len).items()},
                     self.config.train.log_every, params_of=lambda _: None)]

  def _task_evals(self) -> list[Callback]:
    """`train.harness.tasks` through the harness on the training devices, recorded as eval/<task>/<metric>."""
    t = self.config.train
    h = t.harness
    if not h.tasks:
      return []
    from lm.jobs.evals.run import Request, TaskEvaluator, metric_records
    data_dir = None if h.data_dir is None else Path(h.data_dir)
    if data_dir is not None and not data_dir.is_dir():
      raise ConfigError(f'train.harness.data_dir={data_dir} is not a directory; point it at the task files '
                        f'(as lm eval --data-dir takes them) or drop it to load from the Hub')
    evaluator = TaskEvaluator(self.assembly, Request(tasks=h.tasks, data_dir=data_dir, subset=h.limit,
                                                     num_fewshot=h.num_fewshot))
    return [Evaluate(lambda params, _: metric_records(evaluator(params)), h.every or t.eval_every,
                     params_of=self.assembly.params_of)]

  def _start(self) -> TrainState:
    cfg = self.config
    if cfg.train.branch_from is not None:
      return branch_state(self.assembly, cfg, self.train_batches.iterator)
    if cfg.train.init_from is None:
      return self.init_state()
    start = initial_state(self.assembly, cfg.train.init_from, cfg.train.init_from_ema)
    average = ' (the moving average of its params)' if cfg.train.init_from_ema else ''
    print(f'initialised from {cfg.train.init_from}{average}' +
          (f'; new: {", ".join(start.fresh + start.reshaped)}' if start.fresh or start.reshaped else '') +
          (f'; not used: {", ".join(start.unused)}' if start.unused else ''), flush=True)
    return start.state

  def run(self) -> list[Record]:
    """Trains to `train.steps`, resuming if asked; returns the logged records."""
    cfg = self.config
    t = cfg.train
    validation = [Evaluate(lambda params, _: self.held_out(params), t.eval_every, at_start=True,
                           params_of=self.assembly.params_of, at=t.eval_at)]
    if t.ema_decay:  # the moving average beside the params, on the same batches
      validation.append(Evaluate(lambda params, _: self.held_out(params, '_ema'), t.eval_every, at=t.eval_at,
                                 params_of=lambda state: self.assembly.params_of(state, 'ema')))
    return self.loop.run(self.train_batches, self._start,
                         (validation if t.eval_batches else []) + self.task_evals + self._mixture_tokens(),
                         position=self.train_batches.iterator, config=cfg)


def train(config: Config, devices: Sequence[jax.Device] | None = None) -> list[Record]:
  return Pretraining(config, devices).run()
