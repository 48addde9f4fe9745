"""Multi-token prediction (DeepSeek-V3 section 2.2; `model.mtp`): modules after a causal decoder's stack that predict
tokens further ahead, as a denser training signal.

Module k (1-based) reads, at each position i, the states the module before it gave (the stack's output after its
final norm, the states the output layer reads, for k = 1) and the embedding of input token i + k. Each is normalised,
projected (DeepSeek's `eh_proj` on the two concatenated, embedding first, here as two kernels whose outputs add)
and run through one more block of the family's; its own final norm and the shared output layer then predict
target i + k, the token k + 1 places past input i. The shift stays inside the row (zeros fill its end) and a
position whose look-ahead leaves its document has weight 0; the block keeps the row's positions and documents.

The step adds the shifted features to the batch before it lays the sequence out over a mesh (`look_ahead`), so that
under context parallelism each position still finds its own look-ahead.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.models.layers import DTYPES, DenseGeneral, Embed, make_norm
from lm.models.parametrization import Init
from lm.models.transformer import Block, remat_policy
from lm.parallel.rules import constrain

Batch = dict[str, jax.Array]


def ahead_keys(k: int) -> tuple[str, str, str]:
  """The batch keys of depth k's inputs, targets and weights."""
  return f'mtp_inputs_{k}', f'mtp_targets_{k}', f'mtp_weights_{k}'


def _shifted(x: jax.Array, k: int) -> jax.Array:
  """Each row's entries k places on (x[:, i + k] at i), zeros past its end."""
  return jnp.pad(x[:, k:], [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2))


def look_ahead(batch: Batch, depth: int) -> Batch:
  """`batch` (a causal LM's: inputs, targets, weights and maybe segment_ids) with each depth k's inputs (input
  i + k at i), targets (target i + k) and weights: target i + k's, times whether input i + k is in input i's
  document. Unchanged at depth 0."""
  out = dict(batch)
  for k in range(1, depth + 1):
    inputs, targets, weights = ahead_keys(k)
    w = _shifted(batch['weights'].astype(jnp.float32), k)
    if 'segment_ids' in batch:
      w = w * (_shifted(batch['segment_ids'], k) == batch['segment_ids'])
    out.update({inputs: _shifted(batch['inputs'], k), targets: _shifted(batch['targets'], k), weights: w})
  return out


class PredictAhead(nn.Module):
  """Module `k` of `model.mtp`: (states for module k + 1, states for the output layer)."""
  cfg: ModelConfig
  k: int

  @nn.compact
  def __call__(self, h: jax.Array, embedded: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None,
               deterministic: bool) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    dtype, param_dtype = DTYPES[cfg.execution.dtype], DTYPES[cfg.param_dtype]
    norm = lambda name: make_norm(cfg.norm, cfg.norm_eps, dtype, param_dtype, name, cfg.norm_plus_one)
    axes = ('embed', None)
    project = lambda name: DenseGeneral(cfg.d_model, axes, dtype=dtype, param_dtype=param_dtype,
                                        kernel_init=Init(cfg)('mlp_in', axes), name=name)
    x = project('embed_proj')(norm('embed_norm')(embedded)) + project('hidden_proj')(norm('hidden_norm')(h))
    x = constrain(x.astype(dtype), ('batch', 'length', 'embed'))
    layer = cfg.num_layers + self.k - 1  # as DeepSeek numbers it: past the stack's layers
    block = Block
    if cfg.execution.remat != 'none':  # static: deterministic, decode, layer (the self-counting argnums of Stack)
      block = nn.remat(Block, policy=remat_policy(cfg.execution), static_argnums=(7, 8, 9))
    x, _ = block(cfg, True, cfg.num_layers, routed=cfg.moe.routed(layer), name='block')(
      x, segment_ids, positions, None, None, None, deterministic, False, layer)
    return x, norm('final_norm')(x)


def predict_ahead(cfg: ModelConfig, x: jax.Array, ahead: list[jax.Array], embed: Embed,
                  segment_ids: jax.Array | None, positions: jax.Array | None, deterministic: bool
                  ) -> list[jax.Array]:
  """Each depth's states for the output layer, from the stack's output `x` and each depth's shifted inputs
  `ahead`; modules `mtp_0`, `mtp_1`, ... of the calling (compact) module."""
  out = []
  for k, tokens in enumerate(ahead, 1):
    x, readout = PredictAhead(cfg, k, name=f'mtp_{k - 1}')(x, embed(tokens), segment_ids, positions, deterministic)
    out.append(readout)
  return out
