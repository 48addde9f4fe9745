"""Preemption: a SIGTERM (the notice TPU VMs and SLURM give) makes every process checkpoint one step and stop."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping

import jax

from lm.storage.checkpoint import Checkpointer


@contextlib.contextmanager
def preemption(checkpoints: Checkpointer | None) -> Iterator[Callable[[int], bool]]:
  """Yields `reached(step)`, True at the step where the run should checkpoint and stop.

  One process (or a run that does not checkpoint): a SIGTERM handler sets a flag (handlers only run on the main
  thread). Several: JAX's preemption service catches the SIGTERM of any process and agrees on one step for all,
  through orbax's `reached_preemption`; a handler of ours would hide the signal from it.
  """
  if jax.process_count() > 1 and checkpoints is not None:
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


REQUEUE = 'LM_SLURM_REQUEUE'  # launch/slurm.py's job script: a file to create when the job should requeue


def ask_requeue(env: Mapping[str, str] = os.environ) -> str:
  """After a stop by SIGTERM, in a job script that asks for it (launch/slurm.py), creates the file REQUEUE
  names: once every task has exited the script requeues the job, which resumes from the checkpoint just
  written. Returns what happens next, for the log."""
  path = env.get(REQUEUE)
  if not path:
    return 'continue with --resume'
  Path(path).write_text('stopped by SIGTERM\n')
  return 'the job requeues and resumes from it unless it was cancelled'
