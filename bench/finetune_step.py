"""GLUE fine-tuning step time: the family's task head (BERT's pooled [CLS], a decoder's last token, T5's label
text) on random MRPC-shaped pairs at the recipe's batch and length; median step time after compilation; prints a table, writes JSON.

  python bench/finetune_step.py --config bert_base [key=value ...] [--steps 5] [--out FILE]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np
from timing import time_calls

from lm.assembly import assemble
from lm.config import load_config
from lm.data.tokenizers import get_tokenizer
from lm.jobs.glue.finetune import RECIPE, TaskLoss
from lm.jobs.glue.tasks import TASKS
from lm.models import get_family
from lm.parallel.chips import quiet_libtpu
from lm.parallel.rules import batch_sharding
from lm.report import format_lines, write_json
from lm.train.step import make_train_step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='bert_base')
  parser.add_argument('--steps', type=int, default=5, help='timed steps after one warm-up step')
  parser.add_argument('--out', default=None, help='JSON path (default bench/results/finetune_step_<config>.json)')
  parser.add_argument('overrides', nargs='*')
  args = parser.parse_args()
  quiet_libtpu()  # before JAX starts its backends

  recipe = [f'train.global_batch={RECIPE["train"]["global_batch"]}', f'data.seq_len={RECIPE["data"]["seq_len"]}']
  task, tokenizer = TASKS['mrpc'], get_tokenizer('byte')  # byte ids lie inside every preset's vocabulary
  head = get_family(load_config(args.config).model.family).task_head
  config = load_config(args.config, [f'model.num_labels={head.num_labels(task)}', *recipe, *args.overrides])
  assembly = assemble(config)
  step = make_train_step(assembly, TaskLoss(assembly, head, regression=False))
  batch_size, length = config.train.global_batch, config.data.seq_len
  rng = np.random.default_rng(0)
  text = lambda: ''.join(rng.choice(list('abcdefgh '), length))  # a pair fills the row
  target_len = head.target_length(task, tokenizer)
  rows = [{**head.encode(tokenizer, task, (text(), text()), label, length, target_len), 'labels': np.int32(label)}
          for label in rng.integers(0, 2, batch_size).tolist()]
  batch = {k: jax.device_put(np.stack([row[k] for row in rows]), batch_sharding(assembly.mesh, rows[0][k].ndim + 1))
           for k in rows[0]}
  state = assembly.init_state()

  def one_step():
    nonlocal state
    state, metrics = step(state, batch)
    return metrics
  timing = time_calls(one_step, args.steps)
  compile_s, times, step_s = timing.first, timing.times, timing.median
  m = config.model
  result = {'config': config.name, 'overrides': args.overrides, 'backend': jax.default_backend(),
            'devices': jax.device_count(), 'layers': m.num_layers, 'd_model': m.d_model, 'batch': batch_size,
            'seq_len': length, 'dtype': m.execution.dtype, 'first_step_s': compile_s, 'median_step_s': step_s,
            'min_step_s': min(times), 'examples_per_sec': batch_size / step_s}
  print(format_lines([('config', config.name), ('layers x d_model', f'{m.num_layers} x {m.d_model}'),
                      ('batch x length', f'{batch_size} x {length}'), ('dtype', m.execution.dtype),
                      ('devices', f'{jax.device_count()} {jax.default_backend()}'),
                      ('first step (compile) s', f'{compile_s:.2f}'), ('median step s', f'{step_s:.3f}'),
                      ('examples/s', f'{result["examples_per_sec"]:.2f}')]))
  write_json(args.out or Path(__file__).parent / 'results' / f'finetune_step_{config.name}.json', result)


if __name__ == '__main__':
  main()
