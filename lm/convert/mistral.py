"""Mistral (`MistralForCausalLM`): the Llama layout with a sliding window in every layer (`sliding_window`:
4096 in Mistral 7B v0.1, none from v0.2)."""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ModelConfig
from lm.convert.llama import COMMON, Architecture, load_as, save_as
from lm.convert.tensors import Checkpoint, Tensor

ARCHITECTURE = 'MistralForCausalLM'
MISTRAL = Architecture(ARCHITECTURE, 'mistral', {**COMMON, 'intermediate_size': 14336, 'num_key_value_heads': 8,
                                                 'max_position_embeddings': 131072}, {}, window=True)


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  return load_as(MISTRAL, hf, ckpt)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict[str, Any]) -> tuple[dict, list[Tensor]]:
  return save_as(MISTRAL, cfg, flat, base)
