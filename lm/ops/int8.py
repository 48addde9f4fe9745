"""int8 matmuls for training (`model.quantization=int8`): [tokens, in] x [in, out] with both operands quantized
symmetrically to int8 (the input per token, the kernel per output channel: each scale its row's or column's largest
magnitude over 127), multiplied with int32 accumulation, and the int32 product rescaled to the compute dtype.

The backward pass is the stated choice of AQT's default: straight through the quantization, the gradients of the
unquantized matmul in the compute dtype (`mixed.einsum`, float32 accumulation). Only the forward matmul runs in
int8 (the s8 x s8 -> s32 dot of the program); the two backward matmuls keep the compute dtype's precision.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.ops import mixed

Dtype = jnp.dtype | type


def quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """(int8 values, float32 scales) with x ~ values * scales, the scale per slice along the other axis: the largest
  magnitude over `axis` / 127 (1 where the slice is all zeros)."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def _forward(x: jax.Array, kernel: jax.Array, dtype: Dtype) -> jax.Array:
  qx, sx = quantize(x, axis=1)  # per token
  qk, sk = quantize(kernel, axis=0)  # per output channel
  product = jax.lax.dot_general(qx, qk, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  return (product.astype(jnp.float32) * sx * sk).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_matmul(x: jax.Array, kernel: jax.Array, dtype: Dtype) -> jax.Array:
  """x [tokens, in] @ kernel [in, out] in int8 (see the module's docstring), the result in `dtype`."""
  return _forward(x, kernel, dtype)


def _fwd(x, kernel, dtype):
  return _forward(x, kernel, dtype), (x, kernel)


def _bwd(dtype, residuals, g):
  x, kernel = residuals
  dx = mixed.einsum('to,io->ti', g, kernel, dtype=dtype, out_dtype=x.dtype)
  dk = mixed.einsum('ti,to->io', x, g, dtype=dtype, out_dtype=kernel.dtype)
  return dx, dk


int8_matmul.defvjp(_fwd, _bwd)
