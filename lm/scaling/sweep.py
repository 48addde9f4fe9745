"""`lm scaling sweep`: a ladder of ordinary runs, one run dir per point, each with its schedule fitted to its
own token budget.

Two designs. A grid: model sizes (width x depth) times token budgets. IsoFLOP (Chinchilla's approach
2): for each compute budget C, every size with D = C / 6N tokens (N: total parameters). A point's
steps are its tokens over the tokens of one batch; its learning-rate decay ends at its last step and
its warmup is at most a tenth of it; it evaluates `evals` times. `DIR/sweep.json` lists the points,
so `lm scaling collect DIR` finds them. Rerunning the sweep skips the finished points (a checkpoint at
the last step) and resumes interrupted ones from their latest checkpoint. Every process of a
multi-host job runs the same loop, each point on all devices: the same command drives a pod.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from etils import epath

from lm.assembly import accounting
from lm.config import Config, ConfigError, from_dict, merge, parse_overrides
from lm.models import abstract_params, build_model, check_config
from lm.run_dir import CHECKPOINTS, checkpoints

SWEEP = 'sweep.json'
# The default ladder on the embedded corpus: 5 sizes (42k to 1.9M params) x 3 token budgets with gpt_tiny's
# batch and context, about a quarter of an hour on a 2-core CPU.
DEFAULT_SIZES = ((32, 2), (64, 2), (96, 3), (128, 4), (192, 4))
DEFAULT_TOKENS = (100_000, 300_000, 1_000_000)


@dataclass(frozen=True)
class Point:
  label: str
  width: int
  depth: int
  heads: int
  params: int
  steps: int
  tokens: int  # steps x batch x length: the budget rounded to whole steps
  overrides: tuple[str, ...]


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
  """`64x2,128x4` -> ((64, 2), (128, 4)): width x depth."""
  sizes = []
  for item in text.split(','):
    width, sep, depth = item.strip().partition('x')
    if not (sep and width.isdigit() and depth.isdigit() and int(width) > 0 and int(depth) > 0):
      raise ConfigError(f'--sizes {item!r} is not WIDTHxDEPTH; write e.g. --sizes 64x2,128x4')
    sizes.append((int(width), int(depth)))
  return tuple(sizes)


def parse_numbers(text: str, flag: str) -> tuple[float, ...]:
  """`1e5,3e5` -> (100000.0, 300000.0), each positive."""
  try:
    values = tuple(float(item) for item in text.split(','))
  except ValueError:
    values = ()
  if not values or any(not v > 0 for v in values):
    raise ConfigError(f'{flag} {text!r} is not a list of positive numbers; write e.g. {flag} 1e5,3e5')
  return values


def _sized(base: Config, width: int, depth: int) -> tuple[Config, int]:
  """The base config at this width and depth (head size kept), and its total parameters."""
  head_dim = base.model.resolved_head_dim
  heads = max(1, width // head_dim)
  if width % heads:
    raise ConfigError(f'width {width} does not split into heads of {head_dim}; pick widths that are multiples '
                      f'of {head_dim}')
  config = check_config(from_dict(merge(base.to_dict(), {'model': {'d_model': width, 'num_layers': depth,
                                                                    'num_heads': heads, 'num_kv_heads': None,
                                                                    'head_dim': None}})))
  return config, accounting.count_params(abstract_params(build_model(config.model)))['total']


def plan(base: Config, sizes: Sequence[tuple[int, int]], tokens: Sequence[float] = (),
         budgets: Sequence[float] = (), evals: int = 4) -> list[Point]:
  """The sweep's points: sizes x `tokens`, or for each compute budget every size at D = C / 6N."""
  if bool(tokens) == bool(budgets):
    raise ConfigError('a sweep takes token budgets (--tokens) or compute budgets (--budgets), one of the two')
  per_step = base.train.global_batch * base.data.seq_len
  points = []
  for width, depth in sizes:
    config, n = _sized(base, width, depth)
    wanted = [(f'C{c:.2g}_d{width}_l{depth}', c / (6 * n)) for c in budgets] or \
             [(f'd{width}_l{depth}_t{d:.3g}', d) for d in tokens]
    for label, d in wanted:
      steps = round(d / per_step)
      if steps < 1:
        print(f'{label}: {d:.3g} tokens is less than one batch of {per_step}; skipped', flush=True)
        continue
      every = -(-steps // evals)  # ceil: at most `evals` evaluations, the last at the last step
      overrides = (f'model.d_model={width}', f'model.num_layers={depth}', f'model.num_heads={config.model.num_heads}',
                   f'train.steps={steps}', f'optim.decay_steps={steps}',
                   f'optim.warmup_steps={min(base.optim.warmup_steps, steps // 10)}',
                   f'train.eval_every={every}', f'train.checkpoint_every={every}', 'train.resume=true')
      points.append(Point(label.replace('+', ''), width, depth, config.model.num_heads, n, steps,
                          steps * per_step, overrides))
  if not points:
    raise ConfigError('every point of the sweep is shorter than one batch; raise the token or compute budgets')
  return sorted(points, key=lambda p: (p.tokens * p.params, p.label))


def finished(run_dir: epath.Path, steps: int) -> bool:
  """The run has its last step's checkpoint."""
  if not (run_dir / CHECKPOINTS).exists():
    return False
  saved = checkpoints(run_dir)
  try:
    return saved.latest_step() == steps
  finally:
    saved.close()


def sweep(base: Config, out: str, points: Sequence[Point]) -> list[str]:
  """Runs every unfinished point under `out`; returns the run dirs in plan order."""
  from lm.distributed import is_main_process
  from lm.pretraining import Pretraining
  root = epath.Path(out)
  if is_main_process():
    root.mkdir(parents=True, exist_ok=True)
    (root / SWEEP).write_text(json.dumps({'base': base.to_dict(), 'points': [asdict(p) for p in points]},
                                         indent=2) + '\n')
  runs = []
  for i, point in enumerate(points, 1):
    run_dir = root / point.label
    runs.append(str(run_dir))
    head = f'[{i}/{len(points)}] {point.label}: N {point.params:,}, D {point.tokens:,}, {point.steps} steps'
    if finished(run_dir, point.steps):
      print(f'{head}: done, skipped', flush=True)
      continue
    print(head, flush=True)
    config = from_dict(merge(base.to_dict(), parse_overrides([*point.overrides, f'train.run_dir={run_dir}'])))
    Pretraining(check_config(config)).run()
  return runs


def sweep_runs(path: str) -> list[str] | None:
  """The run dirs of the sweep at `path` (its sweep.json), or None when it is no sweep."""
  listing = epath.Path(path) / SWEEP
  if not listing.is_file():
    return None
  return [str(epath.Path(path) / p['label']) for p in json.loads(listing.read_text())['points']]
