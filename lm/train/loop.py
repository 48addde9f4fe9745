"""The training loop: build everything from a Config, then step, log, evaluate and checkpoint."""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax

from lm.assembly import assemble
from lm.checkpoint import Checkpointer
from lm.config import Config, ConfigError
from lm.data.pipeline import Batches, build_batches
from lm.parallel.chips import peak_flops
from lm.run_dir import CHECKPOINTS, CONFIG
from lm.train.accounting import mfu
from lm.train.init_from import initial_state
from lm.train.logging import MetricsLogger
from lm.train.state import TrainState
from lm.train.step import make_eval_step, make_train_step


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
    self.tokenizer, self.train_batches, self.val_batches = build_batches(config, self.mesh)

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
    latest = checkpoints.latest_step()
    if latest is not None and not checkpoints.has_optimizer(latest):
      raise ConfigError(f'{cfg.run_dir} holds an imported model (params only), which training would overwrite; '
                        f'train from it in a new directory: train.init_from={cfg.run_dir} train.run_dir=NEW_DIR')
    if latest is not None and not cfg.train.resume:
      raise ConfigError(f'{cfg.run_dir} already holds checkpoints (latest step {latest}); pass --resume '
                        f'(train.resume=true) to continue, or choose another train.run_dir')
    if latest is None:
      if cfg.train.init_from is None:
        return self.init_state()
      start = initial_state(self.assembly, cfg.train.init_from)
      print(f'initialised from {cfg.train.init_from}' +
            (f'; new: {", ".join(start.fresh)}' if start.fresh else '') +
            (f'; not used: {", ".join(start.unused)}' if start.unused else ''), flush=True)
      return start.state
    state = checkpoints.restore(latest, self.assembly.abstract_state, cfg.to_dict(), self.train_batches.iterator)
    print(f'resumed from {checkpoints.directory}/{latest}', flush=True)
    return state

  def run(self) -> list[dict[str, Any]]:
    """Trains to `train.steps`, resuming if asked; returns the logged records.

    On SIGTERM (the preemption notice of TPU VMs and SLURM) it finishes the current step,
    checkpoints and returns, so `--resume` continues exactly.
    """
    cfg, t = self.config, self.config.train
    is_main = jax.process_index() == 0
    checkpoints = Checkpointer(cfg.run_dir / CHECKPOINTS, keep=t.keep_checkpoints)
    state = self._restore_or_init(checkpoints)
    if is_main:
      cfg.run_dir.mkdir(parents=True, exist_ok=True)
      (cfg.run_dir / CONFIG).write_text(cfg.to_yaml())
    start = int(jax.device_get(state.step))
    logger = MetricsLogger(cfg.run_dir, t.steps, start, t.progress, enabled=is_main)
    records: list[dict[str, Any]] = []

    def emit(record: dict[str, Any]) -> None:
      records.append(record)
      logger.log(record)

    if start == 0 and t.eval_batches:
      emit({'step': 0, 'val_loss': self.evaluate(state.params, self.val_batches, t.eval_batches)})
    pending: list[tuple[int, Any]] = []
    timer = time.perf_counter()
    try:
      with sigterm_flag() as preempted:
        for done in range(start + 1, t.steps + 1):
          state, step_metrics = self.train_step(state, next(self.train_batches))
          pending.append((done, step_metrics))
          last = done == t.steps or preempted.is_set()
          if done % t.log_every == 0 or last:
            for record in self._records(pending, timer):
              emit(record)
            logger.advance(len(pending))
            pending, timer = [], time.perf_counter()
          if t.eval_batches and (done % t.eval_every == 0 or done == t.steps):
            emit({'step': done, 'val_loss': self.evaluate(state.params, self.val_batches, t.eval_batches)})
            timer = time.perf_counter()
          if (t.checkpoint_every and done % t.checkpoint_every == 0) or last:
            checkpoints.save(done, state, self.train_batches.iterator, cfg.to_dict())
          if preempted.is_set():
            print(f'stopped by SIGTERM after step {done}; checkpoint saved, continue with --resume', flush=True)
            break
      checkpoints.wait()
    finally:
      checkpoints.close()
      logger.close()
    self.final_state = state
    return records

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


@contextlib.contextmanager
def sigterm_flag() -> Iterator[threading.Event]:
  """An event set on SIGTERM while the block runs (signals can only be caught on the main thread)."""
  flag = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: flag.set())
  try:
    yield flag
  finally:
    signal.signal(signal.SIGTERM, previous)


def train(config: Config, devices: Sequence[jax.Device] | None = None) -> list[dict[str, Any]]:
  return Trainer(config, devices).run()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in (Path(run_dir) / 'metrics.jsonl').read_text().splitlines() if line]

