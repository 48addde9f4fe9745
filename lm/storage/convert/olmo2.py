"""OLMo 2 (`Olmo2ForCausalLM`): the Llama layout with each branch's output RMS-normalised before it is added
(`post_attention_layernorm`, `post_feedforward_layernorm`; no norm before a branch) and the queries and keys
RMS-normalised over all heads at once (one `[heads x head_dim]` weight each)."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, converter

ARCHITECTURE = 'Olmo2ForCausalLM'
# transformers' Olmo2Config defaults (OLMo 2 7B's shape)
OLMO2_DEFAULTS = {**COMMON, 'vocab_size': 50304, 'max_position_embeddings': 2048, 'rms_norm_eps': 1e-5}
OLMO2 = Architecture(ARCHITECTURE, 'olmo2', OLMO2_DEFAULTS, {'attention_bias': False}, qk_norm=True,
                     qk_norm_scope='all_heads', norm_position='post_branch')

load, save = converter(OLMO2)
