"""OLMo (`OlmoForCausalLM`, the `-hf` releases): the Llama layout with LayerNorms that have no weights (eps 1e-5)
and the query, key and value projections clipped to `clip_qkv` where set."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, converter

ARCHITECTURE = 'OlmoForCausalLM'
# transformers' OlmoConfig defaults (OLMo 7B's shape)
OLMO_DEFAULTS = {**COMMON, 'vocab_size': 50304, 'max_position_embeddings': 2048, 'clip_qkv': None}
OLMO = Architecture(ARCHITECTURE, 'olmo', OLMO_DEFAULTS, {'attention_bias': False}, norm='nonparametric_layernorm',
                    clip=True)

load, save = converter(OLMO)
