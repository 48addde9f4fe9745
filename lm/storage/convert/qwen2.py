"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): the Llama layout with biases on the query, key and value projections,
and sliding-window layers where `layer_types` (or `use_sliding_window` from layer `max_window_layers` on) has them."""
from __future__ import annotations

from lm.storage.convert.llama import COMMON, Architecture, converter

ARCHITECTURE = 'Qwen2ForCausalLM'
QWEN_DEFAULTS = {**COMMON, 'vocab_size': 151936, 'intermediate_size': 22016, 'max_position_embeddings': 32768,
                 'max_window_layers': 28}
QWEN2 = Architecture(ARCHITECTURE, 'qwen2', QWEN_DEFAULTS, {}, qkv_bias=True, layer_windows=True)

load, save = converter(QWEN2)
