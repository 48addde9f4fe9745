"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3): the queries, keys and values of an
attention layer when `model.mla.kv_lora_rank` > 0.

Each token's keys and values come from one latent: x -> `kv_down` [embed, rank + rope] gives the latent (RMS-normalised,
`kv_norm`) and one rotated key part shared by every head; `kv_up` [rank, heads, nope + v] expands the latent into
each head's unrotated key part and its value. Queries come through their own normalised latent (`query_down`,
`query_norm`, `query_up`: `q_lora_rank` > 0) or one projection (`query`), each head `nope` unrotated features
then `rope` rotated ones. A query/key head is `model.head_dim` = nope + rope features; a value head
`model.mla.v_head_dim`. Names follow transformers' `DeepseekV3Attention` in `lm.storage.convert.deepseek_v3`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import flax.linen as nn

from lm.config import LoraConfig, MlaConfig
from lm.models.layers import DenseGeneral, Dtype, RMSNorm
from lm.models.parametrization import Init
from lm.models.rope import Rope, rotary
from lm.ops import mixed


class Kernel(nn.Module):
  """A bare kernel param ('kernel'), for a projection applied by hand (the absorbed latent expansion)."""
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  initializer: nn.initializers.Initializer
  param_dtype: Dtype

  @nn.compact
  def __call__(self) -> jax.Array:
    return self.param('kernel', nn.with_logical_partitioning(self.initializer, self.axes), self.shape,
                      self.param_dtype)


def latent_qkv(x: jax.Array, positions: jax.Array, *, mla: MlaConfig, heads: int, head_dim: int, rope: Rope,
               norm_eps: float, inits: Init, dtype: Dtype, param_dtype: Dtype, use_bias: bool = False,
               lora: LoraConfig | None = None, absorbed: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [batch, length, embed] -> queries, keys [batch, length, heads, head_dim] and values [..., v_head_dim], the
  rotated parts rotated at `positions`. Called inside an attention module's compact call: its params are that
  module's.

  `absorbed` (decoding from a cache of latents): the key expansion folded into the queries instead, as one key/value
  head: (queries [batch, length, heads, rank + rope], keys [batch, length, 1, rank + rope]: each token's latent and
  rotated key part, what the cache holds; the value expansion [rank, heads, v_head_dim]). Attention over them with
  the latents as values, then the expansion, gives the expanded attention's output."""
  nope, rank = head_dim - mla.rope_head_dim, mla.kv_lora_rank
  dense = dict(dtype=dtype, param_dtype=param_dtype, lora=lora)  # kv_up (a bare kernel) takes no adapters
  norm = lambda name: RMSNorm(norm_eps, dtype, param_dtype, axes=(None,), name=name)
  up_axes = ('latent', 'heads', 'kv')
  if mla.q_lora_rank:
    q = DenseGeneral(mla.q_lora_rank, ('embed', None), use_bias=use_bias, kernel_init=inits('query', ('embed', None)),
                     name='query_down', **dense)(x)
    q = DenseGeneral((heads, head_dim), up_axes, kernel_init=inits('query', up_axes), name='query_up',
                     **dense)(norm('query_norm')(q))
  else:
    axes = ('embed', 'heads', 'kv')
    q = DenseGeneral((heads, head_dim), axes, kernel_init=inits('query', axes), name='query', **dense)(x)
  kv = DenseGeneral(rank + mla.rope_head_dim, ('embed', None), use_bias=use_bias,
                    kernel_init=inits('key_value', ('embed', None)), name='kv_down', **dense)(x)
  latent, k_rot = kv[..., :rank], kv[..., rank:]
  up = Kernel((rank, heads, nope + (mla.v_head_dim or head_dim)), up_axes, inits('key_value', up_axes), param_dtype,
              name='kv_up')()  # as DenseGeneral's 'kv_up/kernel'
  latent = norm('kv_norm')(latent)
  q_rot = rotary(q[..., nope:], positions, rope)
  k_rot = rotary(k_rot[:, :, None], positions, rope)  # one rotated key part for every head
  if absorbed:  # q_nope . (latent W_k) = (q_nope W_k^T) . latent, per head
    q_latent = mixed.einsum('blhn,rhn->blhr', q[..., :nope], up[..., :nope], dtype=dtype)
    keys = jnp.concatenate([latent, k_rot[:, :, 0]], axis=-1)[:, :, None]
    return jnp.concatenate([q_latent, q_rot.astype(dtype)], axis=-1), keys.astype(dtype), up[..., nope:]
  kv = mixed.einsum('blr,rhf->blhf', latent, up, dtype=dtype)
  q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
  k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (*k_rot.shape[:2], heads, k_rot.shape[-1]))], axis=-1)
  return q, k, kv[..., nope:]
