"""The training loop: build everything from a Config, then step, log, evaluate and checkpoint."""
from __future__ import annotations

import functools
import math
import time
from typing import Any, Sequence

import jax

from lm.assembly import assemble
from lm.checkpoint import UNRESTORABLE, Checkpointer
from lm.config import Config, ConfigError
from lm.data.pipeline import Batches, build_batches
from lm.distributed import barrier, is_main_process
from lm.parallel.chips import peak_flops
from lm.run_dir import CHECKPOINTS, CONFIG
from lm.train.accounting import mfu
from lm.train.init_from import initial_state
from lm.train.logging import MetricsLogger
from lm.train.preemption import ask_requeue, preemption
from lm.train.state import TrainState
from lm.train.step import make_eval_step, make_train_step


class TrainingError(RuntimeError):
  """The run cannot go on (e.g. a non-finite loss); the message names the step and what to change."""


class Trainer:
  """The assembly (mesh, model, sharded abstract state), data and jitted steps for one Config."""

  def __init__(self, config: Config, devices: Sequence[jax.Device] | None = None):
    self.config = config
    self.assembly = assemble(config, devices)
    self.mesh, self.model = self.assembly.mesh, self.assembly.model
    self.train_step = make_train_step(self.assembly)
    self.eval_step = make_eval_step(self.assembly)
    self.flops_per_token = self.assembly.flops_per_token()
    self.peak_flops = config.train.peak_flops or peak_flops(self.mesh.devices.flat[0])
    self.tokenizer, self.train_batches, self.val_batches = build_batches(
      config, self.mesh, functools.partial(self.assembly.family.objective, config))

  def init_state(self) -> TrainState:
    return self.assembly.init_state()

  def evaluate(self, params: Any, batches: Batches, num_batches: int) -> float:
    """Mean NLL per target token over the first `num_batches` validation batches."""
    nll, weight = 0.0, 0.0
    for batch in batches.first(num_batches):
      out = jax.device_get(self.eval_step(params, batch))
      nll, weight = nll + float(out['nll']), weight + float(out['weight'])
    return nll / max(weight, 1.0)

  def _restore_or_init(self, checkpoints: Checkpointer) -> TrainState:
    cfg = self.config
    if checkpoints.is_params_only():
      raise ConfigError(f'{cfg.run_dir} holds an imported model (params only), which training would overwrite; '
                        f'train from it in a new directory: train.init_from={cfg.run_dir} train.run_dir=NEW_DIR')
    steps = checkpoints.all_steps()
    if steps and not cfg.train.resume:
      raise ConfigError(f'{cfg.run_dir} already holds checkpoints (latest step {steps[-1]}); pass --resume '
                        f'(train.resume=true) to continue, or choose another train.run_dir')
    if steps:
      restored = checkpoints.restore_latest(self.assembly.abstract_state, cfg.to_dict(), self.train_batches.iterator)
      if restored is None:
        raise ConfigError(f'no checkpoint in {checkpoints.directory} restores (each is kept as '
                          f'<step>{UNRESTORABLE}); start a new train.run_dir')
      if restored[0] >= cfg.train.steps:
        print(f'run already complete at step {restored[0]} (train.steps={cfg.train.steps}); raise train.steps '
              f'to train on', flush=True)
      else:
        print(f'resumed from {checkpoints.directory}/{restored[0]}', flush=True)
      return restored[1]
    if cfg.train.resume:
      print(f'no checkpoint in {checkpoints.directory}; starting at step 0', flush=True)
    if cfg.train.init_from is None:
      return self.init_state()
    start = initial_state(self.assembly, cfg.train.init_from)
    print(f'initialised from {cfg.train.init_from}' +
          (f'; new: {", ".join(start.fresh + start.reshaped)}' if start.fresh or start.reshaped else '') +
          (f'; not used: {", ".join(start.unused)}' if start.unused else ''), flush=True)
    return start.state

  def run(self) -> list[dict[str, Any]]:
    """Trains to `train.steps`, resuming if asked; returns the logged records.

    On SIGTERM to any process (the preemption notice of TPU VMs and SLURM) every process finishes
    the same step, checkpoints and returns, so `--resume` continues exactly. Records are written
    before each checkpoint, so after a crash (kill -9) a resumed run's metrics.jsonl matches an
    uninterrupted one's. A non-finite loss or gradient stops the run (train.on_nonfinite=stop) before
    any later checkpoint, or only withholds that step's update (skip).
    """
    cfg, t = self.config, self.config.train
    is_main = is_main_process()
    self.stopped_at: int | None = None  # the step a SIGTERM stopped the run after
    checkpoints = Checkpointer(cfg.run_dir / CHECKPOINTS, keep=t.keep_checkpoints)
    logger = None
    try:
      state = self._restore_or_init(checkpoints)
      if is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / CONFIG).write_text(cfg.to_yaml())
      start = int(jax.device_get(state.step))
      logger = MetricsLogger(cfg.run_dir, t.steps, start, t.progress, enabled=is_main)
      records: list[dict[str, Any]] = []

      def emit(new: list[dict[str, Any]]) -> None:
        for record in new:
          records.append(record)
          logger.log(record)

      if start == 0 and t.eval_batches:
        emit([{'step': 0, 'val_loss': self.evaluate(state.params, self.val_batches, t.eval_batches)}])
      pending: list[tuple[int, Any]] = []
      timer = time.perf_counter()
      with preemption(checkpoints) as reached:
        for done in range(start + 1, t.steps + 1):
          state, step_metrics = self.train_step(state, next(self.train_batches))
          pending.append((done, step_metrics))
          preempted = reached(done)
          last = done == t.steps or preempted
          save = bool(t.checkpoint_every and done % t.checkpoint_every == 0) or last
          if done % t.log_every == 0 or last or save:  # every record up to a checkpoint is written before it
            flushed = self._records(pending, timer)
            emit(flushed)
            logger.advance(len(pending))
            pending, timer = [], time.perf_counter()
            self._check_finite(flushed)
          if t.eval_batches and (done % t.eval_every == 0 or done == t.steps):
            emit([{'step': done, 'val_loss': self.evaluate(state.params, self.val_batches, t.eval_batches)}])
            timer = time.perf_counter()
          if save:
            checkpoints.save(done, state, self.train_batches.iterator, cfg.to_dict())
          if preempted:
            self.stopped_at = done
            break
      checkpoints.wait()
      if self.stopped_at is not None:
        barrier('stopped')  # every process has written its part of the checkpoint
        then = ask_requeue() if is_main else 'continue with --resume'
        print(f'stopped by SIGTERM after step {self.stopped_at}; checkpoint saved, {then}', flush=True)
    finally:
      checkpoints.close()
      if logger is not None:
        logger.close()
    self.final_state = state
    return records

  def _check_finite(self, records: list[dict[str, Any]]) -> None:
    """Under train.on_nonfinite=stop, the first non-finite step ends the run (its state was never updated)."""
    bad = next((r for r in records if r.get('nonfinite')), None)
    if bad is None or self.config.train.on_nonfinite != 'stop':
      return
    metric = next((k for k in ('loss', 'z_loss', 'grad_norm') if not math.isfinite(bad[k])), 'grad_norm')
    raise TrainingError(f'step {bad["step"]}: {metric} is {bad[metric]}; stopped with the state of step '
                        f'{bad["step"] - 1} (no later checkpoint); lower optim.learning_rate, or set '
                        f'train.on_nonfinite=skip to drop such steps')

  def _records(self, pending: list[tuple[int, Any]], since: float) -> list[dict[str, Any]]:
    """Metrics of the steps since the last log; the last one carries throughput over the interval."""
    fetched = jax.device_get(pending)  # blocks until those steps are done
    elapsed = time.perf_counter() - since
    records = [{'step': s, **{k: float(v) for k, v in m.items()}} for s, m in fetched]
    tokens_per_sec = len(fetched) * self.config.train.global_batch * self.config.data.seq_len / elapsed
    records[-1]['tokens_per_sec'] = tokens_per_sec
    utilisation = mfu(tokens_per_sec, self.flops_per_token, self.mesh.devices.size, self.peak_flops)
    if utilisation is not None:
      records[-1]['mfu'] = utilisation
    return records


def train(config: Config, devices: Sequence[jax.Device] | None = None) -> list[dict[str, Any]]:
  return Trainer(config, devices).run()
