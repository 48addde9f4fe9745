"""OLMo (Groeneveld et al. 2024) and OLMo 2 (OLMo et al. 2024): Llama-like decoders from AI2, released with their
intermediate checkpoints. OLMo: LayerNorm without scale or bias (`model.norm=nonparametric_layernorm`) before each
branch, query/key/value projections optionally clipped (`model.clip_qkv`). OLMo 2: RMSNorm of each branch's
output before it is added (`model.norm_position=post_branch`) and of the queries and keys over all heads at once
(`model.qk_norm_scope=all_heads`). OLMo 3: OLMo 2 with sliding-window attention in three layers of four
(`model.sliding_window`, `model.global_every=4`). All: rotary positions, SwiGLU, no biases. The module is the shared
`CausalDecoder`; the shape lives in the config."""
from __future__ import annotations

from lm.models.llama import LlamaFamily


class OlmoFamily(LlamaFamily):
  name = 'olmo'
  hf_converter = 'lm.storage.convert.olmo'


class Olmo2Family(LlamaFamily):
  name = 'olmo2'
  hf_converter = 'lm.storage.convert.olmo2'


class Olmo3Family(LlamaFamily):
  name = 'olmo3'
  hf_converter = 'lm.storage.convert.olmo3'


class OlmoeFamily(LlamaFamily):
  """OLMoE: OLMo 2's query/key norms over all heads, pre-norm branches, routed experts in every layer (model.moe)."""
  name = 'olmoe'
  hf_converter = 'lm.storage.convert.olmoe'


FAMILY, OLMO2, OLMO3, OLMOE = OlmoFamily(), Olmo2Family(), Olmo3Family(), OlmoeFamily()
