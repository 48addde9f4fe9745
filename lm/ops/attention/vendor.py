"""The attention kernels JAX ships, wrapped to our layout and masking semantics.

All take q [B, Lq, H, D], k/v [B, Lk, H, D], segment ids [B, L] (0 = padding: attends to nothing
and gives zeros) and return [B, Lq, H, D].

- `tpu_flash`: `jax.experimental.pallas.ops.tpu.flash_attention` (causal, segment ids, bias with
  its gradient). On CPU it runs only inside `pltpu.force_tpu_interpret_mode()` around the jit.
- `tpu_splash`: splash attention (causal or full mask, segment ids; no bias). Interprets on CPU.
- `cudnn`: `jax.nn.dot_product_attention(implementation='cudnn')` on GPU.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from lm.ops.attention.masking import round_up


def _padded(q, k, v, segment_ids, kv_segment_ids, multiple):
  """Pads lengths to `multiple`, with segment id 0 on the padding (so it is masked)."""
  b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
  pq, pk = round_up(lq, multiple), round_up(lk, multiple)
  q_seg = jnp.ones((b, lq), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  if kv_segment_ids is None:
    kv_segment_ids = q_seg if lq == lk else jnp.ones((b, lk), jnp.int32)
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return pad(q, pq), pad(k, pk), pad(v, pk), pad(q_seg, pq), pad(kv_segment_ids.astype(jnp.int32), pk)


def _finish(out_bhld: jax.Array, q_seg: jax.Array, lq: int) -> jax.Array:
  """Back to [B, Lq, H, D], zeroing padding queries (the vendor kernels let padding attend to padding)."""
  out = jnp.swapaxes(out_bhld, 1, 2)
  return (out * (q_seg != 0)[:, :, None, None].astype(out.dtype))[:, :lq]


def tpu_flash(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, segment_ids: jax.Array | None,
              kv_segment_ids: jax.Array | None, bias: jax.Array | None, scale: float, block_q: int = 128,
              block_k: int = 128, platform: str | None = None) -> jax.Array:
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa
  lq, lk = q.shape[1], k.shape[1]
  block = max(block_q, block_k, 128)
  q, k, v, q_seg, kv_seg = _padded(q, k, v, segment_ids, kv_segment_ids, block)
  bq, bk = min(block_q, q.shape[1]), min(block_k, k.shape[1])
  sizes = tpu_fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1, block_q_major_dkv=bq,
                            block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bk,
                            block_k_dq=bk, block_q_dq=bq)
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bias = jnp.pad(bias, ((0, 0), (0, 0), (0, q.shape[1] - lq), (0, k.shape[1] - lk)))
    bias = jnp.broadcast_to(bias, (q.shape[0], q.shape[2], q.shape[1], k.shape[1])).astype(jnp.float32)
    bias = bias / scale  # this kernel scales (q k^T + bias); ours adds the bias after scaling
  to_bhld = lambda x: jnp.swapaxes(x, 1, 2)
  out = tpu_fa.flash_attention(to_bhld(q), to_bhld(k), to_bhld(v), bias, tpu_fa.SegmentIds(q_seg, kv_seg),
                               causal=causal, sm_scale=scale, block_sizes=sizes)
  return _finish(out, q_seg, lq)


def _splash_kernel(lq: int, lk: int, heads: int, causal: bool, block_q: int, block_k: int, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  head_mask = masks.CausalMask((lq, lk)) if causal else masks.FullMask((lq, lk))
  sizes = splash.BlockSizes(block_q=block_q, block_kv=block_k, block_kv_compute=block_k, block_q_dkv=block_q,
                            block_kv_dkv=block_k, block_kv_dkv_compute=block_k, block_q_dq=block_q, block_kv_dq=block_k)
  # Built in each trace, its mask arrays as constants: a kernel cached by shape, built with them evaluated at compile
  # time, still leaked tracers into a model's train step compiled for TPU (lm compile, attention_impl=tpu_splash).
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(masks.MultiHeadMask([head_mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, interpret=interpret)


def tpu_splash(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, segment_ids: jax.Array | None,
               kv_segment_ids: jax.Array | None, bias: jax.Array | None, scale: float, block_q: int = 128,
               block_k: int = 128, platform: str | None = None) -> jax.Array:
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  if bias is not None:
    raise ValueError('attention impl tpu_splash takes no bias; use flash (ours) or tpu_flash')
  lq = q.shape[1]
  q, k, v, q_seg, kv_seg = _padded(q, k, v, segment_ids, kv_segment_ids, max(block_q, block_k, 128))
  kernel = _splash_kernel(q.shape[1], k.shape[1], q.shape[2], causal, min(block_q, q.shape[1]),
                          min(block_k, k.shape[1]), (platform or jax.default_backend()) == 'cpu')
  to_hld = lambda x: jnp.swapaxes(x, 0, 1)  # per example: [L, H, D] -> [H, L, D]
  per_example = lambda q, k, v, qs, ks: kernel(to_hld(q * scale), to_hld(k), to_hld(v),
                                               segment_ids=splash.SegmentIds(qs, ks))
  out = jax.vmap(per_example)(q, k, v, q_seg, kv_seg)  # [B, H, L, D]
  return _finish(out, q_seg, lq)


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, segment_ids: jax.Array | None,
          kv_segment_ids: jax.Array | None, bias: jax.Array | None, scale: float, block_q: int = 128,
          block_k: int = 128, platform: str | None = None, implementation: str | None = 'cudnn') -> jax.Array:
  """cuDNN fused attention via `jax.nn.dot_product_attention` (tests pass implementation='xla' on CPU)."""
  lq, lk = q.shape[1], k.shape[1]
  q_seg = jnp.ones((q.shape[0], lq), jnp.int32) if segment_ids is None else segment_ids
  kv_seg = kv_segment_ids if kv_segment_ids is not None else (q_seg if lq == lk else jnp.ones((q.shape[0], lk)))
  mask = ((q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0))[:, None]
  if causal:
    mask = mask & jnp.asarray(np.tril(np.ones((lq, lk), bool)))
  dtype = q.dtype
  out = jax.nn.dot_product_attention(q, k, v, bias=None if bias is None else bias.astype(dtype), mask=mask,
                                     scale=scale, implementation=implementation)
  return out * (q_seg != 0)[:, :, None, None].astype(out.dtype)
