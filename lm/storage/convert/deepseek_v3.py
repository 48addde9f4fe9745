"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Kimi K2's checkpoints are this class) <-> our `deepseek_v3` family: Llama's
layout with multi-head latent attention (`model.mla`: `q_a_proj`/`q_a_layernorm`/`q_b_proj` or `q_proj`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; interleaved rotary pairs, YaRN with its `mscale` folded into the
logits' scale), the first `first_k_dense_replace` layers dense and routed experts after them: a sigmoid router whose
selection bias is `e_score_correction_bias`, group-limited choice, the chosen weights renormalised and scaled, and
shared experts.

The released FP8 weights (`quant_method: fp8`, float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block)
load dequantized (`lm.storage.convert.quantized.dequantize_fp8`) and export in the dtype asked for."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, MlaConfig, ModelConfig, MoeConfig, MtpConfig
from lm.storage.convert.hf_config import (GATED, check_exportable, hf_gated_activation, hf_sizes, our_activation,
                                          unsupported)
from lm.storage.convert.llama import COMMON, MoeNames, fused_experts, hf_rope, rope_fields
from lm.storage.convert.quantized import dequantize_fp8
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'DeepseekV3ForCausalLM'
QUANTIZED = ('fp8',)
MTP = True  # holds multi-token prediction modules (`model.mtp`)
# transformers' DeepseekV3Config defaults (DeepSeek-V3's shape)
DEFAULTS = {**COMMON, 'vocab_size': 129280, 'hidden_size': 7168, 'intermediate_size': 18432,
            'moe_intermediate_size': 2048, 'num_hidden_layers': 61, 'num_attention_heads': 128, 'n_shared_experts': 1,
            'n_routed_experts': 256, 'routed_scaling_factor': 2.5, 'kv_lora_rank': 512, 'q_lora_rank': 1536,
            'qk_rope_head_dim': 64, 'v_head_dim': 128, 'qk_nope_head_dim': 128, 'n_group': 8, 'topk_group': 4,
            'num_experts_per_tok': 8, 'first_k_dense_replace': 3, 'norm_topk_prob': True,
            'max_position_embeddings': 4096, 'rms_norm_eps': 1e-6, 'rope_interleave': True}
# the routed layers' tensors, one per expert, or fused as transformers 5 holds them (`accept_fused`)
EXPERTS = MoeNames('mlp', ('gate_proj', 'up_proj', 'down_proj'), 'n_routed_experts', 'moe_intermediate_size')
BIAS_RATE = 0.001  # the selection bias's update speed, DeepSeek-V3's gamma for its first 14.3T tokens (section 4.2)


experts_in_memory = fused_experts  # PEFT's target_parameters (lm.storage.convert.peft)


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(ARCHITECTURE, hf, attention_bias=False, pretraining_tp=1)
  for name in sorted(ckpt.names):  # FP8 weights: each read times its block scales
    if name.endswith('.weight_scale_inv'):
      scale = name
      ckpt.rewrite(name[:-len('_scale_inv')], lambda a, scale=scale: dequantize_fp8(a, ckpt.get(scale)))
      ckpt.used.add(scale)
  h = {**DEFAULTS, **hf}
  rope = rope_fields(h, ARCHITECTURE)['rope']
  rope = dataclasses.replace(rope, interleaved=bool(h['rope_interleave']), scale_logits=rope.scaling == 'yarn')
  routed = h['n_routed_experts'] or 0
  layers = h['num_hidden_layers']
  moe = MoeConfig(num_experts=routed, experts_per_token=h['num_experts_per_tok'],
                  expert_d_ff=h['moe_intermediate_size'], router='sigmoid', normalize=bool(h['norm_topk_prob']), routed_scale=float(h['routed_scaling_factor']),
                  groups=h['n_group'] or 1, top_groups=h['topk_group'] or 1, shared_experts=h['n_shared_experts'] or 0,
                  shared_d_ff=(h['n_shared_experts'] or 0) * h['moe_intermediate_size'] or None,
                  first_dense=min(h['first_k_dense_replace'] or 0, layers), balance_loss=0.0,
                  bias_rate=BIAS_RATE) if routed and (h['first_k_dense_replace'] or 0) < layers else MoeConfig()
  if not moe.shared_experts:
    moe = dataclasses.replace(moe, shared_d_ff=None)
  embed = ckpt.get('model.embed_tokens.weight')
  same = None if embed is None else ckpt.same_as('lm_head.weight', embed)
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=layers, num_heads=h['num_attention_heads'],
    head_dim=h['qk_nope_head_dim'] + h['qk_rope_head_dim'], d_ff=h['intermediate_size'],
    max_len=h['max_position_embeddings'], position='rotary', rope=rope, norm='rmsnorm', norm_eps=h['rms_norm_eps'],
    norm_position='pre', activation=GATED[our_activation(h['hidden_act'], 'hidden_act', ARCHITECTURE)],
    use_bias=False, tie_embeddings=h['tie_word_embeddings'] if same is None else same,
    attention_dropout=h['attention_dropout'] or 0.0, init_std=h['initializer_range'],
    mla=MlaConfig(kv_lora_rank=h['kv_lora_rank'], q_lora_rank=h['q_lora_rank'] or 0,
                  rope_head_dim=h['qk_rope_head_dim'], v_head_dim=h['v_head_dim']),
    moe=moe, execution=ExecutionConfig(scan_layers=False))
  if moe.num_experts:
    moe.check(layers)
    EXPERTS.accept_fused(ckpt, cfg)
  cfg = dataclasses.replace(cfg, mtp=MtpConfig(depth=_mtp_depth(h, ckpt, cfg, embed)))
  return cfg, rules(cfg)


def _mtp_depth(h: dict, ckpt: Checkpoint, cfg: ModelConfig, embed: np.ndarray | None) -> int:
  """The MTP modules the checkpoint holds (`num_nextn_predict_layers`, as layers past the stack; transformers saves
  none), their copies of the embedding and output layer checked against the model's own."""
  n = h.get('num_nextn_predict_layers') or 0
  if not n or any(f'model.layers.{cfg.num_layers + k}.eh_proj.weight' not in ckpt.names for k in range(n)):
    return 0
  head = embed if cfg.tie_embeddings else ckpt.get('lm_head.weight')
  for k in range(n):
    for copy, own in (('embed_tokens', embed), ('shared_head.head', head)):
      name = f'model.layers.{cfg.num_layers + k}.{copy}.weight'
      if own is not None and ckpt.same_as(name, own) is False:
        raise ConfigError(f'{ckpt.path}: {name} differs from the model\'s own {copy.split(".")[-1]}; lm\'s MTP '
                          f'modules share the model\'s, so this checkpoint cannot load as it is')
  return n


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  m = cfg.moe
  if not cfg.mla.kv_lora_rank:
    raise ConfigError(f'cannot export this {cfg.family} model as {ARCHITECTURE}: its attention is latent; set '
                      f'model.mla')
  if m.num_experts and (m.router != 'sigmoid' or m.every != 1 or m.dense_layers or m.shared_gate
                        or m.shared_d_ff not in (None, m.shared_experts * (m.expert_d_ff or cfg.resolved_d_ff))):
    raise ConfigError(f'cannot export this {cfg.family} model as {ARCHITECTURE}: its experts need a sigmoid router '
                      f'(model.moe.router=sigmoid), every layer past model.moe.first_dense routed and ungated shared '
                      f'experts of the routed width')
  check_exportable(cfg, ARCHITECTURE, position='rotary', norm='rmsnorm', norm_position='pre', use_bias=False,
                   scale_attention=True, attn_logit_softcap=0.0, final_logit_softcap=0.0, norm_plus_one=False,
                   scale_embeddings=False, parallel_residual=False, attention_scale_dim=None, sliding_window=0,
                   moe=m, mla=cfg.mla, **{'rope.scale_logits': cfg.rope.scaling == 'yarn',
                                          'rope.interleaved': cfg.rope.interleaved})
  mla = cfg.mla
  hf: dict[str, Any] = {
    **{k: v for k, v in base.items() if k not in ('quantization_config', 'rope_scaling', 'rope_theta')},
    'architectures': [ARCHITECTURE], 'model_type': 'deepseek_v3', **hf_sizes(cfg),
    'num_key_value_heads': cfg.num_heads, 'rms_norm_eps': cfg.norm_eps,
    'hidden_act': hf_gated_activation(cfg.activation, base.get('hidden_act'), ARCHITECTURE), 'attention_bias': False,
    'tie_word_embeddings': cfg.tie_embeddings, 'attention_dropout': cfg.attention_dropout,
    'initializer_range': cfg.init_std, 'kv_lora_rank': mla.kv_lora_rank, 'q_lora_rank': mla.q_lora_rank or None,
    'qk_rope_head_dim': mla.rope_head_dim, 'qk_nope_head_dim': cfg.resolved_head_dim - mla.rope_head_dim,
    'v_head_dim': cfg.value_head_dim, 'rope_interleave': cfg.rope.interleaved,
    'n_routed_experts': m.num_experts or None, 'num_experts_per_tok': m.experts_per_token if m.num_experts else None,
    'moe_intermediate_size': m.expert_d_ff or cfg.resolved_d_ff, 'n_shared_experts': m.shared_experts,
    'routed_scaling_factor': m.routed_scale, 'n_group': m.groups, 'topk_group': m.top_groups,
    'norm_topk_prob': m.normalize, 'first_k_dense_replace': m.first_dense if m.num_experts else cfg.num_layers,
    'num_nextn_predict_layers': cfg.mtp.depth}
  hf.update(hf_rope(cfg, {}))
  return hf, rules(cfg, copies=True)


def rules(cfg: ModelConfig, copies: bool = False) -> list[Tensor]:
  """The tensors of the model and its MTP modules; with `copies`, also the latter's copies of the embedding and
  output layer, which DeepSeek's checkpoints hold (import checks them: `_mtp_depth`)."""
  out = [Tensor('model.embed_tokens.weight', ('token_embed/embedding',))]
  for i in range(cfg.num_layers):
    out += _layer(cfg, i, f'model.layers.{i}.', f'decoder/layers_{i}/')
  out += norm('model.norm', 'decoder/final_norm', bias=False)
  head = Tensor('lm_head.weight', ('lm_head/kernel',), 'linear')
  if not cfg.tie_embeddings:
    out.append(head)
  for k in range(cfg.mtp.depth):  # DeepSeek numbers them on from the stack's layers
    h, o = f'model.layers.{cfg.num_layers + k}.', f'mtp_{k}/'
    out += [*norm(f'{h}enorm', f'{o}embed_norm', bias=False), *norm(f'{h}hnorm', f'{o}hidden_norm', bias=False),
            Tensor(f'{h}eh_proj.weight', (f'{o}embed_proj/kernel', f'{o}hidden_proj/kernel'), 'linear'),
            *norm(f'{h}shared_head.norm', f'{o}final_norm', bias=False),
            *_layer(cfg, cfg.num_layers + k, h, f'{o}block/')]
    if copies:
      out += [Tensor(f'{h}embed_tokens.weight', ('token_embed/embedding',)),
              dataclasses.replace(out[0] if cfg.tie_embeddings else head, name=f'{h}shared_head.head.weight')]
  return out


def _layer(cfg: ModelConfig, i: int, h: str, o: str) -> list[Tensor]:
  """Layer `i`'s tensors (HF prefix `h`, ours `o`)."""
  out = []
  a, ours = f'{h}self_attn.', f'{o}attention/'
  if cfg.mla.q_lora_rank:
    out += [*dense(f'{a}q_a_proj', f'{ours}query_down', 'linear', bias=False),
            *norm(f'{a}q_a_layernorm', f'{ours}query_norm', bias=False),
            *dense(f'{a}q_b_proj', f'{ours}query_up', 'linear', bias=False)]
  else:
    out += dense(f'{a}q_proj', f'{ours}query', 'linear', bias=False)
  out += [*dense(f'{a}kv_a_proj_with_mqa', f'{ours}kv_down', 'linear', bias=False),
          *norm(f'{a}kv_a_layernorm', f'{ours}kv_norm', bias=False),
          *dense(f'{a}kv_b_proj', f'{ours}kv_up', 'linear', bias=False),
          *dense(f'{a}o_proj', f'{ours}out', 'linear', n_in=2, bias=False),
          *norm(f'{h}input_layernorm', f'{o}attention_norm', bias=False),
          *norm(f'{h}post_attention_layernorm', f'{o}mlp_norm', bias=False)]
  out += _routed(cfg, h, o) if cfg.moe.routed(i) else _mlp(f'{h}mlp.', f'{o}mlp/')
  return out


def _mlp(theirs: str, ours: str) -> list[Tensor]:
  return [t for hf, name in (('gate_proj', 'wi_0'), ('up_proj', 'wi_1'), ('down_proj', 'wo'))
          for t in dense(f'{theirs}{hf}', f'{ours}{name}', 'linear', bias=False)]


def _routed(cfg: ModelConfig, h: str, o: str) -> list[Tensor]:
  b = f'{h}mlp.'
  out = [Tensor(f'{b}gate.weight', (f'{o}mlp/router',), 'linear'),
         Tensor(f'{b}gate.e_score_correction_bias', (f'{o}mlp/router_bias',))]
  for j in range(cfg.moe.num_experts):
    out += [Tensor(f'{b}experts.{j}.{theirs}.weight', (f'{o}mlp/{ours}',), 'linear', index=j)
            for theirs, ours in (('gate_proj', 'wi_0'), ('up_proj', 'wi_1'), ('down_proj', 'wo'))]
  return out + (_mlp(f'{b}shared_experts.', f'{o}mlp/shared/') if cfg.moe.shared_experts else [])
