"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): the Llama layout with biases on the query, key and value projections.
Sliding-window layers (`use_sliding_window`) are refused."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, converter

ARCHITECTURE = 'Qwen2ForCausalLM'
QWEN_DEFAULTS = {**COMMON, 'vocab_size': 151936, 'intermediate_size': 22016, 'max_position_embeddings': 32768}
QWEN2 = Architecture(ARCHITECTURE, 'qwen2', QWEN_DEFAULTS, {'use_sliding_window': False}, qkv_bias=True)

load, save = converter(QWEN2)
