"""The family registry: generic code asks the records, never a family's name."""
import dataclasses
import re
from pathlib import Path

import pytest

from lm import cli
from lm.assembly import assemble
from lm.config import ConfigError, load_config
from lm.models import FAMILIES, check_config, get_family

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
    config = load_config(*{'gpt': ('gpt_tiny',), 'bert': ('bert_tiny',), 't5': ('t5_tiny',),
                           'llama': ('llama_tiny',), 'mistral': ('mistral_7b',), 'qwen2': ('qwen2_5_7b',),
                           'qwen3': ('qwen3_tiny',), 'gemma2': ('gemma2_tiny',),
                           'gemma3': ('gemma3_tiny',), 'gpt_neox': ('pythia_tiny',),
                           'olmo': ('olmo_tiny',), 'olmo2': ('olmo2_tiny',),
                           'olmo3': ('olmo2_tiny', ['model.family=olmo3', 'model.sliding_window=64',
                                                    'model.global_every=4']),
                           'mixtral': ('mixtral_8x7b',), 'qwen3_moe': ('qwen3_30b_a3b',), 'olmoe': ('olmoe_1b_7b',),
                           'gpt_oss': ('gpt_oss_tiny',), 'deepseek_v3': ('deepseek_v3_tiny',),
                           'qwen2_moe': ('moe_tiny', ['model.family=qwen2_moe', 'model.qkv_bias=true'])}[name])
    assert config.model.family == name


@pytest.mark.parametrize('preset, override, message', [
  ('gpt_tiny', 'model.family=rnn', "model.family='rnn' is not supported; choose one of: gpt, bert, t5, llama, "
                                   "mistral, qwen2, qwen3, gemma2, gemma3, olmo, olmo2, olmo3, mixtral, qwen2_moe, "
                                   "qwen3_moe, olmoe, gpt_oss, deepseek_v3, gpt_neox"),
  ('bert_tiny', 'model.nsp=true', 'model.nsp=true .* set model.type_vocab_size=2'),
  ('llama_tiny', 'model.position=learned', 'a llama model has no position table'),
])
def test_family_checks_run_wherever_a_config_is_loaded(preset, override, message, capsys):
  """`lm.config` knows no family, yet loading runs the family's checks (`lm.models` registers them); a config built
  in code meets them at `assemble`; every CLI command reports them in one line."""
  overrides = [override] + (['model.type_vocab_size=0'] if 'nsp' in override else [])
  with pytest.raises(ConfigError, match=message):
    load_config(preset, overrides)
  section, _, value = override.partition('=')
  key = section.split('.')[1]
  built = load_config(preset)
  built = dataclasses.replace(built, model=dataclasses.replace(
    built.model, **{key: value == 'true' if value in ('true', 'false') else value},
    **({'type_vocab_size': 0} if 'nsp' in override else {})))
  for check in (check_config, assemble):
    with pytest.raises(ConfigError, match=message):
      check(built)
  assert cli.main(['info', '--config', preset, *overrides]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_decoding_is_declared():
  assert get_family('llama').decoding.kind == 'causal' and get_family('bert').decoding is None
