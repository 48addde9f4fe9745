"""The one training loop: a Trainer owns a run (its directory, resuming, the checkpoint cadence, profiling) and
steps a state over a stream of batches, with callbacks (`lm.train.callbacks`) at their cadence.

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

import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
from etils import epath

from lm.assembly import Assembly
from lm.assembly.state import TrainState, with_fresh_window
from lm.config import Config, ConfigError, batch_at, batch_schedule, microbatches_at
from lm.distributed import all_processes, barrier, is_main_process
from lm.parallel.chips import peak_flops
from lm.storage.checkpoint import UNRESTORABLE, Checkpointer
from lm.storage.run_dir import CHECKPOINTS, CONFIG, PROFILE
from lm.train.callbacks import After, Callback, Checkpoint, FiniteGuard, Interval, Record, Throughput
from lm.train.local_tier import LocalCheckpoint, LocalTier, restore_newest
from lm.train.logging import MetricsLogger, read_metrics
from lm.train.noise_scale import NoiseScale
from lm.train.preemption import ask_requeue, preemption
from lm.train.profiler import Profile
from lm.train.spikes import Rollback, SpikeGuard, count_rollbacks, describe
from lm.train.step import Batch, StepLoss, make_train_step
from lm.train.timing import Clock, SlowSteps, report_summary
from lm.train.trackers import Tracker, check_trackers, make_trackers
from lm.train.watchdog import Watchdog


class Resumable(Protocol):
  """A data stream whose position checkpoints save (grain's iterators; `lm.data.pipeline.HostRows`)."""
  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...


def restore_or_start(checkpoints: Checkpointer, assembly: Assembly, data: Resumable,
                     start: Callable[[], TrainState], local: LocalTier | None = None) -> TrainState:
  """The newest checkpoint's state in either tier (and `data` moved to its position) under `train.resume`, else
  `start()`; refuses to write over another run's checkpoints or an imported model."""
  cfg = assembly.config
  if checkpoints.is_params_only():
    raise ConfigError(f'{checkpoints.directory} holds an imported model (params only), which training would '
                      f'overwrite; train from it in a new directory: train.init_from={cfg.run_dir} '
                      f'train.run_dir=NEW_DIR')
  steps = checkpoints.all_steps()
  held = local is not None and not all_processes(not local.steps())
  if (steps or held) and not cfg.train.resume:
    where = f'{checkpoints.directory.parent} already holds checkpoints (latest step {steps[-1]})' if steps else \
        f'train.local_checkpoint_dir={cfg.train.local_checkpoint_dir} holds checkpoints of this run'
    raise ConfigError(f'{where}; pass --resume (train.resume=true) to continue, or choose another train.run_dir')
  if not steps and not held:
    if cfg.train.resume:
      print(f'no checkpoint in {checkpoints.directory}; starting at step 0', flush=True)
    if local is not None:
      local.drop_after(0)
    return start()
  restored = restore_newest(checkpoints, local, assembly.abstract_state, cfg.to_dict(), data)
  if restored is None:
    raise ConfigError(f'no checkpoint in {checkpoints.directory} restores (each is kept as '
                      f'<step>{UNRESTORABLE}); start a new train.run_dir')
  step, state, directory = restored
  if step >= cfg.train.steps:
    print(f'run already complete at step {step} (train.steps={cfg.train.steps}); raise train.steps '
          f'to train on', flush=True)
  else:
    print(f'resumed from {directory}', flush=True)
  return state


class Trainer:
  """Owns one run: its directory (config.yaml, metrics, checkpoints, profile), resuming, and the loop that steps an
  assembly's state with the job's `loss` to `train.steps`, with the job's callbacks, the checkpoint cadence and
  profiling the config sets, and the monitors (throughput and MFU, slow steps, the finite guard)."""

  def __init__(self, assembly: Assembly, loss: StepLoss, *, run_dir: Any):
    self.assembly, self.config, self.run_dir = assembly, assembly.config, epath.Path(run_dir)
    self.train_step = make_train_step(assembly, loss)
    t = self.config.train
    peak = t.peak_flops or peak_flops(assembly.mesh.devices.flat[0], self.config.model.quantization)
    self.stages = stages = batch_schedule(self.config)  # train.batch_ramp's stages (one without)
    rows_at = lambda step: batch_at(stages, step)
    self.monitors: list[Callback] = [
      Throughput(lambda step: rows_at(step) * self.config.data.seq_len, assembly.flops_per_token(),
                 assembly.mesh.devices.size, peak),
      SlowSteps(t.slow_step_factor if is_main_process() else 0.0, rows_at), FiniteGuard(t.on_nonfinite)]
    if t.noise_scale:
      self.monitors.insert(0, NoiseScale(lambda step: (rows_at(step), microbatches_at(self.config, rows_at(step))),
                                         self.config.data.seq_len, t.watch_every))
    self._concatenate = jax.jit(lambda batches: jax.tree.map(lambda *rows: jnp.concatenate(rows), *batches))
    check_trackers(self.config)  # a tracker that is not installed stops the run before it starts
    self.spike_guard = SpikeGuard(t, 0, is_main_process()) if t.on_spike != 'off' else None
    self.stopped_at: int | None = None  # the step a SIGTERM stopped the run after
    self.final_state: TrainState | None = None
    self._positions: dict[int, Any] = {}  # on_spike=rollback: the data position after each pending step's batch
    self.local: LocalTier | None = None  # the local checkpoint tier (train.local_checkpoint_dir)

  def run(self, batches: Iterator[Batch], start: Callable[[], TrainState], callbacks: Sequence[Callback] = (),
          position: Resumable | None = None, config: Config | None = None) -> list[Record]:
    """Resumes the run dir's latest checkpoint under `train.resume` (else takes `start()`), writes config.yaml and
    trains on `batches`, whose position (`position`, default `batches`) checkpoints keep; returns the records this
    call logged. `config` is what config.yaml and the checkpoints record (default: the assembly's; a branch's
    names the checkpoint it starts from). Checkpoints are made by their first save: a run that fails before
    leaves nothing behind."""
    cfg = self.config if config is None else config
    t = cfg.train
    position = batches if position is None else position
    checkpoints = Checkpointer(self.run_dir / CHECKPOINTS, keep=t.checkpoint.keep, create=False,
                               keep_steps=t.checkpoint.at, keep_every=t.checkpoint.keep_every)
    self.local = LocalTier(cfg, self.run_dir) if t.local_checkpoint_dir else None
    trackers: list[Tracker] = []
    try:
      state = with_fresh_window(restore_or_start(checkpoints, self.assembly, position, start, self.local),
                                self.assembly.abstract_state.spike_window)
      resumed_at = int(jax.device_get(state.step))
      kept = [r for r in read_metrics(self.run_dir) if r['step'] <= resumed_at] \
        if resumed_at and (self.spike_guard or is_main_process()) else []
      if self.spike_guard:  # rollbacks logged before a restart count against train.max_rollbacks (every process
        self.spike_guard.rollbacks = count_rollbacks(kept)  # reads them: each must take the same decision)
      if is_main_process():
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG).write_text(cfg.to_yaml())
        trackers = make_trackers(cfg, self.run_dir, kept)
      profile = [Profile(t.profile, self.run_dir / PROFILE, t.profile_all_hosts)] if t.profile else []
      local = [LocalCheckpoint(self.local, position, cfg.to_dict())] if self.local else []
      return self._train(state, batches, [*callbacks, *profile, *local],
                         Checkpoint.of(checkpoints, t, position, cfg.to_dict()), position, trackers, start, cfg)
    finally:
      checkpoints.close()
      if self.local:
        self.local.checkpointer.close()
      summary = report_summary(self.run_dir) if trackers else {}
      for tracker in trackers:
        tracker.close(summary)

  def _train(self, state: TrainState, batches: Iterator[Batch], callbacks: list[Callback], checkpoint: Checkpoint,
             position: Resumable, trackers: list[Tracker], start: Callable[[], TrainState], cfg: Config
             ) -> list[Record]:
    """`_steps` to the end, begun again from the latest checkpoint at each rollback (train.on_spike)."""
    records: list[Record] = []
    opening: list[Record] = []
    while True:
      try:
        return records + self._steps(state, batches, callbacks, checkpoint, position, opening, trackers)
      except Rollback as spike:
        state, opening = self._roll_back(spike.record, checkpoint, batches, position, start, cfg)
        records = [r for r in records + self._records if r['step'] <= opening[0]['step']]

  def _roll_back(self, spike: Record, checkpoint: Checkpoint, batches: Iterator[Batch], position: Resumable,
                 start: Callable[[], TrainState], cfg: Config) -> tuple[TrainState, list[Record]]:
    """The state of the latest checkpoint (a fresh start without one) and the data from just after the spike's
    batch, `train.rollback_skip_batches` more skipped; returns it and the record saying so."""
    t, step = cfg.train, spike['step']
    checkpoint.finish()  # a save in flight is part of what may be restored
    if self.local:
      self.local.checkpointer.wait()
    restored = restore_newest(checkpoint.checkpointer, self.local, self.assembly.abstract_state, cfg.to_dict(),
                              position)
    back_to, state = restored[:2] if restored is not None else (0, start())
    state = with_fresh_window(state, self.assembly.abstract_state.spike_window)
    position.set_state(self._positions[step])
    for _ in range(t.rollback_skip_batches):
      next(batches)
    self.spike_guard.rollbacks += 1
    if is_main_process():
      print(f'{describe(spike, t.spike_window)}; rolled back to step {back_to} and skipped the batches of steps '
            f'{back_to + 1}-{step} and {t.rollback_skip_batches} more (rollback {self.spike_guard.rollbacks} of at '
            f'most {t.max_rollbacks})', flush=True)
    return state, [{'step': back_to, 'spike/rolled_back_from': step,
                    'spike/skipped_batches': step - back_to + t.rollback_skip_batches}]

  def _steps(self, state: TrainState, batches: Iterator[Batch], callbacks: list[Callback],
             checkpoint: Checkpoint, position: Resumable, opening: list[Record], trackers: list[Tracker]
             ) -> list[Record]:
    """Steps `state` from its step to `train.steps`, running `callbacks` in order, then `checkpoint` (which also
    agrees across processes on the step a SIGTERM stops at); `opening` records (a rollback's) are logged first."""
    callbacks = callbacks + [checkpoint]
    t, is_main = self.config.train, is_main_process()
    start = int(jax.device_get(state.step))
    history = [r for r in read_metrics(self.run_dir) if r['step'] <= start] if start and is_main else []
    logger = MetricsLogger(self.run_dir, t.steps, start, t.progress, enabled=is_main, trackers=trackers)
    self._records = records = []

    def emit(new: list[Record]) -> None:
      for record in new:
        records.append(record)
        history.append(record)
        logger.log(record)

    clock = Clock(self.run_dir, start, enabled=is_main)
    watchdog = Watchdog(self.run_dir, t.hang_timeout_minutes, jax.process_index(), jax.process_count())
    try:
      emit(opening)
      for callback in callbacks:
        emit(callback.start(start, state, history))
      pending: list[tuple[int, Any]] = []
      timer = time.perf_counter()
      with preemption(checkpoint.checkpointer) as reached:
        for done in range(start + 1, t.steps + 1):
          compiles = done == start + 1 or any(after == done - 1 for after, _ in self.stages[1:])  # a ramp's stage
          state, step_metrics = self._take_step(state, batches, done, compiles, position, clock, watchdog)
          pending.append((done, step_metrics))
          preempted = reached(done)
          last = done == t.steps or preempted
          due = [c for c in callbacks if c.due(done, done == t.steps, preempted)]
          if done % t.log_every == 0 or last or due:  # every record up to a callback's step is written before it
            self._log_interval(pending, timer, clock, callbacks, emit)
            logger.advance(len(pending))
            pending = []
            self._positions.clear()
            for callback in due:
              began = time.perf_counter()
              emit(callback(After(done, state, history)))
              clock.add(callback.part, time.perf_counter() - began)
            timer = time.perf_counter()
          if preempted:
            self.stopped_at = done
            break
      self._finish(callbacks, clock)
      clock.record(int(jax.device_get(state.step)))
      if self.stopped_at is not None:
        self._say_stopped()
    finally:
      logger.close()
      watchdog.close()
    self.final_state = state
    return records

  def _take_step(self, state: TrainState, batches: Iterator[Batch], done: int, first: bool, position: Resumable,
                 clock: Clock, watchdog: Watchdog) -> tuple[TrainState, Any]:
    """Dispatches step `done` on the next batch (under on_spike=rollback, the data position after it is kept); the
    process's `first` step, and a batch ramp stage's, which compile the program, are waited for."""
    with jax.profiler.StepTraceAnnotation('train', step_num=done):  # a step to profilers (train.profile)
      waited = time.perf_counter()
      parts = batch_at(self.stages, done) // self.config.train.global_batch  # a batch ramp's stage: that many
      batch = next(batches) if parts == 1 else self._concatenate([next(batches) for _ in range(parts)])  # batches
      if self.config.train.on_spike == 'rollback':
        self._positions[done] = position.get_state()
      stepped = time.perf_counter()
      clock.add('data', stepped - waited)
      state, step_metrics = self.train_step(state, batch)
    if first:
      jax.block_until_ready(step_metrics)
      clock.add('startup', time.perf_counter() - stepped)
      watchdog.completed(done)
    else:
      watchdog.dispatched(done, step_metrics['grad_norm'])
    return state, step_metrics

  def _say_stopped(self) -> None:
    """After a SIGTERM's checkpoint: once every process has written its part, say so (and requeue a SLURM job)."""
    barrier('stopped')
    then = ask_requeue() if is_main_process() else 'continue with --resume'
    print(f'stopped by SIGTERM after step {self.stopped_at}; checkpoint saved, {then}', flush=True)

  @staticmethod
  def _finish(callbacks: list[Callback], clock: Clock) -> None:
    """Each callback waits for what it has in flight (an asynchronous checkpoint), its time counted as its part's."""
    for callback in callbacks:
      began = time.perf_counter()
      callback.finish()
      clock.add(callback.part, time.perf_counter() - began)

  def _log_interval(self, pending: list[tuple[int, Any]], since: float, clock: Clock, callbacks: list[Callback],
                    emit: Callable[[list[Record]], None]) -> None:
    """The metrics of the steps since the last log, the last record with the interval's clock and what the
    monitors and callbacks annotate, logged; then the monitors and callbacks see them."""
    fetched = jax.device_get(pending)  # blocks until those steps are done
    elapsed = time.perf_counter() - since
    watch = self.config.train.watch_every  # per-layer norms: only their steps' are computed
    flushed = [{'step': s, **{k: float(v) for k, v in m.items() if not (k.startswith('watch/') and s % watch)}}
               for s, m in fetched]
    flushed[-1].update(clock.record(fetched[-1][0]))
    for observer in self.monitors + callbacks:
      observer.annotate(Interval(flushed, elapsed))
    emit(flushed)
    for observer in self.monitors + ([self.spike_guard] if self.spike_guard else []) + callbacks:
      observer.logged(flushed)
