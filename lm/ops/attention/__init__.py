"""The one attention entry point; every family calls `attention` and the config picks the impl.

Layout is Flax's: q [batch, q_len, heads, head_dim], k/v [batch, kv_len, kv_heads, head_dim] where
kv_heads divides heads (grouped-query attention when smaller). Segment ids are [batch, len] with 0
marking padding; tokens attend only within their segment. The implementations sit side by side in this
package: `xla` (einsums), `ring` (a sequence sharded over the mesh), `flash` (our Pallas kernel), `vendor`
(the kernels JAX ships).
"""
from __future__ import annotations

import functools
import math
import typing
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import AttentionImpl
from lm.ops.attention import capabilities, vendor
from lm.ops.attention.flash import flash_attention
from lm.ops.attention.ring import QUERY_CHUNK, ring_attention, ring_flash_attention, zigzag_order
from lm.ops.attention.xla import _causal_blocks, attention_mask, blocked_causal_attention, xla_attention
from lm.parallel.rules import active_sharding, axis_size, shard_map, spec_for, target_platform

IMPLEMENTATIONS = typing.get_args(AttentionImpl)


def repeat_kv(k: jax.Array, v: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
  """Key/value heads repeated to `heads`, each kept next to its copies: query head h reads kv head h // group."""
  group = heads // k.shape[2]
  if group == 1:
    return k, v
  return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def _kernel_attention(kernel: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, *,
                      segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None, bias: jax.Array | None,
                      sinks: jax.Array | None = None, **options: Any) -> jax.Array:
  """Runs a Pallas kernel per shard under the active mesh (Pallas calls cannot be auto-partitioned).

  Shard specs come from the logical-axis rules: batch over the data axes, heads over the tensor
  axes; a bias with a batch or heads dim of 1 stays replicated along it (its gradient is then
  summed by shard_map's transpose). Key/value heads fewer than the head shards are repeated up to
  lcm(kv_heads, shards), so each shard holds the ones its query heads read.
  """
  active = active_sharding()
  if sinks is not None:  # only the kernels that have sinks take them (the capability table)
    options['sinks'] = sinks
  if active is None:
    return kernel(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, bias=bias,
                  platform=jax.default_backend(), **options)
  mesh, rules = active
  options['platform'] = mesh.devices.flat[0].platform  # the target, which differs from the host in AOT compiles
  shards = axis_size(mesh, 'heads', rules)
  if k.shape[2] % shards:
    k, v = repeat_kv(k, v, math.lcm(k.shape[2], shards))
  q_spec = spec_for(('batch', 'length', 'heads', 'kv'), q.shape, mesh, rules)
  kv_spec = spec_for(('batch', 'length', 'kv_heads', 'kv'), k.shape, mesh, rules)
  args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
  optional = {'segment_ids': segment_ids, 'kv_segment_ids': kv_segment_ids, 'bias': bias,
              **({'sinks': options.pop('sinks')} if sinks is not None else {})}  # sharded by heads below
  names = [n for n, x in optional.items() if x is not None]
  for name in names:
    x = optional[name]
    if name == 'sinks':
      specs.append(spec_for(('heads',), x.shape, mesh, rules))
    elif name == 'bias':
      x = x.reshape((1,) * (4 - x.ndim) + x.shape)
      specs.append(spec_for(('batch', 'heads', None, None), x.shape, mesh, rules))
    else:
      specs.append(spec_for(('batch', 'length'), x.shape, mesh, rules))
    args.append(x)

  def per_shard(q, k, v, *rest):
    return kernel(q, k, v, **{**dict.fromkeys(optional), **dict(zip(names, rest, strict=True))}, **options)
  return shard_map(per_shard, mesh, tuple(specs), q_spec)(*args)


def sequence_shards() -> int:
  """How many ways the active mesh splits the sequence (its `length` axes); 1 outside a mesh."""
  active = active_sharding()
  return 1 if active is None else axis_size(active[0], 'length', active[1])


def _sharded_sequence_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                                segment_ids: jax.Array | None, bias: jax.Array | None, scale: float,
                                flash: bool, block_q: int, block_k: int, window: int = 0,
                                softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
  """Self-attention over a sequence split across the mesh: ring attention per shard, its blocks through XLA or
  (`flash`) our flash kernel. The length axis of every activation is in `zigzag_order` (the train step lays the
  batch out so), which gives each token's position."""
  mesh, rules = active_sharding()
  length, shards = q.shape[1], sequence_shards()
  order = zigzag_order(length, shards)
  q_spec = spec_for(('batch', 'length', 'heads', 'kv'), q.shape, mesh, rules)
  pos_spec = spec_for(('length',), (length,), mesh, rules)
  ring_axes = pos_spec[0]  # the mesh axes the rules split `length` over
  args, specs = [q, k, v, jnp.asarray(order, jnp.int32)], [q_spec, q_spec, q_spec, pos_spec]
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(spec_for(('batch', 'length'), segment_ids.shape, mesh, rules))
  if bias is not None:  # rows stay in the layout, split with their queries; key columns by position, whole
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bias = jnp.broadcast_to(bias, bias.shape[:2] + (length, length))[..., np.argsort(order)]
    args.append(bias)
    specs.append(spec_for(('batch', 'heads', 'length', None), bias.shape, mesh, rules))
  if sinks is not None:  # whole on every shard of the ring: shard_map's transpose sums their gradient
    args.append(sinks)
    specs.append(spec_for(('heads',), sinks.shape, mesh, rules))

  platform = mesh.devices.flat[0].platform
  _check_platform('ring_flash' if flash else 'ring', platform)

  def per_shard(q, k, v, pos, *rest):
    rest = list(rest)
    seg = rest.pop(0) if segment_ids is not None else None
    rows = rest.pop(0) if bias is not None else None
    sink = rest.pop(0) if sinks is not None else None
    if flash:
      seg = jnp.ones(q.shape[:2], jnp.int32) if seg is None else seg
      return ring_flash_attention(ring_axes, causal, scale, block_q, block_k, platform == 'cpu', q, k, v, seg, seg,
                                  pos, rows, sink)
    return ring_attention(ring_axes, causal, scale, QUERY_CHUNK, window, softcap, q, k, v, pos, pos, seg, seg, rows,
                          sink)
  return shard_map(per_shard, mesh, tuple(specs), q_spec)(*args)


def _check(name: str, needs: set[str]) -> None:
  lacks = capabilities.missing(name, needs)
  if lacks:
    raise ValueError(capabilities.refusal(name, lacks))


def _check_platform(name: str, platform: str) -> None:
  if platform not in capabilities.TABLE[name].platforms:
    raise ValueError(f'{capabilities.NAMES.get(name, f"attention impl {name}")} runs on '
                     f'{" or ".join(capabilities.TABLE[name].platforms)}, not {platform}: use '
                     f'model.execution.attention_impl=xla')


def _same_widths(attend: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """`attend` on value heads of another width than the query/key heads (latent attention's), for the kernels and
  rings, which take one width: the narrower side padded with zeros (zero query/key features add nothing to a
  logit; zero value features give zero outputs), the output cut back to the values' width."""
  pad = lambda a, width: jnp.pad(a, ((0, 0),) * (a.ndim - 1) + ((0, width - a.shape[-1]),))
  width = max(k.shape[-1], v.shape[-1])
  return attend(pad(q, width), pad(k, width), pad(v, width))[..., :v.shape[-1]]


KERNELS: dict[str, Callable[..., jax.Array]] = {
  'flash': flash_attention,
  'tpu_flash': vendor.tpu_flash,
  'tpu_splash': vendor.tpu_splash,
  'cudnn': vendor.cudnn,
}


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              mask: jax.Array | None = None, bias: jax.Array | None = None, scale: float | None = None,
              window: int = 0, softcap: float = 0.0, impl: str = 'xla', dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, block_q: int = 128, block_k: int = 128,
              sinks: jax.Array | None = None) -> jax.Array:
  """Multi-head attention; `mask` and `bias` broadcast to [batch, heads, q_len, kv_len]. `window` > 0 (causal): a
  sliding window of keys fewer than that many positions back; `softcap` > 0: logits soft-capped before the bias
  (xla and our flash kernel); `sinks` [heads]: each head's learned sink logit in the softmax's denominator (xla
  and our flash kernel)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'attention impl {impl!r} is not available; choose one of {IMPLEMENTATIONS}')
  if v.shape[-1] != k.shape[-1] and (impl != 'xla' or sequence_shards() > 1):
    return _same_widths(functools.partial(
      attention, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, mask=mask, bias=bias,
      scale=q.shape[-1] ** -0.5 if scale is None else scale, window=window, softcap=softcap, impl=impl,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, block_q=block_q, block_k=block_k, sinks=sinks), q, k, v)
  if window and not causal:
    raise ValueError('a sliding window applies to causal attention only')
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  needs = {f for f, on in (('window', window), ('softcap', softcap), ('bias', bias is not None),
                           ('dropout', dropout_rate > 0.0), ('mask', mask is not None),
                           ('cross', kv_segment_ids is not None), ('sinks', sinks is not None)) if on}
  if sequence_shards() > 1:  # before `auto` is resolved: on a split sequence it means the ring, blocks by XLA
    if impl not in capabilities.RING:
      raise ValueError(f'a sequence split over the mesh runs ring attention (impl auto, xla or flash), not {impl}')
    _check(capabilities.RING[impl], needs)
    k, v = repeat_kv(k, v, q.shape[2])
    return _sharded_sequence_attention(q, k, v, causal=causal, segment_ids=segment_ids, bias=bias, scale=scale,
                                       flash=impl == 'flash', block_q=block_q, block_k=block_k, window=window,
                                       softcap=softcap, sinks=sinks)
  if impl == 'auto':
    impl = capabilities.pick_impl(target_platform(), needs)
  _check(impl, needs)
  if not capabilities.TABLE[impl].grouped_kv:
    k, v = repeat_kv(k, v, q.shape[2])
  if impl in KERNELS:
    extra = {'window': window, 'softcap': softcap} if window or softcap else {}
    return _kernel_attention(KERNELS[impl], q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             bias=bias, sinks=sinks, causal=causal, scale=scale, block_q=block_q, block_k=block_k,
                             **extra)
  allowed = attention_mask(q.shape[1], k.shape[1], causal=causal, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, mask=mask, window=window)
  num_blocks = _causal_blocks(q.shape[1], k.shape[1]) if causal else 1
  if num_blocks > 1 and not (dropout_rate > 0.0 and dropout_rng is not None):
    return blocked_causal_attention(q, k, v, allowed=allowed, bias=bias, scale=scale, num_blocks=num_blocks,
                                    softcap=softcap, sinks=sinks)
  return xla_attention(q, k, v, allowed=allowed, bias=bias, scale=scale, softcap=softcap,
                       dropout_rate=dropout_rate, dropout_rng=dropout_rng, sinks=sinks)
