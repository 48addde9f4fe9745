"""Qwen3-MoE (`Qwen3MoeForCausalLM`, Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's layout with routed experts in the
layers `decoder_sparse_step` and `mlp_only_layers` choose, the chosen weights renormalised under `norm_topk_prob`
(true as released), no shared expert."""
from __future__ import annotations

from lm.storage.convert.llama import Architecture, MoeNames, converter, fused_experts
from lm.storage.convert.qwen2 import QWEN_DEFAULTS

ARCHITECTURE = 'Qwen3MoeForCausalLM'
# transformers' Qwen3MoeConfig defaults (Qwen3-30B-A3B's shape but its vocabulary and context)
QWEN3_MOE_DEFAULTS = {**QWEN_DEFAULTS, 'hidden_size': 2048, 'intermediate_size': 6144, 'num_hidden_layers': 24,
                      'num_attention_heads': 32, 'num_key_value_heads': 4, 'head_dim': 128, 'num_experts': 128,
                      'num_experts_per_tok': 8, 'moe_intermediate_size': 768, 'decoder_sparse_step': 1,
                      'norm_topk_prob': False, 'router_aux_loss_coef': 0.001}
QWEN3_MOE = Architecture(ARCHITECTURE, 'qwen3_moe', QWEN3_MOE_DEFAULTS, {'attention_bias': False}, qk_norm=True,
                         layer_windows=True,
                         moe=MoeNames('mlp', ('gate_proj', 'up_proj', 'down_proj'), 'num_experts',
                                      'moe_intermediate_size', layer_pattern=True))

load, save = converter(QWEN3_MOE)
experts_in_memory = fused_experts  # PEFT's target_parameters (lm.storage.convert.peft)
