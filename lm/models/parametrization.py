"""How each parameter scales with width, read off the logical axes the layers give it.

`standard`: the families' own initialisation, one learning rate, logits as they are. `mup`: the maximal update
parametrization for Adam-like optimizers (Yang, Hu et al., Tensor Programs V, 2022, Table 3 in the MuReadout form
of microsoft/mup), with width multiplier m = d_model / model.mup.base_width:

- hidden matrices (the residual stream's `embed` axis with a `heads`, `kv_heads`, `mlp` or `experts` axis: routed
  experts and their router too, whose logits a token's O(1) coordinates over a growing width make): init variance
  1/fan_in, i.e. a width-constant std (`model.init=scaled_normal`) divided by sqrt(m), a fan-in init
  (`fan_in`) as it is; Adam lr / m and eps / m, weight decay x m so that optax's lr x decay stays put (MuAdam's
  convention);
- the output layer (`embed` x `vocab`, or the tied embedding): init constant in width (a fan-in init is brought
  back to the base's, as mup's MuReadout rescales), base lr, its logits x 1/m in the forward;
- embeddings, biases, norm scales: as standard;
- attention logits x sqrt(base head dim) / head dim (1/d_head, equal to 1/sqrt(d_head) at the base);
- `model.mup.zero_init`: the query projections and an untied output layer start at zero.

At m = 1 every multiplier is 1 and the model trains as `standard` does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lm.config import ConfigError, ModelConfig, MupConfig, OptimConfig, lr_multipliers
from lm.models.rope import rope_of
from lm.parallel.rules import path_names

HIDDEN = frozenset({'heads', 'kv_heads', 'mlp', 'experts'})  # with 'embed': a hidden (residual-stream) matrix's axes
QUERY = ('embed', 'heads', 'kv')
QUERY_BIAS = ('heads', 'kv')
READOUT = ('embed', 'vocab')


def role(axes: tuple[str | None, ...]) -> str:
  """'query', 'hidden', 'readout' (an untied output layer) or 'other' for a param with these logical axes."""
  names = tuple(a for a in axes if a != 'layers')
  if names == READOUT:
    return 'readout'
  if 'embed' in names and HIDDEN & set(names):
    return 'query' if names == QUERY else 'hidden'
  return 'other'


def width_multiplier(cfg: ModelConfig) -> float:
  return cfg.d_model / cfg.base_width


def readout_multiplier(cfg: ModelConfig) -> float:
  """What the output layer's input is multiplied by in the forward (1/m)."""
  return 1.0 / width_multiplier(cfg)


def readout_input(x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """The output layer's input `x` times its forward multiplier (unchanged under `standard`)."""
  return x if cfg.parametrization == 'standard' else x * jnp.asarray(readout_multiplier(cfg), x.dtype)


def base_head_dim(cfg: ModelConfig) -> float:
  return cfg.mup.base_head_dim or cfg.resolved_head_dim * cfg.mup.base_width / cfg.d_model


def attention_scale(cfg: ModelConfig) -> float | None:
  """The attention logits' scale; None: the kernel's own 1/sqrt(head_dim). A YaRN rotation that scales the logits
  too (`model.rope.scale_logits`, DeepSeek) multiplies it."""
  factor = rope_of(cfg).logit_factor if cfg.position == 'rotary' else 1.0
  if factor != 1.0:
    return factor * (_unscaled(cfg) or cfg.resolved_head_dim ** -0.5)
  return _unscaled(cfg)


def _unscaled(cfg: ModelConfig) -> float | None:
  if cfg.parametrization == 'standard':
    if cfg.attention_scale_dim is not None:
      return cfg.attention_scale_dim ** -0.5 if cfg.scale_attention else 1.0
    return None if cfg.scale_attention else 1.0
  standard = (cfg.attention_scale_dim or cfg.resolved_head_dim) ** -0.5 if cfg.scale_attention else 1.0
  return standard * (base_head_dim(cfg) / cfg.resolved_head_dim) ** 0.5


def init_multiplier(axes: tuple[str | None, ...], cfg: ModelConfig) -> float:
  """What μP multiplies a param's standard init by."""
  kind, m = role(axes), width_multiplier(cfg)
  if cfg.mup.zero_init and kind in ('query', 'readout'):
    return 0.0
  width_constant = cfg.init == 'scaled_normal'
  if kind in ('hidden', 'query'):
    return m ** -0.5 if width_constant else 1.0
  if kind == 'readout':
    return 1.0 if width_constant else m ** 0.5
  return 1.0


def standard_std(cfg: ModelConfig, kind: str, num_layers: int) -> float:
  """A param kind's init std under `model.init`, before the parametrization's multiplier.

  scaled_normal (GPT, BERT, Llama): N(0, init_std), the residual outputs (`attention_out`, `mlp_out`) shrunk by
  1/sqrt(2 x layers) as in GPT-2. fan_in (Mesh-TF, T5, whose attention logits are unscaled): 1/sqrt(fan in) for
  every matrix of the stack and the untied output layer, so logits start at unit scale. Either way embeddings
  and task heads take init_std, T5's relative position table 0.02."""
  if kind not in INIT_KINDS:
    raise ValueError(f'no init for a param of kind {kind!r}; kinds: {", ".join(INIT_KINDS)}')
  if kind in ('embedding', 'head'):
    return cfg.init_std
  if kind == 'relative':
    return 0.02
  if cfg.init == 'scaled_normal':
    return cfg.init_std / math.sqrt(2 * num_layers) if kind in ('attention_out', 'mlp_out') else cfg.init_std
  fan_in = {'query': cfg.d_model * cfg.resolved_head_dim, 'attention_out': cfg.num_heads * cfg.resolved_head_dim,
            'mlp_out': cfg.resolved_d_ff}.get(kind, cfg.d_model)
  return fan_in ** -0.5


# What a param is to its init: token, position and type tables; task heads (BERT's pretraining heads, classifiers);
# the attention projections; the MLP's; an untied output layer; T5's relative position table.
INIT_KINDS = ('embedding', 'head', 'query', 'key_value', 'attention_out', 'mlp_in', 'mlp_out', 'readout', 'relative')


@dataclasses.dataclass(frozen=True)
class Init:
  """Every param's initializer, the one place init scale is decided: the kind's standard std (`standard_std`) times
  what the parametrization multiplies a param with these logical axes by (`init_multiplier`); a zero std (μP's
  zero init) gives zeros. Layers ask it with their param's kind and axes; `num_layers`: the stack's depth."""
  cfg: ModelConfig
  num_layers: int = 1

  def __call__(self, kind: str, axes: tuple[str | None, ...]) -> nn.initializers.Initializer:
    std = standard_std(self.cfg, kind, self.num_layers)
    if self.cfg.parametrization == 'mup':
      std *= init_multiplier(axes, self.cfg)
    return nn.initializers.normal(std) if std else nn.initializers.zeros


def optimizer_multipliers(axes: Any, model: ModelConfig, optim: OptimConfig) -> Any:
  """Per param (a tree of logical axes) its (lr, eps, weight decay) multipliers: μP's hidden-matrix rule times
  the `optim.lr_multipliers` that match its path."""
  m = width_multiplier(model)
  patterns = lr_multipliers(optim)

  def multipliers(path: tuple, spec: PartitionSpec) -> tuple[float, float, float]:
    lr, eps, decay = 1.0, 1.0, 1.0
    if model.parametrization == 'mup' and role(tuple(spec)) in ('hidden', 'query'):
      lr, eps, decay = 1.0 / m, 1.0 / m, m
    name = '/'.join(path_names(path))
    for pattern, factor in patterns:
      if pattern.search(name):
        lr *= factor
    return lr, eps, decay
  return jax.tree_util.tree_map_with_path(multipliers, axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def standard(cfg: ModelConfig) -> ModelConfig:
  """`cfg` under the standard parametrization (its μP fields cleared)."""
  return dataclasses.replace(cfg, parametrization='standard', mup=MupConfig())


def fold(params: Any, axes: Any, cfg: ModelConfig, readout_norm: tuple[str, ...] | None) -> Any:
  """Params of the standard parametrization (`standard(cfg)`) that compute what `params` do under `cfg`'s, for
  export: the attention factor folded into the query projections, the output layer's 1/m into its kernel
  (untied) or into `readout_norm`, the norm feeding a tied one (a classifier's params have no output layer)."""
  if cfg.parametrization == 'standard':
    return params
  specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
  untied = any(role(tuple(s)) == 'readout' for s in specs)
  tied = cfg.tie_embeddings and not cfg.num_labels
  if (tied and readout_norm is None) or (cfg.scale_embeddings and cfg.base_width != cfg.d_model):
    raise ConfigError(f'cannot fold this μP {cfg.family} model into a standard one: its output layer or embedding '
                      f'scale depends on the width otherwise (model.tie_embeddings={cfg.tie_embeddings}, '
                      f'model.scale_embeddings={cfg.scale_embeddings}); export it at model.mup.base_width='
                      f'{cfg.d_model} or untie its output layer')
  query = (base_head_dim(cfg) / cfg.resolved_head_dim) ** 0.5
  readout = readout_multiplier(cfg)
  # a query norm undoes a factor folded into the projection; a norm without params has nothing to fold into
  unfoldable = ('query norm' if cfg.qk_norm and query != 1.0 else 'tied output layer reads a norm without params'
                if tied and not untied and cfg.norm == 'nonparametric_layernorm' else None)
  if unfoldable:
    raise ConfigError(f'cannot fold this μP {cfg.family} model into a standard one: its {unfoldable} would not '
                      f'carry the multiplier; export it at model.mup.base_width={cfg.d_model}')
  norm = '/'.join(readout_norm or ()) + '/'

  def scaled(path: tuple, x: Any, spec: PartitionSpec) -> Any:
    names, name = tuple(a for a in spec if a != 'layers'), '/'.join(path_names(path))
    if names in (QUERY, QUERY_BIAS):
      return x * query
    if names == READOUT or (tied and not untied and name.startswith(norm)):
      return x * readout
    return x
  return jax.tree_util.tree_map_with_path(scaled, params, axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
