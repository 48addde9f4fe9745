"""Optimizers from optax (AdamW, Adafactor, Lion, Muon, schedule-free AdamW) on warmup + cosine/linear/
warmup-stable-decay schedules, after global-norm clipping, with a weight-decay mask and an optional moving
average of the params."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax.sharding import PartitionSpec
from optax.contrib import ScheduleFreeState

from lm.config import ConfigError, ModelConfig, OptimConfig
from lm.parallel.rules import path_names


def decay_schedule(shape: str, peak: float, ratio: float, steps: int) -> optax.Schedule:
  """From `peak` to end = `ratio` x peak over `steps` steps (then `end`): with progress p = step / steps, linear
  peak + (end - peak) p; sqrt end + (peak - end)(1 - sqrt p); cosine end + (peak - end)(1 + cos pi p) / 2."""
  end = peak * ratio
  if shape == 'linear':
    return optax.linear_schedule(peak, end, steps)
  if shape == 'cosine':
    return optax.cosine_decay_schedule(peak, steps, alpha=ratio)
  return lambda count: end + (peak - end) * (1 - jnp.sqrt(jnp.clip(count / steps, 0.0, 1.0)))


def learning_rate_schedule(cfg: OptimConfig, total_steps: int, ramp: Sequence[tuple[int, float]] = ()
                           ) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then a cosine or linear decay to `min_lr_ratio` x peak at the schedule's
  length (`decay_steps`, default `total_steps`), or constant; `wsd` stays at the peak until the last
  `decay_fraction` of the length, then decays in `decay_shape`. `ramp`: (after count, factor) points of a batch
  ramp (`lm.config.ramp_rates`); from each, the rate is the schedule's times its factor."""
  schedule = _base_schedule(cfg, total_steps)
  if not ramp:
    return schedule

  def ramped(count: Any) -> Any:
    factor = jnp.ones_like(jnp.asarray(count), jnp.float32)
    for after, value in ramp:
      factor = jnp.where(count >= after, value, factor)
    return schedule(count) * factor
  return ramped


def _base_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  peak, warmup, length = cfg.learning_rate, cfg.warmup_steps, cfg.decay_steps or total_steps
  if cfg.schedule == 'wsd':
    decay = max(round(cfg.decay_fraction * length), 1)
    parts = [optax.constant_schedule(peak), decay_schedule(cfg.decay_shape, peak, cfg.min_lr_ratio, decay)]
    boundaries = [length - decay]
  elif cfg.schedule == 'constant':
    parts, boundaries = [optax.constant_schedule(peak)], []
  else:
    parts, boundaries = [decay_schedule(cfg.schedule, peak, cfg.min_lr_ratio, max(length - warmup, 1))], []
  if warmup:
    parts, boundaries = [optax.linear_schedule(0.0, peak, warmup), *parts], [warmup, *boundaries]
  return optax.join_schedules(parts, boundaries) if boundaries else parts[0]


def decay_mask(params: Any, exclude: tuple[str, ...]) -> Any:
  """True where weight decay applies: every parameter whose path names none of `exclude`."""
  def applies(path: tuple, _: Any) -> bool:
    return not set(path_names(path)) & set(exclude)
  return jax.tree_util.tree_map_with_path(applies, params)


class ParamsEmaState(NamedTuple):
  """The moving average of the params, undebiased (optax.ema's state: its count and average)."""
  average: optax.EmaState


def params_ema(decay: float) -> optax.GradientTransformation:
  """Passes the updates through unchanged and keeps an exponential moving average of the params they make
  (the chain's last transform): a_t = decay a_(t-1) + (1 - decay) params_t from a_0 = 0, read debiased
  (`ema_params`), so it is the decay-weighted mean of the params after each update so far."""
  ema = optax.ema(decay, debias=False)

  def init(params: Any) -> ParamsEmaState:
    return ParamsEmaState(ema.init(params))

  def update(updates: Any, state: ParamsEmaState, params: Any = None) -> tuple[Any, ParamsEmaState]:
    _, average = ema.update(optax.apply_updates(params, updates), state.average)
    return updates, ParamsEmaState(average)

  return optax.GradientTransformation(init, update)


def ema_params(opt_state: Any, decay: float) -> Any:
  """The params' moving average held in `opt_state` (of an optimizer made with `ema_decay=decay`), debiased."""
  (state,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ParamsEmaState))
              if isinstance(s, ParamsEmaState)]
  correction = 1 - decay ** state.average.count.astype(jnp.float32)
  return jax.tree.map(lambda a: (a / jnp.maximum(correction, 1e-12)).astype(a.dtype), state.average.ema)


HIDDEN = frozenset({'heads', 'kv_heads', 'mlp'})  # with 'embed': the axes of a hidden (residual-stream) matrix


def muon_dimensions(axes: Any) -> Any:
  """Per param (a tree of logical axes, as the models declare them), Muon's dimension numbers for hidden
  matrices (the residual stream's `embed` axis and a `heads`, `kv_heads` or `mlp` axis) and None for the rest
  (embeddings, the readout, norms, biases: AdamW). The input side is the reduction: `embed` unless it is the
  last axis (an output projection); a scanned `layers` axis and routed experts' `experts` axis stay batch axes
  (each expert its own matrix)."""
  def dimensions(names: tuple) -> optax.contrib.MuonDimensionNumbers | None:
    if 'embed' not in names or not HIDDEN & set(names):
      return None
    matrix = [i for i, name in enumerate(names) if name not in ('layers', 'experts')]
    embed = names.index('embed')
    reduction = [i for i in matrix if i != embed] if embed == matrix[-1] else [embed]
    return optax.contrib.MuonDimensionNumbers(tuple(reduction), tuple(i for i in matrix if i not in reduction))
  return jax.tree.map(lambda spec: dimensions(tuple(spec)), axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _with_fixed(view: Any, params: Any) -> Any:
  """A view made of optimizer state, with the params the optimizer keeps no state of (optax.MaskedNode in it)
  as they are."""
  return jax.tree.map(lambda p, v: p if isinstance(v, optax.MaskedNode) else v, params, view)


def schedule_free_params(opt_state: Any, params: Any) -> Any:
  """Schedule-free AdamW's params for evaluation and export (its averaged sequence x, not the point y the
  gradients were taken at), from the state of an optimizer made with `name=schedule_free_adamw`."""
  (state,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, ScheduleFreeState))
              if isinstance(s, ScheduleFreeState)]
  held = jax.tree.map(lambda p, z: z if isinstance(z, optax.MaskedNode) else p, params, state.z)  # without fixed ones
  evaluated = jax.tree.map(lambda y, x: x.astype(y.dtype), held, optax.contrib.schedule_free_eval_params(state, held))
  return _with_fixed(evaluated, params)


def base_optimizer(cfg: OptimConfig, schedule: optax.Schedule, axes: Any = None) -> optax.GradientTransformation:
  """`optim.name` on the schedule, weight decay masked by `decay_exclude`; Muon needs the params' logical `axes`."""
  mask = lambda params: decay_mask(params, cfg.decay_exclude)
  if cfg.name == 'adafactor':
    return optax.adafactor(schedule, min_dim_size_to_factor=cfg.factored_min_dim, decay_rate=cfg.decay_rate,
                           multiply_by_parameter_scale=cfg.parameter_scale,
                           clipping_threshold=cfg.clipping_threshold or None,
                           weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=mask)
  if cfg.name == 'lion':
    return optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask)
  if cfg.name == 'muon':
    if axes is None:
      raise ValueError('muon needs the params\' logical axes to tell hidden matrices from the rest')
    return optax.contrib.muon(schedule, ns_steps=cfg.ns_steps, beta=cfg.muon_momentum, eps=cfg.eps,
                              weight_decay=cfg.weight_decay, weight_decay_mask=mask, adam_b1=cfg.b1, adam_b2=cfg.b2,
                              muon_weight_dimension_numbers=muon_dimensions(axes),
                              consistent_rms=cfg.muon_rms or None)
  if cfg.name == 'schedule_free_adamw':
    # optax.contrib.schedule_free_adamw's inner AdamW (no momentum), with the decay mask it does not take
    adamw = optax.chain(optax.scale_by_rms(decay=cfg.b2, eps=cfg.eps, eps_in_sqrt=False, bias_correction=True),
                        optax.add_decayed_weights(cfg.weight_decay, mask), optax.scale_by_learning_rate(schedule))
    return optax.contrib.schedule_free(adamw, schedule, b1=cfg.b1, weight_lr_power=cfg.weight_lr_power)
  return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)


def grouped_optimizer(cfg: OptimConfig, schedule: optax.Schedule, axes: Any = None, multipliers: Any = None
                      ) -> optax.GradientTransformation:
  """`base_optimizer`, or with per-param (lr, eps, weight decay) `multipliers` (`lm.models.parametrization`) one
  per distinct triple on its params (optax.multi_transform): its schedule x lr, eps x eps, weight decay x decay."""
  is_triple = lambda x: isinstance(x, tuple)
  groups = sorted(set(jax.tree.leaves(multipliers, is_leaf=is_triple)))
  if groups in ([], [(1.0, 1.0, 1.0)]):
    return base_optimizer(cfg, schedule, axes)
  label = lambda group: 'lr {:g} eps {:g} decay {:g}'.format(*group)
  transforms = {label((lr, eps, decay)): base_optimizer(
    dataclasses.replace(cfg, eps=cfg.eps * eps, weight_decay=cfg.weight_decay * decay),
    lambda count, lr=lr: schedule(count) * lr, axes) for lr, eps, decay in groups}
  return optax.multi_transform(transforms, jax.tree.map(label, multipliers, is_leaf=is_triple))


GROUPED_RATES = ('adamw', 'lion', 'adafactor')  # optimizers that take a learning rate per group of params


def check_param_groups(optim: OptimConfig, model: ModelConfig) -> None:
  """μP and `optim.lr_multipliers` give params rates of their own, which only GROUPED_RATES take."""
  if (model.parametrization == 'mup' or optim.lr_multipliers) and optim.name not in GROUPED_RATES:
    raise ConfigError(f'optim.name={optim.name} takes one learning rate for every param, but model.parametrization='
                      f'{model.parametrization} / optim.lr_multipliers set per-param ones; use '
                      f'{", ".join(GROUPED_RATES[:-1])} or {GROUPED_RATES[-1]}')


OPTIMIZED, FIXED = 'optimized', 'fixed'  # make_optimizer's labels


def make_optimizer(cfg: OptimConfig, total_steps: int, ema_decay: float = 0.0, axes: Any = None,
                   multipliers: Any = None, fixed: Any = None, ramp: Sequence[tuple[int, float]] = ()
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """`optim.name` on the schedule, after global-norm clipping; with `ema_decay`, the params' moving average kept
  in the optimizer state (sharded like the params, checkpointed with it). `axes`: the params' logical axes
  (Muon's hidden matrices); `multipliers`: per-param (lr, eps, weight decay) factors (`grouped_optimizer`);
  `fixed`: True for params the optimizer leaves alone and keeps no state of (the step moves them); `ramp`: a
  batch ramp's learning-rate factors (`learning_rate_schedule`)."""
  schedule = learning_rate_schedule(cfg, total_steps, ramp)
  base = grouped_optimizer(cfg, schedule, axes, multipliers)
  parts = ([optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []) + [base] + \
    ([params_ema(ema_decay)] if ema_decay else [])
  tx = optax.chain(*parts) if len(parts) > 1 else base
  if any(jax.tree.leaves(fixed)):
    tx = optax.multi_transform({OPTIMIZED: tx, FIXED: optax.set_to_zero()},
                               jax.tree.map(lambda f: FIXED if f else OPTIMIZED, fixed))
  return tx, schedule


@dataclasses.dataclass(frozen=True)
class ParamsView:
  """A set of params a model is used with, made from a train state's (params, optimizer state); a restore reads
  the optimizer state only for a view that `reads_optimizer`."""
  of: Callable[[Any, Any], Any]  # (params, opt_state) -> params
  reads_optimizer: bool


def params_views(cfg: OptimConfig, ema_decay: float = 0.0) -> dict[str, ParamsView]:
  """The optimizer's views of its params: 'model', what evaluation, export and generation use (schedule-free
  AdamW's averaged sequence x, else the trained params); with `ema_decay`, 'ema', their moving average."""
  if cfg.name == 'schedule_free_adamw':
    views = {'model': ParamsView(lambda params, opt_state: schedule_free_params(opt_state, params), True)}
  else:
    views = {'model': ParamsView(lambda params, _: params, False)}
  if ema_decay:
    views['ema'] = ParamsView(lambda params, opt_state: _with_fixed(ema_params(opt_state, ema_decay), params), True)
  return views
