"""AdamW with warmup + cosine/linear decay, global-norm clipping and a weight-decay mask."""
from __future__ import annotations

from typing import Any

import jax
import optax

from lm.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine/linear decay to `min_lr_ratio * peak` (or constant)."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  decay_steps = max((cfg.decay_steps or total_steps) - warmup, 1)
  end = peak * cfg.min_lr_ratio
  if cfg.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
  elif cfg.schedule == 'linear':
    decay = optax.linear_schedule(peak, end, decay_steps)
  else:
    decay = optax.constant_schedule(peak)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params: Any, exclude: tuple[str, ...]) -> Any:
  """True where weight decay applies: every parameter whose path names none of `exclude`."""
  def applies(path: tuple, _: Any) -> bool:
    names = {getattr(k, 'key', getattr(k, 'name', str(k))) for k in path}
    return not names & set(exclude)
  return jax.tree_util.tree_map_with_path(applies, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(cfg, total_steps)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=lambda params: decay_mask(params, cfg.decay_exclude))
  tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw
  return tx, schedule
