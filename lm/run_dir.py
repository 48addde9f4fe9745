"""The one run-directory layout every command reads, and params from it or from a Hugging Face directory.

  RUN/config.yaml           the resolved Config; `lm train --config RUN/config.yaml` reruns it
  RUN/checkpoints/<step>/   orbax (`lm.checkpoint`): params and config; training adds optimizer and data
  RUN/best/<step>/          fine-tuning: the params that scored best on dev, with that evaluation's metrics;
                            a reader of the run's model takes these when present
  RUN/metrics.jsonl         one JSON record per logged step (training)
  RUN/tensorboard/          TensorBoard events (training)
  RUN/hf_config.json        the config.json of an imported model, so an export keeps every HF field
  RUN/tokenizer/            an imported model's tokenizer files (data.tokenizer=hf:RUN/tokenizer)

`lm train` writes it; `lm convert --from-hf` writes the same layout with one params-only checkpoint
at step 0 and `train.init_from` pointing at itself, so `lm train --config RUN/config.yaml
train.run_dir=NEW` fine-tunes the imported weights, and `lm generate --run RUN` samples from them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.sharding import Mesh

from lm.models import abstract_params, build_model, check_config
from lm.checkpoint import Checkpointer
from lm.data.tokenizers import get_tokenizer
from lm.config import Config, ConfigError, DataConfig, MeshConfig, ModelConfig, TrainConfig, from_dict, load_config
from lm.parallel.mesh import make_mesh

CONFIG = 'config.yaml'
CHECKPOINTS = 'checkpoints'
BEST = 'best'
HF_CONFIG = 'hf_config.json'
TOKENIZER = 'tokenizer'
PROFILE = 'profile'  # train.profile's traces
HF_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json',
                      'vocab.txt', 'vocab.json', 'merges.txt', 'spiece.model')


def is_run_dir(path: str | epath.PathLike) -> bool:
  return (epath.Path(path) / CONFIG).is_file()


def is_hf_dir(path: str | Path) -> bool:
  return (Path(path) / 'config.json').is_file()


def read_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """The run's config.yaml with `key=value` overrides."""
  if not is_run_dir(run_dir):
    raise ConfigError(f'{run_dir} has no {CONFIG}; pass the train.run_dir of a training run or a directory '
                      f'written by lm convert --from-hf')
  return load_config(str(epath.Path(run_dir) / CONFIG), overrides)


def checkpoints(run_dir: str | Path, keep: int = 1) -> Checkpointer:
  """The run's checkpoints, read-only (nothing is created)."""
  return Checkpointer(epath.Path(run_dir) / CHECKPOINTS, keep=keep, async_save=False, create=False)


def model_checkpoints(run_dir: str | Path) -> Checkpointer:
  """Where the run's model is read from, read-only: its best params (a fine-tune) if kept, else its checkpoints."""
  best = epath.Path(run_dir) / BEST
  return Checkpointer(best, async_save=False, create=False) if best.is_dir() else checkpoints(run_dir)


def load_params(path: str | Path, mesh: Mesh, ema: bool = False) -> tuple[ModelConfig, Any]:
  """(model config, params) from one of our run dirs (its best params or latest checkpoint; `ema`: that
  checkpoint's moving average of the params, `train.ema_decay`) or an HF model directory.

  Params land straight on `mesh` with the shardings the rules give them, so no device ever holds
  more than its shards. The model config is the one the params were written with.
  """
  if is_run_dir(path):
    return _run_params(epath.Path(path), mesh, ema)
  if is_hf_dir(path):
    if ema:
      raise ConfigError(f'--ema: {path} is a Hugging Face directory (one set of weights, no moving average); '
                        f'drop --ema')
    return _hf_params(Path(path), mesh)
  raise ConfigError(f'{path} is neither a run directory (with {CONFIG}) nor a Hugging Face model directory '
                    f'(with config.json); pass one of those')


def _run_params(run_dir: epath.Path, mesh: Mesh, ema: bool) -> tuple[ModelConfig, Any]:
  saved = checkpoints(run_dir) if ema else model_checkpoints(run_dir)  # best/ keeps params alone
  try:
    step = saved.latest_step()
    if step is None:
      raise ConfigError(f'{run_dir} holds no checkpoint yet; train it first (lm train ... train.run_dir={run_dir}) '
                        f'or import a model into it with lm convert --from-hf')
    config = check_config(from_dict(saved.saved_config(step)))
    averaged = config.optim.name == 'schedule_free_adamw' and saved.directory.name != BEST  # best/: params alone
    if ema or averaged:
      from lm.assembly import assemble
      assembly = assemble(config, mesh=mesh)
      if ema:
        return config.model, saved.restore_ema(step, assembly.abstract_state, config.train.ema_decay)
      return config.model, saved.restore_model(step, assembly.abstract_state, config.optim.name)
    return config.model, saved.restore_params(step, abstract_params(build_model(config.model), mesh))
  finally:
    saved.close()


def _hf_params(hf_dir: Path, mesh: Mesh) -> tuple[ModelConfig, Any]:
  from lm.convert.hf import load_hf
  model, params = load_hf(hf_dir)

  def place(target: jax.ShapeDtypeStruct, array: np.ndarray) -> jax.Array:
    return jax.make_array_from_callback(target.shape, target.sharding, lambda index: array[index])
  return model.cfg, jax.tree.map(place, abstract_params(model, mesh), params)


def one_device_mesh() -> Mesh:
  return make_mesh(MeshConfig(), jax.devices()[:1])


def import_hf(hf_dir: str | Path, run_dir: str | Path) -> Config:
  """Writes HF directory `hf_dir` as a new run directory; returns the run's config."""
  from lm.convert.hf import read_hf_config
  run_dir = epath.Path(run_dir)
  if (run_dir / CHECKPOINTS).exists() or is_run_dir(run_dir):
    raise ConfigError(f'{run_dir} already holds a run ({CONFIG} or {CHECKPOINTS}/); convert into a new directory')
  hf_config = read_hf_config(hf_dir)
  cfg, params = load_params(hf_dir, one_device_mesh())
  tokenizer_files = [Path(hf_dir) / name for name in HF_TOKENIZER_FILES if (Path(hf_dir) / name).is_file()]
  tokenizer = f'hf:{run_dir / TOKENIZER}' if tokenizer_files else 'byte'
  if not tokenizer_files:
    print(f'warning: {hf_dir} holds no tokenizer files ({", ".join(HF_TOKENIZER_FILES)}); the run uses '
          f'data.tokenizer=byte until you set data.tokenizer=hf:PATH', flush=True)
  config = Config(name=run_dir.name or 'converted', model=cfg,
                  data=DataConfig(seq_len=min(DataConfig.seq_len, cfg.max_len), tokenizer=tokenizer),
                  train=TrainConfig(run_dir=str(run_dir), init_from=str(run_dir.absolute())))
  config = from_dict(config.to_dict())  # validated like any loaded config
  run_dir.mkdir(parents=True, exist_ok=True)
  if tokenizer_files:
    (run_dir / TOKENIZER).mkdir()
    for file in tokenizer_files:
      epath.Path(file).copy(run_dir / TOKENIZER / file.name)
  saver = Checkpointer(run_dir / CHECKPOINTS, keep=1, async_save=False)
  try:
    saver.save_params(0, params, config.to_dict())
  finally:
    saver.close()
  (run_dir / CONFIG).write_text(config.to_yaml())
  (run_dir / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + '\n')
  return config


def export_hf(run_dir: str | Path, hf_dir: str | Path, ema: bool = False) -> Path:
  """Writes the run's latest params (trained or imported; `ema`: their moving average) as HF directory `hf_dir`."""
  from lm.convert.hf import save_hf
  run_dir = epath.Path(run_dir)
  if not is_run_dir(run_dir):
    raise ConfigError(f'{run_dir}/{CONFIG} not found; pass a run directory written by lm train or lm convert')
  cfg, params = load_params(run_dir, one_device_mesh(), ema)
  if (run_dir / HF_CONFIG).is_file():  # an import: its config.json's token ids, dtype, ...
    hf_config = json.loads((run_dir / HF_CONFIG).read_text())
  else:  # a run lm trained: its tokenizer's ids (transformers would otherwise assume GPT-2's 50256)
    spec = read_config(run_dir).data.tokenizer
    try:
      tokenizer = get_tokenizer(spec)
      hf_config = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id,
                   'pad_token_id': tokenizer.pad_id}
    except ConfigError as e:
      print(f'warning: config.json gets no token ids ({e})', flush=True)
      hf_config = None
  return save_hf(cfg, params, hf_dir, hf_config)
