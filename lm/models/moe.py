"""The routed MLP: a layer's experts in place of its dense MLP (`model.moe`), on the routing and expert compute
of `lm.ops.moe`.

Params: `router` [embed, experts] (float32 logits whatever the compute dtype), expert kernels `wi_0` (gated MLPs),
`wi_1` / `wi` and `wo` with a leading 'experts' axis, and the shared experts as a dense `Mlp` (`shared`, with
`shared_gate` for Qwen2-MoE). With `model.use_bias` (GPT-OSS) the router's logits have a bias (`router_logit_bias`
[experts]) and each expert kernel its own (`<kernel>_bias` [experts, out]).

Each layer sows its balance statistics (`LOAD`, `PROB`), router z-loss (`Z_LOSS`) and the share of token copies
dropped (`DROPPED`: on the capacity path, or by a capped expert-parallel buffer) into 'intermediates'; `aux_losses`
makes the model's auxiliary losses of them, which the training loss weights and logs apart from the token loss.

With `model.lora` targeting 'experts', each expert kernel has low-rank adapters (`<kernel>_lora`: `lora_a` [experts,
in, rank], `lora_b` [experts, rank, out]) whose product, scaled, joins the kernel before the experts run: the
routing paths take one kernel, as PEFT's adapters of a parameter (`target_parameters`) do.

Aux-loss-free balancing (`model.moe.bias_rate`, DeepSeek-V3): each layer's `router_bias` [experts] shifts the
scores only to choose experts. It is a param so that checkpoints, shardings and views carry it, but no optimizer
moves it (`fixed_params`): the train step does (`update_bias`), from the token counts each layer sows (`COUNTS`),
summed over the step's microbatches and data shards.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from lm.config import ModelConfig, MoeConfig
from lm.models.layers import ACTIVATIONS, GATED, DenseGeneral, Dtype, Mlp, gated_unit
from lm.models.parametrization import Init
from lm.ops import moe

LOAD, PROB, Z_LOSS, DROPPED, COUNTS = 'moe_load', 'moe_prob', 'moe_z_loss', 'moe_dropped', 'moe_counts'
EXPERT_PARAMS = ('wi_0', 'wi_1', 'wi', 'wo')  # the expert kernels' param names (a dense MLP's end in 'kernel')
EXPERT_BIASES = tuple(f'{name}_bias' for name in EXPERT_PARAMS)
ROUTER, BIAS, ROUTER_BIAS = 'router', 'router_bias', 'router_logit_bias'
EXPERTS = 'experts'  # the model.lora target naming every expert kernel
ADAPTED = '_lora'  # an expert kernel's adapters: the module `<kernel>_lora` beside it (ExpertAdapter)


def active_share(name: str, m: MoeConfig) -> float:
  """The share of a param (by its leaf name) that one token runs: k / E of the experts' kernels and biases, all
  of the rest."""
  return m.experts_per_token / m.num_experts if name in EXPERT_PARAMS + EXPERT_BIASES else 1.0


class RoutedMlp(nn.Module):
  """[batch, length, embed] -> the same: each token through its chosen experts (and the shared ones). `mask`
  [batch, length] (padding 0) keeps padding out of the balance statistics."""
  cfg: ModelConfig
  inits: Init
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    m = self.cfg.moe
    batch, length, d = x.shape
    tokens = x.reshape(-1, d)
    router = self.param(ROUTER, nn.with_logical_partitioning(self.inits('mlp_in', ('embed', 'experts')),
                                                               ('embed', 'experts')), (d, m.num_experts), jnp.float32)
    logits = tokens.astype(jnp.float32) @ router
    if self.cfg.use_bias:
      logits = logits + self.param(ROUTER_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, ('experts',)),
                                   (m.num_experts,), jnp.float32)
    bias = self.param(BIAS, nn.with_logical_partitioning(nn.initializers.zeros, ('experts',)), (m.num_experts,),
                      jnp.float32) if m.bias_rate else None
    routing = moe.route(logits, m.experts_per_token, m.router, m.normalize, m.routed_scale, bias=bias,
                        groups=m.groups, top_groups=m.top_groups)
    flat_mask = None if mask is None else mask.reshape(-1)
    load, prob = moe.expert_load(routing.probs, routing.experts, flat_mask)
    self.sow('intermediates', LOAD, load)
    self.sow('intermediates', PROB, prob)
    if m.bias_rate:
      kept = tokens.shape[0] if flat_mask is None else flat_mask.astype(jnp.float32).sum()
      self.sow('intermediates', COUNTS, load * kept)
    self.sow('intermediates', Z_LOSS, moe.router_z_loss(logits, flat_mask))
    y = self._experts(x.astype(self.dtype), routing)
    return y + self._shared(x) if m.shared_experts else y

  def _kernel(self, name: str, kind: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> jax.Array:
    init = nn.with_logical_partitioning(self.inits(kind, axes), axes)
    kernel = self.param(name, init, shape, self.param_dtype).astype(self.dtype)
    lora = self.cfg.lora
    if lora.rank and EXPERTS in lora.targets:
      adapter = ExpertAdapter(lora.rank, lora.scale, axes, self.param_dtype, name=f'{name}{ADAPTED}')
      kernel = kernel + adapter(shape).astype(self.dtype)
    return kernel

  def _experts(self, x: jax.Array, routing: moe.Routing) -> jax.Array:
    """[batch, length, embed] -> the same, each token through its chosen experts."""
    cfg, m = self.cfg, self.cfg.moe
    e, d, f = m.num_experts, x.shape[-1], m.expert_d_ff or cfg.resolved_d_ff
    gated = cfg.activation in GATED
    act = gated_unit(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) if gated else ACTIVATIONS[cfg.activation]
    up_axes, down_axes = ('experts', 'embed', 'mlp'), ('experts', 'mlp', 'embed')
    up_name = 'wi_1' if gated else 'wi'
    gate = self._kernel('wi_0', 'mlp_in', up_axes, (e, d, f)) if gated else None
    up = self._kernel(up_name, 'mlp_in', up_axes, (e, d, f))
    down = self._kernel('wo', 'mlp_out', down_axes, (e, f, d))
    bias = moe.Biases(self._bias(f'{up_name}_bias', (e, f), 'mlp'), self._bias('wo_bias', (e, d), 'embed'),
                      self._bias('wi_0_bias', (e, f), 'mlp') if gated else None) if cfg.use_bias else None
    if m.compute == 'dropless':
      y, dropped = moe.dropless_on_mesh(x, routing, up, down, gate, act, buffer=m.expert_buffer,
                                        chunks=cfg.execution.mlp_chunks, bias=bias)
      if dropped is not None:
        self.sow('intermediates', DROPPED, dropped)
      return y
    if m.compute == 'capacity':
      # GShard's groups: each sequence's tokens fill slots of their own, so the [E, C, D] buffers split with the
      # batch (one group of the whole batch's tokens is a buffer as large as the batch on every device)
      rows = moe.Routing(*(a.reshape(*x.shape[:2], *a.shape[1:]) for a in routing))
      y, dropped = jax.vmap(lambda t, r: moe.capacity(t, r, up, down, gate, act, m.capacity_factor, bias))(x, rows)
      self.sow('intermediates', DROPPED, dropped.mean())
      return y
    return moe.dense(x.reshape(-1, d), routing, up, down, gate, act, bias).reshape(x.shape)

  def _bias(self, name: str, shape: tuple[int, int], axis: str) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.zeros, ('experts', axis))
    return self.param(name, init, shape, self.param_dtype).astype(self.dtype)

  def _shared(self, x: jax.Array) -> jax.Array:
    cfg, m = self.cfg, self.cfg.moe
    width = m.shared_d_ff or m.shared_experts * (m.expert_d_ff or cfg.resolved_d_ff)
    y = Mlp(width, cfg.activation, use_bias=False, inits=self.inits, dtype=self.dtype, param_dtype=self.param_dtype,
            lora=cfg.lora if cfg.lora.rank else None, name='shared')(x)
    if not m.shared_gate:
      return y
    gate = DenseGeneral(1, ('embed', None), use_bias=False, kernel_init=self.inits('mlp_in', ('embed', None)),
                        dtype=self.dtype, param_dtype=self.param_dtype, name='shared_gate')(x)
    return jax.nn.sigmoid(gate) * y


class ExpertAdapter(nn.Module):
  """A low-rank update of an expert kernel [experts, in, out]: scale x A B per expert, A `lora_a` [experts, in,
  rank] in U(+-1/sqrt(in)) and B `lora_b` [experts, rank, out] zero at first, as PEFT inits them."""
  rank: int
  scale: float
  axes: tuple[str, ...]  # the kernel's logical axes
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, shape: tuple[int, int, int]) -> jax.Array:
    experts, ins, outs = shape
    bound = ins ** -0.5
    uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
    a = self.param('lora_a', nn.with_logical_partitioning(uniform, (self.axes[0], self.axes[1], None)),
                   (experts, ins, self.rank), self.param_dtype)
    b = self.param('lora_b', nn.with_logical_partitioning(nn.initializers.zeros, (self.axes[0], None, self.axes[2])),
                   (experts, self.rank, outs), self.param_dtype)
    return self.scale * jnp.einsum('eir,ero->eio', a.astype(jnp.float32), b.astype(jnp.float32))


def aux_losses(intermediates: Any, m: MoeConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the weighted sum for the training loss, each term by name: 'moe/balance_loss', 'moe/z_loss',
  'moe/max_load' (the busiest expert's share of the choices over an even share, averaged over layers: 1 when
  balanced, E / k at worst) and, where copies can drop, 'moe/dropped') from what the routed layers sowed, scanned (a
  leading layer axis) or not. A pipelined stack's have a leading microbatch axis too: the terms are then each
  microbatch's, averaged, as accumulating the microbatches would give."""
  sown: dict[str, list[jax.Array]] = {LOAD: [], PROB: [], Z_LOSS: [], DROPPED: []}
  for path, values in flatten_dict(intermediates).items():
    if path[-1] in sown:
      sown[path[-1]].extend(values)
  experts = m.num_experts

  def per_layer(name: str, *shape: int) -> jax.Array:  # [microbatches (1 unless pipelined), layers, *shape]
    micro = lambda v: v.shape[0] if v.ndim == len(shape) + 2 else 1
    return jnp.concatenate([v.reshape(micro(v), -1, *shape) for v in sown[name]], axis=1)

  def terms_of(load: jax.Array, prob: jax.Array, z: jax.Array, dropped: jax.Array | None) -> dict[str, jax.Array]:
    terms = {'moe/balance_loss': moe.balance_loss(load, prob, m.balance_over), 'moe/z_loss': z.mean(),
             'moe/max_load': (load.max(-1) * experts / m.experts_per_token).mean()}
    if dropped is not None:
      terms['moe/dropped'] = dropped.mean()
    return terms
  dropped = per_layer(DROPPED) if sown[DROPPED] else None
  terms = jax.tree.map(lambda t: t.mean(0), jax.vmap(terms_of)(per_layer(LOAD, experts), per_layer(PROB, experts),
                                                               per_layer(Z_LOSS), dropped))
  return m.balance_loss * terms['moe/balance_loss'] + m.z_loss * terms['moe/z_loss'], terms


def layers_aux_loss(intermediates: Any, m: MoeConfig, keep: jax.Array, layers: int) -> jax.Array:
  """The part of `aux_losses`' weighted sum (`balance_over=layer`) that some routed layers make, from what they
  sowed (scanned: [layers here, ...]): each kept layer's (`keep` [layers here]) terms over the model's `layers`.
  A stage of a pipeline takes its layers' part in its own backward pass (1F1B)."""
  flat = {path[-1]: values[0] for path, values in flatten_dict(intermediates).items()}
  balance = m.num_experts * jnp.sum(flat[LOAD] * flat[PROB], axis=-1)
  return jnp.sum(jnp.where(keep, m.balance_loss * balance + m.z_loss * flat[Z_LOSS], 0.0)) / layers


def expert_counts(intermediates: Any) -> dict[str, Any]:
  """Each routed layer's token counts per expert (padding left out), in a tree shaped as the `router_bias` params
  they update (a scanned stack's as [layers, experts]; a pipelined one's microbatches added)."""
  return unflatten_dict({(*path[:-1], BIAS): values[0].sum(0) if values[0].ndim == 3 else values[0]
                         for path, values in flatten_dict(intermediates).items() if path[-1] == COUNTS})


def update_bias(params: Any, counts: Any, rate: float) -> Any:
  """`params` with each layer's `router_bias` moved by `rate` toward an even load (DeepSeek-V3):
  b_e + rate * sign(mean_e' c_e' - c_e), from its `counts` (`expert_counts`, summed over the whole step)."""
  flat = flatten_dict(params)
  for path, c in flatten_dict(counts).items():
    flat[path] = flat[path] + rate * jnp.sign(c.mean(-1, keepdims=True) - c)
  return unflatten_dict(flat)


def fixed_params(params: Any) -> Any:
  """True for the params no optimizer moves (the selection biases `update_bias` moves), False for the rest."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], 'key', None) == BIAS, params)
