"""bench/peers.py: the PyTorch peer is the same model as lm's, and one short run reports every contender."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import transformers

from lm.assembly import assemble
from lm.assembly.accounting import count_params
from lm.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bench'))
from peers import peer_gpt2_config  # noqa: E402


def test_the_peer_gpt2_has_lm_gpt_bench_parameter_for_parameter():
  """Same parameter count, and the same shape for each kind of tensor (tied output layer, biases, norms)."""
  config = load_config('gpt_bench')
  ours = count_params(assemble(config, jax.devices()[:1]).abstract_state.params)['total']
  theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**peer_gpt2_config(config)))
  assert sum(p.numel() for p in theirs.parameters()) == ours


@pytest.mark.long(1)
def test_one_round_reports_each_contender_and_the_ratio(tmp_path):
  out = tmp_path / 'peers.json'
  done = subprocess.run([sys.executable, str(ROOT / 'bench/peers.py'), '--config', 'gpt_tiny', '--rounds', '2',
                         '--steps', '1', '--only', 'lm fp32', 'torch eager fp32', '--out', str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(out.read_text())
  assert set(result['tokens_per_sec']) == {'lm fp32', 'torch eager fp32'}
  for name, rounds in result['round_median_step_s'].items():
    assert len(rounds) == 2 and all(t > 0 for t in rounds)
    assert result['tokens_per_sec'][name] == pytest.approx(result['tokens_per_step'] / (sum(rounds) / 2), rel=1e-12)
    assert name in done.stdout
  speed = result['tokens_per_sec']
  assert result['lm_best_over_best_peer'] == speed['lm fp32'] / speed['torch eager fp32']


STUB_TRANSFORMERS = '''
"""Stands in for transformers<5 in the HF Flax worker: the interface it uses, an embedding table as the model."""
import jax


class GPT2Config:
  def __init__(self, **kwargs):
    self.__dict__.update(kwargs)


class Output:
  def __init__(self, logits):
    self.logits = logits


class FlaxGPT2LMHeadModel:
  def __init__(self, config, seed=0):
    self.params = {'wte': 0.02 * jax.random.normal(jax.random.key(seed), (config.vocab_size, config.n_embd))}

  def __call__(self, tokens, params, train):
    return Output(params['wte'][tokens] @ params['wte'].T)
'''


@pytest.mark.long(0.5)
def test_the_flax_worker_runs_with_its_python(tmp_path):
  """`--flax-python`: the worker script starts, trains and reports in that Python (here this one, with a stub
  `transformers` in front: the real Flax GPT-2 needs transformers<5, another environment)."""
  (tmp_path / 'stub').mkdir()
  (tmp_path / 'stub' / 'transformers.py').write_text(STUB_TRANSFORMERS)
  python = tmp_path / 'python'
  python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "stub"} exec {sys.executable} "$@"\n')
  python.chmod(0o755)
  out = tmp_path / 'peers.json'
  done = subprocess.run([sys.executable, str(ROOT / 'bench/peers.py'), '--config', 'gpt_tiny', '--rounds', '1',
                         '--steps', '1', '--only', 'lm fp32', '--flax-python', str(python), '--out', str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert set(json.loads(out.read_text())['tokens_per_sec']) == {'lm fp32', 'HF Flax GPT-2 fp32'}
