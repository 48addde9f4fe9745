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
  hf_converter = 'lm.storage.convert.llama'
  routed_mlp = True

  def validate(self, config: Config) -> None:
    if config.model.position not in ('rotary', 'none'):
      raise ConfigError(f'a {self.name} model has no position table: model.position={config.model.position!r} '
                        f'would be ignored; use model.position=rotary')


class MistralFamily(LlamaFamily):
  """Mistral 7B: Llama's layout at 8 key/value heads."""
  name = 'mistral'
  hf_converter = 'lm.storage.convert.mistral'


class Qwen2Family(LlamaFamily):
  """Qwen2 and Qwen2.5: Llama's layout with query, key and value biases (model.qkv_bias)."""
  name = 'qwen2'
  hf_converter = 'lm.storage.convert.qwen2'


class Qwen3Family(LlamaFamily):
  """Qwen3: Llama's layout with per-head query and key RMSNorm (model.qk_norm)."""
  name = 'qwen3'
  hf_converter = 'lm.storage.convert.qwen3'


class Gemma2Family(LlamaFamily):
  """Gemma 2: (1 + w) RMSNorm before and after each branch, scaled embeddings tied to the output, GeGLU, soft-capped
  attention and output logits, sliding-window layers alternating with global ones (all config fields)."""
  name = 'gemma2'
  hf_converter = 'lm.storage.convert.gemma2'


class MixtralFamily(LlamaFamily):
  """Mixtral: Mistral's layout with routed experts in every layer (model.moe)."""
  name = 'mixtral'
  hf_converter = 'lm.storage.convert.mixtral'


class Qwen2MoeFamily(LlamaFamily):
  """Qwen2-MoE: Qwen2's layout with routed experts and a gated shared expert (model.moe)."""
  name = 'qwen2_moe'
  hf_converter = 'lm.storage.convert.qwen2_moe'


class Qwen3MoeFamily(LlamaFamily):
  """Qwen3-MoE: Qwen3's layout with routed experts (model.moe)."""
  name = 'qwen3_moe'
  hf_converter = 'lm.storage.convert.qwen3_moe'


FAMILY = LlamaFamily()
MISTRAL, QWEN2, QWEN3, GEMMA2 = MistralFamily(), Qwen2Family(), Qwen3Family(), Gemma2Family()
MIXTRAL, QWEN2_MOE, QWEN3_MOE = MixtralFamily(), Qwen2MoeFamily(), Qwen3MoeFamily()
