"""`lm train | finetune | eval | report | scaling | info | compile | convert | generate | tokenizer | data`:
the command line. Each command's parser and function live in `lm.commands`; here they are gathered and run.

Config problems exit with one line naming the fix."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lm.commands import convert, data, evaluate, finetune, generate, planning, scaling, train
from lm.config import ConfigError, TrainConfig

COMMANDS = (train, finetune, convert, planning, generate, evaluate, data, scaling)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='lm', description='Pretrain and study language models with JAX.')
  sub = parser.add_subparsers(dest='command', required=True)
  for command in COMMANDS:
    command.register(sub)
  return parser


def join_timeout_minutes(args: argparse.Namespace) -> float:
  """`lm train`: its config's `train.join_timeout_minutes` (read before JAX starts: it touches no device); other
  commands: the default."""
  if args.command != 'train':
    return TrainConfig.join_timeout_minutes
  from lm.commands.common import checked_config
  return checked_config(args).train.join_timeout_minutes


def main(argv: Sequence[str] | None = None) -> int:
  from lm.parallel.chips import quiet_libtpu
  quiet_libtpu()  # before anything starts JAX's backends
  args = build_parser().parse_args(argv)
  try:
    if getattr(args, 'joins_job', False):  # a command on devices joins a multi-process job first
      from lm.distributed import initialize
      initialize(timeout_seconds=60 * join_timeout_minutes(args))
    return args.fn(args)
  except ConfigError as e:
    print(f'lm: error: {e}', file=sys.stderr)
    return 2
  except RuntimeError as e:
    from lm.storage.checkpoint import CheckpointWriteError
    from lm.train.callbacks import TrainingError
    if not isinstance(e, (TrainingError, CheckpointWriteError)):
      raise
    print(f'lm: error: {e}', file=sys.stderr)
    return 1


if __name__ == '__main__':
  sys.exit(main())
