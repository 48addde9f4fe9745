"""Transformer blocks and the scanned, rematerialised stack every family builds on."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.models.layers import DTYPES, Attention, LearnedPositions, Mlp, make_norm, sinusoidal_positions
from lm.parallel.rules import constrain

REMAT_POLICIES = {
  'full': None,  # save nothing inside a block; recompute it all in the backward pass
  'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'projections': jax.checkpoint_policies.save_only_these_names(
    'query_proj', 'key_proj', 'value_proj', 'attention_out', 'mlp_out'),
}


class Block(nn.Module):
  """One layer: self-attention then MLP, each as a residual branch, with pre- or post-LN."""
  cfg: ModelConfig
  causal: bool

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None, deterministic: bool
               ) -> tuple[jax.Array, None]:
    cfg = self.cfg
    dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    # GPT-2: residual output projections start smaller, by 1/sqrt(2 * layers).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    norm = lambda name: make_norm(cfg.norm, cfg.norm_eps, dtype, param_dtype, name)
    drop = lambda h: nn.Dropout(cfg.dropout)(h, deterministic=deterministic)
    attn = Attention(cfg.num_heads, cfg.resolved_head_dim, use_bias=cfg.use_bias, impl=cfg.attention_impl,
                     dropout_rate=cfg.attention_dropout, init_std=cfg.init_std, out_init_std=out_std,
                     dtype=dtype, param_dtype=param_dtype, name='attention')
    mlp = Mlp(cfg.resolved_d_ff, cfg.activation, use_bias=cfg.use_bias, init_std=cfg.init_std,
              out_init_std=out_std, dtype=dtype, param_dtype=param_dtype, name='mlp')
    self_attn = lambda h: attn(h, h, causal=self.causal, segment_ids=segment_ids, deterministic=deterministic)

    if cfg.norm_position == 'pre':
      x = x + drop(self_attn(norm('attention_norm')(x)))
      x = x + drop(mlp(norm('mlp_norm')(x)))
    else:
      x = norm('attention_norm')(x + drop(self_attn(x)))
      x = norm('mlp_norm')(x + drop(mlp(x)))
    return constrain(x.astype(dtype), ('batch', 'length', 'embed')), None


class Stack(nn.Module):
  """`num_layers` blocks, scanned (compile time independent of depth) or unrolled."""
  cfg: ModelConfig
  causal: bool

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None, deterministic: bool) -> jax.Array:
    cfg = self.cfg
    block = Block
    if cfg.remat != 'none':
      # static_argnums counts self: (self, x, segment_ids, deterministic).
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers,
                       static_argnums=(3,))
    if cfg.scan_layers:
      scanned = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                        in_axes=(nn.broadcast, nn.broadcast), length=cfg.num_layers,
                        metadata_params={nn.PARTITION_NAME: 'layers'})
      x, _ = scanned(cfg, self.causal, name='layers')(x, segment_ids, deterministic)
    else:
      for i in range(cfg.num_layers):
        x, _ = block(cfg, self.causal, name=f'layers_{i}')(x, segment_ids, deterministic)
    return x


def embed_positions(cfg: ModelConfig, positions: jax.Array, name: str = 'position_embed') -> jax.Array | None:
  """Absolute position encodings for `positions` [batch, length], or None when the model has none."""
  if cfg.position == 'learned':
    return LearnedPositions(cfg.max_len, cfg.d_model, init_std=cfg.init_std, dtype=DTYPES[cfg.dtype],
                            param_dtype=DTYPES[cfg.param_dtype], name=name)(positions)
  if cfg.position == 'sinusoidal':
    return sinusoidal_positions(positions, cfg.d_model).astype(DTYPES[cfg.dtype])
  return None


def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)
