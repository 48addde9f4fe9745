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


# High-bandwidth memory per device, bytes (the largest variant where a chip comes in several).
HBM_BYTES = {
  'TPU v4': 32 * 2**30,
  'TPU v5 lite': 16 * 2**30,
  'TPU v5e': 16 * 2**30,
  'TPU v5p': 95 * 2**30,
  'TPU v5': 95 * 2**30,
  'TPU v6 lite': 32 * 2**30,
  'TPU v6e': 32 * 2**30,
  'NVIDIA A100': 80 * 10**9,
  'NVIDIA H100': 80 * 10**9,
  'NVIDIA H200': 141 * 10**9,
}


def _lookup(table: dict[str, Any], device: jax.Device) -> Any:
  kind = getattr(device, 'device_kind', '')
  matches = [name for name in table if kind.startswith(name)]
  return table[max(matches, key=len)] if matches else None


def peak_flops(device: jax.Device) -> float | None:
  """Per-device peak for known accelerators (longest matching name), None for CPUs and unknown kinds."""
  return _lookup(PEAK_FLOPS, device)


def hbm_bytes(device: jax.Device) -> int | None:
  """Per-device accelerator memory for known kinds, None for CPUs and unknown kinds."""
  return _lookup(HBM_BYTES, device)


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


_PER_SEQUENCE = ('pooler', 'nsp_head', 'classifier')  # BERT heads that see only the [CLS] position


def _kernels(params: Any) -> dict[str, int]:
  """Sizes of the dense kernels by role: per-token work of encoder, decoder, cross K/V, and per-sequence heads."""
  out = {'encoder': 0, 'decoder': 0, 'cross_kv': 0, 'per_sequence': 0}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = _path_names(path)
    if names[-1] != 'kernel':
      continue
    size = int(np.prod(leaf.shape))
    if any(n in _PER_SEQUENCE for n in names):
      out['per_sequence'] += size
    elif 'cross_attention' in names and names[-2] in ('key', 'value'):
      out['cross_kv'] += size  # projects the encoder output: once per encoder token
    elif names[0] == 'encoder':
      out['encoder'] += size
    else:
      out['decoder'] += size
  return out


def flops_per_sequence(params: Any, cfg: ModelConfig, seq_len: int, causal_attention: str = 'half') -> float:
  """Training FLOPs (forward + backward = 3x forward) of one row of `seq_len` tokens: matmuls only.

  Dense layers cost 2 FLOPs per weight per token they see; attention 2 * 2 * heads * head_dim per
  query-key pair (scores and the weighted sum of values). A T5 row is `seq_len` encoder tokens and
  the span-corruption targets for the decoder; the encoder-side K/V projections of cross-attention
  run on the encoder tokens. `causal_attention` 'half' counts only the pairs a causal mask allows
  (what a kernel that skips masked blocks does), 'full' the whole square (what dense XLA attention
  computes).
  """
  if causal_attention not in ('half', 'full'):
    raise ValueError(f'causal_attention={causal_attention!r}: choose half or full')
  k = _kernels(params)
  output = cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0  # a tied head's weights are the embedding
  width = cfg.num_heads * cfg.resolved_head_dim
  causal_pairs = lambda n: n * n / 2 if causal_attention == 'half' else n * n
  if cfg.family == 't5':
    from lm.data.objectives import span_lengths
    enc, dec = seq_len, span_lengths(seq_len).targets
    dense = (k['encoder'] + k['cross_kv']) * enc + (k['decoder'] + output) * dec
    pairs = (cfg.num_layers * enc * enc + cfg.resolved_decoder_layers * (causal_pairs(dec) + dec * enc))
  else:
    dense = (k['encoder'] + k['decoder'] + output) * seq_len
    pairs = cfg.num_layers * (causal_pairs(seq_len) if cfg.family == 'gpt' else seq_len * seq_len)
  forward = 2 * (dense + k['per_sequence']) + 4 * width * pairs
  return 3.0 * forward


def flops_per_token(params: Any, cfg: ModelConfig, seq_len: int, causal_attention: str = 'half') -> float:
  """`flops_per_sequence` per row token (the tokens the train loop counts): for a decoder, 6N + attention."""
  return flops_per_sequence(params, cfg, seq_len, causal_attention) / seq_len


def mfu(tokens_per_sec: float, flops_token: float, num_devices: int, peak: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the mesh's peak; None without a known peak."""
  if not peak:
    return None
  return tokens_per_sec * flops_token / (peak * num_devices)


def shard_bytes(tree: Any) -> int:
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
  params = shard_bytes(abstract_state.params)
  out = {
    'params': params,
    'optimizer': shard_bytes(abstract_state.opt_state),
    'gradients': params,
    'activations (estimate)': activation_bytes(config.model, tokens, config.data.seq_len, sizes['tensor']),
  }
  out['total (estimate)'] = sum(out.values())
  return out
