"""What the commands share: `--config` with `key=value` overrides, checked as training would check them, and
`--profile`."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from lm.config import Config, load_config

PROFILE_HELP = ('a jax.profiler trace of COUNT steps from step START (>= 2) in the run dir\'s profile/, for '
                'TensorBoard, XProf or Perfetto (train.profile; train.profile_all_hosts=true: every host)')


def add_config(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--config', default='gpt_tiny', help='preset name in configs/ or a path to a YAML file')
  parser.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides, e.g. train.steps=100')


def checked_config(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
  """The config of --config and the overrides, with its family's and attention's checks: importing the models
  registers them with the loader (imported here: commands that need no model, scaling fit and plot, start without
  JAX)."""
  import lm.models  # noqa: F401
  return load_config(args.config, list(args.overrides) + list(extra))


def profile_overrides(args: argparse.Namespace) -> list[str]:
  return [f'train.profile={args.profile}'] if args.profile else []
