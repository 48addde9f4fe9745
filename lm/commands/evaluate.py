"""`lm eval`: lm-eval-harness tasks on a checkpoint (`lm.jobs.evals.run`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from lm.config import ConfigError


def cmd_eval(args: argparse.Namespace) -> int:
  from lm.distributed import is_main_process
  from lm.jobs.evals.run import Request, run
  tasks = tuple(t for t in args.tasks.split(',') if t)
  if not tasks:
    raise ConfigError('--tasks is empty; name harness tasks, e.g. --tasks hellaswag,piqa')
  for flag, value, low in (('--num-fewshot', args.num_fewshot, 0), ('--limit', args.limit, 1),
                           ('--subset', args.subset, 1), ('--batch-size', args.batch_size, 1)):
    if value is not None and value < low:
      raise ConfigError(f'{flag} {value} must be at least {low}')
  if args.limit is not None and args.subset is not None:
    raise ConfigError('--limit and --subset both choose the documents: pass one')
  data_dir = Path(args.data_dir) if args.data_dir and args.source == 'files' else args.data_dir
  results, out = run(args.model, Request(tasks=tasks, data_dir=data_dir, source=args.source,
                                         num_fewshot=args.num_fewshot,
                                         limit=args.limit, subset=args.subset, max_length=args.max_length,
                                         batch_size=args.batch_size),
                step=args.step, out=args.out, overrides=args.overrides, ema=args.ema)
  if is_main_process():
    from lm_eval.utils import make_table
    print(make_table(results), flush=True)
    print(f'results in {out}', flush=True)
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  ev = sub.add_parser('eval', help='lm-eval-harness tasks on a checkpoint (run dir or HF directory)')
  ev.add_argument('--model', required=True, metavar='PATH', help='a run dir (its latest checkpoint, or --step) or an '
                                                                 'HF model directory')
  ev.add_argument('--tasks', required=True, help='comma-separated harness task names or task YAML files, e.g. '
                                                 'hellaswag,piqa')
  ev.add_argument('--data-dir', metavar='DIR', help='local task data: DIR/<task>/<split>.jsonl or the release '
                                                   'files (default: the harness loads from the Hub); with --source '
                                                   'tfds, the TFDS data dir')
  ev.add_argument('--source', choices=('files', 'tfds'), default='files',
                  help='tfds: prepared TFDS datasets (hellaswag, piqa, ai2_arc, winogrande, super_glue/boolq)')
  ev.add_argument('--num-fewshot', type=int, metavar='K', help='few-shot examples (default: each task\'s own)')
  ev.add_argument('--limit', type=int, metavar='N', help='only the first N documents of each task')
  ev.add_argument('--subset', type=int, metavar='N', help='N documents of each task drawn with a fixed seed (those '
                                                          'train.harness.limit=N evaluates in training)')
  ev.add_argument('--max-length', type=int, metavar='N', help='tokens per request (default: the model\'s context)')
  ev.add_argument('--step', type=int, metavar='S', help='the run\'s checkpoint at step S (default: the latest)')
  ev.add_argument('--ema', action='store_true', help='the params\' moving average (runs trained with '
                                                     'train.ema_decay); results in PATH/eval/step_<S>_ema')
  ev.add_argument('--batch-size', type=int, default=32, metavar='B', help='rows per scoring batch (default 32)')
  ev.add_argument('--out', type=Path, metavar='DIR', help='where results go (default: PATH/eval/step_<S>)')
  ev.add_argument('overrides', nargs='*', metavar='mesh.axis=N', help='how to lay the model over the devices, e.g. '
                                                                    'mesh.fsdp=4 (default: data over all)')
  ev.set_defaults(fn=cmd_eval, joins_job=True)
