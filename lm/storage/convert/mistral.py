"""Mistral (`MistralForCausalLM`): the Llama layout with a sliding window in every layer (`sliding_window`:
4096 in Mistral 7B v0.1, none from v0.2)."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, converter

ARCHITECTURE = 'MistralForCausalLM'
MISTRAL = Architecture(ARCHITECTURE, 'mistral', {**COMMON, 'intermediate_size': 14336, 'num_key_value_heads': 8,
                                                 'max_position_embeddings': 131072}, {}, window=True)

load, save = converter(MISTRAL)
