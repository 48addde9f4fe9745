"""Qwen3 (`Qwen3ForCausalLM`): the Llama layout with a per-head RMSNorm of queries and keys.
Sliding-window layers (`use_sliding_window`) are refused."""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ModelConfig
from lm.convert.llama import Architecture, load_as, save_as
from lm.convert.qwen2 import QWEN_DEFAULTS
from lm.convert.tensors import Checkpoint, Tensor

ARCHITECTURE = 'Qwen3ForCausalLM'
QWEN3 = Architecture(ARCHITECTURE, 'qwen3', {**QWEN_DEFAULTS, 'head_dim': 128},
                     {'use_sliding_window': False, 'attention_bias': False}, qk_norm=True)


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  return load_as(QWEN3, hf, ckpt)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  return save_as(QWEN3, cfg, flat, base)
