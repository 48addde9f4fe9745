"""`lm scaling sweep`: a ladder of ordinary runs, one run dir per point, each with its schedule fitted to its
own token budget.

Two designs. A grid: model sizes (width x depth) times token budgets. IsoFLOP (Chinchilla's approach
2): for each compute budget C, every size with D = C / 6N tokens (N: total parameters; the active ones with routed
experts). A point's steps are its tokens over the tokens of one batch; its learning-rate decay ends at its last step and
its warmup is at most a tenth of it; it evaluates `evals` times. `DIR/sweep.json` lists the points,
so `lm scaling collect DIR` finds them. Rerunning the sweep skips the finished points (a checkpoint at
the last step) and resumes interrupted ones from their latest checkpoint. Every process of a
multi-host job runs the same loop, each point on all devices: the same command drives a pod.

With `schedule='wsd'` (Hägele et al. 2024) every point is a warmup-stable-decay run decaying over its last
`optim.decay_fraction`, and the points of one size share their stable phase: one constant-rate run per size
(`<size>_stable`) trains to the largest budget's last step, checkpointing at each budget's decay start, and each
point is a cooldown branched off it there (`train.branch_from`), equal to the straight WSD run of its budget. The
stable run's own losses beside every cooldown's steps, on the same batches, are what a cooldown's prediction pairs
with (`lm scaling predict --paired`). Point dirs keep their names and layout, so `collect`, `fit` and `plot` read
them as before.

With routed experts (a base whose family routes, e.g. moe_tiny), each size also runs at every expert layout
(E, k, G) of `moe` (Krajewski et al. 2024): E x G experts of width d_ff / G, k x G of them per token, so the
granularity G splits experts finer at the same active and total params. IsoFLOP budgets count the active params
(D = C / 6 N_active).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

from etils import epath

from lm.assembly import accounting
from lm.config import Config, ConfigError, from_dict, merge, parse_overrides
from lm.models import abstract_params, build_model
from lm.storage.run_dir import CHECKPOINTS, checkpoints

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
  branch_at: int = 0  # wsd: the decay's first step, where it branches off its size's stable run (0: trained alone)
  learning_rate: float = 0.0  # --lr-grid: this point's peak rate (0: the base config's)
  batch: int = 0  # --batch-grid: this point's train.global_batch (0: the base config's)
  experts: tuple[int, int, int] = ()  # routed experts: (E, k, G) as `plan` reads them; () the base's own MLP
  active: int = 0  # the params one token runs (`params` without routed experts)


@dataclass(frozen=True)
class Stable:
  """A size's shared stable phase (wsd): constant rate to its largest budget's last step, checkpointed at every
  branch point and evaluated at every budget's last step (where its cooldown's held-out loss pairs with it)."""
  label: str
  steps: int
  branches: tuple[int, ...]
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


def parse_experts(text: str) -> tuple[tuple[int, int, int], ...]:
  """`8x2,8x2g4` -> ((8, 2, 1), (8, 2, 4)): E experts x k per token, optionally at granularity G."""
  layouts = []
  for item in text.split(','):
    experts, sep, rest = item.strip().partition('x')
    k, _, g = rest.partition('g')
    if not (sep and experts.isdigit() and k.isdigit() and (g or '1').isdigit() and
            0 < int(k) <= int(experts) and int(g or 1) > 0):
      raise ConfigError(f'--experts {item!r} is not EXk[gG] (E experts, k of them per token, at granularity G); '
                        f'write e.g. --experts 8x2,8x2g4')
    layouts.append((int(experts), int(k), int(g or 1)))
  return tuple(layouts)


def _sized(base: Config, width: int, depth: int, experts: tuple[int, int, int] = ()) -> tuple[Config, dict[str, int]]:
  """The base config at this width and depth (head size kept), with the expert layout (E, k, G) when given, and
  its params (`accounting.count_params`)."""
  head_dim = base.model.resolved_head_dim
  heads = max(1, width // head_dim)
  if width % heads:
    raise ConfigError(f'width {width} does not split into heads of {head_dim}; pick widths that are multiples '
                      f'of {head_dim}')
  model = {'d_model': width, 'num_layers': depth, 'num_heads': heads, 'num_kv_heads': None, 'head_dim': None}
  if experts:
    config = from_dict(merge(base.to_dict(), {'model': model}))
    e, k, g = experts
    if config.model.resolved_d_ff % g:
      raise ConfigError(f'--experts {e}x{k}g{g}: granularity {g} does not divide the experts\' dense width '
                        f'model.d_ff={config.model.resolved_d_ff}; pick G that divides it')
    model['moe'] = {'num_experts': e * g, 'experts_per_token': k * g, 'expert_d_ff': config.model.resolved_d_ff // g}
  config = from_dict(merge(base.to_dict(), {'model': model}))
  return config, accounting.count_params(abstract_params(build_model(config.model)), config.model)


def plan(base: Config, sizes: Sequence[tuple[int, int]], tokens: Sequence[float] = (),
         budgets: Sequence[float] = (), evals: int = 4, schedule: str = 'cosine',
         learning_rates: Sequence[float] = (), experts: Sequence[tuple[int, int, int]] = (),
         batches: Sequence[int] = ()) -> list[Point]:
  """The sweep's points: sizes (each at every expert layout of `experts`) x `tokens`, or for each compute budget
  every size at D = C / 6N (N active); with `schedule` 'wsd', each a warmup-stable-decay run (a size's points warm
  up alike, so they share a stable phase); each at every one of `batches` (labels `..._b<batch>`; a budget's steps
  are its tokens over that batch's) and of `learning_rates` (labels `..._lr<rate>`). Under μP
  every width scales its init and per-param rates from `model.mup.base_width`; its base head dim is the one the
  sizes keep."""
  if bool(tokens) == bool(budgets):
    raise ConfigError('a sweep takes token budgets (--tokens) or compute budgets (--budgets), one of the two')
  points = []
  for (width, depth), layout, batch in ((size, layout, batch) for size in sizes for layout in experts or ((),)
                                        for batch in batches or (0,)):
    per_step = (batch or base.train.global_batch) * base.data.seq_len
    config, counts = _sized(base, width, depth, layout)
    n, active = counts['total'], counts.get('active', counts['total'])
    shape = f'd{width}_l{depth}' + ('_e{}k{}g{}'.format(*layout) if layout else '')
    wanted = [(f'C{c:.2g}_{shape}', c / (6 * active)) for c in budgets] or [(f'{shape}_t{d:.3g}', d) for d in tokens]
    budgeted = []
    for label, d in wanted:
      steps = round(d / per_step)
      if steps < 1:
        print(f'{label}: {d:.3g} tokens is less than one batch of {per_step}; skipped', flush=True)
        continue
      budgeted.append((label + (f'_b{batch}' if batch else ''), steps))
    if not budgeted:
      continue
    shortest = min(steps for _, steps in budgeted)
    for label, steps in budgeted:
      every = -(-steps // evals)  # ceil: at most `evals` evaluations, the last at the last step
      warmup = min(base.optim.warmup_steps, (shortest if schedule == 'wsd' else steps) // 10)
      overrides = (f'model.d_model={width}', f'model.num_layers={depth}', f'model.num_heads={config.model.num_heads}',
                   f'train.steps={steps}', f'optim.decay_steps={steps}', f'optim.warmup_steps={warmup}',
                   f'train.eval_every={every}', f'train.checkpoint.every={every}', 'train.resume=true')
      if batch:
        overrides += (f'train.global_batch={batch}',)
      if layout:
        m = config.model.moe
        overrides += (f'model.moe.num_experts={m.num_experts}', f'model.moe.experts_per_token={m.experts_per_token}',
                      f'model.moe.expert_d_ff={m.expert_d_ff}')
      if base.model.parametrization == 'mup' and base.model.mup.base_head_dim is None:
        overrides += (f'model.mup.base_head_dim={base.model.resolved_head_dim}',)
      branch_at = 0
      if schedule == 'wsd':
        overrides += ('optim.schedule=wsd',)
        branch_at = steps - max(round(base.optim.decay_fraction * steps), 1)  # as the schedule counts its decay
      for lr in learning_rates or (0.0,):
        points.append(Point(label.replace('+', '') + (f'_lr{lr:g}' if lr else ''), width, depth,
                            config.model.num_heads, n, steps, steps * per_step,
                            overrides + ((f'optim.learning_rate={lr:g}',) if lr else ()), branch_at, lr, batch,
                            layout, active))
  if not points:
    raise ConfigError('every point of the sweep is shorter than one batch; raise the token or compute budgets')
  return sorted(points, key=lambda p: (p.tokens * p.active, p.label))


def size_of(point: Point) -> str:
  """'1,234' or, with routed experts, '5,678 (1,234 active)'."""
  return f'{point.params:,}' + (f' ({point.active:,} active)' if point.active != point.params else '')


def stable_label(point: Point) -> str:
  return (f'd{point.width}_l{point.depth}' + ('_e{}k{}g{}'.format(*point.experts) if point.experts else '')
          + (f'_b{point.batch}' if point.batch else '') + (f'_lr{point.learning_rate:g}' if point.learning_rate else '')
          + '_stable')


def _stable_key(point: Point) -> tuple:
  return point.width, point.depth, point.experts, point.learning_rate, point.batch


def stable_runs(points: Sequence[Point], evals: int = 4) -> dict[tuple, Stable]:
  """(width, depth, expert layout, learning rate, batch) -> its stable run, for the sizes whose points branch
  (wsd)."""
  stable = {}
  for key in dict.fromkeys(_stable_key(p) for p in points if p.branch_at):
    mine = [p for p in points if _stable_key(p) == key and p.branch_at]
    steps = max(p.steps for p in mine)
    every = -(-steps // evals)
    shared = [o for o in mine[0].overrides if o.split('=')[0] in ('model.d_model', 'model.num_layers',
                                                                     'model.num_heads', 'optim.warmup_steps',
                                                                     'optim.learning_rate', 'train.global_batch',
                                                                     'model.mup.base_head_dim',
                                                                     'model.moe.num_experts',
                                                                     'model.moe.experts_per_token',
                                                                     'model.moe.expert_d_ff')]
    stable[key] = Stable(stable_label(mine[0]), steps, tuple(sorted({p.branch_at for p in mine})),
                          (*shared, 'optim.schedule=constant', f'train.steps={steps}', f'train.eval_every={every}',
                           f'train.checkpoint.every={every}',
                           f'train.checkpoint.at=[{",".join(str(p.branch_at) for p in mine)}]',
                           f'train.eval_at=[{",".join(str(p.steps) for p in mine)}]', 'train.resume=true'))
  return stable


def tokens_trained(points: Sequence[Point]) -> tuple[int, int]:
  """(tokens the sweep trains, tokens its points would train as independent runs)."""
  per_step = {_stable_key(p): p.tokens // p.steps for p in points}
  stable = stable_runs(points)
  shared = (sum(s.steps * per_step[key] for key, s in stable.items())
            + sum((p.steps - p.branch_at) * (p.tokens // p.steps) for p in points))
  return shared, sum(p.tokens for p in points)


def finished(run_dir: epath.Path, steps: int) -> bool:
  """The run has its last step's checkpoint."""
  if not (run_dir / CHECKPOINTS).exists():
    return False
  saved = checkpoints(run_dir)
  try:
    return saved.latest_step() == steps
  finally:
    saved.close()


def _train(base: Config, run_dir: epath.Path, overrides: Sequence[str], head: str, steps: int) -> None:
  from lm.jobs.pretraining import Pretraining
  if finished(run_dir, steps):
    print(f'{head}: done, skipped', flush=True)
    return
  print(head, flush=True)
  config = from_dict(merge(base.to_dict(), parse_overrides([*overrides, f'train.run_dir={run_dir}'])))
  Pretraining(config).run()


def sweep(base: Config, out: str, points: Sequence[Point], evals: int = 4) -> list[str]:
  """Runs every unfinished point under `out` (a size's stable run, evaluated `evals` times, before its first
  branch); returns the point run dirs in plan order."""
  from lm.distributed import is_main_process
  root = epath.Path(out)
  stable = stable_runs(points, evals)
  trained, alone = tokens_trained(points)
  if is_main_process():
    root.mkdir(parents=True, exist_ok=True)
    (root / SWEEP).write_text(json.dumps({
      'base': base.to_dict(), 'points': [asdict(p) for p in points], 'stable': [asdict(s) for s in stable.values()],
      'tokens_trained': trained, 'tokens_as_independent_runs': alone}, indent=2) + '\n')
  runs = []
  for i, point in enumerate(points, 1):
    run_dir = root / point.label
    runs.append(str(run_dir))
    shared = stable.pop(_stable_key(point), None)
    if shared is not None:
      _train(base, root / shared.label, shared.overrides,
             f'{shared.label}: N {size_of(point)}, {shared.steps} steps at the peak rate, branching at '
             f'{", ".join(map(str, shared.branches))}', shared.steps)
    branch = (f'train.branch_from={root / stable_label(point)}/{CHECKPOINTS}/{point.branch_at}',) \
      if point.branch_at else ()
    _train(base, run_dir, (*point.overrides, *branch),
           f'[{i}/{len(points)}] {point.label}: N {size_of(point)}, D {point.tokens:,}, {point.steps} steps'
           + (f' (from step {point.branch_at})' if point.branch_at else ''), point.steps)
  return runs


def sweep_runs(path: str) -> list[str] | None:
  """The run dirs of the sweep at `path` (its sweep.json), or None when it is no sweep."""
  listing = epath.Path(path) / SWEEP
  if not listing.is_file():
    return None
  return [str(epath.Path(path) / p['label']) for p in json.loads(listing.read_text())['points']]
