"""Rotary positions (RoPE, Su et al. 2021) and the scalings that stretch a trained context.

Feature pairs (i, i + head_dim/2) rotate by position x inv_freq[i] (the half-split layout of GPT-NeoX and
Hugging Face Llama, so their weights load unpermuted). A scaling changes only `inv_freq` and, for YaRN, the
size of cos and sin; each follows transformers' `modeling_rope_utils`:
- linear (Chen et al. 2023, position interpolation): every frequency / factor;
- llama3 (Llama 3.1): wavelengths above original_max_len / low_freq_factor divided by factor, below
  original_max_len / high_freq_factor kept, a smooth blend between;
- yarn (Peng et al. 2023): by frequency, interpolated below beta_slow rotations over the original context,
  kept above beta_fast, a linear ramp between (its ends whole features unless not `truncate`); cos and sin times an attention factor (0.1 ln factor + 1, or
  DeepSeek's ratio of two such with mscale and mscale_all_dim, whose MLA also scales the logits: `logit_factor`).
`interleaved` rotates the pairs (2i, 2i + 1) instead (DeepSeek), as the halves of [evens, odds].
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig, RopeConfig


@dataclass(frozen=True)
class Rope(RopeConfig):
  """What rotates queries and keys: `model.rope`'s base wavelength and scaling, with their arithmetic."""

  def inverse_frequencies(self, head_dim: int) -> np.ndarray:
    """[head_dim / 2] radians per position, float64."""
    inv_freq = self.theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if self.scaling == 'linear':
      return inv_freq / self.factor
    if self.scaling == 'llama3':
      context = self.original_max_len
      wavelength = 2 * math.pi / inv_freq
      smooth = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
      blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
      return np.where(wavelength > context / self.low_freq_factor, inv_freq / self.factor,
                      np.where(wavelength < context / self.high_freq_factor, inv_freq, blended))
    if self.scaling == 'yarn':
      low, high = (self._yarn_dim(beta, head_dim) for beta in (self.beta_fast, self.beta_slow))
      if self.truncate:
        low, high = math.floor(low), math.ceil(high)
      low, high = max(low, 0), min(high, head_dim - 1)
      ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low if high > low else 1e-3), 0, 1)
      return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq

  def _yarn_dim(self, rotations: float, head_dim: int) -> float:
    """The feature index whose frequency turns `rotations` times over the original context."""
    return head_dim * math.log(self.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

  def _mscale(self, m: float = 1.0) -> float:
    """YaRN's temperature 0.1 m ln(factor) + 1 (1 without stretching)."""
    return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

  @property
  def magnitude(self) -> float:
    """The factor on cos and sin: YaRN's attention temperature (both q and k carry it), else 1."""
    if self.scaling != 'yarn':
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return self._mscale(self.mscale) / self._mscale(self.mscale_all_dim)
    return self._mscale()

  @property
  def logit_factor(self) -> float:
    """What the attention logits are multiplied by beyond their scale: mscale(mscale_all_dim)^2 where
    `scale_logits` (DeepSeek's MLA folds it into the softmax scale), else 1."""
    if self.scaling != 'yarn' or not self.scale_logits or not self.mscale_all_dim:
      return 1.0
    return self._mscale(self.mscale_all_dim) ** 2


def rope_of(cfg: ModelConfig) -> Rope | None:
  """The model's rotation (None unless model.position is rotary)."""
  if cfg.position != 'rotary':
    return None
  return Rope(**dataclasses.asdict(cfg.rope))


def rotary(x: jax.Array, positions: jax.Array, rope: Rope, windowed: bool | jax.Array = False) -> jax.Array:
  """RoPE on x [batch, length, heads, head_dim] at `positions` [batch, length], in float32: the first
  `rope.rotated(head_dim)` features rotate (all but for a partial rotation), the others pass unchanged.
  `windowed` (traced in a scanned stack): a windowed layer's, by `rope.local()`."""
  rotated = rope.rotated(x.shape[-1])
  inv_freq, magnitude = rope.inverse_frequencies(rotated).astype(np.float32), rope.magnitude
  if rope.local_theta and windowed is not False:
    local = rope.local()
    inv_freq = jnp.where(windowed, local.inverse_frequencies(rotated).astype(np.float32), inv_freq)
    magnitude = jnp.where(windowed, local.magnitude, magnitude)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [b, l, half]
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  if rope.magnitude != 1.0:  # the windowed layers' rotation is unscaled: 1 there
    cos, sin = cos * magnitude, sin * magnitude
  x32 = x.astype(jnp.float32)
  part = x32[..., :rotated]
  if rope.interleaved:  # pairs (2i, 2i + 1): rotated as the halves of [evens, odds], left in that order (DeepSeek)
    part = jnp.concatenate([part[..., 0::2], part[..., 1::2]], axis=-1)
  x1, x2 = jnp.split(part, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotated:]], axis=-1).astype(x.dtype)
