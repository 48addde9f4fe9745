"""`lm train | finetune | eval | report | scaling | info | compile | convert | generate | tokenizer | data`:
the command line.

Config problems exit with one line naming the fix."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from lm.config import Config, ConfigError, load_config, parse_overrides, preset_slice


def _config(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
  """The config of --config and the overrides, with its family's checks."""
  from lm.models import check_config
  return check_config(load_config(args.config, list(args.overrides) + list(extra)))


PROFILE_HELP = ('a jax.profiler trace of COUNT steps from step START (>= 2) in the run dir\'s profile/, for '
                'TensorBoard, XProf or Perfetto (train.profile; train.profile_all_hosts=true: every host)')


def _profile(args: argparse.Namespace) -> list[str]:
  return [f'train.profile={args.profile}'] if args.profile else []


def cmd_train(args: argparse.Namespace) -> int:
  from lm.distributed import is_main_process
  from lm.pretraining import Pretraining
  config = _config(args, (['train.resume=true'] if args.resume else []) + _profile(args))
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


def cmd_convert(args: argparse.Namespace) -> int:
  from lm.storage.convert.runs import export_hf, import_hf
  if args.from_hf:
    if not args.to:
      raise ConfigError('lm convert --from-hf HF_DIR needs --to RUN_DIR (where to write the lm checkpoint)')
    if args.ema:
      raise ConfigError('lm convert --ema exports a run\'s moving average of its params: it goes with --to-hf')
    config = import_hf(args.from_hf, args.to)
    print(f'converted {args.from_hf} ({config.model.family}) into {args.to}', flush=True)
  else:
    if not args.source:
      raise ConfigError('lm convert --to-hf HF_DIR needs --from RUN_DIR (the run to export)')
    what = ' (the moving average of its params)' if args.ema else ''
    print(f'exported {args.source}{what} to {export_hf(args.source, args.to_hf, args.ema)}', flush=True)
  return 0


def cmd_eval(args: argparse.Namespace) -> int:
  from lm.distributed import is_main_process
  from lm.evals.run import Request, run
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


def model_report(config: Config, compile_step: bool = False) -> dict[str, Any]:
  """Parameter counts, FLOPs per token, mesh and per-device memory for `lm info`."""
  import jax

  from lm.assembly import assemble
  from lm.assembly.accounting import count_params, estimate_memory
  from lm.compile import compiled_memory
  from lm.parallel.mesh import strategy_name
  from lm.train.step import compile_train_step

  assembly = assemble(config)
  sizes = dict(assembly.mesh.shape)
  report = {
    'name': config.name,
    'params': count_params(assembly.abstract_params),
    'flops_per_token': assembly.flops_per_token(),
    'mesh': {**sizes, 'strategy': strategy_name(sizes), 'devices': jax.device_count(),
             'platform': jax.default_backend()},
    'memory_per_device': estimate_memory(config, assembly.abstract_state, assembly.mesh),
  }
  if compile_step:
    report['compiled_memory_per_device'] = compiled_memory(compile_train_step(assembly))
  return report


def cmd_info(args: argparse.Namespace) -> int:
  from lm.mesh_axes import mesh_text
  from lm.report import format_bytes, format_lines
  devices = args.devices
  if not devices and (named := preset_slice(args.config)):  # a preset sized for a slice: plan on its chips
    from lm.parallel.chips import slice_chips
    chips = slice_chips(named)
    devices = chips if chips > 1 else 0  # one chip: the host's devices, as they are
  if devices:
    import jax
    try:
      jax.config.update('jax_num_cpu_devices', devices)
    except RuntimeError:  # JAX has started already (lm called as a library): plan on the devices it has
      if args.devices:
        raise
  report = model_report(_config(args), args.compile)
  if args.json:
    print(json.dumps(report, indent=2))
    return 0
  p, mesh, mem = report['params'], report['mesh'], report['memory_per_device']
  lines = [
    ('config', report['name']),
    ('parameters', f'{p["total"]:,} total, {p["non_embedding"]:,} non-embedding'),
    ('training FLOPs/token', f'{report["flops_per_token"]:.4g}'),
    ('mesh', f'{mesh_text(mesh)} ({mesh["strategy"]}, '
             f'{mesh["devices"]} {mesh["platform"]} devices)'),
  ]
  lines += [(f'memory/device: {k}', format_bytes(v)) for k, v in mem.items()]
  for k, v in report.get('compiled_memory_per_device', {}).items():
    lines.append((f'compiled memory/device: {k}', format_bytes(v)))
  print(format_lines(lines))
  return 0


def cmd_compile(args: argparse.Namespace) -> int:
  from lm.compile import compile_report, does_not_fit_message, format_report
  topology = args.topology or preset_slice(args.config)
  if topology is None:
    raise ConfigError(f'lm compile: {args.config} names no slice in its header (a "# Slice: v5p-1024" line); '
                      f'pass --topology, e.g. --topology v5e-256')
  if args.plan:
    from lm.plan import best_preset, format_plan, plan, plan_json
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
        (lambda line: print(line, flush=True))
    result = plan(_config(args), topology, args.plan_top, args.num_slices, args.plan_max_compiles, log=log)
    print(json.dumps(plan_json(result), indent=2) if args.json else format_plan(result), flush=True)
    if args.write and result['plan']:
      Path(args.write).write_text(best_preset(result, args.config, parse_overrides(args.overrides)))
      print(f'wrote the best candidate as a preset: {args.write}', file=sys.stderr if args.json else sys.stdout)
    if not result['plan']:
      print(f'lm compile --plan: no candidate fits {topology}; try a bigger slice or a smaller train.global_batch',
            file=sys.stderr, flush=True)
      return 3
    return 0
  report = compile_report(_config(args), topology, args.mfu, args.save, args.num_slices)
  print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
  if not report['fits']:
    print(does_not_fit_message(report), file=sys.stderr, flush=True)
    return 3
  return 0


def cmd_report(args: argparse.Namespace) -> int:
  from lm.train.timing import format_run_report, run_report
  report = run_report(args.run)
  print(json.dumps(report, indent=2) if args.json else format_run_report(report), flush=True)
  return 0


def cmd_generate(args: argparse.Namespace) -> int:
  import jax

  from lm.generate import generate_text
  from lm.models.decode import Sampling
  from lm.storage.source import open_model
  sampling = Sampling(args.temperature, args.top_k, args.top_p)
  _, assembly, params = open_model(args.run, ema=args.ema, flag='--run', overrides=args.overrides)
  texts = generate_text(assembly.config, params, args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        rng=jax.random.key(args.seed))
  for prompt, text in zip(args.prompt, texts):
    print(f'--- {prompt!r}\n{text}', flush=True)
  return 0


def cmd_finetune(args: argparse.Namespace) -> int:
  from lm.glue.runs import Options, finetune_glue, finetune_task, parse_sweep, sweep
  from lm.glue.tasks import GLUE_ORDER
  # `--sweep` takes every key=value after it: those with one value are plain overrides.
  axes = [item for item in args.sweep if ',' in item]
  overrides = [item for item in args.sweep if ',' not in item] + list(args.overrides)
  overrides += (['train.resume=true'] if args.resume else []) + _profile(args)
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


def cmd_scaling_sweep(args: argparse.Namespace) -> int:
  from lm.report import format_lines
  from lm.scaling.sweep import (DEFAULT_SIZES, DEFAULT_TOKENS, parse_numbers, parse_sizes, plan, sweep,
                                 tokens_trained)
  base = _config(args)
  sizes = parse_sizes(args.sizes) if args.sizes else DEFAULT_SIZES
  budgets = parse_numbers(args.budgets, '--budgets') if args.budgets else ()
  tokens = parse_numbers(args.tokens, '--tokens') if args.tokens else (() if budgets else DEFAULT_TOKENS)
  rates = parse_numbers(args.lr_grid, '--lr-grid') if args.lr_grid else ()
  points = plan(base, sizes, tokens, budgets, args.evals, args.schedule, rates)
  print(format_lines([(p.label, f'N {p.params:,}  D {p.tokens:,}  C {6 * p.params * p.tokens:.3g}  {p.steps} steps'
                       + (f' (the decay from step {p.branch_at})' if p.branch_at else '')) for p in points]),
        flush=True)
  trained, alone = tokens_trained(points, base.train.global_batch * base.data.seq_len)
  print(f'tokens to train: {trained:,} ({trained / alone:.0%} of the {alone:,} of independent runs)', flush=True)
  if not args.dry_run:
    sweep(base, args.out, points, args.evals)
    print(f'{len(points)} runs in {args.out}; next: lm scaling collect {args.out} --out points.csv', flush=True)
  return 0


def cmd_scaling_coord_check(args: argparse.Namespace) -> int:
  from lm.report import format_lines
  from lm.scaling.coord_check import ORDER, coord_check, write_coord_check
  from lm.scaling.sweep import parse_numbers
  widths = [int(w) for w in parse_numbers(args.widths, '--widths')]
  result = coord_check(_config(args), widths, args.parametrization, args.lr, args.steps, args.seeds)
  png, data = write_coord_check(result, args.out)
  print(f'{args.parametrization}: slope of log mean|x| against log width, by step 0..{args.steps}', flush=True)
  print(format_lines([(group, '  '.join(f'{s:+.2f}' for s in result['slopes'][group])) for group in ORDER]))
  print(f'wrote {png} and {data}', flush=True)
  return 0


def cmd_scaling_collect(args: argparse.Namespace) -> int:
  from lm.scaling.collect import collect
  from lm.scaling.points import write_points
  runs = [item for item in args.runs if '=' not in item]
  overrides = [item for item in args.runs if '=' in item] + (args.evaluate or [])
  if overrides and args.evaluate is None:
    raise ConfigError(f'{overrides[0]}: overrides only apply with --evaluate (e.g. another eval set); drop them '
                      f'or add --evaluate')
  if bad := [item for item in overrides if '=' not in item]:
    raise ConfigError(f'--evaluate {bad[0]}: takes key=value overrides (e.g. data.paths=[held_out/*.txt]); put run '
                      f'dirs before --evaluate')
  tasks = None
  if args.tasks is not None:
    from lm.evals.run import Request, check_installed
    check_installed()
    names = tuple(t for t in args.tasks.split(',') if t)
    if not names:
      raise ConfigError('--tasks is empty; name harness tasks, e.g. --tasks hellaswag,piqa')
    if args.tasks_data_dir is not None and not args.tasks_data_dir.is_dir():
      raise ConfigError(f'--tasks-data-dir {args.tasks_data_dir} is not a directory')
    if args.tasks_limit is not None and args.tasks_limit < 1:
      raise ConfigError(f'--tasks-limit {args.tasks_limit} must be at least 1')
    tasks = Request(tasks=names, data_dir=args.tasks_data_dir, subset=args.tasks_limit)
  rows = collect(runs, args.evaluate is not None, overrides, tasks, args.eval, args.metric)
  write_points(args.out, rows)
  print(f'{len(rows)} points from {len({r["run"] for r in rows})} runs written to {args.out}', flush=True)
  return 0


def cmd_scaling_fit(args: argparse.Namespace) -> int:
  from lm.scaling.laws import fit
  from lm.scaling.points import read_points
  from lm.scaling.report import format_fit
  if args.bootstrap < 0:
    raise ConfigError(f'--bootstrap {args.bootstrap} must be >= 0 (0: no intervals)')
  if any(not c > 0 for c in args.budget):
    raise ConfigError('--budget takes positive compute budgets in FLOPs, e.g. --budget 1e21 5.76e23')
  if args.law == 'task':
    from lm.scaling.laws import fit_task
    from lm.scaling.points import read_column
    if not args.task:
      raise ConfigError('--law task fits one task: name it with --task (e.g. --task piqa) and its metric with '
                        '--metric (default acc)')
    if len(args.target) % 2 or any(not x > 0 for x in args.target):
      raise ConfigError('--target takes pairs of positive N D (params and tokens), e.g. --target 7e9 1.4e11')
    targets = list(zip(args.target[::2], args.target[1::2]))
    result = fit_task(read_points(args.points, args.params, f'{args.task}/task_loss'),
                      read_column(args.points, f'{args.task}/{args.metric}'), targets, args.bootstrap)
    result.update(task=args.task, metric=args.metric)
  else:
    result = fit(read_points(args.points, args.params), args.law, args.bootstrap, args.budget)
  print(json.dumps(result, indent=2) if args.json else format_fit(result))
  if args.out:
    from pathlib import Path
    Path(args.out).write_text(json.dumps(result, indent=2) + '\n')
  return 0


def cmd_scaling_plot(args: argparse.Namespace) -> int:
  from pathlib import Path

  from lm.scaling.plot import plot
  from lm.scaling.points import loss_of, read_column, read_points, task_accuracies
  fit = None
  if args.fit:
    try:
      fit = json.loads(Path(args.fit).read_text())
    except (OSError, ValueError):
      fit = None
    if not isinstance(fit, dict) or not {'law', 'params'} <= fit.keys():
      raise ConfigError(f'--fit {args.fit} is not a fit written by lm scaling fit --out; write one with '
                        f'lm scaling fit {args.points} --out FIT.json')
  if args.lr:
    from lm.scaling.plot import plot_learning_rates
    best = plot_learning_rates(args.points, args.out)
    print('best learning rate by width: ' + ', '.join(f'{width} {lr:g}' for width, lr in best.items()))
    print(f'wrote {args.out}', flush=True)
    return 0
  tasks = task_accuracies(args.points)
  if fit is not None and fit['law'] == 'task':  # the fitted metric, with its sigmoid
    column = f'{fit["task"]}/{fit["metric"]}'
    tasks = {k: v for k, v in tasks.items() if k.split('/')[0] != fit['task']}
    tasks[column] = (read_column(args.points, column), read_column(args.points, f'{fit["task"]}/task_loss'))
  print(f'wrote {plot(read_points(args.points, args.params), args.out, fit, tasks, loss_of(args.points))}',
        flush=True)
  return 0


def _data_config(args: argparse.Namespace) -> Config:
  """The config's data section, or local files named by --from (JSONL when every glob ends in .jsonl)."""
  extra = []
  if args.source_globs:
    kind = 'jsonl' if all(g.endswith('.jsonl') for g in args.source_globs) else 'text'
    extra = [f'data.source={kind}', f'data.paths=[{",".join(args.source_globs)}]']
  return _config(args, extra)


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
  from lm.data.sources import open_documents
  from lm.data.tokenizer_training import train_sentencepiece
  documents = open_documents(_data_config(args).data, 'train')
  print(f'training a {args.model_type} SentencePiece model of {args.vocab_size:,} pieces on {len(documents):,} '
        f'documents (at most {args.max_lines:,} lines)', flush=True)
  path = train_sentencepiece((documents[i] for i in range(len(documents))), args.out, vocab_size=args.vocab_size,
                             model_type=args.model_type, sentinels=args.sentinels, max_lines=args.max_lines,
                             report=lambda message: print(message, flush=True))
  print(f'wrote {path}; use it with data.tokenizer=sentencepiece:{path}', flush=True)
  return 0


def cmd_data_build(args: argparse.Namespace) -> int:
  from lm.data.build import build_tfds
  counts = build_tfds(args.name, args.source_globs, args.data_dir, text_key=args.text_key,
                      val_fraction=args.val_fraction, max_chars=args.max_chars)
  print(f'built {args.name} in {args.data_dir}: {counts["train"]:,} train and {counts["validation"]:,} validation '
        f'records; train on it with data.source=tfds data.name={args.name} data.data_dir={args.data_dir}', flush=True)
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='lm', description='Pretrain and study language models with JAX.')
  sub = parser.add_subparsers(dest='command', required=True)

  def common(p: argparse.ArgumentParser) -> None:
    p.add_argument('--config', default='gpt_tiny', help='preset name in configs/ or a path to a YAML file')
    p.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides, e.g. train.steps=100')

  train = sub.add_parser('train', help='train a model')
  common(train)
  train.add_argument('--resume', action='store_true', help='continue from the latest checkpoint in the run dir')
  train.add_argument('--profile', metavar='START:COUNT', help=PROFILE_HELP)
  train.set_defaults(fn=cmd_train)

  finetune = sub.add_parser('finetune', help='fine-tune on a GLUE task (or all of GLUE) from a run dir or an HF '
                                             'model directory; writes eval results, predictions, leaderboard files')
  finetune.add_argument('--task', required=True, help='cola sst2 mrpc stsb qqp mnli qnli rte wnli, or glue for all')
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
  finetune.add_argument('overrides', nargs='*', metavar='key.sub=value', help='e.g. train.global_batch=16')
  finetune.set_defaults(fn=cmd_finetune)

  convert = sub.add_parser('convert', help='Hugging Face model directory <-> lm run directory '
                                           '(GPT-2, BERT, T5, Llama)')
  direction = convert.add_mutually_exclusive_group(required=True)
  direction.add_argument('--from-hf', metavar='HF_DIR', help='import a HF directory (config.json, model.safetensors)')
  direction.add_argument('--to-hf', metavar='HF_DIR', help='export a run to a HF directory')
  convert.add_argument('--to', metavar='RUN_DIR', help='run directory to write (with --from-hf)')
  convert.add_argument('--from', dest='source', metavar='RUN_DIR', help='run directory to export (with --to-hf)')
  convert.add_argument('--ema', action='store_true', help='export the params\' moving average (a run trained with '
                                                          'train.ema_decay)')
  convert.set_defaults(fn=cmd_convert)

  info = sub.add_parser('info', help='parameters, FLOPs per token, mesh and per-device memory of a config')
  common(info)
  info.add_argument('--json', action='store_true', help='print the report as JSON')
  info.add_argument('--compile', action='store_true', help='also compile the train step and report its memory')
  info.add_argument('--devices', type=int, default=0,
                    help='simulate this many CPU devices (mesh planning; default: the chips of the slice the '
                         'preset\'s header names when it has more than one, else the host\'s devices)')
  info.set_defaults(fn=cmd_info)

  report = sub.add_parser('report', help='where a run\'s time went: steps, tokens, wall time, goodput, MFU, '
                                         'restarts, time by part, the slowest intervals')
  report.add_argument('run', metavar='RUN_DIR', help='the run directory')
  report.add_argument('--json', action='store_true', help='print the report as JSON')
  report.set_defaults(fn=cmd_report)

  aot = sub.add_parser('compile', help='compile the train step for a TPU slice ahead of time (no TPU needed): '
                                       'per-device memory, FLOPs and predicted step time')
  common(aot)
  aot.add_argument('--topology', help='TPU slice: v5p-1024, v5e-256, v4-128, v6e-64 or v5e:2x2 (default: the '
                                      'slice in the preset\'s header)')
  aot.add_argument('--mfu', type=float, default=0.5, help='assumed MFU for the predicted step time (default 0.5)')
  aot.add_argument('--num-slices', type=int, default=1, help='slices joined by the data-center network (multislice)')
  aot.add_argument('--save', metavar='PATH', help='write the serialized executable (and PATH.json with the report)')
  aot.add_argument('--json', action='store_true', help='print the report as JSON')
  aot.add_argument('--plan', action='store_true', help='search meshes, remat and microbatches; compile the '
                                                        'fastest-predicted that may fit and list those that fit')
  aot.add_argument('--plan-top', type=int, default=5, metavar='N', help='--plan stops when N candidates fit (5)')
  aot.add_argument('--plan-max-compiles', type=int, metavar='N', help='--plan compiles at most N candidates '
                                                                      '(default 3 x --plan-top)')
  aot.add_argument('--write', metavar='PATH', help='--plan: save the best candidate as a preset YAML')
  aot.set_defaults(fn=cmd_compile)

  gen = sub.add_parser('generate', help='sample continuations from a trained run (KV-cached decoding)')
  gen.add_argument('--run', required=True, help='a run directory with a checkpoint (trained or imported)')
  gen.add_argument('--prompt', action='append', required=True, help='prompt text (T5: the encoder input); repeatable')
  gen.add_argument('--max-new-tokens', type=int, default=200)
  gen.add_argument('--temperature', type=float, default=0.0,
                   help='softmax temperature; 0 decodes greedily (default %(default)s)')
  gen.add_argument('--top-k', type=int, default=None,
                   help='sample among the k likeliest tokens (default %(default)s: all)')
  gen.add_argument('--top-p', type=float, default=None,
                   help='sample among the likeliest tokens holding mass p (default %(default)s: all)')
  gen.add_argument('--seed', type=int, default=0)
  gen.add_argument('--ema', action='store_true', help='sample from the params\' moving average (a run trained '
                                                      'with train.ema_decay)')
  gen.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides, e.g. mesh.tensor=2')
  gen.set_defaults(fn=cmd_generate)

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
                                                          'train.evals_limit=N evaluates in training)')
  ev.add_argument('--max-length', type=int, metavar='N', help='tokens per request (default: the model\'s context)')
  ev.add_argument('--step', type=int, metavar='S', help='the run\'s checkpoint at step S (default: the latest)')
  ev.add_argument('--ema', action='store_true', help='the params\' moving average (runs trained with '
                                                     'train.ema_decay); results in PATH/eval/step_<S>_ema')
  ev.add_argument('--batch-size', type=int, default=32, metavar='B', help='rows per scoring batch (default 32)')
  ev.add_argument('--out', type=Path, metavar='DIR', help='where results go (default: PATH/eval/step_<S>)')
  ev.add_argument('overrides', nargs='*', metavar='mesh.axis=N', help='how to lay the model over the devices, e.g. '
                                                                    'mesh.fsdp=4 (default: data over all)')
  ev.set_defaults(fn=cmd_eval)

  tokenizer = sub.add_parser('tokenizer', help='tokenizers').add_subparsers(dest='action', required=True)
  train_tok = tokenizer.add_parser('train', help='train a SentencePiece model on a data source')
  common(train_tok)
  train_tok.add_argument('--from', dest='source_globs', nargs='+', metavar='GLOB',
                         help='local text or JSONL files instead of the config\'s data source')
  train_tok.add_argument('--vocab-size', type=int, required=True)
  train_tok.add_argument('--model-type', choices=('unigram', 'bpe'), default='unigram')
  train_tok.add_argument('--sentinels', type=int, default=0, help='add T5\'s <extra_id_0> ... <extra_id_{N-1}>')
  train_tok.add_argument('--max-lines', type=int, default=2_000_000, help='lines sampled for training')
  train_tok.add_argument('--out', required=True, help='model path (PATH.model and PATH.vocab are written)')
  train_tok.set_defaults(fn=cmd_tokenizer_train)

  scaling = sub.add_parser('scaling', help='scaling-law studies').add_subparsers(dest='action', required=True)
  sweep = scaling.add_parser('sweep', help='train a ladder of sizes x token budgets, or IsoFLOP budgets '
                                            '(resumable: finished runs are skipped)')
  sweep.add_argument('--config', default='gpt_tiny', help='the base preset or YAML every point starts from')
  sweep.add_argument('--out', required=True, help='the sweep directory: one run dir per point and sweep.json')
  sweep.add_argument('--sizes', default=None, metavar='WxL,...',
                     help='model widths x depths (head size kept), default 32x2,64x2,96x3,128x4,192x4')
  design = sweep.add_mutually_exclusive_group()
  design.add_argument('--tokens', default=None, metavar='D1,D2', help='token budgets (default 1e5,3e5,1e6)')
  design.add_argument('--budgets', default=None, metavar='C1,C2', help='IsoFLOP: compute budgets in FLOPs, '
                                                                       'each size at D = C/6N')
  sweep.add_argument('--evals', type=int, default=4, help='evaluations (and checkpoints) per run')
  sweep.add_argument('--lr-grid', default=None, metavar='LR1,LR2',
                     help='peak learning rates: every point at each (learning-rate transfer; see plot --lr)')
  sweep.add_argument('--schedule', choices=('cosine', 'wsd'), default='cosine',
                     help='cosine: each point its own run; wsd: warmup-stable-decay, each size one stable run with '
                          'each point a cooldown branched off it')
  sweep.add_argument('--dry-run', action='store_true', help='print the points and stop')
  sweep.add_argument('overrides', nargs='*', metavar='key.sub=value', help='applied to the base config')
  sweep.set_defaults(fn=cmd_scaling_sweep, joins_job=True)

  coord = scaling.add_parser('coord-check', help='mean |activation| of each layer group against width over a few '
                             'steps (Tensor Programs V): flat under mup')
  coord.add_argument('--config', default='gpt_tiny', help='the base preset or YAML (its d_model is the mup base)')
  coord.add_argument('--widths', default='64,128,256,512,1024', help='d_model of each model, comma-separated')
  coord.add_argument('--parametrization', choices=('mup', 'standard'), default='mup')
  coord.add_argument('--lr', type=float, default=3e-3, help='the (deliberately large) AdamW learning rate')
  coord.add_argument('--steps', type=int, default=3, help='optimizer steps on the one fixed batch')
  coord.add_argument('--seeds', type=int, default=3, help='initialisations averaged')
  coord.add_argument('--out', required=True, help='directory for coord_check.png and coord_check.json')
  coord.add_argument('overrides', nargs='*', metavar='key.sub=value', help='applied to the base config')
  coord.set_defaults(fn=cmd_scaling_coord_check)

  collect = scaling.add_parser('collect', help='run dirs -> points CSV (run, step, params, non_embedding_params, '
                                                'tokens, flops, flops_6nd, loss, loss_of)')
  collect.add_argument('runs', nargs='+', metavar='RUN_DIR', help='run dirs (and, with --evaluate, key=value '
                                                                  'overrides such as data.* for another eval set)')
  collect.add_argument('--out', required=True, help='the CSV to write')
  collect.add_argument('--evaluate', nargs='*', metavar='KEY=VALUE', default=None,
                       help='evaluate held-out loss from every checkpoint instead of reading metrics.jsonl, with '
                            'these overrides (e.g. data.* for another eval set)')
  collect.add_argument('--eval', metavar='NAME', help='the loss of this data.evals set (val/NAME/...) instead of '
                       'the validation split\'s')
  collect.add_argument('--metric', choices=('loss', 'bpb'), default='loss',
                       help='loss: nats per token; bpb: bits per UTF-8 byte (compares across tokenizers)')
  collect.add_argument('--tasks', metavar='T1,T2', help='add harness task columns (<task>/<metric>, <task>/task_loss): '
                       'the in-loop records of train.evals, else the checkpoint evaluated')
  collect.add_argument('--tasks-data-dir', type=Path, metavar='DIR', help='local task files, as lm eval --data-dir')
  collect.add_argument('--tasks-limit', type=int, metavar='N', help='N documents per task (as lm eval --subset N and '
                                                                    'train.evals_limit)')
  collect.set_defaults(fn=cmd_scaling_collect, joins_job=True)  # --evaluate runs on the job's devices

  fit = scaling.add_parser('fit', help='fit a scaling law to a points CSV (params,tokens,loss[,flops])')
  fit.add_argument('points', help='CSV of lm scaling collect, or any with params,tokens,loss columns')
  fit.add_argument('--law', choices=('chinchilla', 'kaplan', 'isoflop', 'task'), default='chinchilla',
                   help='chinchilla: E + A/N^alpha + B/D^beta (approach 3); kaplan: power laws in N and on the '
                   'compute frontier; isoflop: parabolas per budget (approach 2); task: a task\'s loss in N and D, '
                   'then its accuracy as a sigmoid of that loss (Bhagia et al. 2024)')
  fit.add_argument('--task', help='--law task: the task (columns <task>/task_loss and <task>/<metric>)')
  fit.add_argument('--metric', default='acc', help='--law task: the accuracy metric (default acc; e.g. acc_norm)')
  fit.add_argument('--target', type=float, nargs='+', default=[], metavar='N D',
                   help='--law task: models (params, tokens) to predict task loss and accuracy for')
  fit.add_argument('--params', choices=('total', 'non_embedding'), default='total', help='which N to fit')
  fit.add_argument('--bootstrap', type=int, default=0, metavar='N',
                   help='chinchilla, task: N resamples for 95%% intervals')
  fit.add_argument('--budget', type=float, nargs='+', default=[], metavar='C',
                   help='compute budgets (FLOPs) to give compute-optimal N, D and tokens per parameter for')
  fit.add_argument('--json', action='store_true', help='print the fit as JSON')
  fit.add_argument('--out', default=None, help='also write the JSON fit here (lm scaling plot --fit reads it)')
  fit.set_defaults(fn=cmd_scaling_fit)

  plot = scaling.add_parser('plot', help='loss against compute, IsoFLOP profiles, compute-optimal N and D')
  plot.add_argument('points', help='points CSV')
  plot.add_argument('--out', required=True, help='the PNG to write')
  plot.add_argument('--fit', default=None, help='a fit of lm scaling fit --out, drawn over the points')
  plot.add_argument('--params', choices=('total', 'non_embedding'), default='total', help='which N to plot')
  plot.add_argument('--lr', action='store_true', help='final loss against learning rate, a curve per width '
                                                      '(a sweep with --lr-grid)')
  plot.set_defaults(fn=cmd_scaling_plot)

  data = sub.add_parser('data', help='datasets').add_subparsers(dest='action', required=True)
  build = data.add_parser('build', help='local JSONL or text files -> a TFDS dataset (ArrayRecord)')
  build.add_argument('--name', required=True, help='dataset name, lower snake_case')
  build.add_argument('--from', dest='source_globs', nargs='+', required=True, metavar='GLOB')
  build.add_argument('--data-dir', required=True, help='TFDS data directory (a local path or gs:// URI)')
  build.add_argument('--text-key', default='text', help='JSONL field holding the text')
  build.add_argument('--val-fraction', type=float, default=0.02)
  build.add_argument('--max-chars', type=int, default=2048, help='text files are cut into records of this size')
  build.set_defaults(fn=cmd_data_build)
  return parser


# Commands that join a multi-process job first (lm.distributed).
DEVICE_COMMANDS = ('train', 'finetune', 'info', 'convert', 'generate', 'eval')


def main(argv: Sequence[str] | None = None) -> int:
  from lm.parallel.chips import quiet_libtpu
  quiet_libtpu()  # before anything starts JAX's backends
  args = build_parser().parse_args(argv)
  try:
    if args.command in DEVICE_COMMANDS or getattr(args, 'joins_job', False):
      from lm.distributed import initialize
      initialize()
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
