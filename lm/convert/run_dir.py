"""`lm convert`: a Hugging Face model directory <-> an lm run directory.

Layout `hf_to_run` writes into RUN_DIR:
  config.yaml       the lm Config: `model` from config.json (float32, scan_layers=false), defaults elsewhere,
                    train.run_dir=RUN_DIR, so `lm train --config RUN_DIR/config.yaml` trains in this directory
  hf_config.json    the original config.json; `run_to_hf` starts from it, so the export keeps every HF field
  params/0/         an `lm.checkpoint.Checkpointer` (orbax) checkpoint at step 0 whose state is
                    {'params': params} (a TrainState without step and optimizer state), data {} and the
                    config; `restore_params` reads it onto any sharding, e.g. to initialise fine-tuning
`run_to_hf` exports the params of the latest training checkpoint (RUN_DIR/checkpoints/, written by
`lm train`) when there is one, else params/0; runs that never came from HF export too.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from lm.checkpoint import Checkpointer
from lm.config import Config, ConfigError, DataConfig, MeshConfig, TrainConfig, load_config, validate
from lm.convert import tensors
from lm.convert.hf import load_hf, read_hf_config, save_hf
from lm.models import build_model

PARAMS = 'params'
HF_CONFIG = 'hf_config.json'


def hf_to_run(hf_dir: str | Path, run_dir: str | Path) -> Config:
  """Converts HF directory `hf_dir` into a new run directory; returns the run's config."""
  run_dir = Path(run_dir)
  if (run_dir / PARAMS).exists() or (run_dir / 'config.yaml').exists():
    raise ConfigError(f'{run_dir} already holds a model (config.yaml or {PARAMS}/); convert into a new directory')
  model, params = load_hf(hf_dir)
  cfg = model.cfg
  config = Config(name=run_dir.name or 'converted', model=cfg,
                  data=DataConfig(seq_len=min(DataConfig.seq_len, cfg.max_len)),
                  train=TrainConfig(run_dir=str(run_dir)))
  validate(config)
  run_dir.mkdir(parents=True, exist_ok=True)
  checkpoints = Checkpointer(run_dir / PARAMS, keep=1, async_save=False)
  try:
    checkpoints.save(0, {'params': params}, {}, config.to_dict())
  finally:
    checkpoints.close()
  (run_dir / 'config.yaml').write_text(config.to_yaml())
  (run_dir / HF_CONFIG).write_text(json.dumps(read_hf_config(hf_dir), indent=2) + '\n')
  return config


def restore_params(run_dir: str | Path, config: Config, abstract_params: Any = None) -> Any:
  """Params from `run_dir/params/0`, placed like `abstract_params` (default: unsharded ShapeDtypeStructs)."""
  if abstract_params is None:
    abstract_params = tensors.abstract_params(build_model(config.model))
  checkpoints = Checkpointer(Path(run_dir) / PARAMS, keep=1, async_save=False)
  try:
    return checkpoints.restore(0, {'params': abstract_params}, config.to_dict())[0]['params']
  finally:
    checkpoints.close()


def _latest_trained_params(config: Config) -> Any | None:
  """Params of the newest `lm train` checkpoint of the run (restored on one device), or None if it has none."""
  from lm.train.loop import Trainer

  checkpoints = Checkpointer(config.run_dir / 'checkpoints', keep=config.train.keep_checkpoints, async_save=False)
  try:
    step = checkpoints.latest_step()
    if step is None:
      return None
    one_device = dataclasses.replace(config, mesh=MeshConfig())
    abstract = Trainer(one_device, jax.devices()[:1], with_data=False).abstract_state
    return checkpoints.restore(step, abstract, config.to_dict())[0].params
  finally:
    checkpoints.close()


def run_to_hf(run_dir: str | Path, hf_dir: str | Path) -> Path:
  """Writes the run's model (latest training checkpoint, else converted params) as HF directory `hf_dir`."""
  run_dir = Path(run_dir)
  if not (run_dir / 'config.yaml').is_file():
    raise ConfigError(f'{run_dir}/config.yaml not found; pass a run directory written by lm train or lm convert')
  config = load_config(str(run_dir / 'config.yaml'), [f'train.run_dir={run_dir}'])
  params = _latest_trained_params(config)
  if params is None:
    if not (run_dir / PARAMS).is_dir():
      raise ConfigError(f'{run_dir} has neither training checkpoints nor converted {PARAMS}/; nothing to export')
    params = restore_params(run_dir, config)
  hf_config = json.loads((run_dir / HF_CONFIG).read_text()) if (run_dir / HF_CONFIG).is_file() else None
  return save_hf(config.model, params, hf_dir, hf_config)

