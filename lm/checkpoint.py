"""Orbax checkpoints of the train state, the data position and the config, restorable onto any mesh."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from lm.config import ConfigError


class Checkpointer:
  """Async saves every N steps keeping the last K; restore reshards onto the abstract state's shardings."""

  def __init__(self, directory: str | Path, keep: int, async_save: bool = True):
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), config=ocp.args.JsonSave(config)),
      force=True)

  def restore(self, step: int, abstract_state: Any, config: dict) -> tuple[Any, dict]:
    """State placed on `abstract_state`'s shardings, and the data position, after checking the model matches."""
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    if saved.get('model') != config['model']:
      diff = sorted(k for k in set(saved.get('model', {})) | set(config['model'])
                    if saved.get('model', {}).get(k) != config['model'].get(k))
      raise ConfigError(f'checkpoint {self.directory}/{step} was written for a different model '
                        f'(differs in {", ".join("model." + k for k in diff)}); resume with the same model '
                        f'settings or start a new train.run_dir')
    restored = self.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored['state'], restored['data']

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the saved state's params (no optimizer state), placed on `abstract_params`' shardings."""
    item = {'params': abstract_params}
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    return restored['state']['params']

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
