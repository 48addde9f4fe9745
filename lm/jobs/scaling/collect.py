"""`lm scaling collect`: run dirs -> scaling points, one per (run, evaluation).

A run's size comes from its checkpoint's config (the config.yaml when it has no checkpoint yet); its
held-out losses from the `val_loss` records of metrics.jsonl, or with `evaluate`, from each checkpoint
restored through orbax onto the devices present and evaluated on the run's validation split (or on
another, through `data.*` overrides), one compiled program per run for all its checkpoints. Tokens are the row
tokens trained on (step x batch x length; an imported revision series', `lm convert --from-hf-series`, its own);
`flops` is our accounting's count for them and `flops_6nd` 6ND with N the params a token runs (the total
for a dense model, the active for routed experts). Step 0 is
no point: an untrained model says nothing of a law. With `tasks`, each point also gets a `<task>/<metric>`
column per harness metric and `<task>/task_loss`: from the run's in-loop records of that step (`train.harness.tasks`)
where they exist, else by evaluating that step's checkpoint (`lm.jobs.evals.run`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from etils import epath

from lm.assembly import accounting, assemble
from lm.config import Config, ConfigError, batch_at, batch_schedule, from_dict, merge, parse_overrides, tokens_after
from lm.models import abstract_params, build_model
from lm.storage.run_dir import CONFIG, read_series
from lm.storage.source import ModelSource
from lm.jobs.scaling.points import size_label
from lm.jobs.scaling.sweep import sweep_runs
from lm.train.held_out import HeldOut
from lm.train.logging import read_metrics

DEFAULT_EVAL_BATCHES = 20  # --evaluate on a run that trained without evaluation


def _sizes(config: Config) -> dict[str, float]:
  """Total, non-embedding and active params, the expert layout, and training FLOPs per row token, from abstract
  params."""
  params = abstract_params(build_model(config.model))
  counts = accounting.count_params(params, config.model)
  m = config.model.moe
  return {'params': counts['total'], 'non_embedding_params': counts['non_embedding'],
          'active_params': counts.get('active', counts['total']),
          'active_non_embedding_params': counts.get('active_non_embedding', counts['non_embedding']),
          'experts': m.num_experts, 'experts_per_token': m.experts_per_token if m.num_experts else 0,
          'granularity': config.model.resolved_d_ff / (m.expert_d_ff or config.model.resolved_d_ff)
          if m.num_experts else 0,
          'flops_per_token': accounting.flops_per_token(params, config.model, config.data.seq_len,
                                                        config.train.causal_attention_flops)}


def _row(run: str, step: int, config: Config, sizes: dict[str, float], loss: float, tokens: int | None = None
         ) -> dict[str, Any]:
  """`tokens`: those behind the step where the run says (an imported series), else its batches' (a batch ramp's
  stages each at their own batch)."""
  stages = batch_schedule(config)
  tokens = tokens_after(stages, step, config.data.seq_len) if tokens is None else tokens
  batch = batch_at(stages, max(step, 1))  # the batch the step was taken at
  return {'run': run, 'size': size_label(sizes['params']), 'step': step,
          **{k: v for k, v in sizes.items() if k != 'flops_per_token'}, 'tokens': tokens,
          'flops': sizes['flops_per_token'] * tokens, 'flops_6nd': 6 * sizes['active_params'] * tokens,
          'loss': loss, 'width': config.model.d_model, 'learning_rate': config.optim.learning_rate,
          'global_batch': batch, 'batch_tokens': batch * config.data.seq_len,
          # data.unique_tokens: the cap; without one every token trained on is new
          'unique_tokens': min(config.data.unique_tokens or tokens, tokens),
          'epochs': tokens / min(config.data.unique_tokens or tokens, tokens) if tokens else 0.0}


def loss_column(eval_set: str | None = None, metric: str = 'loss') -> str:
  """The metrics.jsonl record of a held-out set's metric: val_loss, val_bpb, val/NAME/loss, val/NAME/bpb."""
  return f'val_{metric}' if eval_set is None else f'val/{eval_set}/{metric}'


def held_out_columns(run_dir: epath.Path) -> dict[int, dict[str, float]]:
  """step -> every held-out metric metrics.jsonl records at it (val_loss, val_bpb, val/NAME/loss, val/NAME/bpb):
  what a loss-to-loss law pairs."""
  columns: dict[int, dict[str, float]] = {}
  for r in read_metrics(run_dir):
    held = {k: float(v) for k, v in r.items()
            if (k in ('val_loss', 'val_bpb') or k.startswith('val/')) and v is not None}
    if held and r['step'] > 0:
      columns.setdefault(int(r['step']), {}).update(held)
  return columns


def recorded_losses(run_dir: epath.Path, column: str = 'val_loss') -> dict[int, float]:
  """step -> `column` of metrics.jsonl (the last record of a step wins: a resumed run rewrites it)."""
  return {int(r['step']): float(r[column]) for r in read_metrics(run_dir) if column in r and r['step'] > 0}


def evaluated_losses(run_dir: epath.Path, config: Config, eval_set: str | None = None,
                     metric: str = 'loss') -> dict[int, float]:
  """step -> a held-out set's `metric` (the validation split's, or the `data.evals` set `eval_set`'s) for every
  checkpoint, evaluated afresh on the devices present."""
  if not config.train.eval_batches:
    config = from_dict(merge(config.to_dict(), {'train': {'eval_batches': DEFAULT_EVAL_BATCHES}}))
  source = ModelSource(run_dir, need_params=False)
  steps = [s for s in source.steps if s > 0]
  if not steps:
    raise ConfigError(f'{run_dir} holds no checkpoint to evaluate; train it first, or collect without --evaluate')
  assembly = assemble(config)
  held_out = HeldOut(assembly)
  if eval_set is not None and eval_set not in held_out.sets:
    raise ConfigError(f'--eval {eval_set}: {run_dir} has no data.evals set of that name (it has: '
                      f'{", ".join(held_out.sets) or "none"}); add it with --evaluate data.evals=[...]')
  batches = held_out.validation if eval_set is None else held_out.sets[eval_set]
  return {step: held_out.evaluate(source.params(assembly.mesh, step), batches, config.train.eval_batches)[metric]
          for step in steps}


def task_columns(run_dir: epath.Path, steps: Sequence[int], request: Any) -> dict[int, dict[str, float]]:
  """step -> `<task>/<metric>` of `request.tasks`: recorded in the loop, else evaluated on the step's checkpoint
  (the evaluator built once per run; a step with neither is a ConfigError)."""
  wanted = set(request.tasks)
  columns: dict[int, dict[str, float]] = {step: {} for step in steps}
  for record in read_metrics(run_dir):
    if record['step'] in columns:
      columns[record['step']].update({k.removeprefix('eval/'): float(v) for k, v in record.items()
                                      if k.startswith('eval/') and k.split('/')[1] in wanted and v is not None})
  missing = [step for step in steps if {key.split('/')[0] for key in columns[step]} != wanted]
  if not missing:
    return columns
  from lm.jobs.evals.run import TaskEvaluator, metric_records
  source = ModelSource(run_dir, need_params=False)
  if absent := [step for step in missing if step not in source.steps]:
    raise ConfigError(f'{run_dir} step {absent[0]}: no task records and no checkpoint to evaluate; train with '
                      f'train.harness.tasks=... or keep its checkpoints (train.checkpoint.keep_every)')
  assembly = source.assembly()
  evaluator = TaskEvaluator(assembly, request)
  for step in missing:
    params = source.params(assembly.mesh, step)
    columns[step] = {k.removeprefix('eval/'): v for k, v in metric_records(evaluator(params)).items()}
  return columns


def _expand(paths: Sequence[str]) -> list[str]:
  """Run dirs, a sweep's directory standing for its started runs."""
  runs = []
  for path in paths:
    listed = sweep_runs(path)
    if listed is None:
      runs.append(path)
      continue
    started = [run for run in listed if (epath.Path(run) / CONFIG).is_file()]
    if len(started) < len(listed):
      print(f'{path}: {len(listed) - len(started)} of its {len(listed)} runs have not started; collected the rest',
            flush=True)
    runs += started
  return runs


def collect(run_dirs: Sequence[str], evaluate: bool = False, overrides: Sequence[str] = (),
            tasks: Any = None, eval_set: str | None = None, metric: str = 'loss') -> list[dict[str, Any]]:
  """Every run's points in the order given (a sweep's directory: its runs), by step, their `loss` the held-out
  set's `metric` (`loss_column`, named in column loss_of). `overrides` (e.g. another eval set's `data.*`) apply
  to the runs' configs when evaluating; `tasks` (an `lm.jobs.evals.run.Request`) adds task columns."""
  column = loss_column(eval_set, metric)
  rows = []
  for name in _expand(run_dirs):
    run_dir = epath.Path(name)
    config = ModelSource(run_dir, need_params=False).config
    if evaluate:
      if overrides:
        config = from_dict(merge(config.to_dict(), parse_overrides(list(overrides))))
      losses = evaluated_losses(run_dir, config, eval_set, metric)
    else:
      losses = recorded_losses(run_dir, column)
      if not losses:
        held = f' data.evals=[{eval_set}=...]' if eval_set else ''
        raise ConfigError(f'{run_dir} has no {column} records in metrics.jsonl; evaluate its checkpoints with '
                          f'--evaluate{held}, or train it with train.eval_batches > 0{held}')
    sizes = _sizes(config)
    extra = {} if tasks is None else task_columns(run_dir, sorted(losses), tasks)
    held = {} if evaluate else held_out_columns(run_dir)
    series = read_series(run_dir).get('steps', {})
    rows += [{**_row(str(run_dir), step, config, sizes, loss, series.get(str(step), {}).get('tokens')),
              'loss_of': column, **held.get(step, {}), **extra.get(step, {})}
             for step, loss in sorted(losses.items())]
  return rows
