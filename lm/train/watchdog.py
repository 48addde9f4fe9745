"""Hang detection (`train.hang_timeout_minutes`): a thread per process that watches its steps complete.

When no step has completed for the timeout (counted from the first step's end, so the first compile is not a
hang), it writes every thread's Python stack to RUN/hang-<process>.txt, prints one line naming the process that
hung first, and exits the process with `lm.distributed.STALLED`; a launcher then stops the others. Which process
hung first comes from heartbeats: each watchdog rewrites RUN/heartbeats/<process>.json with its last completed step
whenever that step changes (within a tick) and every few seconds besides. A process whose heartbeat stopped
(stopped, frozen, its host gone) is the one; if all still beat, the one with the oldest last step (the others
wait for it in a collective).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import traceback
from typing import Any

from etils import epath

from lm.distributed import stalled
from lm.train.trackers import is_local

HEARTBEATS = 'heartbeats'
TICK_SECONDS = 1.0  # how often steps are checked for completion


def hang_file(run_dir: epath.Path, process: int) -> epath.Path:
  return run_dir / f'hang-{process}.txt'


def thread_stacks() -> str:
  """Every thread's Python stack, named, innermost call last (as faulthandler prints them, but as text)."""
  names = {t.ident: t.name for t in threading.enumerate()}
  return '\n'.join(f'Thread {names.get(ident, ident)} ({ident}):\n' + ''.join(traceback.format_stack(frame))
                   for ident, frame in sys._current_frames().items())


def write_whole(path: epath.Path, text: str) -> None:
  """Writes `text` so readers never see half of it: a local file by rename (plain `os`: epath's rename looks up
  its cloud backends, which stalled this thread), an object-store file by one write."""
  if not is_local(path):
    path.write_text(text)
    return
  staged = f'{path.parent}/.{path.name}.tmp'
  with open(staged, 'w') as f:
    f.write(text)
  os.replace(staged, path)


class Watchdog:
  """Watches this process's steps from a thread; `dispatched(step, value)` hands it each step's output (a value the
  step computes), whose readiness marks the step done without blocking the loop."""

  def __init__(self, run_dir: epath.Path, minutes: float, process: int, processes: int):
    """`minutes` 0: off (no thread; the calls do nothing)."""
    self.run_dir, self.timeout, self.process, self.processes = run_dir, 60 * minutes, process, processes
    self.thread = None
    if not minutes:
      return
    self.beat_seconds = min(10.0, max(TICK_SECONDS, self.timeout / 6))
    self.stale_seconds = 3 * self.beat_seconds + 2  # a heartbeat this old: its process no longer runs
    self.pending: collections.deque[tuple[int, Any]] = collections.deque()
    self.step: int | None = None  # the last step done, and when (monotonic and wall clock)
    self.done_at = self.done_wall = 0.0
    self.lock = threading.Lock()
    self.closed = threading.Event()
    (run_dir / HEARTBEATS).mkdir(parents=True, exist_ok=True)
    self.thread = threading.Thread(target=self._watch, name='lm-watchdog', daemon=True)
    self.thread.start()

  def dispatched(self, step: int, value: Any) -> None:
    if self.thread is None:
      return
    with self.lock:
      self.pending.append((step, value))

  def completed(self, step: int) -> None:
    """Step `step` is known done (the loop waited for it): the clock starts, or restarts, here."""
    if self.thread is None:
      return
    with self.lock:
      while self.pending and self.pending[0][0] <= step:
        self.pending.popleft()
      self._done(step)

  def _done(self, step: int) -> None:
    self.step, self.done_at, self.done_wall = step, time.monotonic(), time.time()

  def close(self) -> None:
    if self.thread is not None:
      self.closed.set()
      self.thread.join()

  def _watch(self) -> None:
    last_beat, beaten = 0.0, None
    while not self.closed.wait(TICK_SECONDS):
      with self.lock:
        while self.pending and self.pending[0][1].is_ready():
          self._done(self.pending.popleft()[0])
        step, done_at = self.step, self.done_at
      if step != beaten or time.monotonic() - last_beat >= self.beat_seconds:
        self._beat()
        last_beat, beaten = time.monotonic(), step
      if step is not None and time.monotonic() - done_at > self.timeout:
        self._fire(step)

  def _beat(self) -> None:
    beat = {'process': self.process, 'pid': os.getpid(), 'step': self.step, 'step_time': self.done_wall,
            'beat': time.time()}
    write_whole(self.run_dir / HEARTBEATS / f'{self.process}.json', json.dumps(beat))

  def heartbeats(self) -> dict[int, dict[str, Any]]:
    beats = {}
    for path in (self.run_dir / HEARTBEATS).glob('*.json'):
      try:
        beat = json.loads(path.read_text())
      except (OSError, ValueError):
        continue
      beats[beat['process']] = beat
    return beats

  def hung_first(self) -> str:
    """Which process hung first, and why it is that one."""
    beats, now = self.heartbeats(), time.time()
    missing = [p for p in range(self.processes) if p not in beats]
    if missing:
      return f'process {missing[0]} hung first (it never wrote a heartbeat)'
    stale = [b for b in beats.values() if now - b['beat'] > self.stale_seconds]
    if stale:
      first = min(stale, key=lambda b: b['beat'])
      done = 'it had completed no step' if first['step'] is None else f'its last step was {first["step"]}'
      return f'process {first["process"]} hung first (no heartbeat for {now - first["beat"]:.0f} s; {done})'

    first = min(beats.values(), key=lambda b: (b['step'] or 0, b['step_time']))
    return (f'process {first["process"]} hung first (every process is alive; its last step, {first["step"]}, is '
            f'the oldest)')

  def _fire(self, step: int) -> None:
    path = hang_file(self.run_dir, self.process)
    verdict = self.hung_first()
    write_whole(path, f'process {self.process} of {self.processes}: no step done in {self.timeout / 60:g} minutes '
                    f'after step {step}; {verdict}\n\n{thread_stacks()}')
    stalled(f'process {self.process} of {self.processes}: no step done in {self.timeout / 60:g} minutes after step '
            f'{step} (train.hang_timeout_minutes); {verdict}; this process\'s stacks are in {path}; continue with '
            f'--resume once the cause is fixed')
