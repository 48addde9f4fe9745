"""Mixtral (`MixtralForCausalLM`): Mistral's layout with 8 routed experts in every layer, 2 per token (softmax over
the experts, the top two renormalised); each expert in its own `block_sparse_moe.experts.{j}.w1/w3/w2` tensors as
`save_pretrained` writes them, or fused as transformers 5 holds them in memory."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, MoeNames, converter, fused_experts

ARCHITECTURE = 'MixtralForCausalLM'
# transformers' MixtralConfig defaults (Mixtral-8x7B's shape)
MIXTRAL_DEFAULTS = {**COMMON, 'intermediate_size': 14336, 'num_key_value_heads': 8, 'max_position_embeddings': 131072,
                    'rms_norm_eps': 1e-5, 'num_local_experts': 8, 'num_experts_per_tok': 2,
                    'router_aux_loss_coef': 0.001}
MIXTRAL = Architecture(ARCHITECTURE, 'mixtral', MIXTRAL_DEFAULTS, {'router_jitter_noise': 0.0}, window=True,
                       moe=MoeNames('block_sparse_moe', ('w1', 'w3', 'w2'), 'num_local_experts', 'intermediate_size',
                                    normalize=True))

load, save = converter(MIXTRAL)
experts_in_memory = fused_experts  # PEFT's target_parameters (lm.storage.convert.peft)
