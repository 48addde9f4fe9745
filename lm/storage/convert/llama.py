"""Llama (`LlamaForCausalLM`) <-> our `llama` family, and the shared converter of the classes in its layout
(`Architecture`: Mistral, Qwen2, Qwen3, OLMo, OLMo 2).

HF linear weights are [out, in]; queries and keys are stored for the half-split rotary layout our
`rotary` uses, so they load unpermuted. RoPE settings come as `rope_parameters` (transformers 5)
or `rope_theta` / `rope_scaling` (transformers 4): the default rotation, linear, llama3 (Llama 3.1 to 3.3)
and yarn scaling.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, ModelConfig, MoeConfig, RopeConfig
from lm.storage.convert.hf_config import (FULL, GATED, SLIDING, check_exportable, hf_gated_activation,
                                          hf_layer_types, hf_sizes, our_activation, unsupported, window_pattern)
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'LlamaForCausalLM'


ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3', 'yarn': 'yarn'}  # HF rope_type -> ours
# our field -> its HF rope parameter, per scaling
ROPE_FIELDS = {'linear': {'factor': 'factor'},  # model.rope.* -> HF's name, per scaling
               'llama3': {'factor': 'factor', 'low_freq_factor': 'low_freq_factor',
                          'high_freq_factor': 'high_freq_factor', 'original_max_len': 'original_max_position_embeddings'},
               'yarn': {'factor': 'factor', 'original_max_len': 'original_max_position_embeddings',
                        'beta_fast': 'beta_fast', 'beta_slow': 'beta_slow', 'attention_factor': 'attention_factor',
                        'mscale': 'mscale', 'mscale_all_dim': 'mscale_all_dim', 'truncate': 'truncate'}}


def rope_fields(hf: dict, architecture: str = ARCHITECTURE) -> dict[str, Any]:
  """`model.rope` (as a ModelConfig keyword) from either config layout (`rope_parameters`, transformers 5; `rope_theta` and
  `rope_scaling`, transformers 4); scalings we cannot reproduce (dynamic, longrope, ...) are refused by name."""
  params = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  per_type = [value for value in params.values() if isinstance(value, dict)]  # per layer type (OLMo 3)
  if per_type:
    if any(value != per_type[0] for value in per_type):
      raise ConfigError(f'config.json rope_parameters differ between layer types; {architecture} converts one rotary '
                        f'setting for every layer')
    params = per_type[0]
  kind = params.get('rope_type', params.get('type', 'default'))
  if kind not in ROPE_TYPES:
    raise ConfigError(f'config.json rope type {kind!r} is not supported when converting {architecture} '
                      f'(supported: {", ".join(ROPE_TYPES)})')
  fraction = params.get('partial_rotary_factor', hf.get('partial_rotary_factor'))
  if fraction not in (1.0, None):
    raise ConfigError(f'config.json rope partial_rotary_factor={fraction!r} is not supported when converting '
                      f'{architecture}')
  fields: dict[str, Any] = {'theta': float(params.get('rope_theta', hf.get('rope_theta', 10000.0))),
                            'scaling': ROPE_TYPES[kind]}
  for ours, theirs in ROPE_FIELDS.get(ROPE_TYPES[kind], {}).items():
    if params.get(theirs) is not None:
      fields[ours] = {'original_max_len': int, 'truncate': bool}.get(ours, float)(params[theirs])
  if kind == 'yarn' and params.get('factor') is None:  # HF: the ratio of the extended context to the original
    fields['factor'] = hf['max_position_embeddings'] / params['original_max_position_embeddings']
  return {'rope': RopeConfig(**fields)}


def hf_rope(cfg: ModelConfig, base: dict, per_layer_type: bool = False) -> dict[str, Any]:
  """The rotary settings of config.json, in the layout of `base` (transformers 4 when it has `rope_theta`);
  `per_layer_type`: the same settings for each of `layer_types`' kinds (OLMo 3)."""
  rope = cfg.rope
  scaling = {theirs: getattr(rope, ours) for ours, theirs in ROPE_FIELDS.get(rope.scaling, {}).items()
             if getattr(rope, ours) is not None}
  kind = {v: k for k, v in ROPE_TYPES.items()}[rope.scaling]
  if 'rope_theta' in base:
    return {'rope_theta': rope.theta, 'rope_scaling': {'rope_type': kind, **scaling} if scaling else None}
  if per_layer_type:
    return {'rope_parameters': {t: {'rope_theta': rope.theta, 'rope_type': kind, **scaling} for t in (FULL, SLIDING)}}
  return {'rope_parameters': {**(base.get('rope_parameters') or {}), 'rope_theta': rope.theta,
                              'rope_type': kind, **scaling}}


@dataclass(frozen=True)
class MoeNames:
  """How a transformers mixture-of-experts class names its routed layers, in its files and its config.json."""
  block: str  # the routed MLP's module in the files: 'block_sparse_moe' (Mixtral) or 'mlp'
  experts: tuple[str, str, str]  # each expert's gate, up and down projections
  count: str  # config.json key of the expert count
  width: str  # config.json key of each expert's hidden width
  normalize: bool | None = None  # fixed renormalisation of the chosen weights; None: `norm_topk_prob`
  layer_pattern: bool = False  # `decoder_sparse_step` and `mlp_only_layers` choose the routed layers (Qwen)
  shared: bool = False  # a shared expert with a sigmoid gate (`shared_expert_intermediate_size`, Qwen2-MoE)

  def count_key(self, hf: dict) -> str:
    """The key config.json `hf` spells the expert count with (transformers 5 writes Qwen3-MoE's as
    `num_local_experts`, its constructor takes `num_experts`); the architecture's own when it has neither."""
    return next((k for k in (self.count, 'num_local_experts', 'num_experts') if k in hf), self.count)

  def config(self, h: dict) -> MoeConfig:
    """`model.moe` of config.json `h` (defaults filled in): the architecture's routing; the aux loss weighted as
    its `router_aux_loss_coef` and pooled over layers as transformers' `aux_loss`."""
    shared = self.shared and h.get('shared_expert_intermediate_size')
    moe = MoeConfig(
      num_experts=h[self.count],
      experts_per_token=h['num_experts_per_tok'], expert_d_ff=h[self.width],
      normalize=self.normalize if self.normalize is not None else bool(h.get('norm_topk_prob', False)),
      shared_experts=1 if shared else 0, shared_d_ff=shared or None, shared_gate=bool(shared),
      every=h.get('decoder_sparse_step', 1) if self.layer_pattern else 1,
      dense_layers=tuple(h.get('mlp_only_layers') or ()) if self.layer_pattern else (),
      balance_loss=float(h.get('router_aux_loss_coef', 0.01)), balance_over='model')
    moe.check(h['num_hidden_layers'])
    return moe

  def hf_config(self, m: MoeConfig, num_layers: int, architecture: str, base: dict) -> dict[str, Any]:
    """config.json's routing fields for `m` (the count spelt as in `base`); a ConfigError naming what the
    architecture cannot express."""
    expressed = self.config({'num_hidden_layers': num_layers, self.count: m.num_experts,
                             'num_experts_per_tok': m.experts_per_token, self.width: m.expert_d_ff,
                             'norm_topk_prob': m.normalize,
                             'shared_expert_intermediate_size': m.shared_d_ff if m.shared_experts else 0,
                             'decoder_sparse_step': m.every, 'mlp_only_layers': list(m.dense_layers)})
    training = ('balance_loss', 'balance_over', 'z_loss', 'compute', 'capacity_factor')  # not architecture
    wrong = [f'model.moe.{f.name}={getattr(m, f.name)!r} (needs {getattr(expressed, f.name)!r})'
             for f in dataclasses.fields(MoeConfig)
             if f.name not in training and getattr(m, f.name) != getattr(expressed, f.name)]
    if wrong:
      raise ConfigError(f'cannot export this model as {architecture}: {", ".join(wrong)}')
    hf = {self.count_key(base): m.num_experts, 'num_experts_per_tok': m.experts_per_token, self.width: m.expert_d_ff,
          'router_aux_loss_coef': m.balance_loss}
    if self.normalize is None:
      hf['norm_topk_prob'] = m.normalize
    if self.layer_pattern:
      hf.update(decoder_sparse_step=m.every, mlp_only_layers=list(m.dense_layers))
    if self.shared:
      hf['shared_expert_intermediate_size'] = m.shared_d_ff if m.shared_experts else 0
    return hf

  def rules(self, cfg: ModelConfig, h: str, o: str) -> list[Tensor]:
    """A routed layer's tensors: HF prefix `h` ('model.layers.{i}.'), ours `o` ('decoder/layers_{i}/')."""
    b = f'{h}{self.block}.'
    out = [Tensor(f'{b}gate.weight', (f'{o}mlp/router',), 'linear')]
    for j in range(cfg.moe.num_experts):
      out += [Tensor(f'{b}experts.{j}.{theirs}.weight', (f'{o}mlp/{ours}',), 'linear', index=j)
              for theirs, ours in zip(self.experts, ('wi_0', 'wi_1', 'wo'))]
    if cfg.moe.shared_experts:
      out += [t for theirs, ours in zip(('gate_proj', 'up_proj', 'down_proj'), ('wi_0', 'wi_1', 'wo'))
              for t in dense(f'{b}shared_expert.{theirs}', f'{o}mlp/shared/{ours}', 'linear', bias=False)]
      out += dense(f'{b}shared_expert_gate', f'{o}mlp/shared_gate', 'linear', bias=False)
    return out

  def accept_fused(self, ckpt: Checkpoint, cfg: ModelConfig) -> None:
    """Let `ckpt` hold the experts as transformers 5 keeps them in memory (`mlp.experts.gate_up_proj` [E, 2F, D],
    `mlp.experts.down_proj` [E, D, F], `mlp.gate.weight`) instead of one tensor per expert."""
    for i in range(cfg.num_layers):
      if not cfg.moe.routed(i):
        continue
      fused, b = f'model.layers.{i}.mlp.', f'model.layers.{i}.{self.block}.'
      ckpt.derive(f'{b}gate.weight', f'{fused}gate.weight', lambda a: a)
      gate, up, down = self.experts
      for j in range(cfg.moe.num_experts):
        ckpt.derive(f'{b}experts.{j}.{gate}.weight', f'{fused}experts.gate_up_proj',
                    lambda a, j=j: a[j, :a.shape[1] // 2])
        ckpt.derive(f'{b}experts.{j}.{up}.weight', f'{fused}experts.gate_up_proj',
                    lambda a, j=j: a[j, a.shape[1] // 2:])
        ckpt.derive(f'{b}experts.{j}.{down}.weight', f'{fused}experts.down_proj', lambda a, j=j: a[j])


@dataclass(frozen=True)
class Architecture:
  """One transformers class of the Llama layout (pre-RMSNorm, rotary, gated MLP, no MLP biases): what its
  config.json holds and which of our fields it fixes."""
  name: str  # the transformers class
  model_type: str
  defaults: dict[str, Any]  # config.json fields absent from a file take these (the transformers class's)
  refused: dict[str, Any]  # config.json fields honoured at this value only
  qkv_bias: bool = False  # query, key and value biases (Qwen2)
  qk_norm: bool = False  # RMSNorm of queries and keys (Qwen3, OLMo 2)
  qk_norm_scope: str = 'head'  # per head (Qwen3) or over all heads, one [heads x head_dim] weight (OLMo 2)
  window: bool = False  # `sliding_window` (None: none) applies to every layer (Mistral)
  layer_windows: bool = False  # `sliding_window` in the layers `layer_types` names sliding (Qwen2, Qwen3, OLMo 3;
  # without layer_types: every `global_every`-th layer global, else from layer `max_window_layers` on when
  # `use_sliding_window`, as transformers 4 wrote Qwen's)
  global_every: int = 0  # OLMo 3: 4
  norm: str = 'rmsnorm'  # nonparametric_layernorm: OLMo's, no weights and eps 1e-5 (no config field)
  norm_position: str = 'pre'  # post_branch: OLMo 2's post_attention_ and post_feedforward_layernorm
  clip: bool = False  # `clip_qkv` (None: none) clips the query, key and value projections (OLMo)
  moe: MoeNames | None = None  # routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)

  def eps(self, h: dict) -> float:
    return h['rms_norm_eps'] if self.norm == 'rmsnorm' else 1e-5


COMMON = {'vocab_size': 32000, 'hidden_size': 4096, 'intermediate_size': 11008, 'num_hidden_layers': 32,
          'num_attention_heads': 32, 'num_key_value_heads': None, 'head_dim': None, 'hidden_act': 'silu',
          'max_position_embeddings': 2048, 'rms_norm_eps': 1e-6, 'initializer_range': 0.02,
          'attention_dropout': 0.0, 'tie_word_embeddings': False}
LLAMA = Architecture(ARCHITECTURE, 'llama', COMMON, {'attention_bias': False, 'mlp_bias': False, 'pretraining_tp': 1})


def load_as(arch: Architecture, hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(arch.name, hf, **arch.refused)
  h = {**arch.defaults, **hf}
  if arch.moe:
    h[arch.moe.count] = h[arch.moe.count_key(hf)]
  types = layer_types(arch, h)
  pattern = window_pattern(types, h['num_hidden_layers'], arch.name)
  if pattern != {'global_every': 1} and not arch.layer_windows:
    raise ConfigError(f'config.json layer_types {sorted(set(types))} is not supported when converting {arch.name} '
                      f'(only {FULL} layers)')
  window = (h.get('sliding_window') or 0) if arch.window or pattern != {'global_every': 1} else 0
  embed = ckpt.get('model.embed_tokens.weight')
  same = None if embed is None else ckpt.same_as('lm_head.weight', embed)
  heads = h['num_attention_heads']
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=h['num_hidden_layers'], num_heads=heads,
    num_kv_heads=h['num_key_value_heads'] or heads, head_dim=h['head_dim'] or h['hidden_size'] // heads,
    d_ff=h['intermediate_size'], max_len=h['max_position_embeddings'], position='rotary',
    **rope_fields(hf, arch.name), norm=arch.norm, norm_eps=arch.eps(h), norm_position=arch.norm_position,
    activation=GATED[our_activation(h['hidden_act'], 'hidden_act', arch.name)], use_bias=False,
    qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, qk_norm_scope=arch.qk_norm_scope,
    clip_qkv=float(hf.get('clip_qkv') or 0.0) if arch.clip else 0.0,
    tie_embeddings=h['tie_word_embeddings'] if same is None else same,
    sliding_window=window, **(pattern if window and arch.layer_windows else {}), dropout=0.0,
    attention_dropout=h['attention_dropout'], init_std=h['initializer_range'],
    moe=arch.moe.config(h) if arch.moe else MoeConfig(), execution=ExecutionConfig(scan_layers=False))
  if arch.moe:
    arch.moe.accept_fused(ckpt, cfg)
  return cfg, rules(cfg, arch.moe)


def layer_types(arch: Architecture, h: dict) -> list[str]:
  """Each layer's attention, full or sliding, as config.json `h` (defaults filled in) says."""
  n = h['num_hidden_layers']
  types = h.get('layer_types')
  if types is None and arch.global_every:
    types = [FULL if (i + 1) % arch.global_every == 0 else SLIDING for i in range(n)]
  elif types is None:
    windowed = arch.layer_windows and h.get('use_sliding_window') and h.get('sliding_window')
    types = [SLIDING if windowed and i >= h['max_window_layers'] else FULL for i in range(n)]
  return list(types)


def save_as(arch: Architecture, cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict
            ) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, arch.name, position='rotary', norm=arch.norm, norm_position=arch.norm_position,
                   use_bias=False, scale_attention=True, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm,
                   qk_norm_scope=arch.qk_norm_scope, attn_logit_softcap=0.0,
                   **({} if arch.window or arch.layer_windows else {'sliding_window': 0}),
                   **({'global_every': cfg.global_every, 'global_layers': cfg.global_layers} if arch.layer_windows
                      else {}),
                   **({'clip_qkv': cfg.clip_qkv} if arch.clip else {}), **({'moe': cfg.moe} if arch.moe else {}))
  if arch.norm == 'nonparametric_layernorm' and cfg.norm_eps != 1e-5:
    raise ConfigError(f'cannot export this {cfg.family} model as {arch.name}: model.norm_eps={cfg.norm_eps} '
                      f'(its LayerNorm has eps 1e-5)')
  hf: dict[str, Any] = {
    **base, 'architectures': [arch.name], 'model_type': arch.model_type, **hf_sizes(cfg),
    'num_key_value_heads': cfg.resolved_kv_heads, 'head_dim': cfg.resolved_head_dim,
    **({'rms_norm_eps': cfg.norm_eps} if arch.norm == 'rmsnorm' else {}),
    'hidden_act': hf_gated_activation(cfg.activation, base.get('hidden_act'), arch.name),
    **arch.refused, 'tie_word_embeddings': cfg.tie_embeddings,
    'attention_dropout': cfg.attention_dropout, 'initializer_range': cfg.init_std}
  if arch.window:
    hf['sliding_window'] = cfg.sliding_window or None
  if arch.clip:
    hf['clip_qkv'] = cfg.clip_qkv or None
  hf.pop('layer_types', None)  # transformers derives it; a stale one from `base` could disagree
  if arch.layer_windows:
    types = hf_layer_types(cfg)
    hf.update(sliding_window=cfg.sliding_window or None, layer_types=types)
    if not arch.global_every:  # Qwen's
      hf.update(use_sliding_window=bool(cfg.sliding_window),
                max_window_layers=types.index(SLIDING) if SLIDING in types else cfg.num_layers)
  hf.update(hf_rope(cfg, base, per_layer_type=bool(arch.global_every)))
  if arch.moe:
    hf.update(arch.moe.hf_config(dataclasses.replace(cfg.moe, expert_d_ff=cfg.moe.expert_d_ff or cfg.resolved_d_ff),
                                 cfg.num_layers, arch.name, base))
  return hf, rules(cfg, arch.moe)


def converter(arch: Architecture) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """(load, save) of the converter-module interface (`lm.storage.convert.hf_config`) for `arch`."""
  return functools.partial(load_as, arch), functools.partial(save_as, arch)


load, save = converter(LLAMA)


def fused_experts(cfg: ModelConfig, interleaved: bool = False) -> dict[str, tuple[str, int, bool]]:
  """Where transformers 5 holds each routed layer's expert kernels in memory, the parameters PEFT's
  `target_parameters` adapt (`mlp.experts.gate_up_proj` [E, 2F, D], gate then up, or `interleaved` [E, D, 2F], gate
  in the even columns, as GPT-OSS's; `mlp.experts.down_proj`): our kernel -> (that parameter, the kernel's part of
  it, whether the parts interleave)."""
  out = {}
  for i in range(cfg.num_layers):
    if cfg.moe.num_experts and cfg.moe.routed(i):
      h, o = f'model.layers.{i}.mlp.experts.', f'decoder/layers_{i}/mlp/'
      out.update({f'{o}wi_0': (f'{h}gate_up_proj', 0, interleaved), f'{o}wi_1': (f'{h}gate_up_proj', 1, interleaved),
                  f'{o}wo': (f'{h}down_proj', 0, False)})
  return out


def rules(cfg: ModelConfig, moe: MoeNames | None = None) -> list[Tensor]:
  # OLMo's norms have no weights; OLMo 2 normalises each branch's output (post_attention_ / post_feedforward_)
  weighted = cfg.norm != 'nonparametric_layernorm'
  branch_norms = ({'attention_post_norm': 'post_attention_layernorm', 'mlp_post_norm': 'post_feedforward_layernorm'}
                  if cfg.norm_position == 'post_branch' else
                  {'attention_norm': 'input_layernorm', 'mlp_norm': 'post_attention_layernorm'})
  out = [Tensor('model.embed_tokens.weight', ('token_embed/embedding',))]
  for i in range(cfg.num_layers):
    h, o = f'model.layers.{i}.', f'decoder/layers_{i}/'
    for x, name in zip('qkv', ('query', 'key', 'value')):
      out += dense(f'{h}self_attn.{x}_proj', f'{o}attention/{name}', 'linear', bias=cfg.qkv_bias)
    if cfg.qk_norm:  # per head: [head_dim] as ours; all heads: HF's [heads x head_dim], ours [heads, head_dim]
      layout = 'flat' if cfg.qk_norm_scope == 'all_heads' else 'same'
      out += [Tensor(f'{h}self_attn.{x}_norm.weight', (f'{o}attention/{name}_norm/scale',), layout)
              for x, name in (('q', 'query'), ('k', 'key'))]
    out += dense(f'{h}self_attn.o_proj', f'{o}attention/out', 'linear', n_in=2, bias=False)
    if moe and cfg.moe.routed(i):
      out += moe.rules(cfg, h, o)
    else:
      out += [*dense(f'{h}mlp.gate_proj', f'{o}mlp/wi_0', 'linear', bias=False),
              *dense(f'{h}mlp.up_proj', f'{o}mlp/wi_1', 'linear', bias=False),
              *dense(f'{h}mlp.down_proj', f'{o}mlp/wo', 'linear', bias=False)]
    if weighted:
      out += [t for ours, theirs in branch_norms.items() for t in norm(f'{h}{theirs}', f'{o}{ours}', bias=False)]
  if weighted:
    out += norm('model.norm', 'decoder/final_norm', bias=False)
  if not cfg.tie_embeddings:
    out.append(Tensor('lm_head.weight', ('lm_head/kernel',), 'linear'))
  return out
