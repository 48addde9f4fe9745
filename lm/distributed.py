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


def initialize(env: Mapping[str, str] = os.environ, timeout_seconds: int = 300) -> Cluster | None:
  """Joins the job's other processes (once); returns the cluster kind, None for a lone process."""
  kind = cluster(env)
  if kind is None or jax.distributed.is_initialized():
    return kind
  if kind == 'explicit':
    try:
      jax.distributed.initialize(coordinator_address=env['LM_COORDINATOR_ADDRESS'],
                                 num_processes=int(env['LM_NUM_PROCESSES']), process_id=int(env['LM_PROCESS_ID']),
                                 initialization_timeout=timeout_seconds)
    except ValueError as e:
      raise ConfigError(f'LM_NUM_PROCESSES and LM_PROCESS_ID must be integers ({e})') from None
  else:
    jax.distributed.initialize(initialization_timeout=timeout_seconds)
  return kind


def is_main_process() -> bool:
  """Process 0 writes logs, metrics and the config; every process writes its own checkpoint shards."""
  return jax.process_index() == 0


def all_processes(ok: bool) -> bool:
  """True on every process when `ok` holds on every process (a collective: all must call it)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.asarray([ok]))))


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
