"""Multi-process JAX: a process that is one of several joins the others before anything touches a device.

Which cluster we are in is read from the environment, in this order:
  explicit   LM_COORDINATOR_ADDRESS, LM_NUM_PROCESSES, LM_PROCESS_ID (set by launch/local.py, or by hand)
  SLURM      inside `srun` with more than one task (JAX derives coordinator, count and id)
  Open MPI   `mpirun` with more than one rank
  TPU VM     a Cloud TPU VM (one process per host; JAX reads the slice from the VM's metadata)
Anywhere else the process runs alone and nothing is initialised. `initialize` is idempotent.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Literal, Mapping

import jax
import numpy as np

from lm.config import ConfigError
from lm.parallel.chips import on_tpu_vm

Cluster = Literal['explicit', 'slurm', 'mpi', 'tpu']
EXPLICIT = ('LM_COORDINATOR_ADDRESS', 'LM_NUM_PROCESSES', 'LM_PROCESS_ID')


def cluster(env: Mapping[str, str] = os.environ) -> Cluster | None:
  """The kind of multi-process job this process belongs to, or None when it runs alone."""
  if any(key in env for key in EXPLICIT):
    missing = [key for key in EXPLICIT if key not in env]
    if missing:
      raise ConfigError(f'explicit multi-process settings need all of {", ".join(EXPLICIT)}; missing '
                        f'{", ".join(missing)}')
    return 'explicit' if int(env['LM_NUM_PROCESSES']) > 1 else None
  slurm = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
  if all(key in env for key in slurm) and int(env['SLURM_NTASKS']) > 1:
    return 'slurm'
  if 'OMPI_MCA_orte_hnp_uri' in env and int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1:
    return 'mpi'
  if on_tpu_vm():
    return 'tpu'
  return None


STALLED = 75  # exit status of a process that stopped a stalled job (not joined at start, or hung); launchers read it
HANG_REPORT = 'LM_HANG_REPORT'  # a file a launcher names: the first stalled process writes its one line there
JAX_GRACE_SECONDS = 60  # JAX's own join deadline comes this much later than ours: it aborts with a stack trace


def initialize(env: Mapping[str, str] = os.environ, timeout_seconds: float = 300) -> Cluster | None:
  """Joins the job's other processes (once); returns the cluster kind, None for a lone process. A process not
  joined by every other within `timeout_seconds` prints one line and exits with `STALLED`."""
  kind = cluster(env)
  if kind is None or jax.distributed.is_initialized():
    return kind
  deadline = threading.Timer(timeout_seconds, _not_joined, args=(kind, env, timeout_seconds))
  deadline.daemon = True
  deadline.start()
  try:
    if kind == 'explicit':
      try:
        process, processes = int(env['LM_PROCESS_ID']), int(env['LM_NUM_PROCESSES'])
      except ValueError as e:
        raise ConfigError(f'LM_NUM_PROCESSES and LM_PROCESS_ID must be integers ({e})') from None
      jax.distributed.initialize(coordinator_address=env['LM_COORDINATOR_ADDRESS'], num_processes=processes,
                                 process_id=process, initialization_timeout=int(timeout_seconds) + JAX_GRACE_SECONDS)
    else:
      jax.distributed.initialize(initialization_timeout=int(timeout_seconds) + JAX_GRACE_SECONDS)
  finally:
    deadline.cancel()
  return kind


def _not_joined(kind: Cluster, env: Mapping[str, str], seconds: float) -> None:
  """The join deadline passed: one line naming this process and the fix, then exit (JAX would abort later)."""
  who = {'explicit': ('LM_PROCESS_ID', 'LM_NUM_PROCESSES', 'LM_COORDINATOR_ADDRESS'),
         'slurm': ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_STEP_NODELIST')}.get(kind)
  where = f'process {env[who[0]]} of {env[who[1]]} ({who[2]}={env[who[2]]})' if who else f'this {kind} process'
  stalled(f'{where}: the job\'s other processes did not all join within {seconds / 60:g} minutes '
          f'(train.join_timeout_minutes); start every process (a launcher does), check that the coordinator\'s '
          f'address and port are reachable, or raise train.join_timeout_minutes')


def stalled(line: str, env: Mapping[str, str] = os.environ) -> None:
  """Ends a stalled process: `lm: error: LINE` on stderr and in the launcher's report file (the first process to
  stall writes it), then exit `STALLED` at once (threads waiting in collectives cannot be joined)."""
  print(f'lm: error: {line}', file=sys.stderr, flush=True)
  if env.get(HANG_REPORT):
    try:
      with open(env[HANG_REPORT], 'x') as report:
        report.write(line + '\n')
    except FileExistsError:
      pass
  os._exit(STALLED)


def is_main_process() -> bool:
  """Process 0 writes logs, metrics and the config; every process writes its own checkpoint shards."""
  return jax.process_index() == 0


def all_processes(ok: bool) -> bool:
  """True on every process when `ok` holds on every process (a collective: all must call it)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.asarray([ok]))))


def gathered(row: np.ndarray) -> np.ndarray:
  """Every process's `row` (the same shape and dtype on each), stacked in process order (a collective)."""
  if jax.process_count() == 1:
    return np.asarray(row)[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(row)))


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
