"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): the Llama layout with biases on the query, key and value projections.
Sliding-window layers (`use_sliding_window`) are refused."""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ModelConfig
from lm.convert.llama import COMMON, Architecture, load_as, save_as
from lm.convert.tensors import Checkpoint, Tensor

ARCHITECTURE = 'Qwen2ForCausalLM'
QWEN_DEFAULTS = {**COMMON, 'vocab_size': 151936, 'intermediate_size': 22016, 'max_position_embeddings': 32768}
QWEN2 = Architecture(ARCHITECTURE, 'qwen2', QWEN_DEFAULTS, {'use_sliding_window': False}, qkv_bias=True)


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  return load_as(QWEN2, hf, ckpt)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  return save_as(QWEN2, cfg, flat, base)
