"""`train.init_from`: a new run that starts from another model's params with a fresh optimizer at step 0.

The source is one of our run dirs (latest checkpoint) or an HF model directory. Its layer layout
(scanned or unrolled) is matched to this run's; every param must then exist with the same shape,
except the family's heads (e.g. a classifier or NSP head a pretrained model lacks), which start
fresh, as do low-rank adapters (`model.lora`; an int8 base's kernels are quantized from the source's); so does a
task head of another shape (a model fine-tuned on MNLI's 3 labels starting STS-B's regression, RoBERTa's recipe for
the small tasks). Params the run does not use are left behind; the lists are reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from lm.assembly import Assembly
from lm.assembly.state import TrainState, shardings_of
from lm.config import ConfigError
from lm.models import init_params
from lm.models.lora import ADAPTERS, quantized_base
from lm.models.transformer import relayout
from lm.storage.source import ModelSource


@dataclass(frozen=True)
class Initialised:
  state: TrainState
  fresh: tuple[str, ...]  # params initialised here because the source lacks them (heads, adapters)
  reshaped: tuple[str, ...]  # task-head params the source has in another shape (another task's labels): fresh too
  unused: tuple[str, ...]  # source params this model does not have


def _flat(tree: Any) -> dict[str, Any]:
  return traverse_util.flatten_dict(tree, sep='/')


def initial_state(assembly: Assembly, source: str, ema: bool = False) -> Initialised:
  """Step-0 state whose params come from `source` (`ema`: its params' moving average; fresh heads where it has
  none), sharded on the mesh."""
  params = ModelSource(source, view='ema' if ema else 'model', flag='train.init_from=').params(assembly.mesh)
  params = relayout(params, assembly.config.model.execution.scan_layers)
  want = _flat(assembly.abstract_params)
  have = quantized_base(_flat(params), want)
  heads = assembly.family.per_sequence_params()
  task_head = frozenset(assembly.family.task_head.params if assembly.family.task_head else ())
  fresh, reshaped = [], []
  for name, target in want.items():
    got = have.get(name)
    if got is None:
      if name.split('/')[0] not in heads and name.rsplit('/', 1)[-1] not in ADAPTERS:
        raise ConfigError(f'train.init_from={source} has no parameter {name} {target.shape}, which this '
                          f'{assembly.family.name} model needs; start from a checkpoint of the same model')
      fresh.append(name)
    elif got.shape != target.shape and name.split('/')[0] in task_head:
      reshaped.append(name)
    elif got.shape != target.shape:
      raise ConfigError(f'train.init_from={source}: parameter {name} has shape {got.shape} there but '
                        f'{target.shape} in this model; set the model config to match the source')
  loaded = {name: jax.device_put(have[name].astype(target.dtype), target.sharding)
            for name, target in want.items() if name in have and name not in reshaped}
  if fresh or reshaped:
    loaded.update(_fresh_params(assembly, {name: want[name].sharding for name in fresh + reshaped}))
  params = traverse_util.unflatten_dict(loaded, sep='/')
  rest = assembly.abstract_state  # where the state rests between steps (train.optimizer_offload, param_offload)
  opt_state = jax.jit(assembly.tx.init, out_shardings=shardings_of(rest.opt_state))(params)
  params = jax.device_put(params, shardings_of(rest.params))
  zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), assembly.abstract_state.step.sharding)
  state = TrainState(step=zero(), params=params, opt_state=opt_state, skipped=zero())  # two buffers: both are donated
  return Initialised(state, tuple(fresh), tuple(reshaped), tuple(sorted(set(have) - set(want))))


def _fresh_params(assembly: Assembly, shardings: dict[str, Any]) -> dict[str, jax.Array]:
  """Initialises only the named params: XLA drops the rest of the init from the compiled function."""
  def init(rng: jax.Array) -> dict[str, jax.Array]:
    params = _flat(nn.unbox(init_params(assembly.model, rng, assembly.config.data.seq_len)))
    return {name: params[name] for name in shardings}
  return jax.jit(init, out_shardings=shardings)(jax.random.key(assembly.config.train.seed))
