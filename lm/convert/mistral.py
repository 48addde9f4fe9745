"""Mistral (`MistralForCausalLM`): the Llama layout; a sliding window (`sliding_window`, Mistral 7B v0.1) is
refused, v0.2 and later (no window) load."""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ModelConfig
from lm.convert.llama import COMMON, Architecture, load_as, save_as
from lm.convert.tensors import Checkpoint, Tensor

ARCHITECTURE = 'MistralForCausalLM'
MISTRAL = Architecture(ARCHITECTURE, 'mistral', {**COMMON, 'intermediate_size': 14336, 'num_key_value_heads': 8,
                                                 'max_position_embeddings': 131072}, {'sliding_window': None})


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  return load_as(MISTRAL, hf, ckpt)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  return save_as(MISTRAL, cfg, flat, base)
