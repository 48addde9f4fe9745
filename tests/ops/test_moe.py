"""`lm.ops.moe`: routing against NumPy, and the dense, dropless and capacity paths against a float64 loop over
experts (forward and gradients, skewed and empty experts included); the balance loss against transformers'."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lm.ops import moe

T, D, F, E, K = 13, 6, 5, 4, 2


def weights(rng, gated, dtype=np.float64):
  scale = lambda *shape: rng.normal(size=shape).astype(dtype) / np.sqrt(shape[-2])
  return scale(E, D, F), scale(E, F, D), (scale(E, D, F) if gated else None)


def loop_over_experts(x, experts, w, up, down, gate, act, bias=None):
  """For each of the k choices, every token through the expert it chose (that expert's weights and `bias`
  gathered per token), times the choice's weight: a loop over choices, with none of the paths' sorting, slots or
  combine. `act`: of (x Wg, x Wu) for a gated MLP."""
  y = jnp.zeros_like(x)
  b = bias or moe.Biases(None, None, None)
  for j in range(experts.shape[1]):
    e = experts[:, j]
    project = lambda a, w, b: jnp.einsum('td,tdf->tf', a, w[e]) + (0 if b is None else b[e])
    h = project(x, up, b.up)
    h = act(project(x, gate, b.gate), h) if gate is not None else act(h)
    y = y + w[:, j, None] * project(h, down, b.down)
  return y


def clamped_swiglu(limit):
  """GPT-OSS's gated unit (transformers' `GptOssExperts._apply_gate`), alpha 1.702."""
  def unit(g, u):
    g = jnp.minimum(g, limit)
    return (jnp.clip(u, -limit, limit) + 1) * g * jax.nn.sigmoid(1.702 * g)
  return unit


def skewed_logits(rng, skew):
  logits = rng.normal(size=(T, E))
  if skew:  # expert 0 takes nearly every token, expert 3 none
    logits[:, 0] += 4.0
    logits[:, 3] -= 8.0
  return logits


# the fast tier's case first: the plain MLP on skewed routing (the gated cases compile three times as long); then
# GPT-OSS's experts: biases on every projection, its clamped SwiGLU (clamped at 0.5, inside the values' range)
@pytest.mark.parametrize('gated, skew, biased', [(False, True, False), (True, True, False), (True, False, False),
                                                 (False, False, False), ('clamped', True, True)])
@pytest.mark.variants
def test_every_path_equals_a_float64_loop_over_experts(gated, skew, biased):
  """Outputs and gradients (inputs, expert weights and biases, router logits through the combine weights) of every
  path equal the loop's, in float64; with skew, one expert gets almost every token and another none."""
  rng = np.random.default_rng(0)
  act = {True: moe.gated(jax.nn.silu), False: jax.nn.gelu, 'clamped': clamped_swiglu(0.5)}[gated]
  with jax.enable_x64(True):
    x, logits = jnp.asarray(rng.normal(size=(T, D))), jnp.asarray(skewed_logits(rng, skew))
    up, down, gate = map(lambda a: None if a is None else jnp.asarray(a), weights(rng, gated))
    bias = moe.Biases(*(None if s is None else jnp.asarray(rng.normal(size=s)) for s in ((E, F), (E, D), (E, F))))
    bias = bias if biased else None
    routing = moe.route(logits, K)
    if skew:
      counts = np.bincount(np.asarray(routing.experts).ravel(), minlength=E)
      assert counts[0] == T and counts[3] == 0
    paths = {'dense': lambda *a, bias: moe.dense(*a, act=act, bias=bias),
             **{f'dropless {k}': lambda *a, k=k, bias: moe.dropless(*a, act=act, kernel=k, bias=bias)
                for k in ('ragged_dot', 'tiles')},
             'capacity': lambda *a, bias: moe.capacity(*a, act=act, factor=E, bias=bias)[0]}
    cotangent = jnp.asarray(rng.normal(size=(T, D)))

    def loss(path, x, up, down, gate, logits, bias):
      r = moe.route(logits, K)
      r = r._replace(weights=r.weights.astype(x.dtype))
      out = (path(x, r, up, down, gate, bias=bias) if path else
             loop_over_experts(x, r.experts, r.weights, up, down, gate, act, bias))
      return jnp.sum(out * cotangent)

    args = (x, up, down, gate, logits, bias)
    argnums = (0, 1, 2, 4) + ((3,) if gated else ()) + ((5,) if biased else ())
    want = jax.jit(jax.grad(lambda *a: loss(None, *a), argnums))(*args)
    want_y = loop_over_experts(x, routing.experts, routing.weights, up, down, gate, act, bias)
    for name, path in paths.items():
      np.testing.assert_allclose(path(x, routing, up, down, gate, bias=bias), want_y, rtol=1e-10, atol=1e-12,
                                 err_msg=name)
      got = jax.jit(jax.grad(lambda *a: loss(path, *a), argnums))(*args)
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.long(0.3)  # the Pallas kernel in interpret mode
@pytest.mark.parametrize('skew', [False, True])
def test_the_megablox_kernel_equals_the_loop(skew):
  """Dropless through JAX's Pallas megablox gmm (interpreted here, compiled on TPU; float32 and bf16 only) against
  the float64 loop: outputs, and gradients of inputs and expert weights."""
  rng = np.random.default_rng(9)
  x, logits = rng.normal(size=(T, D)).astype(np.float32), skewed_logits(rng, skew).astype(np.float32)
  up, down, gate = weights(rng, True, np.float32)
  cotangent = rng.normal(size=(T, D)).astype(np.float32)
  routing = moe.route(jnp.asarray(logits), K)

  def loss(path, x, up, down, gate):
    return jnp.sum(path(x, up, down, gate) * cotangent)
  kernel = lambda x, up, down, gate: moe.dropless(x, routing, up, down, gate, moe.gated(jax.nn.silu), kernel='gmm')
  got = jax.value_and_grad(lambda *a: loss(kernel, *a), (0, 1, 2, 3))(*map(jnp.asarray, (x, up, down, gate)))
  with jax.enable_x64(True):
    experts, w = np.asarray(routing.experts), jnp.asarray(np.asarray(routing.weights, np.float64))
    loop = lambda x, up, down, gate: loop_over_experts(x, experts, w, up, down, gate, moe.gated(jax.nn.silu))
    want = jax.value_and_grad(lambda *a: loss(loop, *a), (0, 1, 2, 3))(
      *(jnp.asarray(a, jnp.float64) for a in (x, up, down, gate)))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1], strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize('tile', [1, 3, 64])
def test_tiled_matmul_equals_ragged_dot(tile):
  """The CPU grouped matmul against XLA's ragged_dot, values and gradients, with empty groups, a group spanning
  several tiles, one smaller than a tile, and rows past the groups (zero out, no gradient)."""
  rng = np.random.default_rng(4)
  with jax.enable_x64(True):
    sizes = jnp.array([0, 7, 1, 0, 9], jnp.int32)
    lhs, rhs = jnp.asarray(rng.normal(size=(20, 6))), jnp.asarray(rng.normal(size=(5, 6, 4)))
    cotangent = jnp.asarray(rng.normal(size=(20, 4)))
    assert not jax.lax.ragged_dot(lhs, rhs, sizes)[17:].any()
    ours = lambda a, b: jnp.sum(moe.tiled_matmul(a, b, sizes, tile) * cotangent)
    xla = lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes) * cotangent)
    np.testing.assert_allclose(moe.tiled_matmul(lhs, rhs, sizes, tile), jax.lax.ragged_dot(lhs, rhs, sizes),
                               rtol=1e-12)
    for g, w in zip(jax.grad(ours, (0, 1))(lhs, rhs), jax.grad(xla, (0, 1))(lhs, rhs), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def numpy_route(logits, k, score, normalize, scale, bias, groups, top_groups):
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs = probs / probs.sum(-1, keepdims=True) if score == 'softmax' else 1 / (1 + np.exp(-logits))
  choice = probs + (0 if bias is None else bias)
  if groups > 1:
    g = choice.reshape(len(choice), groups, -1)
    group_score = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-group_score, -1, kind='stable')[:, :top_groups]
    mask = np.zeros_like(group_score, bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, g.shape[-1], 1), choice, -np.inf)
  experts = np.argsort(-choice, -1, kind='stable')[:, :k]
  w = np.take_along_axis(probs, experts, -1)
  if normalize:
    w = w / w.sum(-1, keepdims=True)
  return w * scale, experts


@pytest.mark.parametrize('score, normalize, scale, with_bias, groups, top_groups', [
  ('softmax', True, 1.0, False, 1, 1),  # Mixtral
  ('softmax', False, 1.0, False, 1, 1),  # Qwen2-MoE's norm_topk_prob=False
  ('sigmoid', True, 2.5, True, 4, 2),  # DeepSeek-V3: sigmoid, a selection bias, groups, a routed scaling factor
])
def test_routing_equals_numpy(score, normalize, scale, with_bias, groups, top_groups):
  rng = np.random.default_rng(1)
  e = 8
  logits = rng.normal(size=(32, e)).astype(np.float32)
  bias = rng.normal(size=e).astype(np.float32) if with_bias else None
  r = moe.route(jnp.asarray(logits), 2, score, normalize, scale, None if bias is None else jnp.asarray(bias),
                groups, top_groups)
  w, experts = numpy_route(logits.astype(np.float64), 2, score, normalize, scale, bias, groups, top_groups)
  np.testing.assert_array_equal(r.experts, experts)
  np.testing.assert_allclose(r.weights, w, rtol=1e-6)


def test_a_selection_bias_changes_the_choice_and_not_the_weights():
  """Aux-loss-free balancing: a bias toward expert 3 puts it among every token's choices, and each chosen expert's
  weight is still its unbiased score (renormalised over the choice)."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(16, E)).astype(np.float32))
  plain = moe.route(logits, K, 'sigmoid', normalize=False)
  biased = moe.route(logits, K, 'sigmoid', normalize=False, bias=jnp.array([0, 0, 0, 10.0]))
  assert (np.asarray(biased.experts) == 3).any(1).all() and not (np.asarray(plain.experts) == 3).any(1).all()
  np.testing.assert_array_equal(biased.weights, jnp.take_along_axis(plain.probs, biased.experts, -1))


def test_a_small_capacity_drops_exactly_the_predicted_choices():
  """With one slot in 4 needed, each expert keeps its first choices in the stated order (every token's first
  choice by token index, then the second choices); the output is the loop over the kept choices only."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
  up, down, gate = map(jnp.asarray, weights(rng, True, np.float32))
  routing = moe.route(jnp.asarray(skewed_logits(rng, True).astype(np.float32)), K)
  factor = 0.5
  slots = moe.capacity_slots(T, K, E, factor)
  taken, kept = np.zeros(E, int), np.zeros((T, K), bool)
  for j in range(K):
    for t in range(T):
      e = int(routing.experts[t, j])
      kept[t, j], taken[e] = taken[e] < slots, taken[e] + 1
  y, dropped = moe.capacity(x, routing, up, down, gate, moe.gated(jax.nn.silu), factor)
  want = loop_over_experts(x, routing.experts, routing.weights * kept, up, down, gate, moe.gated(jax.nn.silu))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
  assert 0 < float(dropped) == pytest.approx(1 - kept.mean())


def test_one_expert_with_k_1_is_the_dense_mlp():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
  up, down, gate = (jnp.asarray(a[:1]) for a in weights(rng, True, np.float32))
  routing = moe.route(jnp.asarray(rng.normal(size=(T, 1)).astype(np.float32)), 1)
  mlp = (jax.nn.silu(x @ gate[0]) * (x @ up[0])) @ down[0]
  for path in (moe.dense, moe.dropless):
    np.testing.assert_allclose(path(x, routing, up, down, gate, moe.gated(jax.nn.silu)), mlp, rtol=1e-5, atol=1e-6)


def test_permuting_the_experts_with_the_router_rows_changes_nothing():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(T, D)).astype(np.float32))
  up, down, gate = map(jnp.asarray, weights(rng, True, np.float32))
  router = jnp.asarray(rng.normal(size=(D, E)).astype(np.float32))
  perm = np.array([2, 0, 3, 1])
  run = lambda r, u, d, g: moe.dropless(x, moe.route(x @ r, K), u, d, g, moe.gated(jax.nn.silu))
  np.testing.assert_allclose(run(router[:, perm], up[perm], down[perm], gate[perm]), run(router, up, down, gate),
                             rtol=1e-5, atol=1e-6)


def test_under_dropless_a_tokens_output_ignores_the_other_tokens():
  rng = np.random.default_rng(6)
  x = rng.normal(size=(T, D)).astype(np.float32)
  up, down, gate = map(jnp.asarray, weights(rng, True, np.float32))
  router = jnp.asarray(rng.normal(size=(D, E)).astype(np.float32))
  run = lambda x: moe.dropless(x, moe.route(x @ router, K), up, down, gate, moe.gated(jax.nn.silu))
  other = x.copy()
  other[1:] = rng.normal(size=(T - 1, D)) * 3
  np.testing.assert_array_equal(run(jnp.asarray(x))[0], run(jnp.asarray(other))[0])


def test_the_balance_loss_equals_transformers_with_padding():
  """Against transformers' load_balancing_loss_func (Mixtral's) with an attention mask: one layer, and two layers
  with their statistics pooled (`over='model'`, as transformers concatenates them) or their losses averaged
  (`over='layer'`, each layer alone through transformers); balanced routing gives k."""
  import torch
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  rng = np.random.default_rng(7)
  batch, length = 3, 5
  layers = [rng.normal(size=(batch * length, E)).astype(np.float32) for _ in range(2)]
  mask = np.ones((batch, length), np.int64)
  mask[0, 3:] = mask[2, 1:] = 0
  theirs = lambda *logits: float(load_balancing_loss_func(tuple(map(torch.from_numpy, logits)), E, K,
                                                          torch.from_numpy(mask)))
  loads = [moe.expert_load(r.probs, r.experts, jnp.asarray(mask.reshape(-1)))
           for r in (moe.route(jnp.asarray(logits), K) for logits in layers)]
  f, p = (jnp.stack(a) for a in zip(*loads))
  np.testing.assert_allclose(float(moe.balance_loss(f[:1], p[:1])), theirs(layers[0]), rtol=1e-6)
  np.testing.assert_allclose(float(moe.balance_loss(f, p, 'model')), theirs(*layers), rtol=1e-6)
  np.testing.assert_allclose(float(moe.balance_loss(f, p, 'layer')), np.mean([theirs(x) for x in layers]), rtol=1e-6)
  balanced = jnp.stack([jnp.arange(E), (jnp.arange(E) + 1) % E], 1)  # each expert chosen by 2 of 4 tokens
  assert float(moe.load_balance_loss(jnp.full((E, E), 1 / E), balanced)) == pytest.approx(K)


# expert parallelism (the fast tier's case); the same through the Pallas kernel with the other axes beside it;
# and gmm with no expert axis, per shard with every expert's weights gathered in (XLA cannot partition it)
@pytest.mark.parametrize('axes, kernel', [({'data': 2, 'expert': 4}, 'tiles'),
                                          ({'expert': 2, 'fsdp': 2, 'tensor': 2}, 'gmm'),
                                          ({'fsdp': 4, 'tensor': 2}, 'gmm')])
@pytest.mark.variants
def test_dropless_on_a_mesh_equals_one_device(axes, kernel):
  """Outputs and gradients (tokens, each expert weight and bias, router logits) of dropless on a mesh equal one
  device's. With an expert axis each device's token copies go to the devices holding their experts and back (on
  the CPU the all-gather exchange, with the offsets and sizes a ragged all-to-all takes); the routing is skewed so
  that the first device's experts take most copies and the last device's none. The experts have biases (GPT-OSS)
  but under the Pallas kernel with experts split, which covers the plain ones."""
  from lm.config import MeshConfig
  from lm.parallel.mesh import make_mesh
  from lm.parallel.rules import sharding_context, sharding_for
  rng = np.random.default_rng(11)
  batch, length, e, d, f = 8, 6, 8, 8, 6
  x = jnp.asarray(rng.normal(size=(batch, length, d)).astype(np.float32))
  up, down, gate = (jnp.asarray(rng.normal(size=s).astype(np.float32) / 3) for s in ((e, d, f), (e, f, d), (e, d, f)))
  bias = moe.Biases(*(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((e, f), (e, d), (e, f))))
  bias = None if 'expert' in axes and kernel == 'gmm' else bias
  logits = rng.normal(size=(batch * length, e))
  logits[:, :2] += 2.0
  logits[:, -2:] -= 8.0
  logits = jnp.asarray(logits.astype(np.float32))
  cotangent = jnp.asarray(rng.normal(size=x.shape).astype(np.float32))

  def loss(path):
    return lambda x, up, down, gate, logits, bias: jnp.sum(
      path(x, moe.route(logits, K), up, down, gate, moe.gated(jax.nn.silu), bias=bias) * cotangent)
  one = lambda x, r, up, down, gate, act, bias: moe.dropless(x.reshape(-1, d), r, up, down, gate, act,
                                                             bias=bias).reshape(x.shape)
  grads = (0, 1, 2, 3, 4, 5)
  want = jax.value_and_grad(loss(one), grads)(x, up, down, gate, logits, bias)
  mesh = make_mesh(MeshConfig(**{'data': 1, **axes}))
  with sharding_context(mesh):
    place = lambda a, axes: jax.device_put(a, sharding_for(axes, a.shape, mesh))
    placed_bias = bias and moe.Biases(place(bias.up, ('experts', 'mlp')), place(bias.down, ('experts', 'embed')),
                                      place(bias.gate, ('experts', 'mlp')))
    args = (place(x, ('batch', 'length', None)), place(up, ('experts', 'embed', 'mlp')),
            place(down, ('experts', 'mlp', 'embed')), place(gate, ('experts', 'embed', 'mlp')), logits, placed_bias)
    sharded = lambda *a, bias: moe.dropless_on_mesh(*a, kernel=kernel, bias=bias)[0]
    got = jax.jit(jax.value_and_grad(loss(sharded), grads))(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


def test_a_capped_expert_buffer_drops_the_predicted_copies():
  """`buffer=1` on {data 2, expert 4}: each device receives at most an even share of its expert group's copies
  (T k), kept in sender order, each sender's chunk (sorted by expert) cut at its end. The kept copies predicted
  in NumPy give the outputs (one device's dropless with the dropped copies' weights zeroed) and the drop rate."""
  from lm.config import MeshConfig
  from lm.parallel.mesh import make_mesh
  from lm.parallel.rules import sharding_context, sharding_for
  rng = np.random.default_rng(12)
  batch, length, e, d, f, devices, groups = 8, 6, 8, 8, 6, 4, 2
  x = rng.normal(size=(batch, length, d)).astype(np.float32)
  up, down, gate = (rng.normal(size=s).astype(np.float32) / 3 for s in ((e, d, f), (e, f, d), (e, d, f)))
  logits = rng.normal(size=(batch * length, e))
  logits[:, :2] += 2.0  # the first device's experts overflow
  routing = moe.route(jnp.asarray(logits.astype(np.float32)), K)
  chosen = np.asarray(routing.experts)
  t = batch * length // (devices * groups)  # tokens per device: the batch over data x expert, data major
  kept = np.zeros(chosen.shape, bool)
  for group in range(groups):
    for receiver in range(devices):
      room = t * K
      for sender in range(devices):
        first = (group * devices + sender) * t
        copies = [(chosen[first + i, j], i * K + j) for i in range(t) for j in range(K)
                  if chosen[first + i, j] // (e // devices) == receiver]
        for _, flat in sorted(copies)[:room]:
          kept[first + flat // K, flat % K] = True
        room -= min(room, len(copies))
  assert 0 < kept.mean() < 1
  want = moe.dropless(jnp.asarray(x.reshape(-1, d)), routing._replace(weights=routing.weights * kept), up, down,
                      gate, moe.gated(jax.nn.silu))
  mesh = make_mesh(MeshConfig(data=2, expert=devices))
  with sharding_context(mesh):
    place = lambda a, axes: jax.device_put(a, sharding_for(axes, a.shape, mesh))
    y, dropped = jax.jit(lambda x, up, down, gate: moe.dropless_on_mesh(
      x, routing, up, down, gate, moe.gated(jax.nn.silu), buffer=1.0))(
      place(x, ('batch', 'length', None)), place(up, ('experts', 'embed', 'mlp')),
      place(down, ('experts', 'mlp', 'embed')), place(gate, ('experts', 'embed', 'mlp')))
  np.testing.assert_allclose(np.asarray(y).reshape(-1, d), want, rtol=1e-5, atol=1e-6)
  assert float(dropped) == pytest.approx(1 - kept.mean())


def test_the_megablox_kernel_writes_the_compute_dtype_with_the_values_of_a_float32_result_cast_down():
  """In a bf16 step the grouped matmul's kernel writes bf16, forward and backward (a float32 [M, N] result is twice
  the bytes the backward pass and remat keep: mixtral_8x7b's largest buffers), with the values, and gradients, of
  the float32 result cast to bf16: the outputs equal, the gradients within one bf16 rounding (the backward dots take
  a bf16 cotangent where they took its float32 copy; interpreted here)."""
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
  rng = np.random.default_rng(3)
  sizes = jnp.array([100, 0, 156, 0], jnp.int32)
  lhs = jnp.asarray(rng.normal(size=(256, 128)), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=(4, 128, 256)), jnp.bfloat16)
  cotangent = jnp.asarray(rng.normal(size=(256, 256)), jnp.float32)
  ours = lambda a, b: moe.grouped_matmul(a, b, sizes, jnp.bfloat16, 'gmm')
  cast = lambda a, b: megablox.gmm(a, b, sizes, jnp.float32, (128, 128, 128), None, None, False, True
                                   ).astype(jnp.bfloat16)
  loss = lambda f: lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * cotangent)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss(ours), (0, 1)))(lhs, rhs)
  written = {str(v.aval.dtype) for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == 'pallas_call'
             for v in e.outvars}
  assert written == {'bfloat16'}, written
  np.testing.assert_array_equal(np.asarray(ours(lhs, rhs), np.float32), np.asarray(cast(lhs, rhs), np.float32))
  for got, want in zip(jax.grad(loss(ours), (0, 1))(lhs, rhs), jax.grad(loss(cast), (0, 1))(lhs, rhs)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -7, atol=1e-6)


def _all_eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside its equations."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      inner = getattr(param, 'jaxpr', param)
      if hasattr(inner, 'eqns'):
        yield from _all_eqns(inner)
