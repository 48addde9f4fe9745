"""The one way to open a model, for every job (eval, generate, finetune, train.init_from, scaling collect, convert).

A path is one of our run dirs (its best params when a fine-tune kept them, else its latest checkpoint, or the
checkpoint `step`), a checkpoint of one (RUN/checkpoints/STEP), a Hugging Face model directory, or a PEFT LoRA
adapter directory on one (`model.lora`). It opens to the
config its params were written with (its model and tokenizer) and reads the params onto any mesh, in a view the
run's optimizer defines ('model': what a model is evaluated with; 'ema': the params' moving average).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh

from lm.assembly import Assembly, assemble
from lm.config import Config, ConfigError, DataConfig, from_dict, inference_mesh, merge, parse_overrides
from flax import traverse_util

from lm.models import abstract_params
from lm.models.lora import quantized_base
from lm.models.transformer import relayout
from lm.storage import lora_base
from lm.storage.checkpoint import Checkpointer
from lm.storage.convert.hf import hf_model_config, load_hf
from lm.storage.convert.peft import base_of, is_adapter_dir, load_peft
from lm.storage.run_dir import BEST, CHECKPOINTS, CONFIG, HF_TOKENIZER_FILES, is_hf_dir, is_run_dir, read_config


def hf_config(hf_dir: str | Path) -> Config:
  """The Config of an HF model directory (or a PEFT adapter directory on one: the base's, with its adapters): its
  model, its tokenizer files (else bytes), rows of the default length or its context, if shorter."""
  if is_adapter_dir(hf_dir):
    model, hf_dir = load_peft(hf_dir)[0].cfg, base_of(hf_dir)
  else:
    model = hf_model_config(hf_dir)
  tokenizer = f'hf:{hf_dir}' if has_tokenizer_files(hf_dir) else 'byte'
  return from_dict(Config(name=Path(hf_dir).name or 'converted', model=model,
                          data=DataConfig(seq_len=min(DataConfig.seq_len, model.max_len),
                                          tokenizer=tokenizer)).to_dict())


def has_tokenizer_files(hf_dir: str | Path) -> bool:
  return any((Path(hf_dir) / name).is_file() for name in HF_TOKENIZER_FILES)


def _split(path: epath.Path) -> tuple[epath.Path, int | None]:
  """(run dir or HF directory, step or None) of PATH or RUN/checkpoints/STEP."""
  if path.parent.name == CHECKPOINTS and path.name.isdigit() and is_run_dir(path.parent.parent):
    return path.parent.parent, int(path.name)
  return path, None


class ModelSource:
  """An opened path: `config` (the one its params were written with), `steps` and the `step` read by default;
  `params(mesh)` reads them. `flag` names the command-line option the path came from, in messages."""

  def __init__(self, path: str | Path, step: int | None = None, view: str = 'model', flag: str = '',
               need_params: bool = True):
    self.path, at = _split(epath.Path(path))
    step = at if step is None else step
    self.view, self.flag = view, flag if flag.endswith('=') or not flag else flag + ' '
    self.adapter = not is_run_dir(self.path) and is_adapter_dir(self.path)  # PEFT's, on an HF base
    self.hf = not is_run_dir(self.path) and (is_hf_dir(self.path) or self.adapter)
    self._assemblies: dict[Mesh, Assembly] = {}
    if self.hf:
      self._open_hf(step)
    elif is_run_dir(self.path):
      self._open_run(step, need_params)
    else:
      raise ConfigError(f'{self.flag}{path} is neither a run directory (with {CONFIG}), a Hugging Face model '
                        f'directory (with config.json) nor a PEFT adapter (adapter_config.json); pass one of those')

  def _open_hf(self, step: int | None) -> None:
    if self.view != 'model':
      raise ConfigError(f'--{self.view}: {self.path} is a Hugging Face directory (one set of weights, no moving '
                        f'average); drop --{self.view}')
    if step not in (None, 0):
      raise ConfigError(f'--step {step}: {self.path} is a Hugging Face directory (one set of weights); drop --step')
    self.config, self.steps, self.step, self.directory = hf_config(self.path), (0,), 0, None

  def _open_run(self, step: int | None, need_params: bool) -> None:
    best = self.path / BEST
    # a fine-tune's best params (params alone, already the ones evaluated) unless a step or another view is asked
    self.directory = best if best.is_dir() and step is None and self.view == 'model' else self.path / CHECKPOINTS
    saved = self._checkpointer()
    try:
      self.steps = tuple(saved.all_steps())
      if not self.steps:
        if need_params:
          raise ConfigError(f'{self.path} holds no checkpoint yet; train it first (lm train ... '
                            f'train.run_dir={self.path}) or import a model into it with lm convert --from-hf')
        self.config, self.step = read_config(self.path), None
        return
      self.step = self.steps[-1] if step is None else step
      if self.step not in self.steps:
        raise ConfigError(f'--step {self.step}: {self.path} has checkpoints at steps '
                          f'{", ".join(map(str, self.steps))}')
      self.config = from_dict(saved.saved_config(self.step))
    finally:
      saved.close()
    if self.view == 'ema' and not self.config.train.ema_decay:
      raise ConfigError(f'--ema: {self.path} keeps no moving average of its params (trained without '
                        f'train.ema_decay); drop --ema')

  def _checkpointer(self) -> Checkpointer:
    return Checkpointer(self.directory, async_save=False, create=False)

  @property
  def has_tokenizer(self) -> bool:
    """Whether the source names its tokenizer (an HF directory without tokenizer files reads bytes)."""
    return not self.hf or has_tokenizer_files(self.path)

  def configured(self, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The source's config with `key=value` overrides, on the devices present: its mesh section with the `mesh.*`
    overrides, the data axis taking the devices left (lm.config.inference_mesh)."""
    values = merge(self.config.to_dict(), parse_overrides(list(overrides)))
    return from_dict({**values, 'mesh': inference_mesh(self.config.to_dict()['mesh'], overrides)})

  def assembly(self, overrides: list[str] | tuple[str, ...] = ()) -> Assembly:
    """`configured(overrides)` assembled on every device present."""
    assembly = assemble(self.configured(overrides))
    if not set(parse_overrides(list(overrides))) - {'mesh'}:  # the source's own model and optimizer
      self._assemblies[assembly.mesh] = assembly
    return assembly

  def assembly_on(self, mesh: Mesh) -> Assembly:
    """The source's own config assembled on `mesh` (its optimizer defines the views), once per mesh."""
    if mesh not in self._assemblies:
      self._assemblies[mesh] = assemble(self.config, mesh=mesh)
    return self._assemblies[mesh]

  def params(self, mesh: Mesh, step: int | None = None) -> Any:
    """The params of checkpoint `step` (default: the source's) in the source's view, straight onto `mesh` with
    the shardings the rules give them, so no device ever holds more than its shards."""
    if self.hf:
      return self._hf_params(mesh)
    step = self.step if step is None else step
    if step not in self.steps:
      raise ConfigError(f'{self.path} holds no checkpoint at step {step} (it holds {", ".join(map(str, self.steps))})')
    assembly = self.assembly_on(mesh)
    saved = self._checkpointer()
    try:
      if self.directory.name == BEST:
        return saved.restore_params(step, assembly.abstract_params)
      return saved.restore_view(step, assembly.on_device, assembly.views[self.view])
    finally:
      saved.close()

  def _hf_params(self, mesh: Mesh) -> Any:
    model, params = load_peft(self.path) if self.adapter else load_hf(self.path)

    def place(target: jax.ShapeDtypeStruct, array: np.ndarray) -> jax.Array:
      return jax.make_array_from_callback(target.shape, target.sharding, lambda index: array[index])
    return jax.tree.map(place, abstract_params(model, mesh), params)


def open_model(path: str | Path, *, step: int | None = None, ema: bool = False, flag: str = '',
               overrides: list[str] | tuple[str, ...] = ()) -> tuple[ModelSource, Assembly, Any]:
  """(source, its config with `overrides` assembled on every device present (`mesh.*` overrides choose how),
  its params there)."""
  source = ModelSource(path, step, 'ema' if ema else 'model', flag)
  assembly = source.assembly(overrides)
  return source, assembly, source.params(assembly.mesh)


def _base_item(source: str, ema: bool) -> dict:
  """A LoRA run's base item (lm.storage.lora_base): its `train.init_from` and the step that opens at now."""
  opened = ModelSource(source, view='ema' if ema else 'model', flag='train.init_from=')
  return {'source': str(source), 'step': opened.step, 'view': opened.view}


def _open_base(base: dict, abstract: Any, scan_layers: bool) -> Any:
  """The params `abstract` names (None elsewhere) of the base a LoRA checkpoint's item names, in the layer layout
  `scan_layers`, cast and placed as `abstract` says: the values the run started from (train.init_from)."""
  source = ModelSource(base['source'], view=base['view'], flag='train.init_from=')
  if source.step != base['step']:
    raise ConfigError(f'{base["source"]}, the base of this LoRA run\'s adapters, now opens at step {source.step}, '
                      f'not at step {base["step"]} which they were trained on; put its checkpoint {base["step"]} '
                      f'back (or name it: {base["source"]}/checkpoints/{base["step"]} in a new run)')
  mesh = next(a.sharding.mesh for a in jax.tree.leaves(abstract))
  want = {name: a for name, a in traverse_util.flatten_dict(abstract, sep='/').items() if a is not None}
  have = quantized_base(traverse_util.flatten_dict(relayout(source.params(mesh), scan_layers), sep='/'), want)
  return traverse_util.unflatten_dict({name: jax.device_put(have[name].astype(a.dtype), a.sharding)
                                       for name, a in want.items()}, sep='/')


lora_base.register(_base_item, _open_base)
