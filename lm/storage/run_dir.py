"""The one run-directory layout every command reads and writes.

  RUN/config.yaml           the resolved Config; `lm train --config RUN/config.yaml` reruns it
  RUN/checkpoints/<step>/   orbax (`lm.storage.checkpoint`): params and config; training adds optimizer and data
  RUN/best/<step>/          fine-tuning: the params that scored best on dev, with that evaluation's metrics;
                            a reader of the run's model takes these when present
  RUN/metrics.jsonl         one JSON record per logged step (training)
  RUN/tensorboard/          TensorBoard events (training)
  RUN/hf_config.json        the config.json of an imported model, so an export keeps every HF field
  RUN/tokenizer/            an imported model's tokenizer files (data.tokenizer=hf:RUN/tokenizer)
  RUN/series.json           an imported revision series: each step's revision and the tokens behind it

`lm train` writes it; `lm convert --from-hf` (`lm.storage.convert.runs`) writes the same layout with one
params-only checkpoint at step 0 (`--from-hf-series`: one per revision's step) and `train.init_from` pointing at
itself, so `lm train --config RUN/config.yaml train.run_dir=NEW` fine-tunes the imported weights, and
`lm generate --run RUN` samples from them. Models are opened from it by `lm.storage.source`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from etils import epath

from lm.config import Config, ConfigError, load_config
from lm.storage.checkpoint import Checkpointer

CONFIG = 'config.yaml'
CHECKPOINTS = 'checkpoints'
BEST = 'best'
HF_CONFIG = 'hf_config.json'
SERIES = 'series.json'
TOKENIZER = 'tokenizer'
PROFILE = 'profile'  # train.profile's traces
HF_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json',
                      'vocab.txt', 'vocab.json', 'merges.txt', 'spiece.model', 'chat_template.jinja')
CHAT_TEMPLATE = 'chat_template.jinja'  # a chat fine-tune's template (lm finetune --task sft), exported with it


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


def read_series(run_dir: str | Path) -> dict[str, Any]:
  """RUN/series.json of an imported revision series: its source, config and, by step (a string), each revision's
  name and tokens; {} for any other run."""
  path = epath.Path(run_dir) / SERIES
  return json.loads(path.read_text()) if path.is_file() else {}


def checkpoints(run_dir: str | Path, keep: int = 1) -> Checkpointer:
  """The run's checkpoints, read-only (nothing is created)."""
  return Checkpointer(epath.Path(run_dir) / CHECKPOINTS, keep=keep, async_save=False, create=False)
