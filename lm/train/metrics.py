"""Parameter counts, training FLOPs per token and MFU: the one place these numbers come from."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig

# Dense bf16 peak FLOP/s per device (per chip for TPUs; v4/v5p chips have 2 TensorCores as one device).
PEAK_FLOPS = {
  'TPU v4': 275e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v5p': 459e12,
  'TPU v5': 459e12,
  'TPU v6 lite': 918e12,
  'TPU v6e': 918e12,
  'NVIDIA A100': 312e12,
  'NVIDIA H100': 989e12,
  'NVIDIA H200': 989e12,
}


def peak_flops(device: jax.Device) -> float | None:
  """Per-device peak for known accelerators (longest matching name), None for CPUs and unknown kinds."""
  kind = getattr(device, 'device_kind', '')
  matches = [name for name in PEAK_FLOPS if kind.startswith(name)]
  return PEAK_FLOPS[max(matches, key=len)] if matches else None


def abstract_params(model: nn.Module, cfg: ModelConfig) -> Any:
  """Parameter shapes by `jax.eval_shape`: nothing is allocated, so this works for 175B models."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
  return nn.unbox(variables['params'])


def _path_names(path: tuple) -> list[str]:
  return [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]


def count_params(params: Any) -> dict[str, int]:
  """Total parameters and non-embedding ones (Kaplan et al.: token and position tables excluded)."""
  total, embedding = 0, 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    size = int(np.prod(leaf.shape))
    total += size
    if 'embedding' in _path_names(path):
      embedding += size
  return {'total': total, 'non_embedding': total - embedding}


def matmul_params(params: Any, cfg: ModelConfig) -> int:
  """Weights used in a matmul per token: every dense kernel, plus the output layer when it is tied."""
  kernels = sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                if _path_names(path)[-1] == 'kernel')
  return kernels + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)


def flops_per_token(params: Any, cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
  """Training FLOPs per token: 6 * matmul weights + attention scores and values.

  The attention term is 6 * 2 * layers * heads * head_dim * seq_len (forward QK^T and AV,
  times 3 for backward), halved for causal attention, whose masked half need not be computed.
  """
  attn = 12 * cfg.num_layers * cfg.num_heads * cfg.resolved_head_dim * seq_len
  return 6 * matmul_params(params, cfg) + (attn / 2 if causal else attn)


def mfu(tokens_per_sec: float, flops_token: float, num_devices: int, peak: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the mesh's peak; None without a known peak."""
  if not peak:
    return None
  return tokens_per_sec * flops_token / (peak * num_devices)
