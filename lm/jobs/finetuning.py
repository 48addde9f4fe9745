"""What every fine-tuning job shares: the model and tokenizer its `--init` names."""
from __future__ import annotations

from lm.config import Config, ConfigError
from lm.data.tokenizers import Tokenizer, get_tokenizer
from lm.storage.run_dir import HF_TOKENIZER_FILES
from lm.storage.source import ModelSource


def source_config(init: str) -> Config:
  """The model and tokenizer of `--init` (`lm.storage.source`): a run dir's, or an HF directory's with its
  tokenizer files."""
  source = ModelSource(init, flag='--init', need_params=False)  # its params are read at the run's start
  if not source.has_tokenizer:
    raise ConfigError(f'--init {init} holds no tokenizer files ({", ".join(HF_TOKENIZER_FILES)}); add the '
                      f'model\'s tokenizer there, or pass data.tokenizer=hf:PATH')
  return source.config


def load_tokenizer(config: Config) -> Tokenizer:
  tokenizer = get_tokenizer(config.data.tokenizer)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(f'the tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} ids but the model only '
                      f'{config.model.vocab_size}; pass the tokenizer the model was trained with (data.tokenizer=...)')
  return tokenizer
