"""Parameter counts, training FLOPs per token and MFU: the one place these numbers come from."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lm.config import ModelConfig
from lm.models import init_params

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
  return nn.unbox(jax.eval_shape(lambda: init_params(model, jax.random.key(0), 1)))


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


def _shard_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, 'sharding', None) is not None else leaf.shape
    total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
  return total


def activation_bytes(cfg: ModelConfig, tokens: int, seq_len: int, tensor: int) -> int:
  """Rough bytes of activations kept for the backward pass by one device, for `tokens` local tokens.

  Per layer and token, a pre-LN block keeps its norm inputs/outputs (4d), q, k, v and the attention
  output (4 h dh), the MLP hidden before and after the activation (2 or 3 d_ff) and the float32
  attention probabilities (heads * seq). Remat keeps less but recomputes one layer at a time.
  """
  width = 4 if cfg.dtype == 'float32' else 2
  hd = cfg.num_heads * cfg.resolved_head_dim
  d_ff = cfg.resolved_d_ff * (3 if cfg.activation in ('geglu', 'swiglu', 'reglu') else 2)
  full_layer = (4 * cfg.d_model + (4 * hd + d_ff) / tensor) * width + cfg.num_heads * seq_len * 4 / tensor
  kept = {
    'none': full_layer,
    'full': cfg.d_model * width,
    'dots': (2 * cfg.d_model + (3 * hd + cfg.resolved_d_ff) / tensor) * width,
    'projections': (2 * cfg.d_model + 3 * hd / tensor) * width,
  }[cfg.remat]
  per_token = kept * cfg.num_layers + (0 if cfg.remat == 'none' else full_layer)
  logits = 2 * cfg.vocab_size / tensor * 4  # float32 logits and their gradient
  return int(tokens * (per_token + logits))


def estimate_memory(config: Any, abstract_state: Any, sizes: dict[str, int]) -> dict[str, int]:
  """Per-device bytes: parameters, optimizer state and gradients exactly (from the shardings), activations roughly."""
  t = config.train
  tokens = t.global_batch // t.microbatches // (sizes['data'] * sizes['fsdp']) * config.data.seq_len
  params = _shard_bytes(abstract_state.params)
  out = {
    'params': params,
    'optimizer': _shard_bytes(abstract_state.opt_state),
    'gradients': params,
    'activations (estimate)': activation_bytes(config.model, tokens, config.data.seq_len, sizes['tensor']),
  }
  out['total (estimate)'] = sum(out.values())
  return out
