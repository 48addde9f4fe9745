"""Our Pallas flash attention: blocked online softmax forward, two-kernel backward, bias gradient.

Forward (grid batch x heads x q-blocks x kv-blocks, kv innermost): running max `m`, normaliser `l`
and accumulator live in VMEM scratch; only the output and the log-sum-exp leave the kernel. The
backward recomputes probabilities from the log-sum-exp: one kernel accumulates dK, dV (and writes
dBias blocks) over q-blocks, another accumulates dQ over kv-blocks. Causal kv-blocks above the
diagonal are skipped (and, by clamping the index map, never fetched). Lengths that are not a
multiple of the block are padded with segment id 0, which masks them.

The kernels read and write the model's [batch, length, heads, head_dim] layout directly, viewed as
[batch, length, heads * head_dim] (a free reshape): a block is `heads` consecutive heads' lanes, as few
as make a whole number of 128-lane tiles (one head at head_dim 128, two at 64; all of them where no
smaller group tiles), and the kernel loops over the heads of its block. So no transpose surrounds the
kernels. Block shapes follow TPU (Mosaic) tiling: q- and kv-blocks multiples of 128 (or the whole short
input), per-row statistics as [rows, 1] in VMEM but [8, rows] in HBM (a [rows, 1] float32 array is
padded to 128 lanes there), segment ids as [B, L, 1] / [B, 1, L]. On CPU the same kernels run with
`interpret=True`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lm.ops.attention.masking import MASKED, round_up
from lm.ops.attention.sinks import sink_grad, sunk
from lm.ops.softcap import soft_cap, soft_cap_grad

_LSE_ROWS = 8  # the log-sum-exp leaves the forward kernel as [8, rows]: one sublane tile
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: x @ y.T
_TRANS_A = (((0,), (0,)), ((), ()))  # contract the first dims: x.T @ y


def _tpu_params(semantics: tuple[str, ...]) -> Any:
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _cost(matmuls: int, dims: tuple[int, ...], inputs: list[jax.Array], outputs: list[Any],
          causal: bool) -> pl.CostEstimate:
  """What a kernel costs, for XLA's cost model (a custom call is otherwise counted as free).

  `matmuls` [B, H, Lq, Lk, D]-sized products (dims) of 2 FLOPs each; one exp per score; causal halves both.
  """
  b, h, lq, lk, d = dims
  scores = b * h * lq * lk // (2 if causal else 1)
  nbytes = sum(x.size * x.dtype.itemsize for x in inputs + outputs)
  return pl.CostEstimate(flops=2 * matmuls * scores * d, transcendentals=scores, bytes_accessed=nbytes)


def _scratch(shape: tuple[int, ...]) -> Any:
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.VMEM(shape, jnp.float32)


def _block_mask(q_seg: jax.Array, kv_seg: jax.Array, i: jax.Array, j: jax.Array, bq: int, bk: int,
                causal: bool, window: int) -> jax.Array:
  """[bq, bk] allowed pairs of q-block i and kv-block j: same nonzero segment, causal order, and (window > 0)
  fewer than `window` positions back."""
  mask = (q_seg == kv_seg) & (kv_seg != 0)
  if causal:
    rows = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0) + i * bq
    cols = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk
    mask = mask & (cols <= rows)
    if window:
      mask = mask & (rows - cols < window)
  return mask


def _visible(i: jax.Array, j: jax.Array, bq: int, bk: int, causal: bool, window: int) -> jax.Array | bool:
  """Whether kv-block j holds any key a query of q-block i may see (causal: none after its last query; with a
  window, none `window` or more positions before its first)."""
  if not causal:
    return True
  seen = j * bk <= i * bq + bq - 1
  return seen & (j * bk + bk - 1 > i * bq - window) if window else seen


def _to_rows(column: jax.Array) -> jax.Array:
  """[rows, 1] -> [8, rows] (identical rows): lane-dense, where [rows, 1] in HBM is padded to 128 lanes."""
  return jnp.broadcast_to(column, (column.shape[0], 128)).T[:_LSE_ROWS]


def _to_column(rows: jax.Array) -> jax.Array:
  """[8, rows] as `_to_rows` wrote it -> [rows, 1]."""
  return jnp.broadcast_to(rows[:1], (128, rows.shape[1])).T[:, :1]


def _lanes(head: int, d: int) -> slice:
  """The lanes of a block's `head`-th head."""
  return slice(head * d, (head + 1) * d)


def _scores(q: jax.Array, k: jax.Array, scale: float, softcap: float) -> jax.Array:
  """Scaled q.k, soft-capped to (-softcap, softcap) by softcap * tanh(s / softcap) when softcap > 0 (Gemma 2)."""
  return soft_cap(jax.lax.dot_general(q, k, _TRANS_B, preferred_element_type=jnp.float32) * scale, softcap)


def _with_bias(s: jax.Array, bias_ref: Any, head: int) -> jax.Array:
  if bias_ref is None:
    return s
  return s + bias_ref[0, head if bias_ref.shape[1] > 1 else 0].astype(jnp.float32)  # one head when broadcast


class _Heads:
  """The heads of one block: query head g reads the block's key/value head g // group (a static lane slice:
  a block holds whole groups, or one key/value head shared by all its query heads)."""

  def __init__(self, heads: int, d: int, group: int):
    self.heads, self.d, self.group = heads, d, group

  def q(self, g: int) -> slice:
    return _lanes(g, self.d)

  def kv(self, g: int) -> slice:
    return _lanes(g // self.group, self.d)


# ---------------------------------------------------------------- forward

def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref,
                    m_scr, l_scr, acc_scr, *, causal: bool, window: int, softcap: float, scale: float, bq: int,
                    bk: int, at: _Heads):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(_visible(i, j, bq, bk, causal, window))
  def _step():
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal, window)
    for g in range(at.heads):
      s = _with_bias(_scores(q_ref[0, :, at.q(g)], k_ref[0, :, at.kv(g)], scale, softcap), bias_ref, g)
      s = jnp.where(mask, s, MASKED)
      m_prev = m_scr[g]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
      alpha = jnp.exp(m_prev - m_new)
      l_scr[g] = alpha * l_scr[g] + jnp.sum(p, axis=1, keepdims=True)
      v = v_ref[0, :, at.kv(g)]
      acc_scr[:, at.q(g)] = alpha * acc_scr[:, at.q(g)] + jax.lax.dot(p.astype(v.dtype), v,
                                                                      preferred_element_type=jnp.float32)
      m_scr[g] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    for g in range(at.heads):
      norm = l_scr[g]
      empty = norm == 0.0  # every key masked: output 0, log-sum-exp MASKED (no weight where blocks combine)
      safe = jnp.where(empty, 1.0, norm)
      o_ref[0, :, at.q(g)] = (acc_scr[:, at.q(g)] / safe).astype(o_ref.dtype)
      lse_ref[0, g] = _to_rows(jnp.where(empty, MASKED, m_scr[g] + jnp.log(safe)))


# ---------------------------------------------------------------- backward

def _probs_and_ds(q, k, v, do, lse, o, bias_ref, head, mask, scale, softcap):
  """Recomputed probabilities p, dS = p * (dO V^T - delta) (the gradient of the logits, and of a bias) and the
  gradient of the scaled q.k under it (dS times the soft-cap's derivative 1 - tanh^2) for one block of one head.

  delta = rowsum(dO * O) is recomputed per block rather than passed in: a [rows, 1] float32 array
  in HBM is padded to 128 lanes on TPU, which would cost 128x its size.
  """
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1, keepdims=True)
  capped = _scores(q, k, scale, softcap)
  p = jnp.where(mask, jnp.exp(_with_bias(capped, bias_ref, head) - lse), 0.0)
  dp = jax.lax.dot_general(do, v, _TRANS_B, preferred_element_type=jnp.float32)
  ds = p * (dp - delta)
  return p, ds, ds * soft_cap_grad(capped, softcap) if softcap else ds


def _head_block(refs, at: _Heads, g: int):
  """q, k, v, dO, log-sum-exp and O of head g from the block refs."""
  q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref = refs
  return (q_ref[0, :, at.q(g)], k_ref[0, :, at.kv(g)], v_ref[0, :, at.kv(g)], do_ref[0, :, at.q(g)],
          _to_column(lse_ref[0, g]), o_ref[0, :, at.q(g)])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, bias_ref, q_seg_ref, kv_seg_ref,
                dk_ref, dv_ref, dbias_ref, dk_scr, dv_scr, *, causal: bool, window: int, softcap: float,
                scale: float, bq: int, bk: int, at: _Heads):
  j, i = pl.program_id(2), pl.program_id(3)  # kv-block outer, q-block inner

  @pl.when(i == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  visible = _visible(i, j, bq, bk, causal, window)

  @pl.when(visible)
  def _step():
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal, window)
    for g in range(at.heads):
      q, k, v, do, lse, o = _head_block((q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref), at, g)
      p, ds, ds_qk = _probs_and_ds(q, k, v, do, lse, o, bias_ref, g, mask, scale, softcap)
      lanes = at.q(g)  # dK, dV per query head: summed over each key/value head's group outside
      dv_scr[:, lanes] += jax.lax.dot_general(p.astype(do.dtype), do, _TRANS_A, preferred_element_type=jnp.float32)
      dk_scr[:, lanes] += jax.lax.dot_general(ds_qk.astype(q.dtype), q, _TRANS_A,
                                              preferred_element_type=jnp.float32) * scale
      if dbias_ref is not None:
        dbias_ref[0, g] = ds.astype(dbias_ref.dtype)

  if dbias_ref is not None and causal:
    @pl.when(jnp.logical_not(visible))
    def _zero_bias_grad():
      dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)

  @pl.when(i == pl.num_programs(3) - 1)
  def _store():
    dk_ref[0] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[0] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, bias_ref, q_seg_ref, kv_seg_ref,
               dq_ref, dq_scr, *, causal: bool, window: int, softcap: float, scale: float, bq: int, bk: int,
               at: _Heads):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  @pl.when(_visible(i, j, bq, bk, causal, window))
  def _step():
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal, window)
    for g in range(at.heads):
      q, k, v, do, lse, o = _head_block((q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref), at, g)
      _, _, ds_qk = _probs_and_ds(q, k, v, do, lse, o, bias_ref, g, mask, scale, softcap)
      dq_scr[:, at.q(g)] += jax.lax.dot(ds_qk.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    dq_ref[0] = dq_scr[...].astype(dq_ref.dtype)


# ---------------------------------------------------------------- pallas_call plumbing

def heads_per_block(heads: int, kv_heads: int, d: int) -> int:
  """The fewest query heads per block whose lanes tile TPU's 128 (or are all of them), holding whole groups of
  query heads per key/value head, or sharing one key/value head, whose lanes tile too (or are all of them)."""
  group = heads // kv_heads
  for g in range(1, heads + 1):
    if heads % g or (g % group and group % g):
      continue
    kv_g = max(g // group, 1)
    if (g * d % 128 == 0 or g == heads) and (kv_g * d % 128 == 0 or kv_g == kv_heads):
      return g
  return heads


@functools.lru_cache(maxsize=None)
def _specs(causal: bool, window: int, bq: int, bk: int, d: int, at: tuple[int, int],
           bias_shape: tuple[int, ...] | None, kv_outer: bool):
  """BlockSpecs over [B, L, heads * d] for a grid (b, head block, outer, inner); `at` = (heads per block, group).

  A head block of `g` query heads reads key/value heads from (block * g) // group: with grouped-query
  attention their lanes are fetched, never copied.
  """
  g, group = at
  kv_g = max(g // group, 1)

  def blocks(outer, inner):
    i, j = (inner, outer) if kv_outer else (outer, inner)
    if causal and not kv_outer:  # clamp to the visible kv-blocks: skipped steps fetch nothing new
      # lax.div: no floor-division sign ops in Mosaic; int32 operands also under jax_enable_x64
      j = jnp.minimum(j, jax.lax.div(i * bq + bq - 1, jnp.int32(bk)))
      if window:  # the first block holding a key fewer than `window` positions before the block's first query
        j = jnp.maximum(j, jax.lax.div(jnp.maximum(i * bq - window + 1, 0), jnp.int32(bk)))
    return i, j

  def q_map(b, h, o, n):
    return b, blocks(o, n)[0], h

  def kv_map(b, h, o, n):
    return b, blocks(o, n)[1], jax.lax.div(h * g // group, jnp.int32(kv_g))

  def per_head_kv_map(b, h, o, n):
    return b, blocks(o, n)[1], h

  def bias_map(b, h, o, n):
    i, j = blocks(o, n)
    return (b if bias_shape[0] > 1 else 0), (h if bias_shape[1] > 1 else 0), i, j

  def lse_map(b, h, o, n):
    return b, h, 0, blocks(o, n)[0]

  def q_seg_map(b, h, o, n):
    return b, blocks(o, n)[0], 0

  def kv_seg_map(b, h, o, n):
    return b, 0, blocks(o, n)[1]

  return dict(
    q=pl.BlockSpec((1, bq, g * d), q_map), kv=pl.BlockSpec((1, bk, kv_g * d), kv_map),
    per_head_kv=pl.BlockSpec((1, bk, g * d), per_head_kv_map),
    lse=pl.BlockSpec((1, g, _LSE_ROWS, bq), lse_map),
    bias=None if bias_shape is None else pl.BlockSpec((1, g if bias_shape[1] > 1 else 1, bq, bk), bias_map),
    q_seg=pl.BlockSpec((1, bq, 1), q_seg_map), kv_seg=pl.BlockSpec((1, 1, bk), kv_seg_map),
  )


def _with_optional(kernel, has_bias: bool, n_before_bias: int):
  """Adapts a kernel taking `bias_ref` (and `dbias_ref`) to calls that omit them."""
  if has_bias:
    return kernel

  def wrapped(*refs, **kw):
    refs = list(refs)
    refs.insert(n_before_bias, None)
    if kernel is _dkv_kernel:
      refs.insert(n_before_bias + 5, None)  # dbias_ref after dk, dv
    return kernel(*refs, **kw)
  return wrapped


def _forward(q, k, v, bias, q_seg, kv_seg, *, heads, causal, window, softcap, scale, bq, bk, interpret):
  b, lq, width = q.shape
  lk, d = k.shape[1], width // heads
  kv_heads = k.shape[2] // d
  at = _Heads(heads_per_block(heads, kv_heads, d), d, heads // kv_heads)
  specs = _specs(causal, window, bq, bk, d, (at.heads, at.group), None if bias is None else bias.shape, False)
  inputs = [q, k, v] + ([bias] if bias is not None else []) + [q_seg, kv_seg]
  in_specs = [specs['q'], specs['kv'], specs['kv']] + ([specs['bias']] if bias is not None else []) + \
             [specs['q_seg'], specs['kv_seg']]
  kernel = functools.partial(_with_optional(_forward_kernel, bias is not None, 3),
                             causal=causal, window=window, softcap=softcap, scale=scale, bq=bq, bk=bk, at=at)
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, heads, _LSE_ROWS, lq), jnp.float32)]
  return pl.pallas_call(
    kernel, grid=(b, heads // at.heads, lq // bq, lk // bk), in_specs=in_specs,
    out_specs=[specs['q'], specs['lse']], out_shape=out_shape,
    scratch_shapes=[_scratch((at.heads, bq, 1)), _scratch((at.heads, bq, 1)), _scratch((bq, at.heads * d))],
    compiler_params=None if interpret else _tpu_params(('parallel', 'parallel', 'parallel', 'arbitrary')),
    cost_estimate=_cost(2, (b, heads, lq, lk, d), inputs, out_shape, causal), interpret=interpret)(*inputs)


def _backward(q, k, v, bias, q_seg, kv_seg, o, lse, do, *, heads, causal, window, softcap, scale, bq, bk,
              interpret):
  b, lq, width = q.shape
  lk, d = k.shape[1], width // heads
  kv_heads = k.shape[2] // d
  group = heads // kv_heads
  at = _Heads(heads_per_block(heads, kv_heads, d), d, group)
  has_bias = bias is not None
  bias_shape = None if bias is None else bias.shape
  params = None if interpret else _tpu_params(('parallel', 'parallel', 'parallel', 'arbitrary'))

  def call(kernel, kv_outer, out_specs, out_shape, scratch, matmuls):
    specs = _specs(causal, window, bq, bk, d, (at.heads, group), bias_shape, kv_outer)
    inputs = [q, k, v, do, lse, o] + ([bias] if has_bias else []) + [q_seg, kv_seg]
    in_specs = [specs['q'], specs['kv'], specs['kv'], specs['q'], specs['lse'], specs['q']] + \
               ([specs['bias']] if has_bias else []) + [specs['q_seg'], specs['kv_seg']]
    blocks = heads // at.heads
    grid = (b, blocks, lk // bk, lq // bq) if kv_outer else (b, blocks, lq // bq, lk // bk)
    body = functools.partial(_with_optional(kernel, has_bias, 6), causal=causal, window=window, softcap=softcap,
                             scale=scale, bq=bq, bk=bk, at=at)
    outs = out_shape if isinstance(out_shape, list) else [out_shape]
    return pl.pallas_call(body, grid=grid, in_specs=in_specs, out_specs=out_specs(specs), out_shape=out_shape,
                          scratch_shapes=scratch, compiler_params=params,
                          cost_estimate=_cost(matmuls, (b, heads, lq, lk, d), inputs, outs, causal),
                          interpret=interpret)(*inputs)

  # dK, dV per query head, summed over each key/value head's group below (a no-op without GQA).
  dkv_outs = lambda s: [s['per_head_kv']] * 2 + (
    [pl.BlockSpec((1, at.heads, bq, bk), lambda b_, h_, j, i: (b_, h_, i, j))] if has_bias else [])
  per_head = lambda x: jax.ShapeDtypeStruct((b, lk, width), jnp.float32 if group > 1 else x.dtype)
  dkv_shapes = [per_head(k), per_head(v)] + \
               ([jax.ShapeDtypeStruct((b, heads, lq, lk), jnp.float32)] if has_bias else [])
  scratch = [_scratch((bk, at.heads * d)), _scratch((bk, at.heads * d))]
  dk, dv, *dbias = call(_dkv_kernel, True, dkv_outs, dkv_shapes, scratch, matmuls=4)  # scores, dV, dP, dK
  if group > 1:
    dk, dv = (g.reshape(b, lk, kv_heads, group, d).sum(axis=3).reshape(x.shape).astype(x.dtype)
              for g, x in ((dk, k), (dv, v)))
  dq = call(_dq_kernel, False, lambda s: s['q'], jax.ShapeDtypeStruct(q.shape, q.dtype),
            [_scratch((bq, at.heads * d))], matmuls=3)  # scores, dP, dQ
  if has_bias:  # sum over the dims the bias was broadcast along
    axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
    dbias = jnp.sum(dbias[0], axis=axes, keepdims=True).astype(bias.dtype)
  else:
    dbias = None
  return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13, 14))
def _flash(q, k, v, bias, q_seg, kv_seg, sinks, heads, causal, window, softcap, scale, bq, bk, interpret):
  return _flash_fwd(q, k, v, bias, q_seg, kv_seg, sinks, heads, causal, window, softcap, scale, bq, bk,
                    interpret)[0]


def _flash_fwd(q, k, v, bias, q_seg, kv_seg, sinks, heads, causal, window, softcap, scale, bq, bk, interpret):
  o, lse = _forward(q, k, v, bias, q_seg, kv_seg, heads=heads, causal=causal, window=window, softcap=softcap,
                    scale=scale, bq=bq, bk=bk, interpret=interpret)
  if sinks is not None:  # the kernel's backward, given these, is the gradient with the sinks (`sinks`)
    o4, total = sunk(o.reshape(*o.shape[:2], heads, -1), lse[:, :, 0], sinks)
    o, lse = o4.reshape(o.shape), jnp.broadcast_to(total[:, :, None], lse.shape)
  return o, (q, k, v, bias, q_seg, kv_seg, sinks, o, lse)


def _flash_bwd(heads, causal, window, softcap, scale, bq, bk, interpret, residuals, do):
  q, k, v, bias, q_seg, kv_seg, sinks, o, lse = residuals
  dq, dk, dv, dbias = _backward(q, k, v, bias, q_seg, kv_seg, o, lse, do, heads=heads, causal=causal,
                                window=window, softcap=softcap, scale=scale, bq=bq, bk=bk, interpret=interpret)
  per_head = lambda x: x.reshape(*x.shape[:2], heads, -1)
  dsinks = None if sinks is None else sink_grad(per_head(o), lse[:, :, 0], per_head(do), sinks)
  return dq, dk, dv, dbias, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                    bias: jax.Array | None = None, scale: float | None = None, window: int = 0,
                    softcap: float = 0.0, block_q: int = 128, block_k: int = 128,
                    platform: str | None = None, sinks: jax.Array | None = None) -> jax.Array:
  """Attention over q [B, Lq, H, D], k/v [B, Lk, K, D] (Flax layout) -> [B, Lq, H, D].

  K key/value heads divide the H query heads (grouped-query attention when K < H).
  `segment_ids` / `kv_segment_ids` [B, L] (0 = padding), `bias` broadcastable to [B, H, Lq, Lk] and
  differentiable. `window` > 0 (causal only): each query sees the keys fewer than `window` positions back, and
  kv-blocks wholly outside it are skipped; `softcap` > 0: scaled logits pass through softcap * tanh(. / softcap)
  before the bias. `sinks` [H] (differentiable): each head's learned sink logit in the softmax's denominator
  (`lm.ops.attention.sinks`). Block sizes are rounded to TPU tiles (multiples of 128) and shrunk for short
  inputs; lengths are padded to whole blocks. `platform` (default: the default backend) picks Mosaic
  on 'tpu' and the Pallas interpreter on 'cpu'.
  """
  platform = platform or jax.default_backend()
  if platform not in ('tpu', 'cpu'):
    raise ValueError(f'the flash kernel is written for TPU (Mosaic) and runs interpreted on CPU, not on '
                     f'{platform}; use attention impl cudnn or xla there')
  h = q.shape[2]
  if h % k.shape[2] or k.shape != v.shape:
    raise ValueError(f'key/value heads must match and divide the {h} query heads; got k {k.shape}, v {v.shape}')
  if window and not causal:
    raise ValueError('a sliding window applies to causal attention only')
  scale = q.shape[3] ** -0.5 if scale is None else scale
  blocks = _Blocks(q.shape, k.shape, segment_ids, kv_segment_ids, block_q, block_k)
  out = _flash(blocks.q(q), blocks.kv(k), blocks.kv(v), blocks.bias(bias), blocks.q_seg, blocks.kv_seg, sinks, h,
               causal, int(window), float(softcap), float(scale), blocks.bq, blocks.bk, platform == 'cpu')
  return blocks.unpad(out, h)


class _Blocks:
  """Block sizes for q [B, Lq, H, D] and k/v [B, Lk, K, D], and the padded [B, L, heads * D] views and segment
  ids the kernels take: block sizes are rounded to TPU tiles (multiples of 128) and shrunk for short inputs;
  lengths are padded to whole blocks, the padding in segment 0."""

  def __init__(self, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], segment_ids: jax.Array | None,
               kv_segment_ids: jax.Array | None, block_q: int, block_k: int):
    b, self.lq, _, _ = q_shape
    self.lk = kv_shape[1]
    self.bq = min(round_up(block_q, 128), round_up(self.lq, 8))  # lse blocks are [8, bq]: 128-lane multiples
    self.bk = min(round_up(block_k, 128), round_up(self.lk, 128))
    self.pq, self.pk = round_up(self.lq, self.bq), round_up(self.lk, self.bk)
    if segment_ids is None:
      segment_ids = jnp.ones((b, self.lq), jnp.int32)
    if kv_segment_ids is None:
      kv_segment_ids = segment_ids if self.lq == self.lk else jnp.ones((b, self.lk), jnp.int32)
    self.q_seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, self.pq - self.lq)))[:, :, None]
    self.kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, self.pk - self.lk)))[:, None, :]

  @staticmethod
  def _lanes(x: jax.Array, n: int) -> jax.Array:  # [B, L, heads, D] -> [B, n, heads * D]: a view, padded if short
    x = x.reshape(x.shape[0], x.shape[1], -1)
    return x if n == x.shape[1] else jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0)))

  def q(self, x: jax.Array) -> jax.Array:
    return self._lanes(x, self.pq)

  def kv(self, x: jax.Array) -> jax.Array:
    return self._lanes(x, self.pk)

  def unpad(self, x: jax.Array, heads: int) -> jax.Array:  # [B, pq, heads * D] -> [B, Lq, heads, D]
    return x[:, :self.lq].reshape(x.shape[0], self.lq, heads, -1)

  def bias(self, bias: jax.Array | None) -> jax.Array | None:  # broadcastable to [B, H, Lq, Lk] -> padded 4-d
    if bias is None:
      return None
    bias = jnp.asarray(bias)
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bias = jnp.broadcast_to(bias, bias.shape[:2] + (self.lq, self.lk))
    return jnp.pad(bias, ((0, 0), (0, 0), (0, self.pq - self.lq), (0, self.pk - self.lk)))

  def lse(self, lse: jax.Array) -> jax.Array:  # [B, H, Lq] -> the kernels' [B, H, 8, pq]
    lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, self.pq - self.lq)))
    return jnp.broadcast_to(lse[:, :, None], lse.shape[:2] + (_LSE_ROWS, self.pq))


def flash_block(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_segment_ids: jax.Array,
                bias: jax.Array | None = None, *, causal: bool, scale: float, block_q: int, block_k: int,
                interpret: bool, window: int = 0, softcap: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """One block of a blockwise attention (ring attention's per-hop compute): the normalised output [B, Lq, H, D]
  and log-sum-exp [B, H, Lq] (float32; MASKED where every key is masked, so partial results combine by
  log-sum-exp weights). Not differentiable: `flash_block_grads` is its backward given the final output and
  log-sum-exp. Shapes as `flash_attention`'s, key/value heads equal to the query heads."""
  heads = q.shape[2]
  blocks = _Blocks(q.shape, k.shape, segment_ids, kv_segment_ids, block_q, block_k)
  o, lse = _forward(blocks.q(q), blocks.kv(k), blocks.kv(v), blocks.bias(bias), blocks.q_seg, blocks.kv_seg,
                    heads=heads, causal=causal, window=window, softcap=softcap, scale=scale, bq=blocks.bq,
                    bk=blocks.bk, interpret=interpret)
  return blocks.unpad(o, heads), lse[:, :, 0, :blocks.lq]


def flash_block_grads(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                      kv_segment_ids: jax.Array, bias: jax.Array | None, o: jax.Array, lse: jax.Array,
                      do: jax.Array, *, causal: bool, scale: float, block_q: int, block_k: int, interpret: bool,
                      window: int = 0, softcap: float = 0.0
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """dQ, dK, dV (and d bias, summed over the dims it broadcasts along) of one block given the whole attention's
  output `o` [B, Lq, H, D], log-sum-exp `lse` [B, H, Lq] and output gradient `do`: this block's share of the
  gradients (the probabilities are recomputed against the final log-sum-exp, so the blocks' shares add up to
  the whole attention's gradients)."""
  heads = q.shape[2]
  blocks = _Blocks(q.shape, k.shape, segment_ids, kv_segment_ids, block_q, block_k)
  dq, dk, dv, dbias = _backward(
    blocks.q(q), blocks.kv(k), blocks.kv(v), blocks.bias(bias), blocks.q_seg, blocks.kv_seg,
    blocks.q(o.astype(q.dtype)), blocks.lse(lse), blocks.q(do.astype(q.dtype)), heads=heads, causal=causal,
    window=window, softcap=softcap, scale=scale, bq=blocks.bq, bk=blocks.bk, interpret=interpret)
  kv_unpad = lambda x: x[:, :blocks.lk].reshape(k.shape)
  dbias = None if bias is None else dbias[:, :, :blocks.lq, :blocks.lk].reshape(jnp.shape(bias))
  return blocks.unpad(dq, heads), kv_unpad(dk), kv_unpad(dv), dbias
