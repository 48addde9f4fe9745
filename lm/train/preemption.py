"""Preemption: a SIGTERM (the notice TPU VMs and SLURM give) makes every process checkpoint one step and stop."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

import jax

from lm.checkpoint import Checkpointer


@contextlib.contextmanager
def preemption(checkpoints: Checkpointer) -> Iterator[Callable[[int], bool]]:
  """Yields `reached(step)`, True at the step where the run should checkpoint and stop.

  One process: a SIGTERM handler sets a flag (handlers only run on the main thread). Several: JAX's
  preemption service catches the SIGTERM of any process and agrees on one step for all, through
  orbax's `reached_preemption`; a handler of ours would hide the signal from it.
  """
  if jax.process_count() > 1:
    yield checkpoints.manager.reached_preemption
    return
  flag = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield lambda step: flag.is_set()
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: flag.set())
  try:
    yield lambda step: flag.is_set()
  finally:
    signal.signal(signal.SIGTERM, previous)
