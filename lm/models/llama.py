"""Llama (Touvron et al. 2023) and the families that share its layout: pre-norm decoders with rotary positions,
gated MLPs and no position table. What sets each apart lives in its config fields; the module is the shared
`CausalDecoder`, and each family's Hugging Face converter is `lm.storage.convert.<name>`."""
from __future__ import annotations

from lm.config import Config, ConfigError
from lm.models.causal import CausalDecoder
from lm.models.family import DecoderOnly

# What each family of Llama's layout is, by the config fields that set it apart
LAYOUTS: dict[str, str] = {
    'llama': 'Llama: pre-RMSNorm, rotary positions, SwiGLU, grouped-query attention (Llama 2 70B), no biases, '
             'untied output.',
    'mistral': 'Mistral 7B: Llama at 8 key/value heads.',
    'qwen2': 'Qwen2 and Qwen2.5: Llama with query, key and value biases (model.qkv_bias).',
    'qwen3': 'Qwen3: Llama with per-head query and key RMSNorm (model.qk_norm).',
    'gemma2': 'Gemma 2: (1 + w) RMSNorm before and after each branch, scaled embeddings tied to the output, GeGLU, '
              'soft-capped attention and output logits, sliding-window layers alternating with global ones.',
    'gemma3': "Gemma 3: Gemma 2 without soft-caps, with (1 + w) RMSNorms of each head's queries and keys, five "
              'windowed layers to a global one, and the windowed layers rotating at their own base wavelength '
              '(model.rope.local_theta).',
    'olmo': 'OLMo (Groeneveld et al. 2024): LayerNorm without scale or bias before each branch '
            '(model.norm=nonparametric_layernorm), query/key/value optionally clipped (model.clip_qkv).',
    'olmo2': "OLMo 2: RMSNorm of each branch's output before it is added (model.norm_position=post_branch) and of "
             'the queries and keys over all heads at once (model.qk_norm_scope=all_heads).',
    'olmo3': 'OLMo 3: OLMo 2 with sliding-window attention in three layers of four (model.sliding_window, '
             'model.global_every=4).',
    'mixtral': 'Mixtral: Mistral with routed experts in every layer (model.moe).',
    'qwen2_moe': 'Qwen2-MoE: Qwen2 with routed experts and a gated shared expert (model.moe).',
    'qwen3_moe': 'Qwen3-MoE: Qwen3 with routed experts (model.moe).',
    'olmoe': "OLMoE: OLMo 2's query/key norms over all heads, pre-norm branches, routed experts in every layer "
             '(model.moe).',
    'gpt_oss': 'GPT-OSS: Llama with biases on every projection and the router (model.use_bias), a learned sink logit '
               'per query head (model.attention_sinks), windowed layers alternating with global ones, and routed '
               'experts with a clamped SwiGLU (model.activation=clamped_swiglu) in every layer.',
    'deepseek_v3': "DeepSeek-V3 and Kimi K2: Llama with multi-head latent attention (model.mla) rotating interleaved "
                   'pairs, dense first layers, then routed experts chosen by a sigmoid router within groups, with '
                   'shared experts and an aux-loss-free selection bias (model.moe).',
}


class LlamaFamily(DecoderOnly):
  module = CausalDecoder
  routed_mlp = True

  def __init__(self, name: str) -> None:
    self.name = name
    self.hf_converter = f'lm.storage.convert.{name}'

  def validate(self, config: Config) -> None:
    if config.model.position not in ('rotary', 'none'):
      raise ConfigError(f'a {self.name} model has no position table: model.position={config.model.position!r} '
                        f'would be ignored; use model.position=rotary')


FAMILIES = tuple(LlamaFamily(name) for name in LAYOUTS)
