"""`lm scaling cbs`: the empirical critical batch size at a run's checkpoints (Merrill et al. 2025,
arXiv:2505.23971).

At each checkpoint S, one branch per multiplier k continues the run's whole state (`train.branch_from`) with k times
its batch B (a batch ramp point at S) and its learning rate times sqrt(k) (Adam's rule; `lr_rule` linear: k; none),
for the same T tokens: ceil(T / (k B L)) steps on the run's own schedule. A branch's loss is the held-out loss after
them (`val_loss`), or its training loss over the last quarter of its steps (`loss`). The critical batch size at S is
the largest batch whose loss, and every smaller batch's, stays within `tolerance` (relative) of the smallest batch's:
up to it, a larger batch trains in fewer steps for no more tokens. Branches live in OUT/step_S/k_K; a finished one is reused.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from etils import epath

from lm.config import ConfigError, batch_schedule, from_dict, merge, parse_overrides
from lm.jobs.scaling.sweep import finished
from lm.storage.run_dir import CHECKPOINTS, checkpoints, read_config
from lm.train.logging import read_metrics

CBS_JSON, CBS_TABLE, CBS_PLOT = 'cbs.json', 'cbs.md', 'cbs.png'
METRICS = ('val_loss', 'loss')


@dataclass(frozen=True)
class Request:
  run: str
  at: tuple[int, ...]
  multipliers: tuple[int, ...]
  tokens: int
  out: str
  lr_rule: str = 'sqrt'
  tolerance: float = 0.01
  metric: str = 'val_loss'


def _check(request: Request, saved: Sequence[int], params_only: bool) -> None:
  """One line for what cannot be measured."""
  r = request
  if params_only:
    raise ConfigError(f'lm scaling cbs: {r.run} holds params only (an imported model), no optimizer state to branch; '
                      f'measure a run lm trained')
  if missing := [s for s in r.at if s not in saved]:
    raise ConfigError(f'lm scaling cbs --at: {r.run}/{CHECKPOINTS} holds no step {missing[0]} (it holds '
                      f'{", ".join(map(str, saved))}); name those, or keep more with train.checkpoint.at')
  if sorted(set(r.multipliers)) != list(r.multipliers) or r.multipliers[0] != 1 or len(r.multipliers) < 2:
    raise ConfigError(f'lm scaling cbs --multipliers {",".join(map(str, r.multipliers))}: give increasing whole '
                      f'multiples starting at 1, e.g. 1,2,4,8')
  if r.tokens < 1 or not r.tolerance > 0 or r.metric not in METRICS:
    raise ConfigError(f'lm scaling cbs: --tokens must be >= 1, --tolerance > 0 and --metric one of '
                      f'{", ".join(METRICS)}')


def _branch(request: Request, source: Any, at: int, k: int) -> tuple[epath.Path, list[str], int]:
  """(run dir, overrides, steps) of the branch at `at` with `k` times the batch."""
  t = source.train
  steps = math.ceil(request.tokens / (k * t.global_batch * source.data.seq_len))
  run_dir = epath.Path(request.out) / f'step_{at}' / f'k_{k}'
  length = source.optim.decay_steps or t.steps  # the source's schedule, whatever the branch's length
  overrides = [f'train.branch_from={request.run}/{CHECKPOINTS}/{at}', f'train.global_batch={k * t.global_batch}',
               f'train.batch_ramp_lr={request.lr_rule}', f'train.steps={at + steps}', f'optim.decay_steps={length}',
               f'train.eval_every={steps}', f'train.checkpoint.every={steps}', f'train.run_dir={run_dir}',
               f'train.eval_batches={t.eval_batches or 1}']
  return run_dir, overrides, steps


def _loss(run_dir: epath.Path, at: int, steps: int, metric: str) -> float:
  records = [r for r in read_metrics(run_dir) if r['step'] > at]
  if metric == 'val_loss':
    return [r['val_loss'] for r in records if 'val_loss' in r][-1]
  losses = [r['loss'] for r in records if 'loss' in r]
  return sum(losses[-max(1, steps // 4):]) / max(1, len(losses[-max(1, steps // 4):]))


def measure(request: Request) -> dict[str, Any]:
  """Trains (or reuses) every branch and returns {'request', 'steps': [{'at', 'rows': [...], 'cbs'}]}."""
  from lm.jobs.pretraining import Pretraining
  run = epath.Path(request.run)
  source = read_config(run)
  saved = checkpoints(run)
  try:
    steps, params_only = saved.all_steps(), saved.is_params_only()
  finally:
    saved.close()
  _check(request, steps, params_only)
  stages = batch_schedule(source)
  if any(after < max(request.at) for after, _ in stages[1:]):
    raise ConfigError(f'lm scaling cbs: {run} changes its batch (train.batch_ramp) before step {max(request.at)}; '
                      f'measure at steps where it still takes train.global_batch={source.train.global_batch}')
  result = []
  for at in request.at:
    rows = []
    for k in request.multipliers:
      run_dir, overrides, n = _branch(request, source, at, k)
      if finished(run_dir, at + n):
        print(f'step {at}, batch x{k}: done, reused {run_dir}', flush=True)
      else:
        print(f'step {at}, batch x{k}: {n} steps in {run_dir}', flush=True)
        Pretraining(from_dict(merge(source.to_dict(), parse_overrides(overrides)))).run()
      rows.append({'multiplier': k, 'batch': k * source.train.global_batch, 'steps': n,
                   'tokens': n * k * source.train.global_batch * source.data.seq_len,
                   'loss': _loss(run_dir, at, n, request.metric)})
    within = itertools.takewhile(lambda row: row['loss'] <= rows[0]['loss'] * (1 + request.tolerance), rows)
    result.append({'at': at, 'rows': rows, 'cbs': [row['batch'] for row in within][-1]})
  return {'request': request.__dict__, 'seq_len': source.data.seq_len, 'steps': result}


def table(result: dict[str, Any]) -> str:
  """Markdown: a row per (step, batch), the critical batch of each step marked."""
  r = result['request']
  lines = [f'Critical batch size of {r["run"]}: {r["metric"]} after {r["tokens"]:,} tokens per branch, learning rate '
           f'by {r["lr_rule"]}, within {r["tolerance"]:.1%} of the smallest batch\'s', '',
           f'| step | batch | steps | tokens | {r["metric"]} | |', '|---|---|---|---|---|---|']
  for at in result['steps']:
    for row in at['rows']:
      mark = 'critical' if row['batch'] == at['cbs'] else ''
      lines.append(f'| {at["at"]} | {row["batch"]} | {row["steps"]} | {row["tokens"]:,} | {row["loss"]:.4f} | {mark} |')
  return '\n'.join(lines) + '\n'


def write(result: dict[str, Any], out: str) -> list[epath.Path]:
  """OUT/cbs.json, cbs.md and cbs.png (the loss against the batch, a line per step, each CBS marked)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  root = epath.Path(out)
  root.mkdir(parents=True, exist_ok=True)
  (root / CBS_JSON).write_text(json.dumps(result, indent=2) + '\n')
  (root / CBS_TABLE).write_text(table(result))
  fig, ax = plt.subplots(figsize=(6, 4))
  for at in result['steps']:
    batches, losses = [row['batch'] for row in at['rows']], [row['loss'] for row in at['rows']]
    line, = ax.plot(batches, losses, marker='o', label=f'step {at["at"]}: CBS {at["cbs"]}')
    ax.plot([at['cbs']], [losses[batches.index(at['cbs'])]], marker='*', markersize=14, color=line.get_color())
  ax.set_xscale('log', base=2)
  ax.set_xlabel('batch (sequences)')
  ax.set_ylabel(f'{result["request"]["metric"]} after the same tokens')
  ax.legend()
  fig.tight_layout()
  fig.savefig(str(root / CBS_PLOT), dpi=100)
  plt.close(fig)
  return [root / CBS_JSON, root / CBS_TABLE, root / CBS_PLOT]
