"""What runs beside the loop's steps: callbacks at their cadence (evaluation, the latest checkpoint, the best
params, profiling), and at each logging interval the monitors (throughput and MFU, the finite guard; the slow-step
check lives with the clock in `lm.train.timing`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from lm.assembly.accounting import mfu
from lm.assembly.state import TrainState
from lm.config import TrainConfig
from lm.distributed import all_processes
from lm.storage.checkpoint import Checkpointer

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


@dataclass(frozen=True)
class Interval:
  """A logging interval just ended: its steps' records (the last carries the interval's totals) and wall seconds."""
  records: list[Record]
  elapsed: float


class Callback:
  """Runs after every `every`-th step and after the final one (`every` 0: the final only); returns records to log.
  Its time counts as `part` of the run's (lm.train.timing). At each logging interval `annotate` may add to the
  interval's last record before it is written, and `logged` sees the records once they are."""
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

  def annotate(self, interval: Interval) -> None:
    """Adds to `interval.records[-1]` before the interval is logged."""

  def logged(self, records: list[Record]) -> None:
    """After the interval's records are logged; may stop the run (TrainingError)."""


class Evaluate(Callback):
  """Logs `evaluator(params, step)` (named metrics) every `every` steps, at the steps `at`, after the final one, and
  before step 1 when asked; `params_of(state)` makes the params evaluated (`Assembly.params_of`: a view, on the
  devices)."""
  part = 'eval'

  def __init__(self, evaluator: Callable[[Any, int], Record], every: int, *, params_of: Callable[[Any], Any],
               at_start: bool = False, at: Sequence[int] = ()):
    self.evaluator, self.every, self.at_start, self.params_of, self.at = evaluator, every, at_start, params_of, set(at)

  def due(self, step, final, stopping):
    return step in self.at or super().due(step, final, stopping)

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
    """The cadence `train.checkpoint` sets, the time checked at each log step."""
    c = train.checkpoint
    return cls(checkpointer, c.every, data, config, c.at, c.keep_every, c.every_minutes, train.log_every)

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
                                    metrics={k: v for k, v in record.items() if k != 'step'}, over_base=True)
    return []

  def finish(self):
    self.checkpointer.wait()


class Throughput(Callback):
  """tokens/s of each logging interval and, where the chip's peak is known, MFU, on the interval's last record."""

  def __init__(self, tokens_at: Callable[[int], int], flops_per_token: float, devices: int, peak: float | None):
    """`tokens_at(step)`: the tokens step `step` trains on (a batch ramp changes them)."""
    self.tokens_at, self.flops_per_token, self.devices, self.peak = tokens_at, flops_per_token, devices, peak

  def due(self, step, final, stopping):
    return False

  def annotate(self, interval):
    record = interval.records[-1]
    record['tokens_per_sec'] = sum(self.tokens_at(r['step']) for r in interval.records) / interval.elapsed
    utilisation = mfu(record['tokens_per_sec'], self.flops_per_token, self.devices, self.peak)
    if utilisation is not None:
      record['mfu'] = utilisation


class FiniteGuard(Callback):
  """Under train.on_nonfinite=stop, the first non-finite step ends the run once its record is logged (its state
  was never updated); under skip its update was withheld and the run goes on."""

  def __init__(self, on_nonfinite: str):
    self.stop = on_nonfinite == 'stop'

  def due(self, step, final, stopping):
    return False

  def logged(self, records):
    bad = next((r for r in records if r.get('nonfinite')), None)
    if bad is None or not self.stop:
      return
    metric = next((k for k in ('loss', 'z_loss', 'grad_norm') if k in bad and not math.isfinite(bad[k])),
                  'grad_norm')
    raise TrainingError(f'step {bad["step"]}: {metric} is {bad[metric]}; stopped with the state of step '
                        f'{bad["step"] - 1} (no later checkpoint); lower optim.learning_rate, or set '
                        f'train.on_nonfinite=skip to drop such steps')
