"""The local checkpoint tier (`train.local_checkpoint_dir`): each process saves its own shards and data position
every `train.local_checkpoint_every` steps to its local disk, beside the persistent checkpoints in the run dir.

A resume takes the newest step held complete by every process, local or persistent, agreed by all; a local step
some process lacks (a replaced host, a wiped disk) or that does not restore on some process leaves every process on
the persistent tier. A local checkpoint restores only onto the mesh and devices that wrote it (each process reads
back the shards it wrote), so one written under other mesh settings or process or device counts is not used.
After a restore, local steps past it (an abandoned continuation) are deleted.

Orbax's `experimental.emergency.CheckpointManager` is not used: it needs at least two data-parallel replicas (it
saves locally only on the non-primary ones and restores by broadcasting from a replica that has the step), and it
checkpoints one state PyTree without the data iterator. This tier writes with the same orbax handler options as its
local tier (every process its own primary, every shard it holds), through one manager per process.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import jax
import numpy as np
from etils import epath

from lm.assembly.state import TrainState
from lm.config import Config, ConfigError
from lm.distributed import all_processes, gathered, is_main_process
from lm.storage.checkpoint import Checkpointer, with_defaults
from lm.train.callbacks import Checkpoint

OWNER = 'run.json'  # in the tier's directory: the run it belongs to and the processes and devices that wrote it
_GATHERED = 16  # the newest local steps of each process compared when agreeing on one


class LocalTier:
  """This process's directory in the local tier (`<local_checkpoint_dir>/process_<i>`) and the agreement on the
  newest step that every process holds."""

  def __init__(self, config: Config, run_dir: epath.Path):
    t = config.train
    self.root, self.run_dir, self.every = epath.Path(t.local_checkpoint_dir).absolute(), run_dir.absolute(), \
        t.local_checkpoint_every
    self.owner = {'run_dir': str(self.run_dir), 'processes': jax.process_count(), 'devices': jax.device_count()}
    owner = self._read_owner()
    if owner.get('run_dir', self.owner['run_dir']) != self.owner['run_dir']:
      raise ConfigError(f'train.local_checkpoint_dir={t.local_checkpoint_dir} holds the local checkpoints of '
                        f'{owner["run_dir"]}; give each run its own local directory')
    self.fits = owner in ({}, self.owner)  # written by as many processes and devices as this run has
    self.checkpointer = Checkpointer(self.root / f'process_{jax.process_index()}', keep=1, create=False,
                                     process_local=True)

  def _read_owner(self) -> dict[str, Any]:
    path = self.root / OWNER
    return json.loads(path.read_text()) if path.exists() else {}

  def claim(self) -> None:
    """Records this run as the tier's owner (each process, the same text: a shared disk holds one file)."""
    self.root.mkdir(parents=True, exist_ok=True)
    partial = self.root / f'{OWNER}.{jax.process_index()}'
    partial.write_text(json.dumps(self.owner))
    partial.replace(self.root / OWNER)

  def steps(self) -> list[int]:
    return self.checkpointer.all_steps() if self.fits else []

  def agreed(self) -> tuple[int | None, int | None, list[int]]:
    """The newest local step every process holds, the newest any holds (None: none) and the processes that lack
    the latter (a collective)."""
    mine = self.steps()[-_GATHERED:]
    rows = gathered(np.asarray([-1] * (_GATHERED - len(mine)) + mine, np.int64))
    held = [set(row[row >= 0].tolist()) for row in rows]
    common, newest = set.intersection(*held), max(set.union(*held), default=None)
    return max(common, default=None), newest, [p for p, steps in enumerate(held) if newest not in steps]

  def restore(self, step: int, abstract_state: TrainState, config: dict, data: Any) -> TrainState | None:
    """Local step `step` on every process, or None on all when it does not restore on some (one line says why);
    the mesh and execution settings must be the ones that wrote it."""
    error = None
    try:
      saved = with_defaults(self.checkpointer.saved_config(step))
      if saved['mesh'] != config['mesh'] or saved['model']['execution'] != config['model']['execution']:
        raise ConfigError('it was written under other mesh or model.execution settings')
      state = self.checkpointer.restore(step, abstract_state, config, data)
    except Exception as e:  # a damaged or foreign step: the persistent tier serves
      error, state = e, None
    if all_processes(error is None):
      return state
    if error is not None:
      print(f'local checkpoint {self.checkpointer.directory}/{step} does not restore ({str(error).splitlines()[0]});'
            f' resuming from the persistent tier', file=sys.stderr, flush=True)
    return None

  def drop_after(self, step: int) -> None:
    """Deletes local steps past `step` (a continuation the run abandoned; every step, when written under other
    process or device counts) and records this run as the owner."""
    for later in self.checkpointer.all_steps():
      if later > step or not self.fits:
        self.checkpointer.manager.delete(later)
    self.fits = True
    self.claim()


def restore_newest(checkpoints: Checkpointer, local: LocalTier | None, abstract_state: TrainState, config: dict,
                   data: Any) -> tuple[int, TrainState, epath.Path] | None:
  """The newest step complete on every process in either tier, restored (and `data` moved to its position), with
  the directory it came from; None when no checkpoint restores. Every process takes the same decision."""
  latest = max(checkpoints.all_steps(), default=0)
  if local is not None:
    step, newest, missing = local.agreed()
    if step is not None and step > latest:
      state = local.restore(step, abstract_state, config, data)
      if state is not None:
        local.drop_after(step)
        return step, state, local.checkpointer.directory / str(step)
    elif newest is not None and newest > latest and is_main_process():
      print(f'local checkpoint {newest} is not on process {", ".join(map(str, missing))}; resuming from the '
            f'persistent tier', file=sys.stderr, flush=True)
  restored = checkpoints.restore_latest(abstract_state, config, data)
  if local is not None:
    local.drop_after(restored[0] if restored else 0)
  return None if restored is None else (*restored, checkpoints.directory / str(restored[0]))


class LocalCheckpoint(Checkpoint):
  """The local tier's save every `train.local_checkpoint_every` steps (not at the end or a SIGTERM: the persistent
  tier saves those)."""

  def __init__(self, local: LocalTier, data: Any, config: dict):
    super().__init__(local.checkpointer, local.every, data, config)

  def due(self, step, final, stopping):
    return step % self.every == 0
