"""Qwen3 (`Qwen3ForCausalLM`): the Llama layout with a per-head RMSNorm of queries and keys, and Qwen2's
sliding-window layers."""
from __future__ import annotations

from lm.storage.convert.llama import Architecture, converter
from lm.storage.convert.qwen2 import QWEN_DEFAULTS

ARCHITECTURE = 'Qwen3ForCausalLM'
QWEN3 = Architecture(ARCHITECTURE, 'qwen3', {**QWEN_DEFAULTS, 'head_dim': 128},
                     {'attention_bias': False}, qk_norm=True, layer_windows=True)

load, save = converter(QWEN3)
