"""Ring attention over a sequence sharded 4 ways (x 2 data shards) against float64 NumPy, forward and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lm.ops.attention.ring import causal_pairs_per_shard, ring_attention, ring_flash_attention, zigzag_order

SHARDS = 4


def reference(q, k, v, do, causal, seg, bias, scale):
  """Output and (dq, dk, dv, dbias) of softmax(q k^T * scale + bias) v in float64, masked rows giving zeros."""
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  length = q.shape[1]
  allowed = np.ones((q.shape[0], 1, length, length), bool)
  if causal:
    allowed &= np.tril(np.ones((length, length), bool))
  if seg is not None:
    allowed &= ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]
  s = np.einsum('bqhd,bkhd->bhqk', q, k) * scale + (0 if bias is None else np.asarray(bias, np.float64))
  s = np.where(allowed, s, -np.inf)
  m = s.max(-1, keepdims=True)
  e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  total = e.sum(-1, keepdims=True)
  p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
  o = np.einsum('bhqk,bkhd->bqhd', p, v)
  dp = np.einsum('bqhd,bkhd->bhqk', do, v)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dbias = None if bias is None else ds if bias.shape[0] > 1 else ds.sum(0, keepdims=True)
  grads = (np.einsum('bhqk,bkhd->bqhd', ds, k) * scale, np.einsum('bhqk,bqhd->bkhd', ds, q) * scale,
           np.einsum('bhqk,bqhd->bkhd', p, do), dbias)
  return o, grads


def rel_err(a, b):
  return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def inputs(seed, segments, bias_batch, b=2, length=64, h=2, d=8):
  """q, k, v, the output gradient, segment ids (packed documents, then padding (segment 0) at the end of the
  second row) or None, and a bias of `bias_batch` rows or None."""
  rng = np.random.default_rng(seed)
  q, k, v, do = (rng.standard_normal((b, length, h, d)).astype(np.float32) for _ in range(4))
  seg = None
  if segments:
    seg = np.ones((b, length), np.int32)
    seg[0, 20:] = 2
    seg[1, 9:40], seg[1, 40:] = 2, 0
  bias = None if bias_batch is None else rng.standard_normal((bias_batch, h, length, length)).astype(np.float32)
  return q, k, v, do, seg, bias


def ring(q, k, v, do, causal, seg, bias, scale, order, chunk=512, window=0, softcap=0.0, sinks=None):
  """Output and gradients of ring attention on a (data 2, sequence 4) mesh, the sequence laid out in `order`,
  queries meeting each block `chunk` rows at a time, returned in natural order (with `sinks`, theirs last)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, SHARDS), ('data', 'sequence'))
  place = lambda x, axis: jnp.take(jnp.asarray(x), order, axis=axis)
  pos = jnp.asarray(order, jnp.int32)
  seq = P('data', 'sequence')
  bias_spec = None if bias is None else P('data' if bias.shape[0] > 1 else None, None, 'sequence', None)

  def loss(q, k, v, bias, sinks):
    run = jax.shard_map(
      lambda q, k, v, pos, seg, bias, sinks: ring_attention('sequence', causal, scale, chunk, window, softcap, q, k,
                                                            v, pos, pos, seg, seg, bias, sinks),
      mesh=mesh, in_specs=(seq, seq, seq, P('sequence'), None if seg is None else seq, bias_spec, P()),
      out_specs=seq, check_vma=False)
    o = run(q, k, v, pos, None if seg is None else place(seg, 1), bias, sinks)
    return jnp.sum(o * place(do, 1)), o

  bias_rows = None if bias is None else place(bias, 2)  # query rows in the layout, key columns by position
  return _run(loss, order, q, k, v, bias_rows, sinks)


def _run(loss, order, q, k, v, bias_rows, sinks):
  """`loss`'s output and gradients, the sequence placed in `order` and put back."""
  place = lambda x, axis: jnp.take(jnp.asarray(x), order, axis=axis)
  sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
    place(q, 1), place(k, 1), place(v, 1), bias_rows, sinks)
  back = np.argsort(order)
  unplace = lambda x, axis: None if x is None else np.take(np.asarray(x), back, axis=axis)
  return unplace(o, 1), tuple(unplace(g, 1) for g in grads[:3]) + (unplace(grads[3], 2),) + \
    (() if sinks is None else (np.asarray(grads[4]),))


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('segments', [False, True])
@pytest.mark.parametrize('bias_batch', [None, 1, 2])
@pytest.mark.parametrize('chunk', [512, 4])  # each shard's 16 queries at once, or 4 chunks of 4 rows
@pytest.mark.variants
def test_ring_attention_matches_float64(causal, segments, bias_batch, chunk):
  q, k, v, do, seg, bias = inputs([causal, segments, bias_batch or 0], segments, bias_batch)
  length = q.shape[1]
  want_o, want = reference(q, k, v, do, causal, seg, bias, 0.3)
  got_o, got = ring(q, k, v, do, causal, seg, bias, 0.3, zigzag_order(length, SHARDS), chunk)
  assert rel_err(got_o, want_o) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv', 'dbias'], got, want, strict=True):
    if w is not None:
      assert rel_err(g, w) < 1e-5, name


def ring_flash(q, k, v, do, causal, seg, bias, scale, order, sinks=None):
  """`ring` with flash-kernel blocks (interpreted): segment ids always given (ones for none)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, SHARDS), ('data', 'sequence'))
  place = lambda x, axis: jnp.take(jnp.asarray(x), order, axis=axis)
  pos = jnp.asarray(order, jnp.int32)
  seq = P('data', 'sequence')
  seg = np.ones(q.shape[:2], np.int32) if seg is None else seg
  bias_spec = None if bias is None else P('data' if bias.shape[0] > 1 else None, None, 'sequence', None)

  def loss(q, k, v, bias, sinks):
    run = jax.shard_map(
      lambda q, k, v, seg, pos, bias, sinks: ring_flash_attention('sequence', causal, scale, 128, 128, True, q, k, v,
                                                                  seg, seg, pos, bias, sinks),
      mesh=mesh, in_specs=(seq, seq, seq, seq, P('sequence'), bias_spec, P()), out_specs=seq, check_vma=False)
    o = run(q, k, v, place(seg, 1), pos, bias, sinks)
    return jnp.sum(o * place(do, 1)), o

  return _run(loss, order, q, k, v, None if bias is None else place(bias, 2), sinks)


# Every pair of (causal, segments, bias) values, in 6 of the 12 combinations: the interpreted kernel is slow.
@pytest.mark.parametrize('causal, segments, bias_batch', [
  (True, True, None), (True, False, 1), (True, True, 2), (False, False, None), (False, True, 1), (False, False, 2)])
@pytest.mark.variants
def test_ring_attention_with_flash_blocks_matches_float64(causal, segments, bias_batch):
  """Each hop's sub-blocks through the flash kernel: causal on a shard's own chunks, full where the zig-zag
  layout makes a chunk see all of another, skipped where it sees none; packed documents, padding and a bias."""
  q, k, v, do, seg, bias = inputs([causal, segments, bias_batch or 0, 7], segments, bias_batch)
  length = q.shape[1]
  want_o, want = reference(q, k, v, do, causal, seg, bias, 0.3)
  got_o, got = ring_flash(q, k, v, do, causal, seg, bias, 0.3, zigzag_order(length, SHARDS))
  assert rel_err(got_o, want_o) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv', 'dbias'], got, want, strict=True):
    if w is not None:
      assert rel_err(g, w) < 1e-5, name


def test_any_layout_gives_the_same_attention():
  """Masks follow the positions that travel with each block: contiguous chunks give what the zig-zag gives."""
  rng = np.random.default_rng(1)
  q, k, v, do = (rng.standard_normal((2, 32, 2, 8)).astype(np.float32) for _ in range(4))
  zig, _ = ring(q, k, v, do, True, None, None, 0.5, zigzag_order(32, SHARDS))
  flat, _ = ring(q, k, v, do, True, None, None, 0.5, np.arange(32))
  want, _ = reference(q, k, v, do, True, None, None, 0.5)
  assert rel_err(zig, want) < 1e-5 and rel_err(flat, want) < 1e-5


@pytest.mark.parametrize('shards, length', [(2, 1024), (4, 4096), (8, 32768), (16, 131072)])
def test_the_zigzag_layout_balances_causal_work(shards, length):
  order = zigzag_order(length, shards)
  assert sorted(order) == list(range(length))
  pairs = causal_pairs_per_shard(order, shards)
  assert pairs.sum() == length * (length + 1) // 2  # every causal pair, scored once
  assert pairs.max() <= 1.1 * pairs.min()
  contiguous = causal_pairs_per_shard(np.arange(length), shards)
  assert contiguous.max() > 2 * contiguous.min()  # what the zig-zag avoids


def test_a_sequence_that_does_not_split_into_chunks_is_refused():
  with pytest.raises(ValueError, match='does not split into 8 equal chunks'):
    zigzag_order(100, 4)


@pytest.mark.parametrize('window, softcap, chunk', [(9, 0.0, 4), (9, 2.0, 512), (20, 2.0, 4)])
@pytest.mark.variants
def test_ring_attention_with_a_window_and_soft_capping_matches_float64(window, softcap, chunk):
  """A window of keys fewer than `window` positions back (query chunks against blocks wholly outside it skipped) and
  soft-capped logits, over packed segments with a bias: against the flash tests' float64 reference."""
  from tests.ops.attention.test_flash import reference as windowed_reference
  q, k, v, do, seg, bias = inputs(window + chunk, True, 1)
  want = windowed_reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=bias, scale=0.3, window=window,
                            softcap=softcap)
  got_o, got = ring(q, k, v, do, True, seg, bias, 0.3, zigzag_order(q.shape[1], SHARDS), chunk, window, softcap)
  assert rel_err(got_o, want[0]) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv', 'dbias'], got, want[1:5], strict=True):
    assert rel_err(g, w) < 1e-5, name


@pytest.mark.parametrize('blocks', ['xla', 'flash'])
def test_ring_attention_with_sinks_matches_float64(blocks):
  """GPT-OSS's sinks joined once the ring's blocks are merged: output and every gradient, the sinks' included,
  equal the single-device float64 reference over packed documents with padding."""
  from tests.ops.attention.test_flash import reference as sinks_reference
  q, k, v, do, seg, _ = inputs(40, True, None)
  sinks = np.random.default_rng(41).standard_normal(q.shape[2]) * 2
  order = zigzag_order(q.shape[1], SHARDS)
  run = ring_flash if blocks == 'flash' else ring
  got_o, got = run(q, k, v, do, True, seg, None, 0.3, order, sinks=sinks)
  want = sinks_reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=None, scale=0.3, sinks=sinks)
  assert rel_err(got_o, want[0]) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv', 'dsinks'], [*got[:3], got[4]], [*want[1:4], want[5]], strict=True):
    assert rel_err(g, w) < 1e-5, name


@pytest.mark.parametrize('impl', ['xla', 'flash'])
def test_the_dispatcher_rings_narrower_values_with_sinks_as_one_device(impl):
  """Latent attention's value heads, narrower than its query/key heads, and GPT-OSS's sinks together on a sequence
  split 4 ways (x 2 data shards), through `attention` as a model calls it (values padded for the ring and cut
  back): output and every gradient, the sinks' included, equal the float64 reference."""
  from lm.config import MeshConfig
  from lm.ops.attention import attention
  from lm.parallel.mesh import make_mesh
  from lm.parallel.rules import sharding_context
  from tests.ops.attention.test_flash import reference as sinks_reference
  q, k, v, do, seg, _ = inputs(42, True, None)
  v, do = v[..., :5], do[..., :5]
  sinks = np.random.default_rng(43).standard_normal(q.shape[2]) * 2
  order = zigzag_order(q.shape[1], SHARDS)
  mesh = make_mesh(MeshConfig(data=2, sequence=SHARDS))
  place = lambda x: jnp.take(jnp.asarray(x), order, axis=1)

  def loss(q, k, v, sinks):
    with sharding_context(mesh):
      o = attention(q, k, v, causal=True, segment_ids=place(seg), scale=0.3, impl=impl, sinks=sinks, block_q=8,
                    block_k=8)
    return jnp.sum(o * place(do)), o
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
    place(q), place(k), place(v), jnp.asarray(sinks, jnp.float32))
  back = np.argsort(order)
  want = sinks_reference(q, k, v, do, causal=True, q_seg=seg, kv_seg=seg, bias=None, scale=0.3, sinks=sinks)
  assert o.shape == v.shape and rel_err(np.asarray(o)[:, back], want[0]) < 1e-5
  for name, g, w in zip(['dq', 'dk', 'dv'], grads[:3], want[1:4], strict=True):
    assert rel_err(np.asarray(g)[:, back], w) < 1e-5, name
  assert rel_err(grads[3], want[5]) < 1e-5
