"""Transformer blocks and the scanned, rematerialised stack every family builds on."""
from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import ExecutionConfig, ModelConfig
from lm.models.layers import DTYPES, Attention, Mlp, RelativePositionBias, in_chunks, make_norm
from lm.models.mla import latent_qkv
from lm.models.moe import RoutedMlp, layers_aux_loss
from lm.models.parametrization import Init, attention_scale
from lm.models.rope import rope_of
from lm.parallel.one_f_one_b import one_f_one_b
from lm.parallel.pipeline import LossOffer, active_pipelining, join_rows, loss_taker, pipelined, split_rows
from lm.parallel.rules import active_sharding, constrain, sharding_context, sharding_for, unsharded, without

PROJECTIONS = ('query_proj', 'key_proj', 'value_proj', 'attention_out', 'mlp_out')
REMAT_POLICIES = {
  'full': None,  # save nothing inside a block; recompute it all in the backward pass
  'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  'projections': jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
}


def remat_policy(execution: ExecutionConfig) -> Callable | None:
  """`execution.remat`'s policy; with `execution.offload`, the tensors it names are kept in host memory
  (pinned_host) instead: what the policy saves, or (remat=full) what it would recompute or take from the
  layer's stacked inputs."""
  if not execution.offload:
    return REMAT_POLICIES[execution.remat]
  saved = PROJECTIONS if execution.remat == 'projections' else ()
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[n for n in saved if n not in execution.offload],
    names_which_can_be_offloaded=list(execution.offload), offload_src='device', offload_dst='pinned_host')


class Block(nn.Module):
  """One layer: self-attention, cross-attention (`cross`, decoder of an encoder-decoder), MLP.

  Each is a residual branch with pre-, post-, sandwich (pre and post, Gemma 2) or post-branch (OLMo 2) norms, in
  turn or in parallel (`model.parallel_residual`: each reads the block's input, GPT-NeoX). `layer` (traced when
  scanned) picks the global layers among windowed ones (`model.global_every` or `model.global_layers`). `routed`:
  its MLP is `model.moe`'s experts.
  """
  cfg: ModelConfig
  causal: bool
  num_layers: int
  cross: bool = False
  routed: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None,
               bias: jax.Array | None, encoded: jax.Array | None, encoded_segment_ids: jax.Array | None,
               deterministic: bool, decode: bool, layer: int | jax.Array = 0) -> tuple[jax.Array, None]:
    cfg = self.cfg
    x = checkpoint_name(x, 'layer_input')  # what remat keeps of a layer (model.execution.offload may move it)
    dtype, param_dtype = DTYPES[cfg.execution.dtype], DTYPES[cfg.param_dtype]
    inits = Init(cfg, self.num_layers)
    norm = lambda name: make_norm(cfg.norm, cfg.norm_eps, dtype, param_dtype, name, cfg.norm_plus_one)
    indices = cfg.global_layer_indices
    global_layer = (jnp.isin(layer, jnp.asarray(indices, jnp.int32)) if isinstance(layer, jax.Array)
                    else layer in indices) if indices else False
    drop = lambda h: nn.Dropout(cfg.dropout)(h, deterministic=deterministic)
    quantized = cfg.quantization == 'int8'
    lora = cfg.lora if cfg.lora.rank else None
    make_attention = lambda name, **kw: Attention(
      cfg.num_heads, cfg.resolved_head_dim, use_bias=cfg.use_bias, qkv_bias=cfg.qkv_bias,
      qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, qk_norm_all_heads=cfg.qk_norm_scope == 'all_heads',
      qk_norm_plus_one=cfg.norm_plus_one,
      clip=cfg.clip_qkv, softcap=cfg.attn_logit_softcap, impl=cfg.execution.attention_impl,
      block_q=cfg.execution.attention_block_q, block_k=cfg.execution.attention_block_k,
      logit_scale=attention_scale(cfg), dropout_rate=cfg.attention_dropout, dtype=dtype,
      param_dtype=param_dtype, num_kv_heads=cfg.num_kv_heads, name=name, inits=inits, quantized=quantized,
      lora=lora, **kw)
    latent = functools.partial(latent_qkv, mla=cfg.mla, heads=cfg.num_heads, head_dim=cfg.resolved_head_dim,
                               rope=rope_of(cfg), norm_eps=cfg.norm_eps, inits=inits, dtype=dtype,
                               param_dtype=param_dtype, use_bias=cfg.use_bias,
                               lora=lora) if cfg.mla.kv_lora_rank else None
    branches = [('attention', lambda h: make_attention('attention', rope=rope_of(cfg), window=cfg.sliding_window,
                                                       sinks=cfg.attention_sinks, latent=latent)(
      h, h, causal=self.causal, segment_ids=segment_ids, positions=positions, bias=bias,
      deterministic=deterministic, decode=decode, global_layer=global_layer))]
    if self.cross:
      branches.append(('cross_attention', lambda h: make_attention('cross_attention')(
        h, encoded, causal=False, segment_ids=segment_ids, kv_segment_ids=encoded_segment_ids,
        deterministic=deterministic)))
    if self.routed:  # padding (segment 0) stays out of the balance statistics
      mask = None if segment_ids is None else segment_ids > 0
      experts = RoutedMlp(cfg, inits, dtype=dtype, param_dtype=param_dtype, name='mlp')
      branches.append(('mlp', lambda h: experts(h, mask)))
    else:
      mlp = Mlp(cfg.resolved_d_ff, cfg.activation, use_bias=cfg.use_bias, swiglu=(cfg.swiglu_alpha, cfg.swiglu_limit),
                inits=inits, dtype=dtype, param_dtype=param_dtype, quantized=quantized, lora=lora, name='mlp')
      branches.append(('mlp', lambda h: in_chunks(mlp, h, cfg.execution.mlp_chunks)))

    if cfg.parallel_residual:  # GPT-NeoX: every branch reads the block's input and adds its output to it
      x = x + sum(drop(branch(norm(f'{name}_norm')(x))) for name, branch in branches)
      return constrain(x.astype(dtype), ('batch', 'length', 'embed')), None
    for name, branch in branches:
      if cfg.norm_position == 'pre':
        x = x + drop(branch(norm(f'{name}_norm')(x)))
      elif cfg.norm_position == 'sandwich':
        x = x + drop(norm(f'{name}_post_norm')(branch(norm(f'{name}_norm')(x))))
      elif cfg.norm_position == 'post_branch':
        x = x + drop(norm(f'{name}_post_norm')(branch(x)))
      else:
        x = norm(f'{name}_norm')(x + drop(branch(x)))
    return constrain(x.astype(dtype), ('batch', 'length', 'embed')), None


class Readout(NamedTuple):
  """The model's output layer as a pure function, `apply(params, last hidden states) -> the family's outputs`, for a
  stack that takes the loss in its last stage (1F1B)."""
  params: Any
  apply: Callable[[Any, jax.Array], dict[str, Any]]


class Stack(nn.Module):
  """`num_layers` blocks, scanned (compile time independent of depth) or unrolled.

  Owns what its layers share: the T5 relative position bias (computed once per stack) and, for
  stacks whose residual stream is not normalised after each addition, the final norm. A scanned stack scans each
  run of consecutive layers of one kind (dense, or routed: `model.moe`) on its own: `layers` when one run is the
  whole stack, else `layers_from_<first>` per run (DeepSeek's dense first layers, then the routed ones).

  While a train step pipelines (`lm.parallel.pipeline.pipelining` on a mesh with stages) each run's params, kept
  in that [layers, ...] layout, are read as [repeats, stages, layers per stage, ...] and the run is `pipelined`.
  Under 1F1B the model hands the stack its `readout`: the last run's last stage applies the final norm and it to each
  microbatch and takes the step's offered loss (`lm.parallel.pipeline.loss_taker`); the stack then returns its input.
  """
  cfg: ModelConfig
  causal: bool
  num_layers: int
  cross: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, encoded: jax.Array | None = None,
               encoded_segment_ids: jax.Array | None = None, deterministic: bool = True,
               decode: bool = False, positions: jax.Array | None = None, readout: Readout | None = None) -> jax.Array:
    """`positions` [batch, length] feed rotary attention; other position kinds ignore them here. `readout`: given
    when the stack takes the loss (`loss_taker`)."""
    cfg = self.cfg
    bias = self._relative_bias(x.shape[1], decode) if cfg.position == 'relative' else None
    block = Block
    if cfg.execution.remat != 'none':
      # static_argnums counts self: (self, x, segment_ids, positions, bias, encoded, encoded_segment_ids,
      # deterministic, decode).
      # an unrolled layer's index is static too: its window is then known when it is traced
      block = nn.remat(Block, policy=remat_policy(cfg.execution), prevent_cse=not cfg.execution.scan_layers,
                       static_argnums=(7, 8) if cfg.execution.scan_layers else (7, 8, 9))
    args = (segment_ids, positions, bias, encoded, encoded_segment_ids, deterministic, decode)
    routed = [cfg.moe.routed(i) for i in range(self.num_layers)]
    if cfg.execution.scan_layers:
      # one scan per run of consecutive layers of one kind (dense or routed): a scan's layers share one program
      runs = _runs(routed)
      for start, n in runs:
        scanned = nn.scan(block, variable_axes={'params': 0, 'cache': 0, 'intermediates': 0},
                          split_rngs={'params': True, 'dropout': True}, in_axes=(nn.broadcast,) * len(args) + (0,),
                          length=n, metadata_params={nn.PARTITION_NAME: 'layers'})
        name = scanned_name(start, len(runs) == 1)
        if self._stages(decode) > 1:
          last = readout if (start, n) == runs[-1] else None
          x = self._pipelined(name, routed[start], x, start, n, segment_ids, positions, deterministic, last)
          continue
        layers = scanned(cfg, self.causal, self.num_layers, self.cross, routed[start], name=name)
        x, _ = layers(x, *args, jnp.arange(start, start + n, dtype=jnp.int32))
    else:
      for i in range(self.num_layers):
        x, _ = block(cfg, self.causal, self.num_layers, self.cross, routed[i], name=f'layers_{i}')(x, *args, i)
    if cfg.norm_position != 'post' and readout is None:  # the residual stream is never normalised otherwise
      x = self._final_norm()(x)
    return x

  def _final_norm(self) -> nn.Module:
    cfg = self.cfg
    return make_norm(cfg.norm, cfg.norm_eps, DTYPES[cfg.execution.dtype], DTYPES[cfg.param_dtype], 'final_norm',
                     cfg.norm_plus_one)

  def _stages(self, decode: bool) -> int:
    """The stages the layers run on: the mesh's while a train step pipelines them, else 1."""
    active = active_sharding()
    if decode or active is None or active_pipelining() is None or self.is_initializing():
      return 1
    return active[0].shape.get('stage', 1)

  def _pipelined(self, name: str, routed: bool, x: jax.Array, start: int, n: int, segment_ids: jax.Array | None,
                 positions: jax.Array | None, deterministic: bool, readout: Readout | None) -> jax.Array:
    """The run of `n` layers from `start` (params `name`) over the mesh's stages, the batch in microbatches; with
    `readout`, by 1F1B, taking the loss in the last stage."""
    cfg, plan = self.cfg, active_pipelining()
    mesh = active_sharding()[0]
    stages, repeats, m = mesh.shape['stage'], cfg.execution.pipeline.repeats, plan.microbatches
    # a count the stages do not divide runs padded at the end by layers that pass their input on (the last stages'
    # share is smaller), whose params are zeros and whose statistics are dropped
    per_stage = -(-n // (repeats * stages))
    padded = per_stage * repeats * stages
    staged = lambda a: jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1)).reshape(
      repeats, stages, per_stage, *a.shape[1:])
    params = {'block': jax.tree.map(staged, self.variables['params'][name]),
              'layer': jnp.arange(start, start + padded, dtype=jnp.int32).reshape(repeats, stages, per_stage)}
    block = Block(cfg, self.causal, self.num_layers, self.cross, routed, parent=None)
    if cfg.execution.pipeline.gather_once:
      params['block'] = _gathered(block, params['block'], x)
    rng = jax.random.split(self.make_rng('dropout'), m) if not deterministic else None

    def layer(h: jax.Array, p: Any, sides: dict[str, Any]) -> tuple[jax.Array, Any]:
      rngs = {} if deterministic else {'dropout': jax.random.fold_in(sides['rng'], p['layer'])}
      (y, _), sown = block.apply({'params': p['block']}, h, sides['segment_ids'], sides['positions'], None, None,
                                 None, deterministic, False, p['layer'], rngs=rngs, mutable=['intermediates'])
      return jnp.where(p['layer'] < start + n, y, h), sown.get('intermediates', {})  # a routed layer's statistics
    if cfg.execution.remat != 'none':
      layer = jax.checkpoint(layer, policy=remat_policy(cfg.execution), prevent_cse=False)

    def stage(p: Any, h: jax.Array, sides: dict[str, Any]) -> tuple[jax.Array, Any]:
      return jax.lax.scan(lambda h, p: layer(h, p, sides), h, p)
    split = lambda a: None if a is None else split_rows(a, m)
    sides = {'segment_ids': split(segment_ids), 'positions': split(positions), 'rng': rng}
    if readout is not None:
      offer = loss_taker(cfg.execution.pipeline.schedule)
      sides['rows'] = jax.tree.map(split, offer.batch)
      params = jax.tree.map(lambda a: a[0], params)  # one repeat: [stages, layers per stage, ...]
      stats = self._take_loss(offer, readout, _with_aux_loss(stage, offer, cfg, start, n) if routed else
                              lambda p, h, sides: stage(p, h, sides)[0], params, split_rows(x, m), sides)
      if routed:  # [stages, microbatches, layers per stage, ...] -> [microbatches, layers, ...]
        Sown(name=name)(jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(m, padded, *a.shape[3:])[:, :n], stats))
      return x
    out, sown = pipelined(stage, params, split_rows(x, m), mesh, sides, bubble=plan.bubble)
    # [microbatches, repeats, stages, layers per stage, ...] -> [microbatches, layers, ...], as the scan sows them
    Sown(name=name)(jax.tree.map(lambda a: a.reshape(m, padded, *a.shape[4:])[:, :n], sown))
    return constrain(join_rows(out), ('batch', 'length', 'embed'))

  def _take_loss(self, offer: LossOffer, readout: Readout, stage: Callable, params: Any, xs: jax.Array,
                 sides: dict[str, Any]) -> Any:
    """1F1B over the stages, the final norm, `readout` and the offered loss applied to each microbatch in the last;
    the batch's loss and sums left in `offer`; returns the stages' stats (routed layers')."""
    norm = self._final_norm().clone(parent=None) if self.cfg.norm_position != 'post' else None
    head = {'readout': readout.params, 'norm': self.variables['params'].get('final_norm', {})}

    def loss(head: Any, y: jax.Array, sides: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
      y = y if norm is None else norm.apply({'params': head['norm']}, y)
      return offer.loss(readout.apply(head['readout'], y), sides['rows'])
    mesh, rules = active_sharding()
    with sharding_context(mesh, without('stage', rules)):  # rows as the stages hold them, so dx lands in place
      xs = constrain(xs, (None, 'batch', 'length', 'embed'))
    total, (sums, stats) = one_f_one_b(stage, loss, params, head, xs, mesh, sides,
                                       bubble=active_pipelining().bubble)
    offer.taken = total, sums
    return stats

  def _relative_bias(self, length: int, decode: bool) -> jax.Array:
    """[1, heads, q, k] bias; while decoding, queries sit at the cache position and keys span the cache."""
    cfg = self.cfg
    relpos = RelativePositionBias(cfg.num_heads, cfg.relative_buckets, cfg.relative_max_distance,
                                  bidirectional=not self.causal, inits=Init(cfg), dtype=DTYPES[cfg.execution.dtype],
                                  param_dtype=DTYPES[cfg.param_dtype], name='relpos')
    if not decode:
      return relpos(length, length)
    initialising = not self.has_variable('cache', 'position')
    position = self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
    slots = self.variable('cache', 'slots', jnp.zeros, (length,), jnp.int8)  # its shape records the cache size
    if initialising:
      return relpos(length, length)
    offset = position.value
    position.value = offset + length
    return relpos(length, slots.value.shape[0], offset)


def _with_aux_loss(stage: Callable, offer: LossOffer, cfg: ModelConfig, start: int, n: int) -> Callable:
  """A stage of routed layers that also returns (its layers' part of the auxiliary loss, as the step weighs it on
  the microbatch's rows; their statistics), for 1F1B; the layers that pad the run out are left out."""
  def staged(p: Any, h: jax.Array, sides: dict[str, Any]) -> tuple[jax.Array, tuple[jax.Array, Any]]:
    y, sown = stage(p, h, sides)
    own = layers_aux_loss(sown, cfg.moe, p['layer'] < start + n, n)
    return y, (offer.aux_loss(own, sides['rows']), sown)
  return staged


def _gathered(block: Block, params: Any, x: jax.Array) -> Any:
  """A pipelined run's params ([repeats, stages, layers per stage, ...]) constrained whole over the mesh axes that
  shard their `embed` dims (fsdp), so that they are gathered once, before the tick loop, and their gradients
  reduce-scattered once after it; heads, MLP units and experts stay split."""
  mesh, rules = active_sharding()
  with unsharded():
    boxed = jax.eval_shape(lambda: block.init(jax.random.key(0), x[:1], None, None, None, None, None, True, False, 0))
  whole = tuple((name, None if name == 'embed' else entry) for name, entry in rules)
  constrain_to = lambda names, a: jax.lax.with_sharding_constraint(
    a, sharding_for((None, 'layers', None, *names), a.shape, mesh, whole))
  return jax.tree.map(constrain_to, nn.get_partition_spec(boxed)['params'], params,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


class Sown(nn.Module):
  """Sows `values` (intermediates as a run of layers sowed them: a tree of tuples) under its name, for a run whose
  layers ran outside it (pipelined)."""

  @nn.compact
  def __call__(self, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
      if isinstance(value, Mapping):
        Sown(name=key)(value)
      else:
        for v in value:
          self.sow('intermediates', key, v)


def _runs(kinds: list[bool]) -> list[tuple[int, int]]:
  """(first index, length) of each run of equal consecutive values."""
  lengths = [len(list(run)) for _, run in itertools.groupby(kinds)]
  return [(sum(lengths[:i]), n) for i, n in enumerate(lengths)]


def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None], tokens.shape)


def _take(x: Any, i: int) -> Any:
  """Layer `i` of a stacked array, or of a sharded ShapeDtypeStruct (the layer axis is never sharded)."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    return x[i]
  sharding = None if x.sharding is None else NamedSharding(x.sharding.mesh, PartitionSpec(*x.sharding.spec[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def _stack(*xs: Any) -> Any:
  if not isinstance(xs[0], jax.ShapeDtypeStruct):
    return jnp.stack(xs)
  x = xs[0]
  sharding = None if x.sharding is None else NamedSharding(x.sharding.mesh, PartitionSpec(None, *x.sharding.spec))
  return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=sharding)


SCANNED = re.compile(r'layers(?:_from_(\d+))?')  # a scanned run of layers: `layers`, or `layers_from_<first>`


def scanned_name(start: int, whole: bool) -> str:
  """A scanned run's name: `layers` when it is the whole stack, else `layers_from_<its first layer>`."""
  return 'layers' if whole else f'layers_from_{start}'


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
  """Scanned params (`layers` subtrees with a leading layer axis, or several runs `layers_from_<first>`) ->
  unrolled `layers_0`, `layers_1`, ..."""
  out = {}
  for key, value in params.items():
    run = SCANNED.fullmatch(key)
    if run and isinstance(value, Mapping):
      start, n = int(run.group(1) or 0), jax.tree.leaves(value)[0].shape[0]
      out.update({f'layers_{start + i}': jax.tree.map(lambda x, i=i: _take(x, i), value) for i in range(n)})
    else:
      out[key] = unstack_layers(value) if isinstance(value, Mapping) else value
  return out


def _kind(layer: Any) -> Any:
  """What a scan needs alike in the layers it stacks: the tree and each leaf's shape (a routed layer's MLP
  differs from a dense one's)."""
  return jax.tree.structure(layer), tuple(x.shape for x in jax.tree.leaves(layer))


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
  """Unrolled `layers_0`, `layers_1`, ... -> scanned subtrees with a leading layer axis: one `layers`, or a
  `layers_from_<first>` per run of consecutive layers of one kind (`Stack`'s runs)."""
  numbered = sorted((int(k.removeprefix('layers_')), k) for k in params if re.fullmatch(r'layers_\d+', k))
  out = {k: stack_layers(v) if isinstance(v, Mapping) else v for k, v in params.items()
         if not re.fullmatch(r'layers_\d+', k)}
  runs = [[key for _, key in run] for _, run in itertools.groupby(numbered, key=lambda n: _kind(params[n[1]]))]
  for run in runs:
    out[scanned_name(int(run[0].removeprefix('layers_')), len(runs) == 1)] = jax.tree.map(
      _stack, *(params[k] for k in run))
  return out


def _holds_layers(x: Any) -> bool:
  """A mapping with layers in it, at any depth of mappings: params, or an optimizer's moments of them."""
  return isinstance(x, Mapping) and any(
    re.fullmatch(r'layers_\d+', k) or SCANNED.fullmatch(k) or _holds_layers(v) for k, v in x.items())


def relayout(tree: Any, scanned: bool) -> Any:
  """Every params-shaped mapping in `tree` (the params, the optimizer's moments, also inside optax's per-label
  states) in the scanned or the unrolled layout. Works on arrays (inside jit) and on sharded ShapeDtypeStructs."""
  convert = stack_layers if scanned else unstack_layers
  return jax.tree.map(lambda x: convert(x) if _holds_layers(x) else x, tree, is_leaf=_holds_layers)
