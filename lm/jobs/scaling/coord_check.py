"""The coordinate check of Tensor Programs V (microsoft/mup's `coord_check`): the same-depth model at several
widths trains a few steps on one fixed batch at a large learning rate, and the mean |x| of each layer group's
output (token embeddings, attention, MLP or routed experts, the routers' logits, logits) is recorded at every step,
averaged over seeds. Under μP every
curve is flat in width; under the standard parametrization the logits and hidden outputs grow with it once the
params have moved.

Widths grow the head dim at a fixed number of heads (and d_ff and the experts' widths in proportion), as
microsoft/mup's check does;
μP's base width is the base config's `model.mup.base_width`, else its d_model.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.assembly import assemble
from lm.config import Config, ConfigError, validate
from lm.data.pipeline import training_batches
from lm.models.moe import ROUTER, RoutedMlp
from lm.models.parametrization import standard
from lm.ops.unembed import Unembedding
from lm.train.step import PretrainingLoss, make_train_step

GROUPS = {'token_embed': 'embedding', 'attention': 'attention', 'mlp': 'mlp'}  # module name -> group
ORDER = ('embedding', 'attention', 'mlp', 'router', 'logits')  # 'router': a routed model's only


def width_config(base: Config, width: int, parametrization: str, learning_rate: float) -> Config:
  """`base` at d_model `width` (heads fixed; d_ff and an explicit head_dim in proportion), trained by plain
  AdamW steps at `learning_rate` (no warmup, decay, clipping or weight decay) on one device, unrolled."""
  m = base.model
  scale = lambda x: None if x is None else x * width // m.d_model
  model = standard(m) if parametrization == 'standard' else \
    dataclasses.replace(m, parametrization='mup', mup=dataclasses.replace(m.mup, base_width=m.mup.base_width or m.d_model))
  moe = dataclasses.replace(m.moe, expert_d_ff=scale(m.moe.expert_d_ff), shared_d_ff=scale(m.moe.shared_d_ff))
  model = dataclasses.replace(model.with_execution(scan_layers=False, remat='none'), d_model=width, d_ff=scale(m.d_ff),
                              head_dim=scale(m.head_dim), dropout=0.0, attention_dropout=0.0, moe=moe)
  optim = dataclasses.replace(base.optim, name='adamw', learning_rate=learning_rate, warmup_steps=0,
                              schedule='constant', grad_clip=0.0, weight_decay=0.0, lr_multipliers=())
  mesh = dataclasses.replace(base.mesh, **{f.name: 1 for f in dataclasses.fields(base.mesh)})
  config = dataclasses.replace(base, model=model, optim=optim, mesh=mesh)
  validate(config)
  return config


@dataclass(frozen=True)
class RecordingLoss(PretrainingLoss):
  """The pretraining loss, its metrics adding the mean |x| of each group's outputs in this forward (averaged over
  the layers it has) and of the logits: one compiled step records and trains."""

  def __call__(self, params, batch, rng, totals):
    a = self.assembly
    seen: dict[str, list[jax.Array]] = {group: [] for group in GROUPS.values()}

    def record(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.method_name == '__call__' and context.module.name in GROUPS:
        seen[GROUPS[context.module.name]].append(jnp.mean(jnp.abs(out.astype(jnp.float32))))
      if context.method_name == '__call__' and isinstance(context.module, RoutedMlp):  # its logits, as it makes them
        router = context.module.get_variable('params', ROUTER)
        seen.setdefault('router', []).append(jnp.mean(jnp.abs(args[0].astype(jnp.float32) @ router)))
      return out

    with nn.intercept_methods(record):
      outputs = a.family.apply(a.model, params, batch, deterministic=False, rngs={'dropout': rng})
    loss, sums = self.of_outputs(totals)(outputs, batch)
    logits = outputs['logits']
    logits = logits.logits() if isinstance(logits, Unembedding) else logits
    means = {group: jnp.mean(jnp.stack(values)) for group, values in seen.items() if values}
    means['logits'] = jnp.mean(jnp.abs(logits.astype(jnp.float32)))
    return loss, {**sums, **{f'coord/{group}': jax.lax.stop_gradient(v) for group, v in means.items()}}

  def metrics(self, sums, totals):
    return {**super().metrics(sums, totals), **{k: v for k, v in sums.items() if k.startswith('coord/')}}


def coord_check(base: Config, widths: Sequence[int], parametrization: str, learning_rate: float, steps: int,
                seeds: int) -> dict[str, Any]:
  """{'widths', 'steps', 'mean_abs': {group: [[per width] per step 0..steps]}, 'slopes': {group: [per step]}}:
  step t is the forward after t updates; a slope is d log mean|x| / d log width, by least squares."""
  if len(widths) < 2 or any(w <= 0 for w in widths) or steps < 1 or seeds < 1:
    raise ConfigError('the coordinate check needs two or more positive --widths, --steps >= 1 and --seeds >= 1')
  batch = None
  mean_abs: dict[str, np.ndarray] = {}
  for i, width in enumerate(widths):
    config = width_config(base, width, parametrization, learning_rate)
    assembly = assemble(config, jax.devices()[:1])
    if batch is None:  # one batch for every width and seed
      objective_for = functools.partial(assembly.family.objective, config)
      batch = next(training_batches(config, assembly.mesh, objective_for)[1])
    step = make_train_step(assembly, RecordingLoss(assembly))
    for seed in range(seeds):
      state = assembly.init_state(jax.random.key(seed))
      for t in range(steps + 1):  # the forward of step t sees the params after t updates
        state, metrics = step(state, batch)
        for group in (g for g in ORDER if f'coord/{g}' in metrics):
          values = mean_abs.setdefault(group, np.zeros((steps + 1, len(widths))))
          values[t, i] += float(metrics[f'coord/{group}']) / seeds
  log_w = np.log(np.asarray(widths, np.float64))
  slopes = {group: [float(np.polyfit(log_w, np.log(values[t]), 1)[0]) for t in range(steps + 1)]
            for group, values in mean_abs.items()}
  return {'parametrization': parametrization, 'base_width': base.model.mup.base_width or base.model.d_model,
          'learning_rate': learning_rate, 'widths': list(widths), 'steps': steps, 'seeds': seeds,
          'mean_abs': {group: values.tolist() for group, values in mean_abs.items()}, 'slopes': slopes}


def plot_coord_check(result: dict[str, Any], out: str | Path) -> None:
  """One panel per group, mean |x| against width on log-log axes, a line per step."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  groups = list(result['mean_abs'])
  fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), constrained_layout=True)
  colors = plt.cm.viridis(np.linspace(0, 0.9, result['steps'] + 1))
  for ax, group in zip(axes, groups):
    for t, values in enumerate(result['mean_abs'][group]):
      ax.plot(result['widths'], values, 'o-', color=colors[t], markersize=3,
              label=f'step {t} (slope {result["slopes"][group][t]:+.2f})')
    ax.set(xscale='log', yscale='log', xlabel='width (d_model)', title=group)
    ax.legend(fontsize=7)
  axes[0].set_ylabel('mean |x|')
  fig.suptitle(f'{result["parametrization"]}: coordinate check (lr {result["learning_rate"]:g}, base width '
               f'{result["base_width"]}, {result["seeds"]} seeds)')
  fig.savefig(out, dpi=110)
  plt.close(fig)


def write_coord_check(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  png, data = out_dir / 'coord_check.png', out_dir / 'coord_check.json'
  plot_coord_check(result, png)
  data.write_text(json.dumps(result, indent=2) + '\n')
  return png, data
