"""The one assembly seam: a Config becomes mesh, family, model, optimizer, abstract state and shardings.

`lm train`, `lm info`, `lm compile`, `lm generate` and `train.init_from` all start here, so the same
checks (the mesh fits the devices, every sharded parameter dimension divides its mesh axes) and the
same shardings hold everywhere. Nothing is allocated: state is abstract until `init_state`. (The
batch is checked against the mesh where a train step is built: generation never sees it.)
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from lm.assembly import accounting
from lm.assembly.optim import ParamsView, check_param_groups, make_optimizer, params_views
from lm.assembly.state import HOST, TrainState, abstract_state, abstract_window, in_memory, is_offloaded, \
  make_init_fn, offloaded, shardings_of, to_device, with_fresh_window
from lm.config import Config, ConfigError, ramp_rates
from lm.models import abstract_params, check_config, get_family, logical_axes
from lm.models.family import Family
from lm.models.lora import check_multipliers, check_targets, frozen
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
  abstract_state: TrainState  # ShapeDtypeStructs carrying their NamedShardings: where the state rests between steps
  views: dict[str, ParamsView]  # the optimizer's: 'model' (what a model is evaluated with), 'ema' when kept
  fixed: Any = None  # per param, True for those no gradient moves (model.lora's frozen base, selection biases)

  @property
  def shardings(self) -> TrainState:
    return shardings_of(self.abstract_state)

  @property
  def abstract_params(self) -> Any:
    """The params as a model is evaluated with them: on the devices (also under train.param_offload)."""
    return self.on_device.params

  @property
  def params_shardings(self) -> Any:
    return shardings_of(self.abstract_params)

  @functools.cached_property
  def on_device(self) -> TrainState:
    """The abstract state with everything in device memory (`abstract_state` where nothing is offloaded)."""
    return in_memory(self.abstract_state, 'device') if is_offloaded(self.abstract_state) else self.abstract_state

  def params_of(self, state: TrainState, view: str = 'model') -> Any:
    """The params `view` (see `views`) makes of a train state, on the devices."""
    if self.on_device is self.abstract_state:  # nothing offloaded
      return self.views[view].of(state.params, state.opt_state)
    if view not in self._view_fns:  # one program, so only what the view reads of offloaded state comes in
      rest = self.abstract_state
      self._view_fns[view] = jax.jit(lambda params, opt_state: self.views[view].of(
        to_device(params, rest.params), to_device(opt_state, rest.opt_state)), out_shardings=self.params_shardings)
    return self._view_fns[view](state.params, state.opt_state)

  @functools.cached_property
  def _view_fns(self) -> dict[str, Any]:
    return {}

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


def check_offload(config: Config, device: Any) -> None:
  """Offloading (model.execution.offload, train.optimizer_offload, train.param_offload) needs host memory the
  device can address (pinned_host); a compile-only device that lists no memories is taken at its word."""
  asked = ([f'model.execution.offload={list(config.model.execution.offload)}'] if config.model.execution.offload
           else []) + [f'train.{name}=true' for name in ('optimizer_offload', 'param_offload')
                       if getattr(config.train, name)]
  try:
    kinds = {memory.kind for memory in device.addressable_memories()}
  except (AttributeError, RuntimeError, NotImplementedError):
    return
  if asked and HOST not in kinds:
    raise ConfigError(f'{" and ".join(asked)} need host memory the {device.platform} devices can address '
                      f'(pinned_host; they have {", ".join(sorted(kinds))}); drop it on this platform')


def assemble(config: Config, devices: Sequence[jax.Device] | None = None, *, mesh: Mesh | None = None) -> Assembly:
  """Builds everything but data for `config` on `devices` (default: all), or on an existing `mesh`."""
  family = get_family(check_config(config).model.family)
  check_param_groups(config.optim, config.model)
  mesh = make_mesh(config.mesh, devices) if mesh is None else mesh
  check_offload(config, mesh.devices.flat[0])
  model = family.build(config.model)
  axes = logical_axes(model)  # Muon's hidden matrices, μP's and optim.lr_multipliers' param groups
  params = abstract_params(model, mesh)
  check_targets(params, config.model.lora)
  check_multipliers(params, config.model.lora, config.optim, family.per_sequence_params())
  fixed = jax.tree.map(operator.or_, fixed_params(params),
                       frozen(params, config.model.lora, family.per_sequence_params()))
  tx, schedule = make_optimizer(config.optim, config.train.steps, config.train.ema_decay, axes,
                                optimizer_multipliers(axes, config.model, config.optim), fixed, ramp_rates(config))
  state = offloaded(abstract_state(params, tx, mesh), config.train).replace(
    spike_window=abstract_window(config.train, mesh))
  return Assembly(config=config, family=family, mesh=mesh, model=model, tx=tx, schedule=schedule,
                  abstract_state=state, views=params_views(config.optim, config.train.ema_decay), fixed=fixed)
