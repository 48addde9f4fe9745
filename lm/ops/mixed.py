"""Two-operand einsum whose low-precision form multiplies in bf16 and accumulates in float32, forward and backward.

A bf16 x bf16 dot with a bf16 result is compiled on CPU as convert, float32 dot, convert, and JAX's transpose of
a dot hands the backward dots the float32 cotangent of a float32-accumulated forward, so both run at the float32
rate. Asking for float32 results from bf16 operands (`preferred_element_type`) runs on the CPU's bf16 units at
about twice that rate. This einsum does so in all three dots of a matmul's forward and backward: the cotangent is
cast to the compute dtype, each gradient accumulates in float32 and is cast to its operand's dtype, so a float32
weight passed in gets a float32 gradient without a round trip through bf16.

On TPU (and GPU) the matrix units accumulate in float32 whatever type they write, so each dot there writes its
result type directly: bf16 activations and their gradients, float32 weight gradients and logits. A float32 result
that is only cast down afterwards costs twice the bytes, and on TPU the float32-output forward projections of a
sharded step made the compiler abort ("TransformWindow: split of a padded window dim is not supported") at 4, 8
and 16 rows per device for Llama 2 7B on v5p-64.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from lm.parallel.rules import target_platform

Dtype = Any


def einsum(spec: str, a: jax.Array, b: jax.Array, *, dtype: Dtype, out_dtype: Dtype | None = None) -> jax.Array:
  """`jnp.einsum(spec, a, b)` computed in `dtype` with float32 accumulation, the result in `out_dtype`
  (default `dtype`). Float32 `dtype` is the plain einsum. Each index of an operand must appear in the other
  operand or the output (no index summed within one operand), as in every matmul."""
  out_dtype = out_dtype or dtype
  if jnp.dtype(dtype) == jnp.float32:
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype)).astype(out_dtype)
  on_cpu = target_platform() == 'cpu'
  return _mixed(spec, jnp.dtype(dtype), jnp.dtype(out_dtype), a.dtype, b.dtype, on_cpu, a, b)


def _dot(spec: str, a: jax.Array, b: jax.Array, out_dtype: jnp.dtype, on_cpu: bool) -> jax.Array:
  """The einsum as one float32-accumulating dot_general with its result in `out_dtype`: written directly by the
  dot off CPU, converted from the dot's float32 result on CPU (see `_cpu_dot`)."""
  if not on_cpu:
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
  return _cpu_dot(spec, a, b).astype(out_dtype)


def _cpu_dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """The einsum as one float32-output dot_general whose left operand has its contracted axes last.

  XLA:CPU runs a low-precision dot on its bf16 units (YNNPACK) only in that layout: with the left operand's
  contracted axis first (a weight gradient, [tokens, in]^T [tokens, out]) it upcasts both operands to float32,
  or for some batched shapes fails at run time ("Unsupported element type for DotThunk"). So the operands are
  ordered, and the left one transposed if need be, for the fewest elements moved; optimization barriers keep
  XLA from folding a transpose of an operand or of the result back into the dot's dimension numbers.
  """
  inputs, out = spec.replace(' ', '').split('->')
  contracted = ''.join(c for c in inputs.split(',')[0] if c in inputs.split(',')[1] and c not in out)

  def plan(lhs_spec: str, rhs_spec: str, lhs: jax.Array, rhs: jax.Array) -> tuple[int, str, str, str]:
    """(elements moved, the left operand's axis order, the batch axes, the dot's output order) with `lhs` on
    the left."""
    arranged = lhs_spec if lhs_spec.endswith(contracted) else \
      ''.join(c for c in lhs_spec if c not in contracted) + contracted
    batch = ''.join(c for c in arranged if c in rhs_spec and c in out)
    y_spec = batch + ''.join(c for c in arranged if c not in rhs_spec) + ''.join(c for c in rhs_spec
                                                                                 if c not in arranged)
    out_size = math.prod(dict(zip(lhs_spec + rhs_spec, lhs.shape + rhs.shape))[c] for c in out)
    moved = (lhs.size if arranged != lhs_spec else 0) + (out_size if y_spec != out else 0)
    return moved, arranged, batch, y_spec

  a_spec, b_spec = inputs.split(',')
  as_given, swapped = plan(a_spec, b_spec, a, b), plan(b_spec, a_spec, b, a)
  chosen = as_given
  if swapped[0] < as_given[0]:
    a_spec, b_spec, a, b, chosen = b_spec, a_spec, b, a, swapped
  _, arranged, batch, y_spec = chosen
  if arranged != a_spec:
    a = jax.lax.optimization_barrier(jnp.transpose(a, [a_spec.index(c) for c in arranged]))
  dims = (([arranged.index(c) for c in contracted], [b_spec.index(c) for c in contracted]),
          ([arranged.index(c) for c in batch], [b_spec.index(c) for c in batch]))
  y = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  if y_spec == out:
    return y
  return jnp.transpose(jax.lax.optimization_barrier(y), [y_spec.index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _mixed(spec: str, dtype: jnp.dtype, out_dtype: jnp.dtype, a_dtype: jnp.dtype, b_dtype: jnp.dtype, on_cpu: bool,
           a: jax.Array, b: jax.Array) -> jax.Array:
  return _dot(spec, a.astype(dtype), b.astype(dtype), out_dtype, on_cpu)


def _mixed_fwd(spec, dtype, out_dtype, a_dtype, b_dtype, on_cpu, a, b):
  a_c, b_c = a.astype(dtype), b.astype(dtype)  # the residuals: half a float32 copy's memory
  return _dot(spec, a_c, b_c, out_dtype, on_cpu), (a_c, b_c)


def _mixed_bwd(spec, dtype, out_dtype, a_dtype, b_dtype, on_cpu, residuals, g):
  a_c, b_c = residuals
  inputs, out = spec.replace(' ', '').split('->')
  a_spec, b_spec = inputs.split(',')
  g = g.astype(dtype)
  da = _dot(f'{out},{b_spec}->{a_spec}', g, b_c, a_dtype, on_cpu)
  db = _dot(f'{a_spec},{out}->{b_spec}', a_c, g, b_dtype, on_cpu)
  return da, db


_mixed.defvjp(_mixed_fwd, _mixed_bwd)
