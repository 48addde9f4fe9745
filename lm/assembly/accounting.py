"""Parameter, FLOP, MFU and memory accounting: the one place these numbers come from."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from lm.assembly.state import HOST
from lm.config import Config, ModelConfig
from lm.models import get_family
from lm.models.family import KernelSizes
from lm.models.layers import GATED, KERNEL_SCALE
from lm.models.lora import frozen
from lm.models.moe import BIAS, EXPERT_PARAMS, ROUTER, active_share
from lm.ops.attention.capabilities import config_needs, pick_impl
from lm.parallel.rules import axis_size, check_batch, path_names
from lm.parallel.schedules import table


def count_params(params: Any, cfg: ModelConfig | None = None) -> dict[str, int]:
  """Total parameters and non-embedding ones (Kaplan et al.: token and position tables excluded); for a model
  with routed experts (`cfg.moe`), also those one token runs ('active', 'active_non_embedding': k of E experts)."""
  routed = cfg is not None and cfg.moe.num_experts > 0
  total, embedding, inactive = 0, 0, 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = path_names(path)
    if names[-1] in (BIAS, KERNEL_SCALE):
      continue  # a routed layer's selection bias is a statistic the step keeps, an int8 base's scales a storage
      # format: no weights (DeepSeek's buffer; QLoRA's quantization constants)
    size = int(np.prod(leaf.shape))
    total += size
    if 'embedding' in names:
      embedding += size
    if routed:
      inactive += size - round(size * active_share(names[-1], cfg.moe))
  counts = {'total': total, 'non_embedding': total - embedding}
  if routed:
    counts.update(active=total - inactive, active_non_embedding=total - embedding - inactive)
  if cfg is not None and cfg.lora.rank:
    counts['trained'] = sum(int(np.prod(p.shape)) for p in _trained(params, cfg))
  return counts


def _trained(params: Any, cfg: ModelConfig) -> list[Any]:
  """The params a step trains (under `model.lora`: the adapters and a task head; else all)."""
  fixed = jax.tree.leaves(frozen(params, cfg.lora, get_family(cfg.family).per_sequence_params()))
  return [p for p, f in zip(jax.tree.leaves(params), fixed, strict=True) if not f]


def kernel_sizes(params: Any, cfg: ModelConfig) -> KernelSizes:
  """Sizes of the dense kernels by the tokens they see (see `KernelSizes`); heads per the family record. Routed
  experts count the share a token runs (k of E), their router whole."""
  per_sequence_modules = get_family(cfg.family).per_sequence_params()
  sizes = dict(encoder=0, other=0, cross_kv=0, per_sequence=0)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = path_names(path)
    size = int(np.prod(leaf.shape))
    if names[-1] in EXPERT_PARAMS or names[-1] == ROUTER:
      sizes['other'] += round(size * active_share(names[-1], cfg.moe))
      continue
    if names[-1] != 'kernel':
      continue
    if names[0] in per_sequence_modules:
      sizes['per_sequence'] += size
    elif 'cross_attention' in names and names[-2] in ('key', 'value'):
      sizes['cross_kv'] += size
    elif names[0] == 'encoder':
      sizes['encoder'] += size
    else:
      sizes['other'] += size
  return KernelSizes(**sizes, output=cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0)


def flops_per_sequence(params: Any, cfg: ModelConfig, seq_len: int, causal_attention: str = 'half') -> float:
  """Training FLOPs (forward + backward = 3x forward) of one row of `seq_len` tokens: matmuls only.

  Dense layers cost 2 FLOPs per weight per token they see; attention 2 * 2 * heads * head_dim per
  query-key pair (scores and the weighted sum of values); the family record adds them up for its
  shape (an encoder-decoder row is `seq_len` encoder tokens and its targets). `causal_attention`
  'half' counts only the pairs a causal mask (and a sliding window) allows (what a kernel that skips masked
  blocks does), 'full' the whole square (what dense XLA attention computes).
  """
  if causal_attention not in ('half', 'full'):
    raise ValueError(f'causal_attention={causal_attention!r}: choose half or full')
  w = cfg.sliding_window
  share = len(cfg.global_layer_indices) / cfg.num_layers  # of the layers, the global ones among windowed

  def half(n: int) -> float:  # the pairs a causal mask allows; in a window, each query sees at most w keys
    windowed = n * n / 2 if not w or w >= n else w * n - w * w / 2
    return share * n * n / 2 + (1 - share) * windowed
  pairs = half if causal_attention == 'half' else (lambda n: n * n)
  forward = get_family(cfg.family).forward_flops(kernel_sizes(params, cfg), cfg, seq_len, pairs)
  return 3.0 * forward


def flops_per_token(params: Any, cfg: ModelConfig, seq_len: int, causal_attention: str = 'half') -> float:
  """`flops_per_sequence` per row token (the tokens the train loop counts): for a decoder, 6N + attention."""
  return flops_per_sequence(params, cfg, seq_len, causal_attention) / seq_len


def mfu(tokens_per_sec: float, flops_token: float, num_devices: int, peak: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the mesh's peak; None without a known peak."""
  if not peak:
    return None
  return tokens_per_sec * flops_token / (peak * num_devices)


def shard_bytes(tree: Any, memory: str = 'device') -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings, in its own memory ('device') or in
  the host memory it addresses ('pinned_host': offloaded state)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    if (getattr(sharding, 'memory_kind', None) == HOST) != (memory == HOST):
      continue
    shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
    total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
  return total


def cache_bytes_per_token(cfg: ModelConfig) -> int:
  """Bytes the KV-cached decode keeps per token of context over all layers (in the compute dtype): each layer's
  keys and values, or under latent attention (`model.mla`) its latent and rotated key part alone. A layer that
  is always windowed stops growing at the window; this counts a context within it."""
  if cfg.mla.kv_lora_rank:
    per_layer = cfg.mla.kv_lora_rank + cfg.mla.rope_head_dim
  else:
    per_layer = cfg.resolved_kv_heads * (cfg.resolved_head_dim + cfg.value_head_dim)
  return per_layer * cfg.num_layers * compute_bytes(cfg)


def compute_bytes(cfg: ModelConfig) -> int:
  """Bytes of one activation element in the compute dtype."""
  return 4 if cfg.execution.dtype == 'float32' else 2


def saved_per_token(cfg: ModelConfig, tensor: int) -> dict[str, float]:
  """Bytes per token and layer of the tensors remat saves by name (what model.execution.offload can move to the
  host): full remat's layer input, projections' five outputs; empty for the other policies."""
  width = compute_bytes(cfg)
  hd = cfg.num_heads * cfg.resolved_head_dim
  kv = cfg.resolved_kv_heads * cfg.resolved_head_dim
  if cfg.execution.remat == 'full':
    return {'layer_input': cfg.d_model * width}
  if cfg.execution.remat == 'projections':
    return {'query_proj': hd / tensor * width, 'key_proj': kv / tensor * width, 'value_proj': kv / tensor * width,
            'attention_out': cfg.d_model * width, 'mlp_out': cfg.d_model * width}
  return {}


def _mlp_per_token(cfg: ModelConfig) -> float:
  """Elements per token of one layer's MLP activations (its widest kind, dense or routed): the hidden before and
  after the activation (2 or 3 widths), a K-th of it with `model.execution.mlp_chunks=K`; a routed layer's k copies
  of the token and their outputs besides."""
  gates = 3 if cfg.activation in GATED else 2
  chunks = cfg.execution.mlp_chunks
  dense = cfg.resolved_d_ff * gates / chunks
  m = cfg.moe
  if not m.num_experts:
    return dense
  width = m.expert_d_ff or cfg.resolved_d_ff
  shared = m.shared_d_ff or m.shared_experts * width
  routed = (m.experts_per_token * width + shared) * gates / chunks + 2 * m.experts_per_token * cfg.d_model
  return max(routed, dense if any(not m.routed(i) for i in range(cfg.num_layers)) else 0)


def keeps_probabilities(cfg: ModelConfig, platform: str) -> bool:
  """Whether attention holds the [heads, queries, keys] probabilities: the XLA path does; the kernels (flash,
  splash, cuDNN; `auto` on TPU and GPU) never hold them whole."""
  impl = cfg.execution.attention_impl
  if impl == 'auto':
    impl = pick_impl(platform, config_needs(cfg))
  return impl == 'xla'


def activation_bytes(cfg: ModelConfig, tokens: int, seq_len: int, tensor: int, platform: str = 'tpu') -> int:
  """Rough bytes of activations kept for the backward pass by one device, for `tokens` local tokens (those that
  model.execution.offload moves to the host not counted: `offloaded_bytes`).

  Per layer and token, a pre-LN block keeps its norm inputs/outputs (4d), q, k, v and the attention
  output (2 h dh + 2 kv_heads dh), the MLP's activations (`_mlp_per_token`) and, on the XLA attention path, the
  float32 attention probabilities (heads * seq). Remat keeps less but recomputes one layer at a time. With
  `gathered_layer_bytes` and the state, against compiles for v5p: mixtral_8x7b at 8 to 27 rows within 6%,
  llama2_7b at 32 to 68 within 6% (tests/planning/test_compile.py).
  """
  kept, full_layer, output = _per_token(cfg, seq_len, tensor, platform)
  if cfg.execution.remat == 'none':  # every layer's activations are live when the backward pass starts at the loss
    return int(tokens * (kept * cfg.num_layers + output))
  # with remat, what the layers keep, then one layer recomputed or the output layer, not both at once
  return int(tokens * (kept * cfg.num_layers + max(full_layer, output)))


def _per_token(cfg: ModelConfig, seq_len: int, tensor: int, platform: str) -> tuple[float, float, float]:
  """Bytes per token: what a layer keeps for its backward pass, a whole layer's activations (one recomputed), and
  the output layer's (its logits and their gradient, or a tile's)."""
  width = compute_bytes(cfg)
  hd = cfg.num_heads * cfg.resolved_head_dim
  kv = cfg.resolved_kv_heads * cfg.resolved_head_dim
  probabilities = cfg.num_heads * seq_len * 4 / tensor if keeps_probabilities(cfg, platform) else 0
  full_layer = (4 * cfg.d_model + (2 * hd + 2 * kv + _mlp_per_token(cfg)) / tensor) * width + probabilities
  saved = saved_per_token(cfg, tensor)
  kept = {
    'none': full_layer,
    'dots': (2 * cfg.d_model + (hd + 2 * kv + cfg.resolved_d_ff) / tensor) * width,
  }.get(cfg.execution.remat, sum(v for name, v in saved.items() if name not in cfg.execution.offload))
  logits = 2 * cfg.vocab_size / tensor * 4  # float32 logits and their gradient, per token
  if cfg.execution.loss_chunk:  # one tile's of them, and the hidden states' gradient computed with them
    return kept, full_layer, min(cfg.execution.loss_chunk, seq_len) / seq_len * logits + cfg.d_model * 4
  return kept, full_layer, logits


def pipelined_activation_bytes(config: Config, mesh: Mesh) -> int:
  """Rough bytes of activations one device keeps through a step pipelined over the mesh's stages.

  A stage's layers keep what remat saves at every tick of the forward loop (GPipe's m + p - 1, circular's m r + p -
  1, each running a repeat's share of the stage's layers); 1F1B keeps its stash (the schedule's most in flight) of
  stage inputs and recomputes the stage for one microbatch at a time. Besides: the stage's buffers of microbatch
  inputs and outputs, and one layer recomputed or the output layer, which GPipe and circular apply to the whole
  batch after the stack and 1F1B to a microbatch in the last stage."""
  cfg, t, p = config.model, config.train, config.model.execution.pipeline
  stages, m, seq_len = mesh.shape['stage'], t.microbatches, config.data.seq_len
  inner = t.global_batch // m // (axis_size(mesh, 'batch') // stages) * seq_len  # a microbatch's tokens a device
  kept, full_layer, output = _per_token(cfg, seq_len, axis_size(mesh, 'heads'), mesh.devices.flat[0].platform)
  layers = -(-cfg.num_layers // (stages * p.repeats)) * p.repeats  # a stage's, padded
  stream = cfg.d_model * compute_bytes(cfg)
  if p.schedule == '1f1b':
    held = max(table('1f1b', stages, m).in_flight())
    stack = held * stream + layers * kept + (m + 2) * stream  # stash; one stage recomputed; inputs, two sends
    return int(inner * (stack + max(full_layer, output)))
  ticks = table(p.schedule, stages, m, p.repeats).forward_ticks
  buffers = (3 if p.schedule == 'circular' else 2) * m  # inputs, outputs (and circular's parked microbatches)
  whole = t.global_batch // axis_size(mesh, 'batch') * seq_len  # the output layer's tokens a device
  return int(inner * (ticks * layers / p.repeats * kept + buffers * stream + full_layer) + whole * output)


def offloaded_bytes(cfg: ModelConfig, tokens: int, tensor: int) -> int:
  """Bytes of saved activations model.execution.offload keeps in host memory for one device's `tokens`."""
  saved = saved_per_token(cfg, tensor)
  return int(tokens * cfg.num_layers * sum(v for name, v in saved.items() if name in cfg.execution.offload))


def gathered_layer_bytes(cfg: ModelConfig, params: Any, mesh: Mesh) -> int:
  """Where the parameters shard over the batch's devices (fsdp), one layer's weights gathered whole in the compute
  dtype and its float32 gradient before the reduce-scatter: a layer's share of the non-embedding parameters."""
  if axis_size(mesh, 'embed') == 1:
    return 0
  width = compute_bytes(cfg)
  per_layer = count_params(params)['non_embedding'] / cfg.num_layers / axis_size(mesh, 'heads')
  return int(per_layer * (width + 4))


def estimate_memory(config: Config, abstract_state: Any, mesh: Mesh) -> dict[str, int]:
  """Per-device bytes: parameters, optimizer state and gradients exactly (from the shardings), activations roughly.

  How far the batch and the heads split comes from the logical-axis rules for `mesh`.
  """
  t = config.train
  check_batch(mesh, t.global_batch, t.microbatches)
  tokens = t.global_batch // t.microbatches // axis_size(mesh, 'batch') * config.data.seq_len
  params = shard_bytes(abstract_state.params) + shard_bytes(abstract_state.params, HOST)  # in for the step
  trained = _trained(abstract_state.params, config.model)
  out = {
    'params': params,
    'optimizer': shard_bytes(abstract_state.opt_state),  # none where train.optimizer_offload keeps it on the host
    'gradients': shard_bytes(trained) + shard_bytes(trained, HOST),  # none of what model.lora freezes
    'one layer gathered': gathered_layer_bytes(config.model, abstract_state.params, mesh),
    'activations (estimate)': pipelined_activation_bytes(config, mesh) if mesh.shape.get('stage', 1) > 1 else
    activation_bytes(config.model, tokens, config.data.seq_len, axis_size(mesh, 'heads'),
                     mesh.devices.flat[0].platform),
  }
  out['total (estimate)'] = sum(out.values())
  host = shard_bytes(abstract_state, HOST) + offloaded_bytes(config.model, tokens, axis_size(mesh, 'heads'))
  if host:  # offloaded state and saved activations
    out['host (estimate)'] = host
  return out
