"""The family registry: generic code asks the records, never a family's name."""
import re
from pathlib import Path

import pytest

from lm.config import ConfigError, load_config
from lm.models import FAMILIES, get_family

LM = Path(__file__).resolve().parents[2] / 'lm'
RECORDS = {LM / 'models' / f'{name}.py' for name in [*FAMILIES, 'family', '__init__']}


def test_no_generic_module_tests_a_family_name():
  pattern = re.compile(r"family\s*(==|!=|\bin\b|\bnot in\b)|\.family\s*(==|!=)|==\s*'(" + '|'.join(FAMILIES) + ")'")
  offenders = [f'{path.relative_to(LM.parent)}:{i}: {line.strip()}'
               for path in LM.rglob('*.py') if path not in RECORDS
               for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
  assert not offenders, '\n'.join(offenders)


def test_every_family_declares_what_generic_code_needs():
  for name, family in FAMILIES.items():
    assert family.name == name
    assert family.converter().ARCHITECTURE  # its HF converter imports
    config = load_config({'gpt': 'gpt_tiny', 'bert': 'bert_tiny', 't5': 't5_tiny', 'llama': 'llama_tiny'}[name])
    assert config.model.family == name


def test_an_unknown_family_lists_the_registered_ones():
  with pytest.raises(ConfigError, match="model.family='rnn' is not supported; choose one of: gpt, bert, t5, llama"):
    load_config('gpt_tiny', ['model.family=rnn'])
  with pytest.raises(ConfigError, match='model.nsp=true .* set model.type_vocab_size=2'):
    load_config('bert_tiny', ['model.nsp=true', 'model.type_vocab_size=0'])
  with pytest.raises(ConfigError, match='a llama model has no position table'):
    load_config('llama_tiny', ['model.position=learned'])
  assert get_family('llama').decoding == 'decoder' and get_family('bert').decoding is None
