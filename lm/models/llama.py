"""Llama (Touvron et al. 2023): pre-RMSNorm decoder, rotary positions, SwiGLU MLP, grouped-query
attention (Llama 2 70B), no biases, untied output. The shape lives in the config; the module is the
shared `CausalDecoder`."""
from __future__ import annotations

from lm.config import Config, ConfigError
from lm.models.causal import CausalDecoder
from lm.models.family import DecoderOnly


class LlamaFamily(DecoderOnly):
  name = 'llama'
  module = CausalDecoder
  hf_converter = 'lm.convert.llama'

  def validate(self, config: Config) -> None:
    if config.model.position not in ('rotary', 'none'):
      raise ConfigError(f'a llama model has no position table: model.position={config.model.position!r} would be '
                        f'ignored; use model.position=rotary')


FAMILY = LlamaFamily()
