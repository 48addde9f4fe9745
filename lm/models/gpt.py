"""GPT-2 (Radford et al. 2019): learned positions, pre-LN blocks, GELU MLP, tied output, final norm."""
from __future__ import annotations

from lm.models.causal import CausalDecoder
from lm.models.family import DecoderOnly


class GPTFamily(DecoderOnly):
  name = 'gpt'
  module = CausalDecoder
  hf_converter = 'lm.storage.convert.gpt2'


FAMILY = GPTFamily()
