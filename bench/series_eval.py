"""Evaluating a checkpoint series: `lm scaling collect` over an imported series (one process, one compiled program
for every checkpoint) against one `lm eval` process per checkpoint, on the same task; writes JSON.

  python bench/series_eval.py [--checkpoints 8] [--docs 50] [--eval-batches 1] [--hidden 256] [--layers 4] [--out FILE]

The series is a random GPT-NeoX (Pythia's layout, byte-level vocabulary) saved by transformers at `--checkpoints`
steps with other weights each, imported with `lm convert --from-hf-series`. The task is eval_throughput.py's
four-way multiple choice on embedded-corpus text. `collect` also evaluates each checkpoint's held-out loss
(`--eval-batches` batches), work the `lm eval` processes do not do; its task accuracies must equal theirs. The
ratio grows with the checkpoints and shrinks with the scoring each one takes: a process's start and compiles
(about a minute here) are what `collect` does once.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval_throughput import write_task


def save_series(folder: Path, checkpoints: int, hidden: int, layers: int) -> None:
  import torch
  import transformers
  config = transformers.GPTNeoXConfig(vocab_size=264, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 64, intermediate_size=4 * hidden,
                                      max_position_embeddings=1024, rotary_pct=0.25)
  for i in range(1, checkpoints + 1):
    torch.manual_seed(i)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(folder / f'step{1000 * i}', safe_serialization=True)


def lm(*argv: str) -> float:
  """Seconds of one `lm` process, as a user runs it."""
  start = time.perf_counter()
  done = subprocess.run([sys.executable, '-m', 'lm.cli', *argv], capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(f'lm {" ".join(argv)} failed:\n{done.stderr[-3000:]}')
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoints', type=int, default=8)
  parser.add_argument('--docs', type=int, default=50, help='task documents (four requests each)')
  parser.add_argument('--eval-batches', type=int, default=1, help='held-out batches collect evaluates besides')
  parser.add_argument('--hidden', type=int, default=256)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'series_eval.json'))
  args = parser.parse_args()
  os.environ.setdefault('TQDM_DISABLE', '1')
  from lm.report import format_lines, write_json
  with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp)
    save_series(folder / 'suite', args.checkpoints, args.hidden, args.layers)
    task = write_task(folder, args.docs)
    run = folder / 'run'
    lm('convert', '--from-hf-series', str(folder / 'suite'), '--to', str(run), '--tokens-per-step', '2048')
    points = folder / 'points.csv'
    collect = lm('scaling', 'collect', str(run), '--out', str(points), '--tasks', str(task), '--evaluate',
                 f'train.eval_batches={args.eval_batches}')
    collected = {int(r['step']): float(r['bench_choice/acc']) for r in csv.DictReader(points.open())}
    separate, evaluated = 0.0, {}
    for step in sorted(collected):
      separate += lm('eval', '--model', str(run), '--step', str(step), '--tasks', str(task))
      results = json.loads((run / 'eval' / f'step_{step}' / 'results.json').read_text())
      evaluated[step] = float(results['tasks']['bench_choice']['metrics']['acc'])
  if evaluated != collected:
    raise SystemExit(f'the accuracies differ: collect {collected}, lm eval {evaluated}')
  ratio = separate / collect
  print(f'{args.checkpoints} checkpoints of a {args.layers}-layer GPT-NeoX at width {args.hidden}, '
        f'{args.docs} documents x 4 choices each')
  print(format_lines([('lm scaling collect (one process)', f'{collect:.1f} s'),
                      (f'lm eval x {len(evaluated)} processes', f'{separate:.1f} s'), ('ratio', f'{ratio:.2f}x')]))
  out = write_json(args.out, {'checkpoints': args.checkpoints, 'docs': args.docs, 'eval_batches': args.eval_batches,
                              'hidden': args.hidden,
                              'layers': args.layers, 'collect_seconds': collect, 'separate_seconds': separate,
                              'ratio': ratio, 'accuracy': {str(k): v for k, v in collected.items()}})
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
