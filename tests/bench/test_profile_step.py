"""bench/profile_step.py: the profile's matmul FLOPs, read from the compiled HLO, equal the FLOPs counted by hand,
and every kernel of the step lands in the part that computes it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL, built_once

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'bench'))
from profile_step import part_of  # noqa: E402

BATCH, SEQ, D, VOCAB = 16, 32, 64, 264  # SMALL's rows and width, gpt_tiny's vocabulary


@pytest.fixture(scope='session')
def result():
  """The benchmark in its own process, as a user runs it: a process that has loaded libtpu (as the suite's AOT
  tests do) cannot start the profiler. 4 tiles of the output layer: a loop of 4 trips whose FLOPs count 4 times.
  Run once for both tests that read it (`built_once`: ~14 CPU-s)."""
  def build(root):
    env = {**os.environ, 'XLA_FLAGS': ''}  # one CPU device
    done = subprocess.run([sys.executable, str(ROOT / 'bench/profile_step.py'), '--config', 'gpt_tiny', '--steps',
                           '2', '--out', str(root / 'profile.json'), *SMALL, 'model.execution.loss_chunk=8',
                           f'train.run_dir={root}/run'], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
  return json.loads((built_once('profile_step', build) / 'profile.json').read_text())


@pytest.mark.long(0.5)
def test_matmul_flops_from_the_hlo_equal_the_count_by_hand(result):
  """32 tokens attend unblocked (the whole square), so the compiled dots are the accounting's 'full' count:
  dense layers, attention and the tied output layer, forward and backward."""
  assert result['matmul_flops'] == pytest.approx(result['model_flops'], rel=1e-9)
  output_layer = 3 * 2 * BATCH * SEQ * D * VOCAB  # logits, their gradient to the hidden states and to the table
  assert result['parts']['output layer + loss (tiled)']['matmul_flops'] == pytest.approx(output_layer, rel=1e-9)


@pytest.mark.long(0.5)  # with its sibling: the profiled step (~30 s) stays out of the fast tier
def test_each_kernel_lands_in_the_part_that_computes_it(result):
  parts = result['parts']
  assert sum(p['seconds'] for p in parts.values()) == pytest.approx(result['kernel_seconds'])
  assert {'forward attention', 'backward attention', 'forward mlp', 'backward mlp', 'optimizer'} <= set(parts)
  assert parts['optimizer']['kernels'] > 0 and parts['optimizer']['matmul_flops'] == 0
  for name in ('other', 'unattributed (layout copies)'):  # every matmul is attributed to a model part
    assert parts.get(name, {'matmul_flops': 0})['matmul_flops'] == 0
  assert 0 < result['step_seconds'] and result['tokens_per_sec'] == pytest.approx(BATCH * SEQ / result['step_seconds'])


@pytest.mark.parametrize('op_name, part', [
  ('jit(step)/jvp(GPT)/decoder/layers_3/mlp/wi/ti,io->to/dot_general', 'forward mlp'),
  ('jit(step)/transpose(jvp(GPT))/decoder/layers/attention/bhqk,bhkd->bhqd/dot_general', 'backward attention'),
  ('jit(step)/jvp(output_loss)/while/body/closed_call/bcd,bcv->dv/dot_general', 'output layer + loss (tiled)'),
  ('jit(step)/optimizer/jit(_where)/select_n', 'optimizer'),
  ('jit(step)/transpose(jvp(GPT))/decoder/final_norm/reduce_sum', 'backward final_norm'),
  ('', 'unattributed (layout copies)'),
])
def test_part_of_reads_the_scope(op_name, part):
  assert part_of(op_name) == part
