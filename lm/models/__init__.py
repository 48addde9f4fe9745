"""Model families: the one registry of family records (see `lm.models.family`)."""
from __future__ import annotations

import functools
from typing import Any

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
from jax.sharding import Mesh

from lm.config import Config, ConfigError, ModelConfig, register_check
from lm.mesh_axes import axis_size
from lm.models import bert, gpt, gpt_neox, llama, t5
from lm.models.family import Family
from lm.ops.attention.capabilities import check_attention
from lm.parallel.rules import tree_shardings

if TYPE_CHECKING:
  from lm.data.objectives import Objective
  from lm.data.tokenizers import Tokenizer

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, bert.FAMILY, t5.FAMILY, *llama.FAMILIES,
                                                           gpt_neox.FAMILY)}


def get_family(name: str) -> Family:
  if name not in FAMILIES:
    raise ConfigError(f'model.family={name!r} is not supported; choose one of: {", ".join(FAMILIES)}')
  return FAMILIES[name]


def build_model(cfg: ModelConfig) -> nn.Module:
  return get_family(cfg.family).build(cfg)


def check_config(config: Config) -> Config:
  """The checks beyond `lm.config.validate` (which knows no family or attention implementation): the family's
  own, then whether the attention implementation serves what the model asks; `config` when they pass."""
  family = get_family(config.model.family)
  if config.model.moe.num_experts and not family.routed_mlp:
    routed = ', '.join(n for n, f in FAMILIES.items() if f.routed_mlp) or 'none yet'
    raise ConfigError(f'model.moe.num_experts={config.model.moe.num_experts}: the {family.name} family builds no '
                      f'routed experts (families that do: {routed}); set model.moe.num_experts=0')
  if axis_size(config.mesh, 'stage') > 1 and config.model.execution.pipeline.schedule == '1f1b' and not family.loss_in_last_stage:
    raise ConfigError(f'model.execution.pipeline.schedule=1f1b takes the loss in the last stage, which the '
                      f'{family.name} family\'s stack cannot (its output layers read more than its last hidden '
                      f'states); use schedule=gpipe or circular')
  if config.model.mtp.depth and not family.predicts_ahead:
    raise ConfigError(f'model.mtp.depth={config.model.mtp.depth} adds modules after a causal decoder\'s stack; the '
                      f'{family.name} family is not one (its predictions are not of the next tokens): set '
                      f'model.mtp.depth=0')
  family.validate(config)
  check_attention(config)
  return config


register_check(check_config)  # every config loaded from here on runs them (`lm.config.from_dict`)


def make_objective(config: Config, tokenizer: Tokenizer) -> Objective:
  """The pretraining objective the config's family declares (causal LM, masked LM, span corruption)."""
  return get_family(config.model.family).objective(config, tokenizer)


def abstract_params(model: nn.Module, mesh: Mesh | None = None) -> Any:
  """The params as ShapeDtypeStructs (nothing allocated: works for 175B models), carrying their
  NamedShardings on `mesh` when given; an uneven split is a ConfigError naming the field to change."""
  boxed = _boxed_shapes(model)
  params = nn.unbox(boxed)
  if mesh is None:
    return params
  shardings = tree_shardings(nn.get_partition_spec(boxed), params, mesh)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)


def logical_axes(model: nn.Module) -> Any:
  """Each param's logical axes (a PartitionSpec of names such as 'embed', 'mlp', 'layers'), as the layers
  declare them."""
  return nn.get_partition_spec(_boxed_shapes(model))


@functools.lru_cache(maxsize=4)
def _boxed_shapes(model: nn.Module) -> Any:
  """The params' shapes with their logical axes, traced once per model (modules hash by their fields): an
  assembly asks for both its params and their axes."""
  return jax.eval_shape(lambda rng: get_family(model.cfg.family).init(model, rng, 1), jax.random.key(0))


def init_params(model: nn.Module, rng: jax.Array, length: int) -> Any:
  """Boxed (logically partitioned) params of `model`, from dummy inputs of `length` tokens, initialised as its
  `model.parametrization` says."""
  return get_family(model.cfg.family).init(model, rng, length)
