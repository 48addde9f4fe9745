"""`train.branch_from`: a new run that continues another run's whole state from one of its checkpoints.

Unlike `train.init_from` (params only, a fresh optimizer at step 0), a branch takes the params, optimizer state
(its step count, Adam's moments, the moving average) and data position of checkpoint S, so its steps from S on
are those of a run that had had its own schedule from the start: the cooldowns of a warmup-stable-decay ladder
branch off one stable run this way. The branch may change the schedule's length and decay (`train.steps`,
`optim.decay_steps`, `decay_fraction`, `decay_shape`, `min_lr_ratio`, `schedule`), its batch (a larger multiple
of the source's: a batch ramp point at S, the learning rate scaled by `train.batch_ramp_lr`; `lm scaling cbs`
branches so) and what a resume may; its learning rate must equal the source's at every step before S, so the
steps already taken are its own. It starts
its metrics.jsonl with the source's records up to S, and its config.yaml names the checkpoint it branched from.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np
from etils import epath

from lm.assembly import Assembly
from lm.assembly.optim import learning_rate_schedule
from lm.assembly.state import TrainState
from lm.storage.checkpoint import config_mismatch, with_defaults
from lm.config import Config, ConfigError, batch_schedule, from_dict, ramp_rates
from lm.distributed import is_main_process
from lm.storage.run_dir import CHECKPOINTS, CONFIG, checkpoints, read_config
from lm.train.logging import METRICS, read_metrics

# What a branch may set otherwise than its source: the schedule's length and decay.
SCHEDULE_FIELDS = frozenset({'schedule', 'decay_steps', 'decay_fraction', 'decay_shape', 'min_lr_ratio'})
# Training fields besides the seed, moving average and batch (checked on their own) that shape each step.
STEP_FIELDS = ('z_loss',)


def _source(spec: str) -> tuple[epath.Path, int | None]:
  """(run dir, step or None for its latest) of `RUN` or `RUN/checkpoints/STEP`."""
  path = epath.Path(spec)
  if path.parent.name == CHECKPOINTS and path.name.isdigit():
    return path.parent.parent, int(path.name)
  if (path / CHECKPOINTS).is_dir():
    return path, None
  raise ConfigError(f'train.branch_from={spec} is neither a training run dir (holding {CHECKPOINTS}/) nor one of '
                    f'its checkpoints (RUN/{CHECKPOINTS}/STEP)')


def resolve_branch(config: Config) -> Config:
  """`config` with `train.branch_from` naming its checkpoint (RUN/checkpoints/STEP), once everything the saved
  config tells is checked: the step exists, the model, data order, seed, moving average, batch and optimizer
  (but for the schedule's length and decay) are the source's, and so is the learning rate at every step before
  the branch. A new `train.global_batch` (a multiple of the source's) becomes a batch ramp point at the branch
  step (`with_new_batch`). A run resuming its own checkpoints keeps what its config.yaml names."""
  spec = config.train.branch_from
  if spec is None:
    return config
  own = config.run_dir
  if (own / CHECKPOINTS).is_dir() and _steps(own) and (own / CONFIG).is_file():
    return _as_recorded(config, read_config(own))
  run, step = _source(spec)
  saved_steps = _steps(run)
  if not saved_steps:
    raise ConfigError(f'train.branch_from={spec}: {run}/{CHECKPOINTS} holds no checkpoint yet; train it first')
  step = saved_steps[-1] if step is None else step
  if step not in saved_steps:
    raise ConfigError(f'train.branch_from={spec}: {run}/{CHECKPOINTS} holds no step {step} (it holds '
                      f'{", ".join(map(str, saved_steps))}); name one of those')
  if step >= config.train.steps:
    raise ConfigError(f'train.branch_from={spec}: the branch starts at step {step}, not before train.steps='
                      f'{config.train.steps}; raise train.steps or branch from an earlier checkpoint')
  source = checkpoints(run)
  try:
    saved = with_defaults(source.saved_config(step))
  finally:
    source.close()
  source_config = from_dict(saved)
  config = with_new_batch(config, source_config, step)
  _check_same(config, saved, source_config, run, step)
  return _with_branch(config, str(run / CHECKPOINTS / str(step)))


def with_new_batch(config: Config, source: Config, step: int) -> Config:
  """A branch at `step` whose `train.global_batch` differs from its source's: the source's batch schedule up to the
  step, then the new batch (`train.batch_ramp`, in steps), its learning rate scaled by `train.batch_ramp_lr`; the
  source's microbatches keep their rows. The same config when the batch is the source's."""
  t, theirs = config.train, source.train
  if t.global_batch == theirs.global_batch:
    return config
  stages = batch_schedule(source)
  before = [(after, batch) for after, batch in stages[1:] if after < step]
  now = ([theirs.global_batch] + [batch for _, batch in before])[-1]
  if t.batch_ramp or t.global_batch <= now or t.global_batch % theirs.global_batch:
    raise ConfigError(f'train.branch_from at step {step}: train.global_batch={t.global_batch} must be a multiple of '
                      f'the source\'s {theirs.global_batch}, above its {now} at the branch, without a '
                      f'train.batch_ramp of its own; ramp from the branch in steps after it')
  ramp = tuple(f'{batch}@{after}' for after, batch in before) + (f'{t.global_batch}@{step}',)
  return dataclasses.replace(config, train=dataclasses.replace(
    t, global_batch=theirs.global_batch, microbatches=theirs.microbatches, batch_ramp=ramp,
    batch_ramp_unit='steps'))


def _as_recorded(config: Config, recorded: Config) -> Config:
  """A branch resuming its own checkpoints: the checkpoint and batch schedule its config.yaml names (the command
  that started it asked for the batch its ramp ends at)."""
  if not recorded.train.branch_from:
    return config
  t, kept = config.train, recorded.train
  if t.global_batch != kept.global_batch and not t.batch_ramp and t.global_batch == batch_schedule(recorded)[-1][1]:
    t = dataclasses.replace(t, global_batch=kept.global_batch, microbatches=kept.microbatches,
                            batch_ramp=kept.batch_ramp, batch_ramp_unit=kept.batch_ramp_unit)
  return dataclasses.replace(config, train=dataclasses.replace(t, branch_from=kept.branch_from))


def _check_same(config: Config, saved: dict, source: Config, run: epath.Path, step: int) -> None:
  """The branch shares its source's (`saved`, as a dict and as `source`) model, data order, seed, optimizer and
  batch, and its learning rate before the branch step."""
  ours = config.to_dict()
  mismatch = config_mismatch(saved, ours)
  differ = [f'optim.{k}' for k in sorted(set(ours['optim']) - SCHEDULE_FIELDS) if saved['optim'][k] != ours['optim'][k]]
  differ += [f'train.{k}' for k in STEP_FIELDS if saved['train'][k] != ours['train'][k]]
  taken = lambda c: [stage for stage in batch_schedule(c) if stage[0] < step]  # the batches of the steps taken
  differ += ['train.global_batch or train.batch_ramp'] if taken(config) != taken(source) else []
  if mismatch or differ:
    fields = (mismatch[1] if mismatch else []) + differ
    raise ConfigError(f'train.branch_from={run}/{CHECKPOINTS}/{step} was trained with other settings (differs in '
                      f'{", ".join(fields)}); a branch may change only the schedule\'s length and decay, the batch '
                      f'and what a resume may')
  # Every other optimizer field is the source's (checked above).
  source_optim = dataclasses.replace(config.optim, **{k: saved['optim'][k] for k in SCHEDULE_FIELDS})
  theirs = learning_rate_schedule(source_optim, saved['train']['steps'], ramp_rates(source))
  mine = learning_rate_schedule(config.optim, config.train.steps, ramp_rates(config))
  counts = jnp.arange(step)
  applied = lambda schedule: np.broadcast_to(np.asarray(schedule(counts), np.float32), counts.shape)  # as the step
  apart = np.flatnonzero(applied(theirs) != applied(mine))
  if apart.size:
    raise ConfigError(f'train.branch_from={run}/{CHECKPOINTS}/{step}: this run\'s learning rate differs from the '
                      f'source\'s from step {int(apart[0]) + 1} (the source took those steps at its own): branch at '
                      f'or before this run\'s decay start, with the same warmup and peak')


def _steps(run: epath.Path) -> list[int]:
  saved = checkpoints(run)
  try:
    return saved.all_steps()
  finally:
    saved.close()


def _with_branch(config: Config, spec: str) -> Config:
  return dataclasses.replace(config, train=dataclasses.replace(config.train, branch_from=spec))


def branch_state(assembly: Assembly, config: Config, data: Any) -> TrainState:
  """The state of the checkpoint `config.train.branch_from` names (resolved), placed on the assembly's shardings,
  `data` moved to its position; the run dir starts its metrics with the source's records up to that step."""
  run, step = _source(config.train.branch_from)
  source = checkpoints(run)
  try:
    state = source.restore(step, assembly.abstract_state, config.to_dict(), data)
  finally:
    source.close()
  if is_main_process():
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / METRICS).write_text(''.join(json.dumps(r) + '\n' for r in read_metrics(run) if r['step'] <= step))
  print(f'branched from {run}/{CHECKPOINTS}/{step}', flush=True)
  return state
