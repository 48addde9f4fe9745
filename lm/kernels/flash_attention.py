"""Our Pallas flash attention: blocked online softmax forward, two-kernel backward, bias gradient.

Forward (grid batch x heads x q-blocks x kv-blocks, kv innermost): running max `m`, normaliser `l`
and accumulator live in VMEM scratch; only the output and the log-sum-exp leave the kernel. The
backward recomputes probabilities from the log-sum-exp: one kernel accumulates dK, dV (and writes
dBias blocks) over q-blocks, another accumulates dQ over kv-blocks. Causal kv-blocks above the
diagonal are skipped (and, by clamping the index map, never fetched). Lengths that are not a
multiple of the block are padded with segment id 0, which masks them.

Block shapes follow TPU (Mosaic) tiling: q- and kv-blocks multiples of 128 (or the whole short
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

MASKED = -1e30  # finite: a fully masked row must give 0, never inf - inf
_LSE_ROWS = 8  # the log-sum-exp leaves the forward kernel as [8, rows]: one sublane tile
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: x @ y.T
_TRANS_A = (((0,), (0,)), ((), ()))  # contract the first dims: x.T @ y


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _tpu_params(semantics: tuple[str, ...]) -> Any:
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _cost(matmuls: int, inputs: list[jax.Array], outputs: list[Any], causal: bool) -> pl.CostEstimate:
  """What a kernel costs, for XLA's cost model (a custom call is otherwise counted as free).

  `matmuls` [B, H, Lq, Lk, D]-sized products of 2 FLOPs each; one exp per score; causal halves both.
  """
  b, h, lq, d = inputs[0].shape
  scores = b * h * lq * inputs[1].shape[2] // (2 if causal else 1)
  nbytes = sum(x.size * x.dtype.itemsize for x in inputs + outputs)
  return pl.CostEstimate(flops=2 * matmuls * scores * d, transcendentals=scores, bytes_accessed=nbytes)


def _scratch(shape: tuple[int, ...]) -> Any:
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.VMEM(shape, jnp.float32)


def _block_mask(q_seg: jax.Array, kv_seg: jax.Array, i: jax.Array, j: jax.Array, bq: int, bk: int,
                causal: bool) -> jax.Array:
  """[bq, bk] allowed pairs of q-block i and kv-block j: same nonzero segment, and causal order."""
  mask = (q_seg == kv_seg) & (kv_seg != 0)
  if causal:
    rows = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0) + i * bq
    cols = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk
    mask = mask & (cols <= rows)
  return mask


def _visible(i: jax.Array, j: jax.Array, bq: int, bk: int, causal: bool) -> jax.Array | bool:
  """Whether kv-block j holds any key a query of q-block i may see."""
  return j * bk <= i * bq + bq - 1 if causal else True


def _to_rows(column: jax.Array) -> jax.Array:
  """[rows, 1] -> [8, rows] (identical rows): lane-dense, where [rows, 1] in HBM is padded to 128 lanes."""
  return jnp.broadcast_to(column, (column.shape[0], 128)).T[:_LSE_ROWS]


def _to_column(rows: jax.Array) -> jax.Array:
  """[8, rows] as `_to_rows` wrote it -> [rows, 1]."""
  return jnp.broadcast_to(rows[:1], (128, rows.shape[1])).T[:, :1]


def _logits(q: jax.Array, k: jax.Array, bias_ref: Any, scale: float) -> jax.Array:
  s = jax.lax.dot_general(q, k, _TRANS_B, preferred_element_type=jnp.float32) * scale
  if bias_ref is not None:
    s = s + bias_ref[0, 0].astype(jnp.float32)
  return s


# ---------------------------------------------------------------- forward

def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref,
                    m_scr, l_scr, acc_scr, *, causal: bool, scale: float, bq: int, bk: int):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(_visible(i, j, bq, bk, causal))
  def _step():
    s = _logits(q_ref[0, 0], k_ref[0, 0], bias_ref, scale)
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal)
    s = jnp.where(mask, s, MASKED)
    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[0, 0]
    acc_scr[...] = alpha * acc_scr[...] + jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    m_scr[...] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    norm = l_scr[...]
    empty = norm == 0.0  # every key masked: output 0, log-sum-exp 0
    safe = jnp.where(empty, 1.0, norm)
    o_ref[0, 0] = (acc_scr[...] / safe).astype(o_ref.dtype)
    lse_ref[0, 0] = _to_rows(jnp.where(empty, 0.0, m_scr[...] + jnp.log(safe)))


# ---------------------------------------------------------------- backward

def _probs_and_ds(q, k, v, do, lse, o, bias_ref, mask, scale):
  """Recomputed probabilities p and dS = p * (dO V^T - delta) for one block.

  delta = rowsum(dO * O) is recomputed per block rather than passed in: a [rows, 1] float32 array
  in HBM is padded to 128 lanes on TPU, which would cost 128x its size.
  """
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1, keepdims=True)
  s = _logits(q, k, bias_ref, scale)
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = jax.lax.dot_general(do, v, _TRANS_B, preferred_element_type=jnp.float32)
  return p, p * (dp - delta)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, bias_ref, q_seg_ref, kv_seg_ref,
                dk_ref, dv_ref, dbias_ref, dk_scr, dv_scr, *, causal: bool, scale: float, bq: int, bk: int):
  j, i = pl.program_id(2), pl.program_id(3)  # kv-block outer, q-block inner

  @pl.when(i == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  visible = _visible(i, j, bq, bk, causal)

  @pl.when(visible)
  def _step():
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal)
    p, ds = _probs_and_ds(q, k, v, do, _to_column(lse_ref[0, 0]), o_ref[0, 0], bias_ref, mask, scale)
    dv_scr[...] += jax.lax.dot_general(p.astype(do.dtype), do, _TRANS_A, preferred_element_type=jnp.float32)
    dk_scr[...] += jax.lax.dot_general(ds.astype(q.dtype), q, _TRANS_A, preferred_element_type=jnp.float32) * scale
    if dbias_ref is not None:
      dbias_ref[0, 0] = ds.astype(dbias_ref.dtype)

  if dbias_ref is not None and causal:
    @pl.when(jnp.logical_not(visible))
    def _zero_bias_grad():
      dbias_ref[0, 0] = jnp.zeros(dbias_ref.shape[2:], dbias_ref.dtype)

  @pl.when(i == pl.num_programs(3) - 1)
  def _store():
    dk_ref[0, 0] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, bias_ref, q_seg_ref, kv_seg_ref,
               dq_ref, dq_scr, *, causal: bool, scale: float, bq: int, bk: int):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  @pl.when(_visible(i, j, bq, bk, causal))
  def _step():
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    mask = _block_mask(q_seg_ref[0], kv_seg_ref[0], i, j, bq, bk, causal)
    _, ds = _probs_and_ds(q, k, v, do, _to_column(lse_ref[0, 0]), o_ref[0, 0], bias_ref, mask, scale)
    dq_scr[...] += jax.lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale

  @pl.when(j == pl.num_programs(3) - 1)
  def _store():
    dq_ref[0, 0] = dq_scr[...].astype(dq_ref.dtype)


# ---------------------------------------------------------------- pallas_call plumbing

@functools.lru_cache(maxsize=None)
def _specs(causal: bool, bq: int, bk: int, d: int, bias_shape: tuple[int, ...] | None, kv_outer: bool,
           group: int = 1):
  """BlockSpecs of the shared inputs for a grid (b, h, outer, inner) over query heads h.

  With grouped-query attention (`group` query heads per key/value head) the key/value blocks of
  query head h are those of head h // group: fetched, never copied.
  """
  def blocks(outer, inner):
    i, j = (inner, outer) if kv_outer else (outer, inner)
    if causal and not kv_outer:  # clamp to the last visible kv-block: skipped steps fetch nothing new
      # lax.div: no floor-division sign ops in Mosaic; int32 operands also under jax_enable_x64
      j = jnp.minimum(j, jax.lax.div(i * bq + bq - 1, jnp.int32(bk)))
    return i, j

  def q_map(b, h, o, n):
    return b, h, blocks(o, n)[0], 0

  def kv_map(b, h, o, n):
    return b, h // group, blocks(o, n)[1], 0

  def per_head_kv_map(b, h, o, n):
    return b, h, blocks(o, n)[1], 0

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
    q=pl.BlockSpec((1, 1, bq, d), q_map), kv=pl.BlockSpec((1, 1, bk, d), kv_map),
    per_head_kv=pl.BlockSpec((1, 1, bk, d), per_head_kv_map),
    lse=pl.BlockSpec((1, 1, _LSE_ROWS, bq), lse_map),
    bias=None if bias_shape is None else pl.BlockSpec((1, 1, bq, bk), bias_map),
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


def _forward(q, k, v, bias, q_seg, kv_seg, *, causal, scale, bq, bk, interpret):
  b, h, lq, d = q.shape
  lk = k.shape[2]
  specs = _specs(causal, bq, bk, d, None if bias is None else bias.shape, False, h // k.shape[1])
  inputs = [q, k, v] + ([bias] if bias is not None else []) + [q_seg, kv_seg]
  in_specs = [specs['q'], specs['kv'], specs['kv']] + ([specs['bias']] if bias is not None else []) + \
             [specs['q_seg'], specs['kv_seg']]
  kernel = functools.partial(_with_optional(_forward_kernel, bias is not None, 3),
                             causal=causal, scale=scale, bq=bq, bk=bk)
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, _LSE_ROWS, lq), jnp.float32)]
  return pl.pallas_call(
    kernel, grid=(b, h, lq // bq, lk // bk), in_specs=in_specs,
    out_specs=[specs['q'], specs['lse']], out_shape=out_shape,
    scratch_shapes=[_scratch((bq, 1)), _scratch((bq, 1)), _scratch((bq, d))],
    compiler_params=None if interpret else _tpu_params(('parallel', 'parallel', 'parallel', 'arbitrary')),
    cost_estimate=_cost(2, inputs, out_shape, causal), interpret=interpret)(*inputs)


def _backward(q, k, v, bias, q_seg, kv_seg, o, lse, do, *, causal, scale, bq, bk, interpret):
  b, h, lq, d = q.shape
  kv_heads, lk = k.shape[1], k.shape[2]
  group = h // kv_heads
  has_bias = bias is not None
  bias_shape = None if bias is None else bias.shape
  params = None if interpret else _tpu_params(('parallel', 'parallel', 'parallel', 'arbitrary'))

  def call(kernel, kv_outer, out_specs, out_shape, scratch, matmuls):
    specs = _specs(causal, bq, bk, d, bias_shape, kv_outer, group)
    inputs = [q, k, v, do, lse, o] + ([bias] if has_bias else []) + [q_seg, kv_seg]
    in_specs = [specs['q'], specs['kv'], specs['kv'], specs['q'], specs['lse'], specs['q']] + \
               ([specs['bias']] if has_bias else []) + [specs['q_seg'], specs['kv_seg']]
    grid = (b, h, lk // bk, lq // bq) if kv_outer else (b, h, lq // bq, lk // bk)
    body = functools.partial(_with_optional(kernel, has_bias, 6), causal=causal, scale=scale, bq=bq, bk=bk)
    outs = out_shape if isinstance(out_shape, list) else [out_shape]
    return pl.pallas_call(body, grid=grid, in_specs=in_specs, out_specs=out_specs(specs), out_shape=out_shape,
                          scratch_shapes=scratch, compiler_params=params,
                          cost_estimate=_cost(matmuls, inputs, outs, causal), interpret=interpret)(*inputs)

  # dK, dV per query head, summed over each key/value head's group below (a no-op without GQA).
  dkv_outs = lambda s: [s['per_head_kv']] * 2 + (
    [pl.BlockSpec((1, 1, bq, bk), lambda b_, h_, j, i: (b_, h_, i, j))] if has_bias else [])
  per_head = lambda x: jax.ShapeDtypeStruct((b, h, lk, d), jnp.float32 if group > 1 else x.dtype)
  dkv_shapes = [per_head(k), per_head(v)] + \
               ([jax.ShapeDtypeStruct((b, h, lq, lk), jnp.float32)] if has_bias else [])
  dk, dv, *dbias = call(_dkv_kernel, True, dkv_outs, dkv_shapes, [_scratch((bk, d)), _scratch((bk, d))],
                     matmuls=4)  # scores, dV, dP, dK
  if group > 1:
    dk, dv = (g.reshape(b, kv_heads, group, lk, d).sum(axis=2).astype(x.dtype) for g, x in ((dk, k), (dv, v)))
  dq = call(_dq_kernel, False, lambda s: s['q'], jax.ShapeDtypeStruct(q.shape, q.dtype), [_scratch((bq, d))],
            matmuls=3)  # scores, dP, dQ
  if has_bias:  # sum over the dims the bias was broadcast along
    axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
    dbias = jnp.sum(dbias[0], axis=axes, keepdims=True).astype(bias.dtype)
  else:
    dbias = None
  return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, bias, q_seg, kv_seg, causal, scale, bq, bk, interpret):
  return _forward(q, k, v, bias, q_seg, kv_seg, causal=causal, scale=scale, bq=bq, bk=bk, interpret=interpret)[0]


def _flash_fwd(q, k, v, bias, q_seg, kv_seg, causal, scale, bq, bk, interpret):
  o, lse = _forward(q, k, v, bias, q_seg, kv_seg, causal=causal, scale=scale, bq=bq, bk=bk, interpret=interpret)
  return o, (q, k, v, bias, q_seg, kv_seg, o, lse)


def _flash_bwd(causal, scale, bq, bk, interpret, residuals, do):
  q, k, v, bias, q_seg, kv_seg, o, lse = residuals
  dq, dk, dv, dbias = _backward(q, k, v, bias, q_seg, kv_seg, o, lse, do, causal=causal, scale=scale,
                                bq=bq, bk=bk, interpret=interpret)
  return dq, dk, dv, dbias, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                    bias: jax.Array | None = None, scale: float | None = None, block_q: int = 128,
                    block_k: int = 128, platform: str | None = None) -> jax.Array:
  """Attention over q [B, Lq, H, D], k/v [B, Lk, K, D] (Flax layout) -> [B, Lq, H, D].

  K key/value heads divide the H query heads (grouped-query attention when K < H).
  `segment_ids` / `kv_segment_ids` [B, L] (0 = padding), `bias` broadcastable to [B, H, Lq, Lk] and
  differentiable. Block sizes are rounded to TPU tiles (multiples of 128) and shrunk for short
  inputs; lengths are padded to whole blocks. `platform` (default: the default backend) picks Mosaic
  on 'tpu' and the Pallas interpreter on 'cpu'.
  """
  platform = platform or jax.default_backend()
  if platform not in ('tpu', 'cpu'):
    raise ValueError(f'the flash kernel is written for TPU (Mosaic) and runs interpreted on CPU, not on '
                     f'{platform}; use attention impl cudnn or xla there')
  interpret = platform == 'cpu'
  b, lq, h, d = q.shape
  lk = k.shape[1]
  if h % k.shape[2] or k.shape != v.shape:
    raise ValueError(f'key/value heads must match and divide the {h} query heads; got k {k.shape}, v {v.shape}')
  scale = d ** -0.5 if scale is None else scale
  bq = min(_round_up(block_q, 128), _round_up(lq, 8))  # lse blocks are [8, bq]: 128-lane multiples or whole
  bk = min(_round_up(block_k, 128), _round_up(lk, 128))
  pq, pk = _round_up(lq, bq), _round_up(lk, bk)
  if segment_ids is None:
    segment_ids = jnp.ones((b, lq), jnp.int32)
  if kv_segment_ids is None:
    kv_segment_ids = segment_ids if lq == lk else jnp.ones((b, lk), jnp.int32)
  q_seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pq - lq)))[:, :, None]
  kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, pk - lk)))[:, None, :]
  to_bhld = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
  if bias is not None:
    bias = jnp.asarray(bias)
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bias = jnp.broadcast_to(bias, bias.shape[:2] + (lq, lk))
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, pq - lq), (0, pk - lk)))
  out = _flash(to_bhld(q, pq), to_bhld(k, pk), to_bhld(v, pk), bias, q_seg, kv_seg, causal, float(scale), bq, bk,
               bool(interpret))
  return jnp.swapaxes(out[:, :, :lq], 1, 2)
