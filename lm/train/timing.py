"""Where a run's wall time goes, across restarts.

Each process that trains (an attempt) splits its time into: `startup` (from the process's start through its first
step, which compiles the program), `device` (the device steps: what is left of an interval once the rest is taken
out), `data` (waiting on the host's batches), `checkpoint` and `eval` (the callbacks that save and evaluate, their
final waits included), and `other` (the rest of the callbacks). Process 0 appends to RUN/attempts.jsonl a line
when an attempt starts ({'start': unix time, 'step'}) and one per logged interval ({'time', 'step', and each
part's seconds so far}). A resumed run reads the earlier attempts' lines: an attempt's time after the step the
next one resumed from was spent on steps done again (`recomputed`), and the time between its last line and the
next start was lost to the restart. `goodput` is the device time of the steps that count (this attempt's, and
earlier attempts' up to the step the next resumed from) over the wall time since the first attempt started; the
parts add up to that wall time.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

from etils import epath

from lm.config import ConfigError, batch_schedule, tokens_after
from lm.report import format_lines
from lm.train.callbacks import Callback, Interval

ATTEMPTS = 'attempts.jsonl'
PARTS = ('startup', 'device', 'data', 'checkpoint', 'eval', 'other')


def is_timing(key: str) -> bool:
  """A wall-clock figure of a record (differs between any two runs of the same steps)."""
  return key in ('tokens_per_sec', 'mfu', 'goodput') or key.startswith('time/')


@dataclass
class Attempt:
  start: float
  step: int
  lines: list[dict[str, Any]] = field(default_factory=list)  # progress: time, step, cumulative parts

  def at(self, step: int) -> dict[str, Any]:
    """The last progress line at or before `step` (the attempt's start when none)."""
    kept = [line for line in self.lines if line['step'] <= step]
    return kept[-1] if kept else {'time': self.start, 'step': self.step, **{p: 0.0 for p in PARTS}}

  @property
  def last(self) -> dict[str, Any]:
    return self.at(float('inf'))


def read_attempts(run_dir: str | epath.PathLike) -> list[Attempt]:
  path = epath.Path(run_dir) / ATTEMPTS
  attempts: list[Attempt] = []
  for line in (path.read_text().splitlines() if path.exists() else []):
    entry = json.loads(line)
    if 'start' in entry:
      attempts.append(Attempt(entry['start'], entry['step']))
    elif attempts:
      attempts[-1].lines.append(entry)
  return attempts


def account(attempts: list[Attempt]) -> dict[str, Any]:
  """The run's time by part over its attempts (the last one's up to its last line): each part's seconds of the
  steps that count, 'recomputed' (seconds, steps) and 'restart' seconds, 'wall' since the first start,
  'goodput'."""
  totals = {p: 0.0 for p in PARTS} | {'recomputed': 0.0, 'restart': 0.0}
  recomputed_steps = 0
  for attempt, following in zip(attempts, attempts[1:] + [None]):
    kept = attempt.at(following.step) if following else attempt.last
    for part in PARTS:
      totals[part] += kept[part]
    if following:
      last = attempt.last
      totals['recomputed'] += last['time'] - kept['time']
      recomputed_steps += max(0, last['step'] - following.step)
      totals['restart'] += following.start - last['time']
  wall = attempts[-1].last['time'] - attempts[0].start if attempts else 0.0
  return {'seconds': totals, 'recomputed_steps': recomputed_steps, 'restarts': max(0, len(attempts) - 1),
          'wall': wall, 'goodput': totals['device'] / wall if wall > 0 else 0.0}


def process_start() -> float | None:
  """This process's start (unix seconds, to the clock tick) where /proc tells it (Linux), else None."""
  try:
    ticks = int(Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[19])  # since boot
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, AttributeError):
    return None
  return time.time() - age


class Clock:
  """One attempt's clock: the loop adds each part's seconds; `record` closes an interval (the step time is what
  the other parts leave of it) and, on process 0, appends the attempt's progress to RUN/attempts.jsonl."""

  def __init__(self, run_dir: Any, step: int, enabled: bool):
    self.path, self.enabled = epath.Path(run_dir) / ATTEMPTS, enabled
    self.earlier = read_attempts(run_dir) if enabled else []
    now, self.mark = time.time(), time.perf_counter()
    began = process_start() or now  # the attempt began with its process: imports, data, restore are startup
    self.start = began
    # earlier attempts' counted device time, fixed now: this attempt's lines add only its own running totals
    earlier = account(self.earlier + [Attempt(began, step)])
    self.earlier_device, self.first_start = earlier['seconds']['device'], (self.earlier or [Attempt(began, 0)])[0].start
    self.interval = {p: 0.0 for p in PARTS if p != 'device'}
    self.total = {p: 0.0 for p in PARTS} | {'startup': now - began}
    self._append({'start': began, 'step': step})

  def add(self, part: str, seconds: float) -> None:
    self.interval[part] += seconds

  def record(self, step: int) -> dict[str, float]:
    """The interval's parts (seconds) since the last record; the attempt's progress line written (after the last
    step, once more when the callbacks have finished: their waits count too)."""
    now = time.perf_counter()
    parts = {**self.interval, 'device': now - self.mark - sum(self.interval.values())}
    self.mark, self.interval = now, {p: 0.0 for p in self.interval}
    for part, seconds in parts.items():
      self.total[part] += seconds
    line = {'time': self.start + sum(self.total.values()), 'step': step, **self.total}
    self._append(line)
    wall = line['time'] - self.first_start
    goodput = (self.earlier_device + self.total['device']) / wall if wall > 0 else 0.0
    return {**{f'time/{p}_s': s for p, s in parts.items() if p != 'startup' or s}, 'goodput': goodput,
            'time/wall_s': wall}
  def _append(self, entry: dict[str, Any]) -> None:
    if not self.enabled:
      return
    if '://' in str(self.path):  # object stores do not append: the whole file again
      self.path.write_text((self.path.read_text() if self.path.exists() else '') + json.dumps(entry) + '\n')
      return
    with self.path.open('a') as f:
      f.write(json.dumps(entry) + '\n')


class SlowSteps(Callback):
  """Says when an interval's mean step time exceeds `factor` times the median of the intervals before it (three
  or more; `factor` 0: never), each per row of its batch (`rows_at(step)`: a batch ramp's grow), and gives each
  interval's last record its mean (`time/per_step_s`)."""

  def __init__(self, factor: float, rows_at: Callable[[int], int] = lambda step: 1):
    self.factor, self.rows_at, self.means = factor, rows_at, []

  def due(self, step, final, stopping):
    return False

  def annotate(self, interval: Interval) -> None:
    record, steps = interval.records[-1], len(interval.records)
    mean = record['time/per_step_s'] = record['time/device_s'] / steps
    rows = self.rows_at(record['step'])
    if self.factor and len(self.means) >= 3:
      median = statistics.median(self.means) * rows  # at this interval's batch
      if mean > self.factor * median:
        print(f'step {record["step"]}: {mean:.3g} s per step over the last {steps}, {mean / median:.1f}x the '
              f'median {median:.3g} s of the intervals before', flush=True)
    self.means.append(mean / rows)


def run_report(run_dir: str | epath.PathLike, slowest: int = 5) -> dict[str, Any]:
  """`lm report RUN`: steps, tokens, wall time, goodput, mean MFU, restarts, each part's seconds and the
  `slowest` logging intervals by mean step time."""
  from lm.storage.run_dir import read_config
  from lm.train.logging import read_metrics
  config, records = read_config(run_dir), read_metrics(run_dir)
  attempts = read_attempts(run_dir)
  if not attempts:
    raise ConfigError(f'{run_dir}/{ATTEMPTS} not found: the run has not logged a step with this version of lm '
                      f'(its metrics.jsonl has {len(records)} records)')
  summary = account(attempts)
  steps = attempts[-1].last['step']
  mfu = [r['mfu'] for r in records if 'mfu' in r]
  timed = sorted((r for r in records if 'time/per_step_s' in r), key=lambda r: -r['time/per_step_s'])[:slowest]
  return {'steps': steps, 'tokens': tokens_after(batch_schedule(config), steps, config.data.seq_len), **summary,
          'mfu': sum(mfu) / len(mfu) if mfu else None,
          'slowest': [{'step': r['step'], 'seconds_per_step': r['time/per_step_s']} for r in timed]}


def format_run_report(report: dict[str, Any]) -> str:
  wall = report['wall']
  share = lambda seconds: f'{seconds:,.1f} s ({seconds / wall:.1%})' if wall else f'{seconds:,.1f} s'
  lines = [('steps', f'{report["steps"]:,}'), ('tokens', f'{report["tokens"]:,}'), ('wall time', f'{wall:,.1f} s'),
           ('goodput', f'{report["goodput"]:.1%}'),
           ('MFU (mean)', 'n/a' if report['mfu'] is None else f'{report["mfu"]:.1%}'),
           ('restarts', str(report['restarts']))]
  seconds = report['seconds']
  lines += [(f'time: {part}', share(seconds[part])) for part in PARTS]
  lines += [('time: restarts', share(seconds['restart'])),
            ('time: recomputed', f'{share(seconds["recomputed"])}, {report["recomputed_steps"]} steps')]
  lines += [(f'slow: step {s["step"]}', f'{s["seconds_per_step"]:.3g} s per step') for s in report['slowest']]
  return format_lines(lines)


def report_summary(run_dir: str | epath.PathLike) -> dict[str, float]:
  """`lm report`'s figures, flat, for a tracker's run summary: report/steps, report/goodput,
  report/seconds/<part>, ... (none before a step is timed)."""
  try:
    report = run_report(run_dir)
  except ConfigError:
    return {}
  flat = {f'report/{k}': v for k, v in report.items() if isinstance(v, (int, float))}
  flat.update({f'report/seconds/{k}': v for k, v in report.get('seconds', {}).items()})
  return flat
