"""OLMoE (`OlmoeForCausalLM`, OLMoE-1B-7B): the Llama layout with query/key RMSNorm over all heads at once,
`clip_qkv` where set, and routed experts of width `intermediate_size` in every layer (64 experts, 8 per token as
released; the chosen weights renormalised only under `norm_topk_prob`)."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, MoeNames, converter, fused_experts

ARCHITECTURE = 'OlmoeForCausalLM'
# transformers' OlmoeConfig defaults (OLMoE-1B-7B's shape)
OLMOE_DEFAULTS = {**COMMON, 'vocab_size': 50304, 'hidden_size': 2048, 'intermediate_size': 2048,
                  'num_hidden_layers': 16, 'num_attention_heads': 16, 'max_position_embeddings': 4096,
                  'rms_norm_eps': 1e-5, 'clip_qkv': None, 'num_experts': 64, 'num_experts_per_tok': 8,
                  'norm_topk_prob': False, 'router_aux_loss_coef': 0.01}
OLMOE = Architecture(ARCHITECTURE, 'olmoe', OLMOE_DEFAULTS, {'attention_bias': False}, qk_norm=True,
                     qk_norm_scope='all_heads', clip=True,
                     moe=MoeNames('mlp', ('gate_proj', 'up_proj', 'down_proj'), 'num_experts', 'intermediate_size'))

load, save = converter(OLMOE)
experts_in_memory = fused_experts  # PEFT's target_parameters (lm.storage.convert.peft)
