"""The one assembly seam: a Config becomes mesh, family, model, optimizer, abstract state and shardings.

`lm train`, `lm info`, `lm compile`, `lm generate` and `train.init_from` all start here, so the same
checks (the mesh fits the devices, every sharded parameter dimension divides its mesh axes) and the
same shardings hold everywhere. Nothing is allocated: state is abstract until `init_state`. (The
batch is checked against the mesh where a train step is built: generation never sees it.)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from lm.assembly import accounting
from lm.assembly.optim import ParamsView, check_param_groups, make_optimizer, params_views
from lm.assembly.state import TrainState, abstract_state, abstract_window, make_init_fn, shardings_of, \
  with_fresh_window
from lm.config import Config, ConfigError
from lm.models import abstract_params, check_config, get_family, logical_axes
from lm.models.family import Family
from lm.models.moe import fixed_params
from lm.models.parametrization import optimizer_multipliers
from lm.parallel.mesh import make_mesh


@dataclass(frozen=True)
class Assembly:
  config: Config
  family: Family
  mesh: Mesh
  model: nn.Module
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState  # ShapeDtypeStructs carrying their NamedShardings
  views: dict[str, ParamsView]  # the optimizer's: 'model' (what a model is evaluated with), 'ema' when kept

  @property
  def shardings(self) -> TrainState:
    return shardings_of(self.abstract_state)

  @property
  def abstract_params(self) -> Any:
    return self.abstract_state.params

  def params_of(self, state: TrainState, view: str = 'model') -> Any:
    """The params `view` (see `views`) makes of a train state."""
    return self.views[view].of(state.params, state.opt_state)

  def init_state(self, rng: jax.Array | None = None) -> TrainState:
    """Fresh state from `rng` (default: the config's seed), each device creating only its shards."""
    rng = jax.random.key(self.config.train.seed) if rng is None else rng
    return with_fresh_window(self._init_fn(rng), self.abstract_state.spike_window)

  @functools.cached_property
  def _init_fn(self):
    # One jit per assembly: a state made twice (a reference, a restart) compiles its init once.
    return make_init_fn(self.model, self.tx, self.shardings.replace(spike_window=None), self.config.data.seq_len)

  def flops_per_token(self) -> float:
    return accounting.flops_per_token(self.abstract_params, self.config.model, self.config.data.seq_len,
                                      self.config.train.causal_attention_flops)


def check_offload(offload: Sequence[str], device: Any) -> None:
  """model.execution.offload needs host memory the device can address (pinned_host); a compile-only device that
  lists no memories is taken at its word."""
  try:
    kinds = {memory.kind for memory in device.addressable_memories()}
  except (AttributeError, RuntimeError, NotImplementedError):
    return
  if offload and 'pinned_host' not in kinds:
    raise ConfigError(f'model.execution.offload={list(offload)} needs host memory the {device.platform} devices can '
                      f'address (pinned_host; they have {", ".join(sorted(kinds))}); drop it on this platform')


def assemble(config: Config, devices: Sequence[jax.Device] | None = None, *, mesh: Mesh | None = None) -> Assembly:
  """Builds everything but data for `config` on `devices` (default: all), or on an existing `mesh`."""
  family = get_family(check_config(config).model.family)
  check_param_groups(config.optim, config.model)
  mesh = make_mesh(config.mesh, devices) if mesh is None else mesh
  check_offload(config.model.execution.offload, mesh.devices.flat[0])
  model = family.build(config.model)
  axes = logical_axes(model)  # Muon's hidden matrices, μP's and optim.lr_multipliers' param groups
  params = abstract_params(model, mesh)
  tx, schedule = make_optimizer(config.optim, config.train.steps, config.train.ema_decay, axes,
                                optimizer_multipliers(axes, config.model, config.optim), fixed_params(params))
  state = abstract_state(params, tx, mesh).replace(spike_window=abstract_window(config.train, mesh))
  return Assembly(config=config, family=family, mesh=mesh, model=model, tx=tx, schedule=schedule,
                  abstract_state=state, views=params_views(config.optim, config.train.ema_decay))
