"""`lm train` (pretraining) and `lm report` (where a run's time went)."""
from __future__ import annotations

import argparse
import json

from lm.commands.common import PROFILE_HELP, add_config, checked_config, profile_overrides
from lm.config import ConfigError


def cmd_train(args: argparse.Namespace) -> int:
  from lm.distributed import is_main_process
  from lm.jobs.pretraining import Pretraining
  config = checked_config(args, (['train.resume=true'] if args.resume else []) + profile_overrides(args))
  if args.resume and not config.run_dir.exists():  # a typo in the run dir should not start a new long run
    raise ConfigError(f'--resume: {config.run_dir} does not exist; check train.run_dir, or drop --resume to start '
                      f'a new run there')
  trainer = Pretraining(config)  # data and mesh problems stop here, before the config is printed
  main = is_main_process()
  if main:
    print(config.to_yaml(), flush=True)
  records = trainer.run()
  evals = [r for r in records if 'val_loss' in r]
  if main and evals and trainer.stopped_at is None:
    print(f'final val_loss {evals[-1]["val_loss"]:.4f} at step {evals[-1]["step"]}; '
          f'outputs in {config.run_dir}', flush=True)
  return 0


def cmd_report(args: argparse.Namespace) -> int:
  from lm.train.timing import format_run_report, run_report
  report = run_report(args.run)
  print(json.dumps(report, indent=2) if args.json else format_run_report(report), flush=True)
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  train = sub.add_parser('train', help='train a model')
  add_config(train)
  train.add_argument('--resume', action='store_true', help='continue from the latest checkpoint in the run dir')
  train.add_argument('--profile', metavar='START:COUNT', help=PROFILE_HELP)
  train.set_defaults(fn=cmd_train, joins_job=True)

  report = sub.add_parser('report', help='where a run\'s time went: steps, tokens, wall time, goodput, MFU, '
                                         'restarts, time by part, the slowest intervals')
  report.add_argument('run', metavar='RUN_DIR', help='the run directory')
  report.add_argument('--json', action='store_true', help='print the report as JSON')
  report.set_defaults(fn=cmd_report)
