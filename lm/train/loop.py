"""The one training loop: a state over a stream of batches, with callbacks at their cadence.

Jobs (pretraining, GLUE fine-tuning, scaling sweeps) build the data, the loss and the callbacks and hand them
here. Every step's metrics are logged (metrics.jsonl, TensorBoard, a bar or lines), the last of each logging
interval with tokens/s and MFU; a non-finite loss or gradient stops the run (`train.on_nonfinite=stop`) before
any later checkpoint, or only withholds that step's update (skip). Callbacks (evaluation, the latest checkpoint,
the best params) run after the steps their cadence names and after the last one, with every record up to that
step written first, so after a crash (kill -9) a resumed run's metrics.jsonl matches an uninterrupted one's. On
SIGTERM to any process (the preemption notice of TPU VMs and SLURM) every process finishes the same step, runs
the checkpoint callback and returns, so `--resume` continues exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import jax

from lm.assembly import Assembly
from lm.assembly.accounting import mfu
from lm.assembly.state import TrainState
from lm.storage.checkpoint import UNRESTORABLE, Checkpointer
from lm.config import ConfigError, TrainConfig
from lm.distributed import all_processes, barrier, is_main_process
from lm.parallel.chips import peak_flops
from lm.train.logging import MetricsLogger, read_metrics
from lm.train.preemption import ask_requeue, preemption
from lm.train.step import Batch, StepLoss, make_train_step
from lm.train.timing import Clock, SlowSteps

Record = dict[str, Any]


class TrainingError(RuntimeError):
  """The run cannot go on (e.g. a non-finite loss); the message names the step and what to change."""


@dataclass(frozen=True)
class After:
  """What a callback sees: the step just taken, the state after it, and every record logged so far (a resumed
  run's included)."""
  step: int
  state: TrainState
  history: list[Record]


class Callback:
  """Runs after every `every`-th step and after the final one (`every` 0: the final only); returns records to log.
  Its time counts as `part` of the run's (lm.train.timing)."""
  every: int = 0
  part: str = 'other'

  def due(self, step: int, final: bool, stopping: bool) -> bool:
    """Whether to run after `step`: `final` is train.steps; `stopping`, a step a SIGTERM stops the run after."""
    return final or bool(self.every and step % self.every == 0)

  def start(self, step: int, state: TrainState, history: list[Record]) -> list[Record]:
    """Before the first step (`step` 0 for a fresh run, the checkpoint's step for a resumed one)."""
    return []

  def __call__(self, after: After) -> list[Record]:
    return []

  def finish(self) -> None:
    """After the last step: wait for anything still in flight."""


class Evaluate(Callback):
  """Logs `evaluator(params, step)` (named metrics) every `every` steps, after the final one, and before step 1
  when asked; `params_of(state)` picks the params evaluated (default the trained ones)."""
  part = 'eval'

  def __init__(self, evaluator: Callable[[Any, int], Record], every: int, at_start: bool = False,
               params_of: Callable[[Any], Any] = lambda state: state.params):
    self.evaluator, self.every, self.at_start, self.params_of = evaluator, every, at_start, params_of

  def start(self, step, state, history):
    return [{'step': 0, **self.evaluator(self.params_of(state), 0)}] if self.at_start and step == 0 else []

  def __call__(self, after):
    return [{'step': after.step, **self.evaluator(self.params_of(after.state), after.step)}]


class Checkpoint(Callback):
  """The latest state, the data position and the config, every `every` steps, at the steps `at` and the multiples
  of `keep_every`, after the final one, at a SIGTERM, and (`minutes` > 0) at the first step of `check_every` (the
  logging interval) at which every process has spent that long since the last save; asynchronous unless the
  checkpointer says otherwise."""
  part = 'checkpoint'

  def __init__(self, checkpointer: Checkpointer, every: int, data: Any, config: dict, at: Sequence[int] = (),
               keep_every: int = 0, minutes: float = 0.0, check_every: int = 1,
               clock: Callable[[], float] = time.monotonic):
    self.checkpointer, self.every, self.data, self.config, self.at = checkpointer, every, data, config, set(at)
    self.keep_every, self.minutes, self.check_every, self.clock = keep_every, minutes, check_every, clock
    self.last_save = clock()

  @classmethod
  def of(cls, checkpointer: Checkpointer, train: TrainConfig, data: Any, config: dict) -> Checkpoint:
    """The cadence `train` sets (checkpoint_every, checkpoint_at, keep_every, checkpoint_every_minutes)."""
    return cls(checkpointer, train.checkpoint_every, data, config, train.checkpoint_at, train.keep_every,
               train.checkpoint_every_minutes, train.log_every)

  def start(self, step, state, history):
    self.last_save = self.clock()
    return []

  def due(self, step, final, stopping):
    if stopping or step in self.at or super().due(step, final, stopping) or \
        (self.keep_every and step % self.keep_every == 0):
      return True
    # every process takes the same decision at the same step (a collective where there are several)
    return bool(self.minutes) and step % self.check_every == 0 and \
        all_processes(self.clock() - self.last_save >= 60 * self.minutes)

  def __call__(self, after):
    self.checkpointer.save(after.step, after.state, self.data, self.config)
    self.last_save = self.clock()
    return []

  def finish(self):
    self.checkpointer.wait()


class KeepBest(Callback):
  """A params-only checkpoint whenever `metric` (logged by an evaluation at the same cadence, before this) beats
  every earlier value (higher is better; the first of equals is kept). The record holding it is saved with the
  params, so a resumed run compares against it and a job reads the best metrics back."""
  part = 'checkpoint'

  def __init__(self, checkpointer: Checkpointer, metric: str, every: int, config: dict):
    self.checkpointer, self.metric, self.every, self.config = checkpointer, metric, every, config
    self.best: float | None = None

  def start(self, step, state, history):
    if step == 0:  # a fresh run: best params of an earlier start that never checkpointed are not this run's
      self.checkpointer.delete_all()
    saved = self.checkpointer.latest_step()
    self.best = None if saved is None else self.checkpointer.saved_metrics(saved)[self.metric]
    return []

  def __call__(self, after):
    record = next((r for r in reversed(after.history) if r['step'] == after.step and self.metric in r), None)
    if record is not None and (self.best is None or record[self.metric] > self.best):
      self.best = record[self.metric]
      self.checkpointer.save_params(after.step, after.state.params, self.config,
                                    metrics={k: v for k, v in record.items() if k != 'step'})
    return []

  def finish(self):
    self.checkpointer.wait()


class Resumable(Protocol):
  """A data stream whose position checkpoints save (grain's iterators; `lm.data.pipeline.HostRows`)."""
  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...


def restore_or_start(checkpoints: Checkpointer, assembly: Assembly, data: Resumable,
                     start: Callable[[], TrainState]) -> TrainState:
  """The latest checkpoint's state (and `data` moved to its position) under `train.resume`, else `start()`;
  refuses to write over another run's checkpoints or an imported model."""
  cfg = assembly.config
  if checkpoints.is_params_only():
    raise ConfigError(f'{checkpoints.directory} holds an imported model (params only), which training would '
                      f'overwrite; train from it in a new directory: train.init_from={cfg.run_dir} '
                      f'train.run_dir=NEW_DIR')
  steps = checkpoints.all_steps()
  if steps and not cfg.train.resume:
    raise ConfigError(f'{checkpoints.directory.parent} already holds checkpoints (latest step {steps[-1]}); pass '
                      f'--resume (train.resume=true) to continue, or choose another train.run_dir')
  if not steps:
    if cfg.train.resume:
      print(f'no checkpoint in {checkpoints.directory}; starting at step 0', flush=True)
    return start()
  restored = checkpoints.restore_latest(assembly.abstract_state, cfg.to_dict(), data)
  if restored is None:
    raise ConfigError(f'no checkpoint in {checkpoints.directory} restores (each is kept as '
                      f'<step>{UNRESTORABLE}); start a new train.run_dir')
  if restored[0] >= cfg.train.steps:
    print(f'run already complete at step {restored[0]} (train.steps={cfg.train.steps}); raise train.steps '
          f'to train on', flush=True)
  else:
    print(f'resumed from {checkpoints.directory}/{restored[0]}', flush=True)
  return restored[1]


class Trainer:
  """Trains an assembly's state with `loss` (default: the family's pretraining objective) to `train.steps`,
  logging into `log_dir`."""

  def __init__(self, assembly: Assembly, loss: StepLoss | None = None, *, log_dir: Any):
    self.assembly, self.config, self.log_dir = assembly, assembly.config, log_dir
    self.train_step = make_train_step(assembly, loss)
    self.flops_per_token = assembly.flops_per_token()
    self.peak_flops = self.config.train.peak_flops or peak_flops(assembly.mesh.devices.flat[0])
    self._slow_steps = SlowSteps(self.config.train.slow_step_factor if is_main_process() else 0.0)
    self.stopped_at: int | None = None  # the step a SIGTERM stopped the run after
    self.final_state: TrainState | None = None

  def run(self, state: TrainState, batches: Iterator[Batch], callbacks: Sequence[Callback] = (),
          checkpoint: Checkpoint | None = None) -> list[Record]:
    """Steps `state` on `batches` from its step to `train.steps`, running `callbacks` in order, then `checkpoint`
    (which also agrees across processes on the step a SIGTERM stops at); returns the records this call logged."""
    callbacks = list(callbacks) + ([checkpoint] if checkpoint else [])
    t, is_main = self.config.train, is_main_process()
    start = int(jax.device_get(state.step))
    history = [r for r in read_metrics(self.log_dir) if r['step'] <= start] if start and is_main else []
    logger = MetricsLogger(self.log_dir, t.steps, start, t.progress, enabled=is_main)
    records: list[Record] = []

    def emit(new: list[Record]) -> None:
      for record in new:
        records.append(record)
        history.append(record)
        logger.log(record)

    clock = Clock(self.log_dir, start, enabled=is_main)
    try:
      for callback in callbacks:
        emit(callback.start(start, state, history))
      pending: list[tuple[int, Any]] = []
      timer = time.perf_counter()
      with preemption(checkpoint.checkpointer if checkpoint else None) as reached:
        for done in range(start + 1, t.steps + 1):
          with jax.profiler.StepTraceAnnotation('train', step_num=done):  # a step to profilers (train.profile)
            waited = time.perf_counter()
            batch = next(batches)
            stepped = time.perf_counter()
            clock.add('data', stepped - waited)
            state, step_metrics = self.train_step(state, batch)
          if done == start + 1:  # this process's first step compiles the program
            jax.block_until_ready(step_metrics)
            clock.add('startup', time.perf_counter() - stepped)
          pending.append((done, step_metrics))
          preempted = reached(done)
          last = done == t.steps or preempted
          due = [c for c in callbacks if c.due(done, done == t.steps, preempted)]
          if done % t.log_every == 0 or last or due:  # every record up to a callback's step is written before it
            flushed = self._records(pending, timer)
            flushed[-1].update(clock.record(done))
            self._slow_steps.check(flushed[-1], len(pending))
            emit(flushed)
            logger.advance(len(pending))
            pending = []
            self._check_finite(flushed)
            for callback in due:
              began = time.perf_counter()
              emit(callback(After(done, state, history)))
              clock.add(callback.part, time.perf_counter() - began)
            timer = time.perf_counter()
          if preempted:
            self.stopped_at = done
            break
      for callback in callbacks:
        began = time.perf_counter()
        callback.finish()
        clock.add(callback.part, time.perf_counter() - began)
      clock.record(int(jax.device_get(state.step)))
      if self.stopped_at is not None:
        barrier('stopped')  # every process has written its part of the checkpoint
        then = ask_requeue() if is_main else 'continue with --resume'
        print(f'stopped by SIGTERM after step {self.stopped_at}; checkpoint saved, {then}', flush=True)
    finally:
      logger.close()
    self.final_state = state
    return records

  def _check_finite(self, records: list[Record]) -> None:
    """Under train.on_nonfinite=stop, the first non-finite step ends the run (its state was never updated)."""
    bad = next((r for r in records if r.get('nonfinite')), None)
    if bad is None or self.config.train.on_nonfinite != 'stop':
      return
    metric = next((k for k in ('loss', 'z_loss', 'grad_norm') if k in bad and not math.isfinite(bad[k])),
                  'grad_norm')
    raise TrainingError(f'step {bad["step"]}: {metric} is {bad[metric]}; stopped with the state of step '
                        f'{bad["step"] - 1} (no later checkpoint); lower optim.learning_rate, or set '
                        f'train.on_nonfinite=skip to drop such steps')

  def _records(self, pending: list[tuple[int, Any]], since: float) -> list[Record]:
    """Metrics of the steps since the last log; the last one carries throughput over the interval."""
    fetched = jax.device_get(pending)  # blocks until those steps are done
    elapsed = time.perf_counter() - since
    watch = self.config.train.watch_every  # per-layer norms: only their steps' are computed
    records = [{'step': s, **{k: float(v) for k, v in m.items() if not (k.startswith('watch/') and s % watch)}}
               for s, m in fetched]
    tokens_per_sec = len(fetched) * self.config.train.global_batch * self.config.data.seq_len / elapsed
    records[-1]['tokens_per_sec'] = tokens_per_sec
    utilisation = mfu(tokens_per_sec, self.flops_per_token, self.assembly.mesh.devices.size, self.peak_flops)
    if utilisation is not None:
      records[-1]['mfu'] = utilisation
    return records
