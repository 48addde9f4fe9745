"""Qwen3 (`Qwen3ForCausalLM`): the Llama layout with a per-head RMSNorm of queries and keys.
Sliding-window layers (`use_sliding_window`) are refused."""
from __future__ import annotations

from lm.storage.convert.llama import Architecture, converter
from lm.storage.convert.qwen2 import QWEN_DEFAULTS

ARCHITECTURE = 'Qwen3ForCausalLM'
QWEN3 = Architecture(ARCHITECTURE, 'qwen3', {**QWEN_DEFAULTS, 'head_dim': 128},
                     {'use_sliding_window': False, 'attention_bias': False}, qk_norm=True)

load, save = converter(QWEN3)
