"""Train-step throughput: median step time and tokens/s after compilation; prints a table, writes JSON.

  python bench/train_throughput.py --config gpt_bench [key=value ...] [--steps 20] [--out FILE]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
from timing import time_calls

from lm.config import load_config
from lm.jobs.pretraining import Pretraining
from lm.report import format_lines, write_json


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='gpt_bench')
  parser.add_argument('--steps', type=int, default=20, help='timed steps after two warm-up steps')
  parser.add_argument('--out', default=None, help='JSON path (default bench/results/train_throughput_<config>.json)')
  parser.add_argument('overrides', nargs='*')
  args = parser.parse_args()

  config = load_config(args.config, args.overrides)
  trainer = Pretraining(config)
  state, batch = trainer.init_state(), next(trainer.train_batches)

  def step():
    nonlocal state
    state, metrics = trainer.train_step(state, batch)
    return metrics
  timing = time_calls(step, args.steps, warmup=2)
  compile_s, times, step_s = timing.first, timing.times, timing.median
  tokens = config.train.global_batch * config.data.seq_len
  m = config.model
  result = {
    'config': config.name, 'overrides': args.overrides, 'backend': jax.default_backend(),
    'devices': jax.device_count(), 'layers': m.num_layers, 'd_model': m.d_model, 'heads': m.num_heads,
    'vocab': m.vocab_size, 'seq_len': config.data.seq_len, 'batch': config.train.global_batch,
    'dtype': m.execution.dtype, 'first_step_s': compile_s, 'median_step_s': step_s,
    'min_step_s': min(times), 'tokens_per_sec': tokens / step_s,
    'model_tflops_per_sec': trainer.assembly.flops_per_token() * tokens / step_s / 1e12,
  }
  rows = [('config', config.name), ('layers x d_model x heads', f'{m.num_layers} x {m.d_model} x {m.num_heads}'),
          ('vocab / seq / batch', f'{m.vocab_size} / {config.data.seq_len} / {config.train.global_batch}'),
          ('dtype', m.execution.dtype), ('devices', f'{jax.device_count()} {jax.default_backend()}'),
          ('first step (compile) s', f'{compile_s:.2f}'), ('median step s', f'{step_s:.4f}'),
          ('tokens/s', f'{result["tokens_per_sec"]:,.0f}'),
          ('model TFLOP/s', f'{result["model_tflops_per_sec"]:.3f}')]
  print(format_lines(rows))
  out = write_json(args.out or Path(__file__).parent / 'results' / f'train_throughput_{config.name}.json', result)
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
