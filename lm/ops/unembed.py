"""The output layer and its cross-entropy in tiles over the sequence, so the [tokens, vocab] logits never exist whole.

A model hands the loss an `Unembedding` (its last hidden states and the output layer's weights) instead of
logits. With `chunk` > 0 the loss runs over tiles of `chunk` positions: each tile's logits, softmax and
logits gradient live only inside one iteration of a scan, and the gradients of the hidden states, kernel and
bias are computed right there, in the forward pass (Liger's fused linear cross-entropy): the backward only
scales them by the loss's cotangent. So the step keeps no logits, recomputes no output-layer matmul, and runs
the same three matmuls as the untiled layer.
"""
from __future__ import annotations

import functools
from typing import Any

import einops
import jax
import jax.numpy as jnp
from flax import struct

from lm.ops import mixed
from lm.ops.losses import cross_entropy, weighted_sums
from lm.ops.softcap import soft_cap, soft_cap_grad
from lm.parallel.rules import constrain

Dtype = Any

# einsum specs by the kernel's layout: logits, the hidden states' gradient.
_SPECS = {'vd': ('bcd,vd->bcv', 'bcv,vd->bcd'), 'dv': ('bcd,dv->bcv', 'bcv,dv->bcd')}


@struct.dataclass
class Unembedding:
  """The output layer not yet applied: `logits()` applies it; the token loss tiles it (`chunk` positions)."""
  hidden: jax.Array  # [batch, length, embed] in the compute dtype
  kernel: jax.Array  # [vocab, embed] (layout 'vd', a tied embedding table) or [embed, vocab] ('dv', an lm_head)
  bias: jax.Array | None  # [vocab] or None
  layout: str = struct.field(pytree_node=False)
  axes: tuple[str | None, ...] = struct.field(pytree_node=False)  # the kernel's logical axes
  dtype: Dtype = struct.field(pytree_node=False)
  chunk: int = struct.field(pytree_node=False, default=0)  # sequence positions per tile; 0: untiled
  softcap: float = struct.field(pytree_node=False, default=0.0)  # > 0: logits soft-capped (Gemma 2's final 30)

  def logits(self) -> jax.Array:
    """[batch, length, vocab] in the compute dtype."""
    h = self.hidden
    if self.layout == 'vd':
      logits = mixed.einsum('bld,vd->blv', h, self.kernel, dtype=self.dtype)
    else:  # as one [tokens, embed] x [embed, vocab] matmul, as a dense layer (`layers._matmul_2d`)
      tokens = einops.rearrange(h, 'b l d -> (b l) d')
      logits = mixed.einsum('td,dv->tv', tokens, self.kernel, dtype=self.dtype).reshape(*h.shape[:2], -1)
    if self.bias is not None:
      logits = logits + self.bias.astype(logits.dtype)
    if self.softcap:
      logits = soft_cap(logits.astype(jnp.float32), self.softcap).astype(logits.dtype)
    return constrain(logits, ('batch', 'length', 'vocab'))


def tiled_cross_entropy(u: Unembedding, targets: jax.Array, weights: jax.Array, z_loss: float
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(sum of weighted NLL + z-loss, the NLL sum, the z-loss sum) of `u`'s logits against `targets` [batch,
  length] with `weights`, in float32, tile by tile. Only the first is differentiable (the loss); the two
  sums are metrics, constants to autodiff."""
  length = targets.shape[1]
  chunk = min(u.chunk, length)
  pad = -length % chunk  # padded positions have weight 0: no loss, no gradient
  hidden, targets, weights = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                              for x in (u.hidden, targets, weights.astype(jnp.float32)))
  tiles = lambda x: einops.rearrange(x, 'b (n c) ... -> n b c ...', c=chunk)
  loss, (nll, z) = _fused(u.layout, u.axes, jnp.dtype(u.dtype), float(z_loss), float(u.softcap), tiles(hidden),
                          u.kernel, u.bias, tiles(targets), tiles(weights))
  return loss, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(z)


def _tile_logits(layout: str, dtype: Dtype, softcap: float, h: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                 targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """(float32 softmax [b, c, vocab], log-partition [b, c], target logits [b, c], the one-hot mask of targets, the
  soft-cap's derivative at the logits)."""
  logits = mixed.einsum(_SPECS[layout][0], h, kernel, dtype=dtype, out_dtype=jnp.float32)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  logits = constrain(soft_cap(logits, softcap), ('batch', 'length', 'vocab'))
  # The log-partition from the exponentials the softmax reuses: one exp over the tile, not two.
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - row_max)
  total = jnp.sum(e, axis=-1, keepdims=True)
  log_z = (row_max + jnp.log(total))[..., 0]
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]  # a sum, not a gather: vocab may be sharded
  cap_grad = soft_cap_grad(logits, softcap) if softcap else None
  return e / total, log_z, jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1), is_target, cap_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
@jax.named_scope('output_loss')  # profiles (bench/profile_step.py) group its kernels by this name
def _fused(layout, axes, dtype, z_loss, softcap, hidden, kernel, bias, targets, weights):
  """Loss and metric sums only (no gradients): the primal, for evaluation."""
  def tile(sums, xs):
    h, t, w = xs
    _, log_z, target_logits, _, _ = _tile_logits(layout, dtype, softcap, h, kernel, bias, t)
    nll, z = weighted_sums(z_loss, log_z, target_logits, w)
    return (sums[0] + nll, sums[1] + z), None
  (nll, z), _ = jax.lax.scan(tile, (jnp.float32(0), jnp.float32(0)), (hidden, targets, weights))
  return nll + z, (nll, z)


@jax.named_scope('output_loss')
def _fused_fwd(layout, axes, dtype, z_loss, softcap, hidden, kernel, bias, targets, weights):
  hidden_spec = _SPECS[layout][1]
  # The kernel's gradient accumulates as [embed, vocab] whatever its layout: both of a tile's gradient matmuls
  # then read the logits' gradient as it is made, [tokens, vocab] (a [vocab, tokens] operand costs XLA:CPU a
  # transposed copy of it); a tied table's is transposed once, after the last tile.
  dv_axes = axes if layout == 'dv' else axes[::-1]

  def tile(carry, xs):
    d_kernel, d_bias, nll_sum, z_sum = carry
    h, t, w = xs
    probs, log_z, target_logits, is_target, cap_grad = _tile_logits(layout, dtype, softcap, h, kernel, bias, t)
    nll, z = weighted_sums(z_loss, log_z, target_logits, w)
    # d(nll + z)/d logits = w (1 + 2 z_loss log_z) softmax - w onehot(target), through the soft-cap's derivative
    d_logits = probs * (w * (1.0 + 2.0 * z_loss * log_z))[..., None] - jnp.where(is_target, w[..., None], 0.0)
    if cap_grad is not None:
      d_logits = d_logits * cap_grad
    d_logits = constrain(d_logits, ('batch', 'length', 'vocab'))
    d_h = mixed.einsum(hidden_spec, d_logits, kernel, dtype=dtype, out_dtype=jnp.float32)
    d_kernel = d_kernel + mixed.einsum('bcd,bcv->dv', h, d_logits, dtype=dtype, out_dtype=jnp.float32)
    if d_bias is not None:
      d_bias = d_bias + jnp.sum(d_logits, axis=(0, 1))
    return (constrain(d_kernel, dv_axes), d_bias, nll_sum + nll, z_sum + z), d_h.astype(hidden.dtype)

  zeros = lambda shape: jnp.zeros(shape, jnp.float32)
  vocab = kernel.shape[0] if layout == 'vd' else kernel.shape[1]
  init = (constrain(zeros((hidden.shape[-1], vocab)), dv_axes), None if bias is None else zeros(bias.shape),
          jnp.float32(0), jnp.float32(0))
  (d_kernel, d_bias, nll, z), d_hidden = jax.lax.scan(tile, init, (hidden, targets, weights))
  d_kernel = d_kernel if layout == 'dv' else constrain(d_kernel.T, axes)
  d_bias = None if bias is None else d_bias.astype(bias.dtype)
  return (nll + z, (nll, z)), (d_hidden, d_kernel.astype(kernel.dtype), d_bias)


def _fused_bwd(layout, axes, dtype, z_loss, softcap, residuals, cotangents):
  g = cotangents[0]  # the metric sums' cotangents are zero: the caller stops their gradient
  scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
  return (*map(scale, residuals), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_loss(head: Unembedding, targets: jax.Array, weights: jax.Array, z_loss: float = 0.0
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(sum of weighted NLL + z-loss, the NLL sum, the z-loss sum, sum of weights) of the output layer `head`
  against `targets`: untiled, or in tiles when `head.chunk` > 0 (`model.execution.loss_chunk`). Only the first is
  differentiated; the sums are metrics."""
  weights = weights.astype(jnp.float32)
  if head.chunk:
    loss, nll, z = tiled_cross_entropy(head, targets, weights, z_loss)
  else:
    nll, z, _ = cross_entropy(head.logits(), targets, weights, z_loss)
    loss, nll, z = nll + z, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(z)
  return loss, nll, z, jnp.sum(weights)
