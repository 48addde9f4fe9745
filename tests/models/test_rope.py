"""Rotary scalings: inverse frequencies and cos/sin factors equal transformers' own (`ROPE_INIT_FUNCTIONS`), and
the config refuses a scaling it cannot apply in one line."""
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lm.config import ConfigError, load_config
from lm.models.rope import Rope, rope_of, rotary

HEAD_DIM = 32
# (our Rope, the same as HF rope_parameters): a context of 64 puts every llama3 and yarn band in use at head dim 32
CASES = {
  'linear': (Rope(5e5, 'linear', 4.0), {'rope_type': 'linear', 'factor': 4.0}),
  'llama3': (Rope(5e5, 'llama3', 8.0, 64, 1.0, 4.0),
             {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
              'original_max_position_embeddings': 64}),
  'yarn': (Rope(1e4, 'yarn', 4.0, 64), {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64}),
  'yarn_betas': (Rope(1e4, 'yarn', 4.0, 64, beta_fast=16.0, beta_slow=2.0, attention_factor=1.3),
                 {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64, 'beta_fast': 16.0,
                  'beta_slow': 2.0, 'attention_factor': 1.3}),
  # DeepSeek's: cos and sin times mscale(1.0) / mscale(0.8) at factor 40
  'yarn_mscales': (Rope(1e4, 'yarn', 40.0, 64, mscale=1.0, mscale_all_dim=0.8),
                   {'rope_type': 'yarn', 'factor': 40.0, 'original_max_position_embeddings': 64, 'mscale': 1.0,
                    'mscale_all_dim': 0.8}),
  # GPT-OSS's: the ramp's ends left fractional
  'yarn_untruncated': (Rope(1e4, 'yarn', 4.0, 64, truncate=False),
                       {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 64, 'truncate': False}),
}


@pytest.mark.parametrize('case', list(CASES))
def test_scaled_frequencies_equal_transformers(case):
  rope, params = CASES[case]
  hf = transformers.LlamaConfig(hidden_size=HEAD_DIM * 2, num_attention_heads=2, max_position_embeddings=256,
                                rope_parameters={**params, 'rope_theta': rope.theta})
  inv_freq, factor = ROPE_INIT_FUNCTIONS[params['rope_type']](hf, 'cpu')
  ours = rope.inverse_frequencies(HEAD_DIM)
  np.testing.assert_allclose(ours, inv_freq.double().numpy(), rtol=2e-6)  # HF computes in float32
  assert rope.magnitude == pytest.approx(factor)
  assert not np.allclose(ours, Rope(rope.theta).inverse_frequencies(HEAD_DIM))  # the scaling does something


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
  x = np.random.default_rng(0).normal(size=(1, 5, 2, HEAD_DIM)).astype(np.float32)
  positions = jnp.arange(5)[None]
  yarn = Rope(1e4, 'yarn', 4.0, 64)
  as_linear = rotary(jnp.asarray(x), positions, yarn) / yarn.magnitude
  # the same rotation without the factor: the rotation preserves norms, the factor scales them
  np.testing.assert_allclose(np.linalg.norm(np.asarray(as_linear), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  assert yarn.magnitude == pytest.approx(0.1 * np.log(4.0) + 1)


def test_deepseeks_interleaved_pairs_and_logit_scale_equal_transformers():
  """Pairs (2i, 2i + 1) rotate as transformers' DeepSeek-V3 rotates them (its output in [evens, odds] order), and
  `scale_logits` multiplies the softmax scale as its `yarn_apply_mscale`."""
  import torch
  from transformers.modeling_rope_utils import yarn_apply_mscale
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
  rope, params = CASES['yarn_mscales']
  rope = Rope(**{**rope.__dict__, 'interleaved': True, 'scale_logits': True})
  x = np.random.default_rng(0).normal(size=(2, 7, 3, HEAD_DIM)).astype(np.float32)
  positions = np.stack([np.arange(7), np.arange(3, 10)])
  angles = positions[..., None] * rope.inverse_frequencies(HEAD_DIM)[None, None]  # [b, l, half]
  emb = torch.from_numpy(np.concatenate([angles, angles], axis=-1))
  cos, sin = emb.cos() * rope.magnitude, emb.sin() * rope.magnitude  # as transformers scales them
  theirs, _ = apply_rotary_pos_emb_interleave(torch.from_numpy(x).double(), torch.from_numpy(x).double(), cos, sin,
                                              unsqueeze_dim=2)
  ours = rotary(jnp.asarray(x), jnp.asarray(positions), rope)
  np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=2e-5, atol=2e-5)
  assert rope.logit_factor == pytest.approx(yarn_apply_mscale({**params, 'rope_theta': 1e4}, 1.0))
  assert rope.logit_factor != 1.0 and Rope(**{**rope.__dict__, 'scale_logits': False}).logit_factor == 1.0


def test_the_config_names_what_a_scaling_needs():
  cfg = load_config('llama_tiny', ['model.rope.scaling=llama3', 'model.rope.factor=8',
                                   'model.rope.original_max_len=128']).model
  assert rope_of(cfg) == Rope(10000.0, 'llama3', 8.0, 128, 1.0, 4.0)
  assert rope_of(load_config('gpt_tiny').model) is None
  with pytest.raises(ConfigError, match='needs model.rope.original_max_len'):
    load_config('llama_tiny', ['model.rope.scaling=yarn', 'model.rope.factor=4'])
  with pytest.raises(ConfigError, match='scales rotary positions, but model.position=learned'):
    load_config('gpt_tiny', ['model.rope.scaling=linear'])
  for field in ('mscale=1', 'truncate=false'):
    with pytest.raises(ConfigError, match='model.rope.mscale, mscale_all_dim, scale_logits and truncate belong to '
                                          'YaRN, but model.rope.scaling=linear'):
      load_config('llama_tiny', ['model.rope.scaling=linear', 'model.rope.factor=2', f'model.rope.{field}'])
  with pytest.raises(ConfigError, match='model.rope.factor=0.5 must be >= 1'):
    load_config('llama_tiny', ['model.rope.scaling=linear', 'model.rope.factor=0.5'])
