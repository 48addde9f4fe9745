"""`lm finetune`: GLUE tasks (`lm.jobs.glue`) or chat data (`lm.jobs.chat`) from a run dir or an HF directory."""
from __future__ import annotations

import argparse

from lm.commands.common import PROFILE_HELP, profile_overrides
from lm.config import ConfigError


CHAT_FLAGS = ('data', 'eval_data', 'chat_template')


def cmd_finetune(args: argparse.Namespace) -> int:
  from lm.jobs.glue.runs import Options, finetune_glue, finetune_task, parse_sweep, sweep
  from lm.jobs.glue.tasks import GLUE_ORDER
  # `--sweep` takes every key=value after it: those with one value are plain overrides.
  axes = [item for item in args.sweep if ',' in item]
  overrides = [item for item in args.sweep if ',' not in item] + list(args.overrides)
  overrides += (['train.resume=true'] if args.resume else []) + profile_overrides(args)
  if args.task in ('sft', 'dpo'):
    return _chat(args, overrides, parse_sweep(axes) if axes else None)
  given = [f'--{flag.replace("_", "-")}' for flag in CHAT_FLAGS if getattr(args, flag) is not None]
  if given:
    raise ConfigError(f'{", ".join(given)} go with --task sft or dpo; GLUE tasks read --data-dir')
  options = Options(data_dir=args.data_dir, init=args.init, preset=args.config, overrides=tuple(overrides),
                    source=args.source, epochs=args.epochs)
  if axes:
    sweep(GLUE_ORDER if args.task == 'glue' else [args.task], options, parse_sweep(axes))
  elif args.task == 'glue':
    finetune_glue(options)
  else:
    result = finetune_task(args.task, options)
    if result is not None:  # None: stopped by SIGTERM, as the loop said
      print(f'{result["task"]} best at step {result["step"]}: ' +
            ', '.join(f'{k} {v:.4f}' for k, v in result['metrics'].items()), flush=True)
  return 0


def _chat(args: argparse.Namespace, overrides: list[str], grid: list[tuple[str, ...]] | None) -> int:
  from lm.jobs.chat.dpo import DPOSettings, finetune_dpo
  from lm.jobs.chat.sft import ChatOptions, finetune_sft
  from lm.jobs.chat.sweep import sweep_chat
  from lm.jobs.finetuning import source_config
  if args.data is None:
    shape = 'messages, or prompt and completion' if args.task == 'sft' else 'prompt, chosen and rejected'
    raise ConfigError(f'--task {args.task} needs --data GLOB: JSON lines of {shape}')
  options = ChatOptions(data=args.data, init=args.init, eval_data=args.eval_data, eval_fraction=args.eval_fraction,
                        eval_generate=args.eval_generate, chat_template=args.chat_template, train_on=args.train_on,
                        preset=args.config, overrides=tuple(overrides), epochs=args.epochs)
  settings = DPOSettings(beta=args.beta, loss_type=args.loss_type, label_smoothing=args.label_smoothing,
                         reference=args.reference)
  run = finetune_sft if args.task == 'sft' else lambda o: finetune_dpo(o, settings)
  if grid is not None:
    sweep_chat(options, grid, run, f'runs/{args.task}/{source_config(args.init).name}')
    return 0
  result = run(options)
  if result:
    print(f'{args.task} done: ' + ', '.join(f'{k} {v:.4f}' for k, v in result.items() if k != 'step'), flush=True)
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  finetune = sub.add_parser('finetune', help='fine-tune a run dir or an HF model directory: a GLUE task (or all of '
                                             'GLUE), chat SFT or DPO')
  finetune.add_argument('--task', required=True, help='cola sst2 mrpc stsb qqp mnli qnli rte wnli, glue for all, '
                                                      'sft (chat data, --data) or dpo (preference pairs, --data)')
  finetune.add_argument('--data-dir', default=None, help='GLUE as its download script lays it out (CoLA/, SST-2/, '
                                                         '...); with --source tfds, the TFDS data dir')
  finetune.add_argument('--init', required=True, help='our run dir or an HF model directory (with its tokenizer)')
  finetune.add_argument('--config', default=None, help='preset or YAML for everything but the model '
                                                        '(default: the source run\'s config)')
  finetune.add_argument('--source', choices=('tsv', 'tfds'), default='tsv',
                        help='GLUE\'s TSV files or TFDS glue/<task>')
  finetune.add_argument('--epochs', type=float, default=3.0, help='passes over the training set (train.steps=N wins)')
  finetune.add_argument('--resume', action='store_true',
                        help='continue each task from the latest checkpoint in its folder (after a stop or a crash)')
  finetune.add_argument('--sweep', nargs='+', metavar='key=v1,v2', default=(),
                        help='a grid, e.g. optim.learning_rate=2e-5,3e-5,5e-5 train.seed=0,1,2 (a key with '
                        'one value is an override)')
  finetune.add_argument('--profile', metavar='START:COUNT', help=PROFILE_HELP)
  chat = finetune.add_argument_group('chat data (--task sft, dpo)')
  chat.add_argument('--data', default=None, help='JSON-lines files (a glob) of messages, or prompt and completion')
  chat.add_argument('--eval-data', default=None, help='held-out chats (a glob); default: --eval-fraction of --data')
  chat.add_argument('--eval-fraction', type=float, default=0.0, help='the share of --data held out (seeded)')
  chat.add_argument('--eval-generate', type=int, default=16,
                    help='held-out chats generated from at each evaluation (eval/exact_match)')
  chat.add_argument('--chat-template', default=None, help='a Jinja chat template file (default: the tokenizer\'s)')
  chat.add_argument('--train-on', choices=('assistant', 'all'), default='assistant',
                    help='sft: the tokens the loss counts: the assistant\'s turns, or every token')
  chat.add_argument('--beta', type=float, default=0.1, help='dpo: how far the policy may move from the reference')
  chat.add_argument('--loss-type', default='sigmoid', help='dpo: sigmoid, ipo or robust (as TRL computes them)')
  chat.add_argument('--label-smoothing', type=float, default=0.0,
                    help='dpo: the robust loss\'s chance that a preference is flipped')
  chat.add_argument('--reference', choices=('precomputed', 'frozen'), default='precomputed',
                    help='dpo: the init\'s log-probabilities scored once at the start, or per batch by its params')
  finetune.add_argument('overrides', nargs='*', metavar='key.sub=value', help='e.g. train.global_batch=16')
  finetune.set_defaults(fn=cmd_finetune, joins_job=True)
