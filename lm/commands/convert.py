"""`lm convert`: an HF model directory as a run dir, and back (`lm.storage.convert.runs`)."""
from __future__ import annotations

import argparse

from lm.config import ConfigError


def cmd_convert(args: argparse.Namespace) -> int:
  from lm.storage.convert.runs import export_hf, export_peft, import_hf
  if args.tokens_per_step is not None and not args.from_hf_series:
    raise ConfigError('lm convert --tokens-per-step goes with --from-hf-series (the tokens behind each '
                      'revision\'s step)')
  if args.from_hf_series:
    return _convert_series(args)
  if args.from_hf:
    if not args.to:
      raise ConfigError('lm convert --from-hf HF_DIR needs --to RUN_DIR (where to write the lm checkpoint)')
    if args.ema:
      raise ConfigError('lm convert --ema exports a run\'s moving average of its params: it goes with --to-hf')
    config = import_hf(args.from_hf, args.to)
    print(f'converted {args.from_hf} ({config.model.family}) into {args.to}', flush=True)
  elif args.to_peft:
    if not args.source:
      raise ConfigError('lm convert --to-peft DIR needs --from RUN_DIR (a run trained with model.lora)')
    print(f'exported the adapters of {args.source} to {export_peft(args.source, args.to_peft)}', flush=True)
  else:
    if not args.source:
      raise ConfigError('lm convert --to-hf HF_DIR needs --from RUN_DIR (the run to export)')
    what = ' (the moving average of its params)' if args.ema else ''
    print(f'exported {args.source}{what} to {export_hf(args.source, args.to_hf, args.ema)}', flush=True)
  return 0


def _convert_series(args: argparse.Namespace) -> int:
  """Exit 2 when a revision was skipped (each named on stderr), after the others are converted."""
  from lm.storage.convert.series import import_hf_series
  if not args.to:
    raise ConfigError('lm convert --from-hf-series SRC needs --to RUN_DIR (the run its revisions become)')
  if args.tokens_per_step is not None and args.tokens_per_step <= 0:
    raise ConfigError(f'--tokens-per-step {args.tokens_per_step} must be positive (Pythia: 1024 x 2048 = 2097152)')
  converted, done, skipped = import_hf_series(args.from_hf_series, args.to, args.tokens_per_step)
  print(f'{args.to}: {len(converted)} revision(s) converted, {len(done)} already there, {len(skipped)} skipped',
        flush=True)
  return 2 if skipped else 0


def register(sub: argparse._SubParsersAction) -> None:
  convert = sub.add_parser('convert', help='Hugging Face model directory <-> lm run directory '
                                           '(GPT-2, BERT, T5, Llama, ...; a revision series)')
  direction = convert.add_mutually_exclusive_group(required=True)
  direction.add_argument('--from-hf', metavar='HF_DIR', help='import a HF directory (config.json, model.safetensors)')
  direction.add_argument('--from-hf-series', metavar='SRC',
                         help='import a revision series (a folder of step1000, ... folders or a hub cache folder '
                              'models--ORG--NAME) as one run, a checkpoint per step; a rerun adds the new ones')
  direction.add_argument('--to-hf', metavar='HF_DIR', help='export a run to a HF directory')
  direction.add_argument('--to-peft', metavar='DIR', help='export the low-rank adapters of a run trained with '
                                                          'model.lora as a PEFT LoRA adapter')
  convert.add_argument('--to', metavar='RUN_DIR', help='run directory to write (with --from-hf)')
  convert.add_argument('--from', dest='source', metavar='RUN_DIR',
                       help='run directory to export (with --to-hf): its latest params, or RUN/checkpoints/STEP\'s')
  convert.add_argument('--tokens-per-step', type=int, metavar='N',
                       help='with --from-hf-series: tokens per step (else read from names like step1000-tokens4B)')
  convert.add_argument('--ema', action='store_true', help='export the params\' moving average (a run trained with '
                                                          'train.ema_decay)')
  convert.set_defaults(fn=cmd_convert, joins_job=True)
