"""Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layout with routed experts in the layers
`decoder_sparse_step` and `mlp_only_layers` choose (dense MLPs of `intermediate_size` in the others), the chosen
weights renormalised only under `norm_topk_prob`, and a shared expert behind a sigmoid gate."""
from __future__ import annotations

from lm.storage.convert.llama import Architecture, MoeNames, converter, fused_experts
from lm.storage.convert.qwen2 import QWEN_DEFAULTS

ARCHITECTURE = 'Qwen2MoeForCausalLM'
# transformers' Qwen2MoeConfig defaults (Qwen1.5-MoE-A2.7B's shape)
QWEN2_MOE_DEFAULTS = {**QWEN_DEFAULTS, 'hidden_size': 2048, 'intermediate_size': 5632, 'num_hidden_layers': 24,
                      'num_attention_heads': 16, 'num_key_value_heads': 16, 'num_experts': 60,
                      'num_experts_per_tok': 4, 'moe_intermediate_size': 1408, 'shared_expert_intermediate_size': 5632,
                      'decoder_sparse_step': 1, 'norm_topk_prob': False, 'router_aux_loss_coef': 0.001}
QWEN2_MOE = Architecture(ARCHITECTURE, 'qwen2_moe', QWEN2_MOE_DEFAULTS, {'qkv_bias': True}, qkv_bias=True,
                         layer_windows=True,
                         moe=MoeNames('mlp', ('gate_proj', 'up_proj', 'down_proj'), 'num_experts',
                                      'moe_intermediate_size', layer_pattern=True, shared=True))

load, save = converter(QWEN2_MOE)
experts_in_memory = fused_experts  # PEFT's target_parameters (lm.storage.convert.peft)
