"""`lm convert`: a Hugging Face model directory written as a run dir, and a run's params written as one."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from etils import epath

from lm.config import Config, ConfigError, TrainConfig, from_dict
from lm.data.tokenizers import get_tokenizer
from lm.parallel.mesh import one_device_mesh
from lm.storage.checkpoint import Checkpointer
from lm.storage.convert.hf import read_hf_config, save_hf
from lm.storage.convert.peft import save_peft
from lm.storage.run_dir import (CHAT_TEMPLATE, CHECKPOINTS, CONFIG, HF_CONFIG, HF_TOKENIZER_FILES, TOKENIZER,
                                is_run_dir, read_config)
from lm.storage.source import ModelSource


def import_hf(hf_dir: str | Path, run_dir: str | Path) -> Config:
  """Writes HF directory `hf_dir` as a new run directory; returns the run's config."""
  run_dir = epath.Path(run_dir)
  if (run_dir / CHECKPOINTS).exists() or is_run_dir(run_dir):
    raise ConfigError(f'{run_dir} already holds a run ({CONFIG} or {CHECKPOINTS}/); convert into a new directory')
  hf_config = read_hf_config(hf_dir)
  source = ModelSource(hf_dir)
  params = source.params(one_device_mesh())
  tokenizer_files = [Path(hf_dir) / name for name in HF_TOKENIZER_FILES if (Path(hf_dir) / name).is_file()]
  if not tokenizer_files:
    print(f'warning: {hf_dir} holds no tokenizer files ({", ".join(HF_TOKENIZER_FILES)}); the run uses '
          f'data.tokenizer=byte until you set data.tokenizer=hf:PATH', flush=True)
  data = dataclasses.replace(source.config.data, tokenizer=f'hf:{run_dir / TOKENIZER}' if tokenizer_files else 'byte')
  config = Config(name=run_dir.name or 'converted', model=source.config.model, data=data,
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
  """Writes the params of a run (its latest, trained or imported) or of one of its checkpoints (RUN/checkpoints/STEP)
  as HF directory `hf_dir`; `ema`: their moving average."""
  source = ModelSource(run_dir, view='ema' if ema else 'model', flag='--from')  # resolves RUN/checkpoints/STEP
  if source.hf:
    raise ConfigError(f'--from {run_dir} is a Hugging Face directory already; pass a run directory written by lm '
                      f'train or lm convert, or a checkpoint of one (RUN/{CHECKPOINTS}/STEP)')
  run_dir = source.path
  params = source.params(one_device_mesh())
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
  out = save_hf(source.config.model, params, hf_dir, hf_config)
  _export_tokenizer(run_dir, read_config(run_dir).data.tokenizer, out)
  return out


def export_peft(run_dir: str | Path, peft_dir: str | Path) -> Path:
  """Writes the low-rank adapters of a run trained with `model.lora` (or of one of its checkpoints) as a PEFT LoRA
  adapter in `peft_dir`, naming the run's source model (`train.init_from`) as its base."""
  source = ModelSource(run_dir, view='model', flag='--from')
  if source.hf:
    raise ConfigError(f'--from {run_dir} is a Hugging Face directory; pass a run directory trained with '
                      f'model.lora')
  init = read_config(source.path).train.init_from
  return save_peft(source.config.model, source.params(one_device_mesh()), peft_dir, init and str(init))


def _export_tokenizer(run_dir: epath.Path, spec: str, hf_dir: Path) -> None:
  """The run's HF tokenizer files beside the weights, and the chat template a chat fine-tune rendered with, so
  transformers' AutoTokenizer and apply_chat_template read the export."""
  kind, _, path = spec.partition(':')
  if kind == 'hf':
    for name in HF_TOKENIZER_FILES:
      if (Path(path) / name).is_file():
        epath.Path(Path(path) / name).copy(hf_dir / name, overwrite=True)
  if (run_dir / CHAT_TEMPLATE).is_file():
    (hf_dir / CHAT_TEMPLATE).write_text((run_dir / CHAT_TEMPLATE).read_text())
