"""int8 matmuls for training (`model.quantization=int8`): [tokens, in] x [in, out] with both operands quantized
symmetrically to int8 (the input per token, the kernel per output channel: each scale its row's or column's largest
magnitude over 127), multiplied with int32 accumulation, and the int32 product rescaled to the compute dtype.

The backward pass is the stated choice of AQT's default: straight through the quantization, the gradients of the
unquantized matmul in the compute dtype (`mixed.einsum`, float32 accumulation). Only the forward matmul runs in
int8 (the s8 x s8 -> s32 dot of the program); the two backward matmuls keep the compute dtype's precision.

A frozen kernel (model.lora's base, QLoRA's way) is stored quantized once (`quantize_kernel`: int8 values, float32
scales), a quarter of float32's bytes: `frozen_int8_matmul` multiplies by it as `int8_matmul` would, and its input
gradient uses the kernel those values and scales give back (it has none of its own).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def quantize_kernel(kernel: jax.Array, scale_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 values, float32 scales of `scale_shape`) of a kernel [*in, *out] (layers stacked before, if any)
  quantized per output channel as `int8_matmul` does: the scales' shape is the kernel's with each contracted (in)
  axis 1."""
  axes = tuple(i for i, (k, s) in enumerate(zip(kernel.shape, scale_shape, strict=True)) if s == 1 and k != 1)
  x = kernel.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127.0 if axes else jnp.abs(x) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)
  return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def frozen_int8_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, dtype: Dtype) -> jax.Array:
  """x [tokens, in] @ a stored int8 kernel (`values` [in, out] int8, `scales` [1, out]) in int8, the result in
  `dtype`; no gradient for the kernel."""
  qx, sx = quantize(x, axis=1)
  product = jax.lax.dot_general(qx, values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  return (product.astype(jnp.float32) * sx * scales).astype(dtype)


def _frozen_fwd(x, values, scales, dtype):
  return frozen_int8_matmul(x, values, scales, dtype), (x, values, scales)


def _frozen_bwd(dtype, residuals, g):
  x, values, scales = residuals
  kernel = (values.astype(jnp.float32) * scales).astype(dtype)
  dx = mixed.einsum('to,io->ti', g, kernel, dtype=dtype, out_dtype=x.dtype)
  return dx, np.zeros(values.shape, jax.dtypes.float0), jnp.zeros_like(scales)


frozen_int8_matmul.defvjp(_frozen_fwd, _frozen_bwd)
