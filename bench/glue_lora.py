"""LoRA against full fine-tuning on the GLUE tasks the suite fine-tunes (tests/jobs/glue/test_finetune.py: each
family pretrained on the embedded corpus, then its synthetic pair task, and STS-B's regression for BERT and T5),
with the suite's recipes; LoRA at rank 8 on the attention projections alone, at each of `--lr-factors` times the
rate (adapters starting from zero want a larger one) for `--lora-steps` times the steps, the best on dev kept as
GLUE results are. Prints the dev metrics and LoRA's share of full fine-tuning's; writes JSON.

  python bench/glue_lora.py [--families bert,gpt,llama,t5] [--rank 8] [--lr-factors 3,10] [--lora-steps 1] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the suite's synthetic tasks and recipes: the runs this compares are its runs

from lm.jobs.glue.tasks import TASKS  # noqa: E402
from lm.report import format_lines, write_json  # noqa: E402
from tests.jobs.glue import synthetic  # noqa: E402
from tests.jobs.glue.test_finetune import FAMILIES, PAIR_TASK, REGRESSION  # noqa: E402


def lm(*argv: str) -> None:
  """`lm` as the suite's fine-tuning tests run it: one process on the host CPU, XLA fully optimising."""
  done = subprocess.run([sys.executable, '-m', 'lm.cli', *argv, 'train.progress=false'], capture_output=True,
                        text=True, env={**os.environ, 'XLA_FLAGS': '', 'JAX_PLATFORMS': 'cpu'}, cwd=ROOT)
  if done.returncode:
    raise SystemExit(f'lm {" ".join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}')


def scaled(overrides: list[str], rate: float, steps: int) -> list[str]:
  """A recipe's overrides with its learning rate times `rate` and its steps (and evaluations) times `steps`."""
  def times(key: str, factor: float, kind: type) -> Callable[[str], str]:
    return lambda o: re.sub(rf'^{re.escape(key)}=(.*)$', lambda m: f'{key}={kind(float(m[1]) * factor):g}', o)
  edits = [times('optim.learning_rate', rate, float), times('train.steps', steps, int),
           times('train.eval_every', steps, int)]
  for edit in edits:
    overrides = [edit(o) for o in overrides]
  return overrides


def compare(task: str, init: str, data: Path, out: Path, overrides: list[str], rank: int, factors: list[float],
            steps: int) -> dict:
  """Full fine-tuning's dev metric on `task` from `init`, and LoRA's at each rate factor and at the best."""
  metric = TASKS[task].main_metric
  runs = {'full': overrides,
          **{f'lora_x{f:g}': [f'model.lora.rank={rank}', *scaled(overrides, f, steps)] for f in factors}}
  scores = {}
  for name, extra in runs.items():
    lm('finetune', '--task', task, '--data-dir', str(data), '--init', init, f'train.run_dir={out / name}', *extra)
    scores[name] = json.loads((out / name / task / 'eval_results.json').read_text())['metrics'][metric]
  best = max((name for name in scores if name != 'full'), key=scores.get)
  return {'task': task, 'metric': metric, 'full': scores['full'], 'lora': scores[best], 'lr_factor': best[6:],
          'share': scores[best] / scores['full'], 'runs': scores}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--families', default=','.join(FAMILIES))
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--lr-factors', default='3,10', help='LoRA rates, as multiples of full fine-tuning\'s')
  parser.add_argument('--lora-steps', type=int, default=1, help='LoRA steps, as a multiple of full fine-tuning\'s')
  parser.add_argument('--out', default=str(ROOT / 'docs' / 'results' / 'glue_lora.json'))
  args = parser.parse_args()
  rows, factors = [], [float(f) for f in args.lr_factors.split(',')]
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    data = work / 'glue'
    for write in (synthetic.write_rte, synthetic.write_mrpc, synthetic.write_stsb):
      write(data)
    for family in args.families.split(','):
      preset, pretraining, finetuning = FAMILIES[family]
      init = work / family / 'pretrained'
      lm('train', '--config', preset, f'train.run_dir={init}', *pretraining, 'train.eval_batches=0')
      task = PAIR_TASK[family][0]
      rows.append({'family': family, **compare(task, str(init), data, work / family / task, finetuning, args.rank,
                                               factors, args.lora_steps)})
      if family in REGRESSION:  # from the fully fine-tuned pair task's model, as the suite's STS-B
        rows.append({'family': family, **compare('stsb', str(work / family / task / 'full' / task), data,
                                                 work / family / 'stsb', REGRESSION[family], args.rank, factors,
                                                 args.lora_steps)})
      for row in rows[-2 if family in REGRESSION else -1:]:
        print(line(row), flush=True)
  report = {'rank': args.rank, 'targets': 'query,key,value,out', 'lr_factors': factors, 'lora_steps': args.lora_steps,
            'rows': rows,
            'lowest_share': min(r['share'] for r in rows)}
  print(format_lines([('lowest LoRA share of full fine-tuning', f'{report["lowest_share"]:.3f}'),
                      ('written', str(write_json(args.out, report)))]))


def line(row: dict) -> str:
  return (f'{row["family"]:<6} {row["task"]:<5} {row["metric"]:<9} full {row["full"]:.3f}  LoRA {row["lora"]:.3f}  '
          f'(x{row["lr_factor"]} rate)  share {row["share"]:.3f}')


if __name__ == '__main__':
  main()
