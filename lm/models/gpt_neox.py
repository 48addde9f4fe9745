"""GPT-NeoX (Black et al. 2022; the Pythia suite): pre-LayerNorm blocks whose attention and MLP read the same input
(`model.parallel_residual`, as the released Pythia models), rotary positions on a quarter of each head's features
(`model.rope.fraction`), biases everywhere, a GELU MLP and an untied output layer. The module is the shared
`CausalDecoder`; the shape lives in the config."""
from __future__ import annotations

from lm.config import Config, ConfigError
from lm.models.causal import CausalDecoder
from lm.models.family import DecoderOnly


class GPTNeoXFamily(DecoderOnly):
  name = 'gpt_neox'
  module = CausalDecoder
  hf_converter = 'lm.storage.convert.gpt_neox'

  def validate(self, config: Config) -> None:
    if config.model.position != 'rotary':
      raise ConfigError(f'a {self.name} model has no position table: model.position={config.model.position!r} '
                        f'would be ignored; use model.position=rotary')


FAMILY = GPTNeoXFamily()
