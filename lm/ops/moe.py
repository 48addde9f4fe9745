"""Mixture-of-experts routing and expert compute, as functions of arrays (the routed layer wraps them).

Routing and the combine are float32 or wider whatever the compute dtype (`_wide`): ties at the top-k boundary in
bf16 would pick other experts.
A token's k choices come with combine weights; three paths compute sum_k weight_k * expert_{e_k}(x):
- `dense`: every expert on every token (the reference the tests hold the others to);
- `dropless`: token copies sorted by expert, then one grouped matmul per projection (`grouped_matmul`: XLA's
  `jax.lax.ragged_dot` on every platform, JAX's Pallas megablox `gmm`, the TPU default, or `tiled_matmul`, the
  CPU default);
- `capacity`: GShard's dispatch and combine with `capacity` slots per expert (as a scatter into the experts'
  slots and a gather back, not one-hot einsums); choices past an expert's slots are dropped, in this order: every
  token's first choice (by token index) before any second choice, and so on.

Expert weights: `up` [E, D, F], `down` [E, F, D] and, for a gated MLP, `gate` [E, D, F]; optional per-expert
biases (`Biases`: GPT-OSS). `act` is the activation of x Wu, or for a gated MLP the unit of (x Wg, x Wu) (`gated`).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm.parallel.rules import active_sharding, manual_axes, shard_map, spec_for, target_platform

Activation = Callable[..., jax.Array]


def gated(act: Callable[[jax.Array], jax.Array]) -> Activation:
  """The gated unit act(x Wg) * (x Wu) of a plain activation."""
  return lambda g, u: act(g) * u


class Biases(NamedTuple):
  """Each expert's biases of its projections: up [E, F], down [E, D], gate [E, F] (None for a plain MLP)."""
  up: jax.Array
  down: jax.Array
  gate: jax.Array | None = None


def _wide(dtype) -> jnp.dtype:
  """float32, or float64 for float64 (the tests' references)."""
  return jnp.promote_types(dtype, jnp.float32)


class Routing(NamedTuple):
  weights: jax.Array  # [T, k] float32 combine weights
  experts: jax.Array  # [T, k] int32 chosen experts, best first
  probs: jax.Array  # [T, E] float32 router scores (softmax or sigmoid) before any selection bias


def route(logits: jax.Array, k: int, score: str = 'softmax', normalize: bool = True, scale: float = 1.0,
          bias: jax.Array | None = None, groups: int = 1, top_groups: int = 1) -> Routing:
  """Top-k routing of router `logits` [T, E]. `score`: softmax over all experts (Mixtral, Qwen) or a sigmoid
  per expert (DeepSeek-V3). `normalize`: the chosen scores divided by their sum (Mixtral's top-k-then-softmax;
  Qwen2-MoE's norm_topk_prob=False keeps them as they are). `scale`: the routed scaling factor. `bias` [E]
  (aux-loss-free balancing) shifts the scores only to choose experts, never in the weights. `groups` > 1: experts
  in equal groups, only the `top_groups` groups whose two best scores sum highest may be chosen (DeepSeek-V3)."""
  logits = logits.astype(_wide(logits.dtype))
  probs = jax.nn.softmax(logits, axis=-1) if score == 'softmax' else jax.nn.sigmoid(logits)
  choice = probs if bias is None else probs + bias.astype(logits.dtype)
  if groups > 1:
    t, e = choice.shape
    grouped = choice.reshape(t, groups, e // groups)
    group_score = jax.lax.top_k(grouped, min(2, e // groups))[0].sum(-1)  # [T, groups]
    allowed = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], jax.lax.top_k(group_score, top_groups)[1]].set(
      True)
    choice = jnp.where(jnp.repeat(allowed, e // groups, axis=1), choice, -jnp.inf)
  experts = jax.lax.top_k(choice, k)[1]
  weights = jnp.take_along_axis(probs, experts, axis=-1)
  if normalize:
    weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if score == 'sigmoid' else 0.0))
  return Routing(weights * scale, experts.astype(jnp.int32), probs)


def _expert_mlp(x: jax.Array, up: jax.Array, down: jax.Array, gate: jax.Array | None, act: Activation,
                matmul: Callable[[jax.Array, jax.Array], jax.Array], bias: Biases | None = None,
                rows: jax.Array | None = None) -> jax.Array:
  """down(act(x gate, x up)) or down(act(x up)) with `matmul` doing each projection, plus the `bias` of each
  row's expert: `rows` [N] names it for rows [N, ...] grouped by expert; None: x is [E, N, D], one block per expert."""
  def project(a: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = matmul(a, w)
    return y if b is None else y + (b[:, None] if rows is None else b[rows]).astype(y.dtype)
  b = bias or Biases(None, None, None)
  h = project(x, up, b.up)
  h = act(project(x, gate, b.gate), h) if gate is not None else act(h)
  return project(h, down, b.down)


def _per_expert(a: jax.Array, w: jax.Array) -> jax.Array:
  """Each expert's rows [E, N, D] times its weight [E, D, F]."""
  return jnp.einsum('end,edf->enf', a, w)


def dense(x: jax.Array, routing: Routing, up: jax.Array, down: jax.Array, gate: jax.Array | None,
          act: Activation, bias: Biases | None = None) -> jax.Array:
  """Every expert on every token [T, D], combined by the routing's weights (zero for experts not chosen)."""
  num_experts = up.shape[0]
  combine = jnp.zeros((x.shape[0], num_experts), _wide(x.dtype)).at[
    jnp.arange(x.shape[0])[:, None], routing.experts].add(routing.weights)
  outputs = _expert_mlp(jnp.broadcast_to(x, (num_experts, *x.shape)), up, down, gate, act, _per_expert,
                        bias)  # [E, T, D]
  return jnp.einsum('te,etd->td', combine, outputs.astype(combine.dtype)).astype(x.dtype)


GROUPED_KERNELS = ('ragged_dot', 'gmm', 'tiles')


def default_kernel() -> str:
  """The grouped matmul for the compile target: gmm on TPU, tiles on CPU, ragged_dot elsewhere (GPU)."""
  return {'tpu': 'gmm', 'cpu': 'tiles'}.get(target_platform(), 'ragged_dot')


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, out_dtype: jnp.dtype,
                   kernel: str | None = None) -> jax.Array:
  """Rows of `lhs` [M, K] in consecutive groups of `sizes` [G], each group times its `rhs` [G, K, N], accumulated
  in float32 or wider; rows past the groups come out zero. `kernel`: 'ragged_dot' (XLA), 'gmm' (the megablox
  kernel, compiled on TPU and interpreted elsewhere) or 'tiles' (`tiled_matmul`). The default follows the compile
  target, not the host's backend: gmm for TPU; tiles for CPU, where XLA computes a ragged_dot as G whole matmuls;
  ragged_dot elsewhere (GPU)."""
  kernel = kernel or default_kernel()
  if kernel == 'ragged_dot':
    return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=_wide(lhs.dtype)).astype(out_dtype)
  if kernel == 'tiles':
    return tiled_matmul(lhs, rhs, sizes).astype(out_dtype)
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
  (m, k), n = lhs.shape, rhs.shape[2]
  # Every dimension padded with zeros to whole 128-blocks (rows past the groups come out zero): the kernel's
  # blocks must divide them, and its backward swaps the roles of K and N
  lhs = jnp.pad(lhs, ((0, -m % 128), (0, -k % 128)))
  rhs = jnp.pad(rhs.astype(lhs.dtype), ((0, 0), (0, -k % 128), (0, -n % 128)))
  # The kernel accumulates in float32 and writes `out_dtype` once, as a float32 result cast after would: the same
  # values, without the float32 [M, N] buffers (twice a bf16 one's bytes) the backward pass and remat would keep.
  out = megablox.gmm(lhs, rhs, sizes, out_dtype, (128, 128, 128), None, None, False, target_platform() != 'tpu')
  return out[:m, :n]


def tiled_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, tile: int = 128) -> jax.Array:
  """`grouped_matmul` as one batched matmul over row tiles: each group padded to whole tiles of `tile` rows, each
  tile times its group's weight (gathered per tile). At most G (tile - 1) padding rows, so the FLOPs stay near the
  useful ones; the gathered weights take tiles x K x N, fine for the small models that run on a CPU."""
  m, groups = lhs.shape[0], sizes.shape[0]
  tile = min(tile, max(m, 1))
  tiles = -(-(m + groups * (tile - 1)) // tile)  # a static bound on the padded groups' tiles
  padded = -(-sizes // tile) * tile
  start = jnp.cumsum(sizes) - sizes  # each group's first row in lhs
  padded_start = jnp.cumsum(padded) - padded
  group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=m)  # each row's group
  dest = padded_start[group] + jnp.arange(m) - start[group]  # each row's place among the padded groups
  x = jnp.zeros((tiles * tile, lhs.shape[1]), lhs.dtype).at[dest].set(lhs)
  tile_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * tile, side='right'),
                           groups - 1)  # tiles past the last group hold zeros: any weight will do
  out = jnp.einsum('tmk,tkn->tmn', x.reshape(tiles, tile, -1), rhs.astype(lhs.dtype)[tile_group],
                   preferred_element_type=_wide(lhs.dtype))
  return jnp.where((jnp.arange(m) < sizes.sum())[:, None], out.reshape(tiles * tile, -1)[dest], 0)  # rows past
  # the groups (an expert-parallel receive buffer's unused rows) come out zero, as ragged_dot's and gmm's


def dropless(x: jax.Array, routing: Routing, up: jax.Array, down: jax.Array, gate: jax.Array | None,
             act: Activation, kernel: str | None = None, bias: Biases | None = None) -> jax.Array:
  """Each token's k copies sorted by expert, the projections as grouped matmuls over the experts' contiguous
  groups (empty groups included; `grouped_matmul`'s `kernel`), the outputs weighted and summed back per token."""
  t, k = routing.experts.shape
  flat = routing.experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=up.shape[0]).astype(jnp.int32)
  grouped = lambda a, w: grouped_matmul(a, w, sizes, x.dtype, kernel)
  out = _expert_mlp(x[token], up, down, gate, act, grouped, bias, flat[order])  # [T k, D] in expert order
  weighted = out.astype(_wide(x.dtype)) * routing.weights.reshape(-1)[order][:, None]
  return jnp.zeros((t, x.shape[1]), weighted.dtype).at[token].add(weighted).astype(x.dtype)


def exchange(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
             output_offsets: jax.Array, recv_sizes: jax.Array, axis: str | tuple[str, ...]) -> jax.Array:
  """`jax.lax.ragged_all_to_all` over mesh `axis` where the platform compiles it (TPU, GPU). XLA's CPU has none:
  there the same exchange from all-gathers, each device gathering every device's rows and offsets and keeping the
  chunks sent to it (P times the memory; the CPU runs small models)."""
  if target_platform() != 'cpu':
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)
  me = jax.lax.axis_index(axis)
  rows, starts, sizes, offsets = (jax.lax.all_gather(a, axis) for a in (operand, input_offsets, send_sizes,
                                                                        output_offsets))
  row = jnp.arange(output.shape[0])
  for sender in range(rows.shape[0]):
    at = row - offsets[sender, me]
    sent = (at >= 0) & (at < sizes[sender, me])
    output = jnp.where(sent[:, None], rows[sender][jnp.clip(starts[sender, me] + at, 0, operand.shape[0] - 1)],
                       output)
  return output


def expert_parallel(x: jax.Array, experts: jax.Array, weights: jax.Array, up: jax.Array, down: jax.Array,
                    gate: jax.Array | None, act: Activation, kernel: str, axis: str | tuple[str, ...],
                    devices: int, buffer: float = 0.0, bias: Biases | None = None) -> tuple[jax.Array, jax.Array]:
  """Expert parallelism, per device inside a shard_map over mesh `axis` (`devices` devices, device i
  holding experts i E/P ... (i+1) E/P - 1 of `up`, `down`, `gate` [E/P, ...]): this device's tokens x [T, D] with
  their choices `experts` and combine `weights` [T, k] -> [T, D]. Its token copies, sorted by expert, go to the
  devices holding their experts (`exchange`, sizes agreed by an all-gather of every device's counts per expert),
  which regroup what they receive by local expert, run the grouped matmuls and send each row back where it came
  from. The receive buffer holds P T k rows, the most that can arrive (every token of every device choosing this
  device's experts); its unused rows are zero and stay out of every group. `buffer` > 0 holds `buffer` T k rows
  instead (T k: an even share): a device keeps what arrives in device order until it is full, each sender's
  chunk cut at its end (its last experts' copies), and a dropped copy adds nothing. Returns (outputs, the share of
  the expert group's copies dropped)."""
  t, k = experts.shape
  local = up.shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  counts = jax.lax.all_gather(jnp.bincount(flat, length=local * devices).astype(jnp.int32), axis)
  counts = counts.reshape(devices, devices, local)  # [sender, receiver, the receiver's local expert]
  exclusive = lambda a, dim: jnp.cumsum(a, axis=dim) - a
  sizes = counts.sum(-1)  # rows each device sends each device
  starts = exclusive(sizes, 1)  # a chunk's first row at its sender
  rows = min(math.ceil(buffer * t * k), devices * t * k) if buffer else devices * t * k
  dropped = jnp.zeros(())
  if buffer:  # what fits, first come first kept: each chunk's start, then each expert's copies in it
    kept = jnp.clip(rows - exclusive(sizes, 0), 0, sizes)
    dropped = 1 - kept.sum() / jnp.maximum(sizes.sum(), 1)
    counts = jnp.clip(kept[..., None] - exclusive(counts, 2), 0, counts)
    sizes = kept
  lands = exclusive(sizes, 0)  # a chunk's first row at its receiver
  me = jax.lax.axis_index(axis)
  received = exchange(x[token], jnp.zeros((rows, x.shape[1]), x.dtype), starts[me], sizes[me], lands[me],
                      sizes[:, me], axis)
  mine = counts[:, me]  # [sender, local expert]: each sender's chunk is sorted by local expert
  local_expert = jnp.repeat(jnp.tile(jnp.arange(local), devices), mine.reshape(-1), total_repeat_length=rows)
  local_expert = jnp.where(jnp.arange(rows) < mine.sum(), local_expert, local)  # unused rows last
  regroup = jnp.argsort(local_expert, stable=True)
  grouped = lambda a, w: grouped_matmul(a, w, mine.sum(0), x.dtype, kernel)
  if bias is not None:  # the unused rows (local expert `local`) take a zero bias
    bias = Biases(*(None if b is None else jnp.pad(b, ((0, 1), (0, 0))) for b in bias))
  out = _expert_mlp(received[regroup], up, down, gate, act, grouped, bias, local_expert[regroup])
  out = jnp.zeros_like(out).at[regroup].set(out)  # in the order received
  back = exchange(out, jnp.zeros((t * k, x.shape[1]), out.dtype), lands[:, me], sizes[:, me], starts[:, me],
                  sizes[me], axis)
  weighted = back.astype(_wide(x.dtype)) * weights.reshape(-1)[order][:, None]
  y = jnp.zeros((t, x.shape[1]), weighted.dtype).at[token].add(weighted).astype(x.dtype)
  return y, dropped


def in_slices(fn: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]], chunks: int,
              tokens: jax.Array, experts: jax.Array, combine: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`fn(tokens [T, D], experts [T, k], combine [T, k])` -> (outputs [T, D], the share dropped), run over `chunks`
  contiguous slices of the tokens in turn, each rematerialized: one slice's [T k / chunks, d_ff] expert activations
  are live at a time, in the forward and the backward pass. Dropless, a token's output depends on its own choices
  only, so the outputs are the same; T that `chunks` does not divide runs whole."""
  t = tokens.shape[0]
  if chunks == 1 or t % chunks:
    return fn(tokens, experts, combine)
  split = lambda a: a.reshape(chunks, t // chunks, *a.shape[1:])
  step = jax.checkpoint(lambda carry, s: (carry, fn(*s)), prevent_cse=False)
  _, (y, dropped) = jax.lax.scan(step, None, (split(tokens), split(experts), split(combine)))
  return y.reshape(t, -1), dropped.mean()


def dropless_on_mesh(x: jax.Array, routing: Routing, up: jax.Array, down: jax.Array, gate: jax.Array | None,
                     act: Activation, kernel: str | None = None, buffer: float = 0.0, chunks: int = 1,
                     bias: Biases | None = None) -> tuple[jax.Array, jax.Array | None]:
  """`dropless` of tokens x [B, L, D] (routing [B L, k]) under the active mesh. Where the experts shard over mesh
  devices (the `expert` axis), expert parallelism: each device's token copies go to the devices holding their
  experts and come back (`expert_parallel`). Else XLA partitions ragged_dot and the tiles itself; a Pallas kernel
  (gmm) cannot be partitioned automatically, so it runs per shard: each shard's tokens through every expert. Either
  way, the expert weights' (and biases') other sharded dims are all-gathered in per shard (their gradients
  reduce-scattered back, as FSDP's). Off a mesh, `dropless` as it is. `chunks` > 1: each shard's tokens
  `in_slices`, unless `buffer` caps the receive buffers (a cap per slice would drop other copies). Returns (outputs,
  the share of the token copies dropped: None unless `buffer` > 0 caps expert parallelism's receive buffers)."""
  batch, length, d = x.shape
  kernel = kernel or default_kernel()
  active = active_sharding()
  chunks = 1 if buffer else chunks
  if active is None or _expert_axis(up, active) is None and kernel != 'gmm':
    def whole(t, e, c):
      return dropless(t, Routing(c, e, None), up, down, gate, act, kernel, bias), jnp.zeros(())
    y, _ = in_slices(whole, chunks, x.reshape(-1, d), routing.experts, routing.weights)
    return y.reshape(x.shape), None
  mesh, rules = active
  expert_axis = _expert_axis(up, active)
  # every expert weight and bias by its logical axes, in one list: (up, down, gate, up bias, down bias, gate bias)
  named = {'up': (up, ('experts', 'embed', 'mlp')), 'down': (down, ('experts', 'mlp', 'embed')),
           'gate': (gate, ('experts', 'embed', 'mlp'))}
  if bias is not None:
    named.update({f'{k}_bias': (b, ('experts', 'mlp' if k != 'down' else 'embed'))
                  for k, b in bias._asdict().items()})
  named = {k: v for k, v in named.items() if v[0] is not None}
  specs = {k: spec_for(axes, w.shape, mesh, rules) for k, (w, axes) in named.items()}
  k = routing.experts.shape[-1]
  token_spec = spec_for(('batch', 'length', None), (batch, length, k), mesh, rules)
  expert_names = (expert_axis,) if isinstance(expert_axis, str) else expert_axis or ()
  devices = math.prod(mesh.shape[a] for a in expert_names)

  def per_shard(x, experts, combine, *leaves):
    w = {}
    for (key, leaf) in zip(named, leaves, strict=True):
      for dim, entry in enumerate(specs[key]):
        if entry is not None and (dim > 0 or expert_axis is None):  # each device keeps its own experts
          leaf = jax.lax.all_gather(leaf, entry, axis=dim, tiled=True)
      w[key] = leaf
    b = Biases(w['up_bias'], w['down_bias'], w.get('gate_bias')) if bias is not None else None
    def compute(tokens, experts, combine):
      if expert_axis is None:
        return (dropless(tokens, Routing(combine, experts, None), w['up'], w['down'], w.get('gate'), act, kernel, b),
                jnp.zeros(()))
      return expert_parallel(tokens, experts, combine, w['up'], w['down'], w.get('gate'), act, kernel, expert_axis,
                             devices, buffer, b)
    y, dropped = in_slices(compute, chunks, x.reshape(-1, d), experts.reshape(-1, k), combine.reshape(-1, k))
    return y.reshape(x.shape), dropped.reshape(1)
  shaped = lambda a: a.reshape(batch, length, k)
  every = P(tuple(a for a in mesh.axis_names if a not in manual_axes()))  # one value per device (of a stage)
  y, dropped = shard_map(per_shard, mesh, (token_spec, token_spec, token_spec, *specs.values()), (token_spec, every))(
    x, shaped(routing.experts), shaped(routing.weights), *(w for w, _ in named.values()))
  return y, dropped.mean() if buffer and expert_axis is not None else None


def _expert_axis(up: jax.Array, active: tuple) -> str | tuple[str, ...] | None:
  """The mesh axis (or axes) the experts shard over under the `active` sharding, or None."""
  return spec_for(('experts', 'embed', 'mlp'), up.shape, *active)[0]


def capacity_slots(tokens: int, k: int, num_experts: int, factor: float) -> int:
  """Slots per expert: `factor` times an even share of the T k choices, rounded up."""
  return max(1, math.ceil(factor * tokens * k / num_experts))


def capacity(x: jax.Array, routing: Routing, up: jax.Array, down: jax.Array, gate: jax.Array | None,
             act: Activation, factor: float, bias: Biases | None = None) -> tuple[jax.Array, jax.Array]:
  """GShard's dispatch and combine with `capacity_slots` per expert: (outputs [T, D], the share of the T k
  choices dropped). A dropped choice adds nothing; the kept weights are not renormalised."""
  t, k = routing.experts.shape
  num_experts = up.shape[0]
  slots = capacity_slots(t, k, num_experts, factor)
  onehot = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.int32)  # [T, k, E]
  by_rank = onehot.transpose(1, 0, 2).reshape(k * t, num_experts)  # first choices of all tokens, then seconds, ...
  position = (jnp.cumsum(by_rank, axis=0) - 1).reshape(k, t, num_experts).transpose(1, 0, 2)
  slot = (position * onehot).sum(-1)  # [T, k]: the choice's place in its expert's queue
  kept = slot < slots
  # each kept choice's row in the [E C] expert inputs; dropped ones all go to one spare row, read back as nothing
  row = jnp.where(kept, routing.experts * slots + slot, num_experts * slots).reshape(-1)
  inputs = jnp.zeros((num_experts * slots + 1, x.shape[1]), x.dtype).at[row].set(jnp.repeat(x, k, axis=0))
  outputs = _expert_mlp(inputs[:-1].reshape(num_experts, slots, -1), up, down, gate, act, _per_expert, bias)
  outputs = jnp.concatenate([outputs.reshape(num_experts * slots, -1), jnp.zeros((1, x.shape[1]), outputs.dtype)])
  weights = jnp.where(kept, routing.weights, 0).astype(_wide(x.dtype))
  y = jnp.einsum('tk,tkd->td', weights, outputs[row].reshape(t, k, -1).astype(weights.dtype)).astype(x.dtype)
  return y, 1.0 - kept.mean()


def expert_load(probs: jax.Array, experts: jax.Array, mask: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """One layer's balance statistics over the tokens `mask` [T] keeps (padding excluded): (f [E], p [E]), f_e the
  share of tokens with e among their k choices (so sum_e f_e = k), p_e the mean router score of e."""
  num_experts = probs.shape[-1]
  w = jnp.ones(probs.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(1)  # [T, E]
  return (chosen * w[:, None]).sum(0) / w.sum(), (probs * w[:, None]).sum(0) / w.sum()


def balance_loss(f: jax.Array, p: jax.Array, over: str = 'layer') -> jax.Array:
  """Switch-style balance loss E * sum_e f_e p_e from `expert_load`'s statistics of L layers (f, p [L, E]).
  `over='layer'`: the mean of each layer's loss (Switch, MaxText, Megatron); `'model'`: f and p averaged over the
  layers first, as transformers' `load_balancing_loss_func` concatenates every layer's tokens. Balanced routing
  gives k either way."""
  num_experts = f.shape[-1]
  if over == 'model':
    return num_experts * jnp.sum(f.mean(0) * p.mean(0))
  return num_experts * jnp.mean(jnp.sum(f * p, axis=-1))


def load_balance_loss(probs: jax.Array, experts: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """One layer's balance loss, as transformers' `load_balancing_loss_func` for one layer."""
  f, p = expert_load(probs, experts, mask)
  return balance_loss(f[None], p[None])


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """ST-MoE's router z-loss: the mean over kept tokens of logsumexp(logits)^2."""
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
  w = jnp.ones_like(z) if mask is None else mask.astype(jnp.float32)
  return (z * w).sum() / w.sum()
