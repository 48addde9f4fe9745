"""Typed, validated, frozen run configuration: presets in YAML plus `key.sub=value` overrides."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from etils import epath

from lm.mesh_axes import MESH_AXES, axis_size, in_slice_axes

CONFIG_DIR = Path(__file__).resolve().parent.parent / 'configs'


class ConfigError(ValueError):
  """A configuration problem a researcher can fix; the message names the field and the fix."""


# Every enumerated field is a Literal: loading rejects other values and lists these (`_coerce`).
# Families and tokenizers are open sets checked against their registries in `validate`.
Position = Literal['learned', 'sinusoidal', 'relative', 'rotary', 'none']  # relative: T5 buckets; rotary: RoPE
RopeScaling = Literal['none', 'linear', 'llama3', 'yarn']
Norm = Literal['layernorm', 'rmsnorm', 'nonparametric_layernorm']  # the last: no scale or bias (OLMo)
# sandwich: a norm before and after each branch (Gemma 2); post_branch: a norm of each branch's output before it is
# added (OLMo 2's reordered norm); post: a norm after each addition (BERT)
NormPosition = Literal['pre', 'post', 'sandwich', 'post_branch']
QkNormScope = Literal['head', 'all_heads']
# clamped_swiglu: GPT-OSS's (x Wu clamped, + 1) * g sigmoid(alpha g) of g = x Wg clamped above (model.swiglu_*)
Activation = Literal['gelu', 'gelu_tanh', 'relu', 'silu', 'geglu', 'geglu_tanh', 'swiglu', 'reglu', 'clamped_swiglu']
ComputeDtype = Literal['float32', 'bfloat16', 'float16']
ParamDtype = Literal['float32', 'bfloat16']
AttentionImpl = Literal['xla', 'flash', 'tpu_flash', 'tpu_splash', 'cudnn', 'auto']  # flash: our Pallas kernel
Remat = Literal['none', 'full', 'dots', 'projections']
PipelineSchedule = Literal['gpipe', 'circular', '1f1b']
Quantization = Literal['none', 'int8']
# The activations a layer names for remat (`jax.ad_checkpoint.checkpoint_name`): its input, and the projection
# outputs remat=projections keeps; model.execution.offload moves any of them to host memory instead.
OFFLOADABLE = ('layer_input', 'query_proj', 'key_proj', 'value_proj', 'attention_out', 'mlp_out')
Init = Literal['scaled_normal', 'fan_in']
Parametrization = Literal['standard', 'mup']  # mup: Yang et al. 2022 (see lm.models.parametrization)
Source = Literal['embedded', 'text', 'jsonl', 'parquet', 'hf', 'tokenized', 'tfds']
Schedule = Literal['cosine', 'linear', 'constant', 'wsd']  # wsd: warmup, stable at the peak, then a decay
DecayShape = Literal['linear', 'sqrt', 'cosine']  # sqrt: 1 - sqrt(progress) (Hägele et al. 2024)
CausalFlops = Literal['half', 'full']
NonFinite = Literal['stop', 'skip']
OnSpike = Literal['off', 'skip', 'rollback']
Divergence = Literal['forward', 'reverse']  # forward: KL(teacher || student); reverse: KL(student || teacher)
Tracker = Literal['tensorboard', 'wandb']
RampUnit = Literal['steps', 'tokens']
RampRate = Literal['sqrt', 'linear', 'none']  # the learning rate times (batch / train.global_batch)^(1/2 | 1 | 0)
RampGrowth = Literal['accumulate', 'rows']  # more microbatches of the same rows, or more rows per microbatch
OptimizerName = Literal['adamw', 'adafactor', 'lion', 'muon', 'schedule_free_adamw']
RouterScore = Literal['softmax', 'sigmoid']  # sigmoid: DeepSeek-V3
MoeCompute = Literal['dropless', 'capacity', 'dense']  # dense: every expert on every token (a reference)
BalanceOver = Literal['layer', 'model']  # each layer's balance loss averaged, or the statistics of all layers' tokens


@dataclass(frozen=True)
class RopeConfig:
  """Rotary positions (model.position=rotary) and their scaling for contexts beyond the trained one
  (`lm.models.rope`): linear (positions / factor), llama3 (Llama 3.1's frequency-dependent factor), yarn (by
  frequency, with YaRN's attention temperature)."""
  theta: float = 10000.0  # base wavelength
  scaling: RopeScaling = 'none'  # linear, llama3 or yarn stretch the rotation for longer contexts; none: as trained
  factor: float = 1.0  # linear, llama3, yarn: how many times the original context
  original_max_len: int = 0  # llama3, yarn: the context the model was first trained at
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3
  beta_fast: float = 32.0  # yarn: rotations over the original context above which frequencies stay
  beta_slow: float = 1.0  # yarn: ... below which they are divided by factor
  truncate: bool = True  # yarn: the ramp's ends rounded out to whole features (transformers' truncate; GPT-OSS: false)
  attention_factor: float | None = None  # yarn: cos and sin times this; default 0.1 ln(factor) + 1, or with both
  # mscales mscale(mscale) / mscale(mscale_all_dim), mscale(m) = 0.1 m ln(factor) + 1
  mscale: float | None = None  # yarn: DeepSeek's mscale (with mscale_all_dim)
  mscale_all_dim: float | None = None  # yarn: DeepSeek's mscale_all_dim
  scale_logits: bool = False  # yarn: the attention logits also times mscale(mscale_all_dim)^2 (DeepSeek's MLA)
  interleaved: bool = False  # feature pairs (2i, 2i + 1) rotate together (DeepSeek), not (i, i + half)
  fraction: float = 1.0  # the share of each head's features that rotate (GPT-NeoX's rotary_pct); the rest pass
  local_theta: float = 0.0  # > 0: windowed layers rotate with this base wavelength, unscaled, while global layers
  # keep theta and the scaling (Gemma 3: 1e4 beside 1e6 x 8); 0: every layer alike

  def local(self) -> RopeConfig:
    """The windowed layers' rotation: `local_theta`, unscaled (Gemma 3), or this one when it is unset."""
    if not self.local_theta:
      return self
    return dataclasses.replace(self, theta=self.local_theta, scaling='none', factor=1.0, local_theta=0.0)

  def rotated(self, head_dim: int) -> int:
    """How many of a head's features rotate: the first `fraction` of them (transformers' int(head_dim x it))."""
    return int(head_dim * self.fraction)

  def check(self, position: str, head_dim: int) -> None:
    if position == 'rotary' and self.fraction == 1 and head_dim % 2:
      raise ConfigError(f'rotary positions rotate pairs of features, but the head dim is {head_dim}; '
                        f'use an even model.head_dim')
    if position == 'rotary' and (not 0 < self.fraction <= 1 or self.rotated(head_dim) % 2
                                 or not self.rotated(head_dim)):
      raise ConfigError(f'model.rope.fraction={self.fraction} rotates {self.rotated(head_dim)} of the head dim '
                        f'{head_dim} features; it needs an even number of them above 0 (Pythia: 0.25)')
    if position != 'rotary' and self.fraction != 1:
      raise ConfigError(f'model.rope.fraction={self.fraction} applies to rotary positions, but '
                        f'model.position={position}; set model.position=rotary or remove it')
    if self.local_theta < 0 or (self.local_theta and position != 'rotary'):
      raise ConfigError(f'model.rope.local_theta={self.local_theta} is the windowed layers\' rotary base wavelength: '
                        f'it must be >= 0 and needs model.position=rotary')
    if (self.mscale is not None or self.mscale_all_dim is not None or self.scale_logits
        or not self.truncate) and self.scaling != 'yarn':
      raise ConfigError(f'model.rope.mscale, mscale_all_dim, scale_logits and truncate belong to YaRN, but '
                        f'model.rope.scaling={self.scaling}; set model.rope.scaling=yarn or drop them')
    if self.scaling == 'none':
      return
    if position != 'rotary':
      raise ConfigError(f'model.rope.scaling={self.scaling} scales rotary positions, but model.position={position}; '
                        f'set model.position=rotary or model.rope.scaling=none')
    if self.factor < 1:
      raise ConfigError(f'model.rope.factor={self.factor} must be >= 1 (how many times the trained context)')
    if self.scaling in ('llama3', 'yarn') and self.original_max_len <= 0:
      raise ConfigError(f'model.rope.scaling={self.scaling} needs model.rope.original_max_len, the context the '
                        f'model was first trained at (Llama 3.1: 8192)')
    if self.scaling == 'llama3' and not self.high_freq_factor > self.low_freq_factor > 0:
      raise ConfigError(f'model.rope.high_freq_factor={self.high_freq_factor} must exceed '
                        f'model.rope.low_freq_factor={self.low_freq_factor} > 0 (Llama 3.1: 4 and 1)')


@dataclass(frozen=True)
class MupConfig:
  """μP's base shapes (model.parametrization=mup, `lm.models.parametrization`)."""
  base_width: int = 0  # the d_model the hyperparameters were tuned at (width multiplier d_model / it)
  base_head_dim: int | None = None  # the base model's head dim; default head_dim x base_width / d_model
  zero_init: bool = False  # the query projections and an untied output layer start at zero

  def check(self, parametrization: str, d_model: int) -> None:
    if parametrization == 'standard':
      if self != MupConfig():
        raise ConfigError('model.mup fields are set but model.parametrization=standard; set '
                          'model.parametrization=mup or drop them')
    elif self.base_width <= 0 or (self.base_head_dim is not None and self.base_head_dim <= 0):
      raise ConfigError(f'model.parametrization=mup needs model.mup.base_width > 0 (the width the hyperparameters '
                        f'were tuned at, e.g. model.mup.base_width={d_model}) and a positive '
                        f'model.mup.base_head_dim if set')


@dataclass(frozen=True)
class MlaConfig:
  """Multi-head latent attention (DeepSeek-V2/V3, `lm.models.mla`): keys and values of every head expanded from one
  normalised latent per token (`kv_lora_rank` > 0 turns it on), queries from their own (`q_lora_rank`) or a plain
  projection. Each query/key head (`model.head_dim` features) is `head_dim - rope_head_dim` unrotated features and
  `rope_head_dim` rotated ones, the latter's key shared by every head; values have `v_head_dim` features."""
  kv_lora_rank: int = 0  # the latent's width (DeepSeek-V3: 512); 0: attention as usual
  q_lora_rank: int = 0  # > 0: queries through a normalised latent of this width (1536); 0: one projection
  rope_head_dim: int = 64  # the rotated part of each query/key head (qk_rope_head_dim)
  v_head_dim: int | None = None  # each value head's features; default model.head_dim

  def check(self, m: ModelConfig) -> None:
    if not self.kv_lora_rank:
      if self != MlaConfig():
        raise ConfigError('model.mla fields are set but model.mla.kv_lora_rank=0; set the latent\'s width '
                          '(DeepSeek-V3: 512) or drop them')
      return
    if self.kv_lora_rank < 0 or self.q_lora_rank < 0 or (self.v_head_dim is not None and self.v_head_dim <= 0):
      raise ConfigError(f'model.mla.kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank} and '
                        f'v_head_dim={self.v_head_dim} must be positive (q_lora_rank 0: no query latent)')
    if not 0 < self.rope_head_dim < m.resolved_head_dim or self.rope_head_dim % 2:
      raise ConfigError(f'model.mla.rope_head_dim={self.rope_head_dim} is the rotated part of each '
                        f'{m.resolved_head_dim}-feature query/key head: an even number above 0 and below '
                        f'model.head_dim')
    clashes = {'model.position': m.position != 'rotary', 'model.num_kv_heads': m.resolved_kv_heads != m.num_heads,
               'model.qk_norm': m.qk_norm, 'model.clip_qkv': bool(m.clip_qkv), 'model.qkv_bias': m.qkv_bias,
               'model.rope.fraction': m.rope.fraction != 1}
    named = [k for k, on in clashes.items() if on]
    if named:
      raise ConfigError(f'model.mla (latent attention) sets the heads itself: it needs model.position=rotary and '
                        f'leaves {", ".join(named)} as default; drop them')


@dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (Hu et al. 2021; `lm.models.layers.DenseGeneral`): each projection named in `targets` adds
  (alpha / rank) x (x A) B to its output (rsLoRA: alpha / sqrt(rank)), A [in, rank] uniform in +-1/sqrt(in) and B
  [rank, out] zero at first, as PEFT inits them; every other param is frozen but a fine-tuning task head's (the
  optimizer keeps no state of the frozen ones)."""
  rank: int = 0  # r; 0: no adapters, every param trains
  alpha: float = 8.0  # lora_alpha
  dropout: float = 0.0  # on the adapters' input (lora_dropout), while training
  targets: tuple[str, ...] = ('query', 'key', 'value', 'out')  # projections by module name (attention: query, key,
  # value, out; MLPs: wi or wi_0 and wi_1, wo; latent attention: query_down, query_up, kv_down; routed experts: experts)
  rslora: bool = False  # scale by alpha / sqrt(rank) (Kalajdzievski 2023; PEFT's use_rslora)

  @property
  def scale(self) -> float:
    return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

  def check(self) -> None:
    if not self.rank:
      if self != LoraConfig():
        raise ConfigError('model.lora fields are set but model.lora.rank=0 (no adapters); set model.lora.rank '
                          '(e.g. 8) or drop them')
      return
    if self.rank < 0 or not self.targets or not 0 <= self.dropout < 1:
      raise ConfigError(f'model.lora.rank={self.rank} must be positive, model.lora.targets={list(self.targets)} '
                        f'non-empty and model.lora.dropout={self.dropout} in [0, 1)')


@dataclass(frozen=True)
class MtpConfig:
  """Multi-token prediction (DeepSeek-V3 section 2.2, `lm.models.mtp`): `depth` modules after a causal decoder's
  stack, the k-th predicting the token k + 1 places past each input from the (k - 1)-th's states and the embedding
  of the token k places on, through one more block of the family's and the shared output layer. Their mean loss
  times `weight` joins the training loss; each is logged as `mtp/loss_k`."""
  depth: int = 0  # modules (num_nextn_predict_layers); 0: none
  weight: float = 0.3  # the mean MTP loss's weight (DeepSeek-V3: 0.3, then 0.1 for the last 4.8T tokens)

  def check(self) -> None:
    if self.depth < 0 or self.weight < 0:
      raise ConfigError(f'model.mtp.depth={self.depth} and model.mtp.weight={self.weight} must be >= 0 '
                        f'(depth 0: no multi-token prediction)')


@dataclass(frozen=True)
class MoeConfig:
  """Routed MLP layers (`lm.ops.moe`): `num_experts` > 0 replaces the MLP of the chosen layers by experts of which
  each token uses `experts_per_token` (HF names in the comments)."""
  num_experts: int = 0  # num_local_experts / num_experts; 0: every layer's MLP is dense
  experts_per_token: int = 2  # num_experts_per_tok (top-k)
  expert_d_ff: int | None = None  # each expert's hidden width (moe_intermediate_size); default model.d_ff
  router: RouterScore = 'softmax'
  normalize: bool = True  # the chosen weights divided by their sum (norm_topk_prob)
  routed_scale: float = 1.0  # the chosen weights times this (routed_scaling_factor)
  groups: int = 1  # > 1: experts in equal groups, tokens choose within the best top_groups (n_group, topk_group)
  top_groups: int = 1  # groups > 1: the groups each token chooses experts within (topk_group)
  shared_experts: int = 0  # experts every token uses besides its chosen ones (n_shared_experts)
  shared_d_ff: int | None = None  # their hidden width together (shared_expert_intermediate_size); default
  # shared_experts x expert_d_ff
  shared_gate: bool = False  # the shared experts' output times a sigmoid gate of the token (Qwen2-MoE)
  first_dense: int = 0  # the first n layers keep a dense MLP (first_k_dense_replace)
  every: int = 1  # layers i with (i + 1) % every == 0 are routed (decoder_sparse_step)
  dense_layers: tuple[int, ...] = ()  # and these stay dense (mlp_only_layers)
  compute: MoeCompute = 'dropless'
  capacity_factor: float = 1.25  # compute=capacity: slots per expert, times an even share of the choices
  expert_buffer: float = 0.0  # > 0: under expert parallelism each device receives at most this times an even
  # share of the token copies, the rest dropped (MaxText's ragged_buffer_factor); 0: room for every copy (dropless)
  balance_loss: float = 0.01  # the load-balance loss's weight in the training loss (router_aux_loss_coef)
  balance_over: BalanceOver = 'layer'  # model: transformers' aux_loss (every layer's tokens pooled)
  z_loss: float = 0.0  # the router z-loss's weight
  bias_rate: float = 0.0  # > 0: aux-loss-free balancing (DeepSeek-V3): each layer's selection bias per expert,
  # outside the optimizer, moves this much after each step toward an even load

  def routed(self, layer: int) -> bool:
    """Whether `layer` (0-based) has experts."""
    return (self.num_experts > 0 and layer >= self.first_dense and (layer + 1) % self.every == 0
            and layer not in self.dense_layers)

  def check(self, num_layers: int) -> None:
    if self.num_experts == 0:
      if self != MoeConfig():
        raise ConfigError('model.moe fields are set but model.moe.num_experts=0 (no experts); set '
                          'model.moe.num_experts or drop them')
      return
    if self.num_experts < 0 or not 0 < self.experts_per_token <= self.num_experts:
      raise ConfigError(f'model.moe.experts_per_token={self.experts_per_token} must lie in [1, model.moe.num_experts='
                        f'{self.num_experts}]')
    if self.compute == 'capacity' and self.capacity_factor <= 0:
      raise ConfigError(f'model.moe.capacity_factor={self.capacity_factor} must be > 0 (1.25: a quarter more slots '
                        f'than an even share)')
    if self.groups < 1 or self.num_experts % self.groups or not 1 <= self.top_groups <= self.groups or (
        self.groups > 1 and self.experts_per_token > self.top_groups * self.num_experts // self.groups):
      raise ConfigError(f'model.moe.groups={self.groups} must divide model.moe.num_experts={self.num_experts}, and '
                        f'model.moe.top_groups={self.top_groups} groups must hold the '
                        f'{self.experts_per_token} experts each token chooses')
    if min(self.every, self.first_dense + 1) < 1 or self.shared_experts < 0 or not any(
        self.routed(i) for i in range(num_layers)):
      raise ConfigError(f'model.moe.every={self.every}, first_dense={self.first_dense} and dense_layers='
                        f'{list(self.dense_layers)} leave no routed layer among {num_layers}; route at least one')
    if min(self.balance_loss, self.z_loss, self.bias_rate, self.routed_scale, self.expert_buffer) < 0:
      raise ConfigError('model.moe.balance_loss, z_loss, bias_rate, routed_scale and expert_buffer must be >= 0')


@dataclass(frozen=True)
class PipelineConfig:
  """The layer stack split over the `stage` mesh axis (mesh.stage > 1): each train step runs its
  `train.microbatches` through the stages in one fill and drain."""
  # gpipe | circular: the stages passed `repeats` times (a smaller bubble) | 1f1b: each microbatch's backward as soon
  # as it leaves the last stage, which takes the loss, so a stage holds at most p microbatches' inputs, not m
  schedule: PipelineSchedule = 'gpipe'
  repeats: int = 1  # circular: passes through the stages, each stage holding that many runs of layers
  gather_once: bool = False  # a stage's weights gathered whole over fsdp once a step, before the tick loop, rather
  # than each layer's at each tick (a stage's params whole on each of its devices: for models whose stages fit)

  def check(self) -> None:
    if self.repeats < 1:
      raise ConfigError(f'model.execution.pipeline.repeats={self.repeats} must be >= 1')
    if self.schedule != 'circular' and self.repeats != 1:
      raise ConfigError(f'model.execution.pipeline.repeats={self.repeats} needs schedule=circular '
                        f'({self.schedule} passes the stages once); set model.execution.pipeline.schedule=circular '
                        f'or repeats=1')


@dataclass(frozen=True)
class ExecutionConfig:
  """How the step computes, not which params it trains: a resume may change any of these (another slice, a memory
  fix), while every other model field must match the checkpoint's."""
  dtype: ComputeDtype = 'float32'  # compute dtype; params stay in model.param_dtype
  attention_impl: AttentionImpl = 'xla'  # tpu_flash / tpu_splash: JAX's kernels; auto: best for the platform
  attention_block_q: int = 128  # flash block sizes
  attention_block_k: int = 128
  scan_layers: bool = True  # the layers as one scanned layer (one trace and compile of a layer)
  remat: Remat = 'none'  # none | full: each layer recomputed in the backward pass from its input | dots |
  # projections: the attention projections and the branch outputs kept
  offload: tuple[str, ...] = ()  # activations remat saves in host memory (pinned_host) until the backward pass
  loss_chunk: int = 0  # > 0: output layer and token loss in tiles of this many positions, the [tokens, vocab]
  # logits never whole (their gradients computed tile by tile in the forward pass); 0: untiled
  mlp_chunks: int = 1  # > 1: each dense MLP runs over this many interleaved slices of the positions in turn, each
  # rematerialised, so one slice's [tokens, d_ff] intermediates are live at a time (same values; lengths it divides)
  pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # with mesh.stage > 1: the stages' schedule

  def check(self) -> None:
    self.pipeline.check()
    if self.mlp_chunks < 1:
      raise ConfigError(f'model.execution.mlp_chunks={self.mlp_chunks} must be >= 1 (1: the MLP over all positions '
                        f'at once)')
    if self.loss_chunk < 0:
      raise ConfigError(f'model.execution.loss_chunk={self.loss_chunk} must be >= 0 (0: the output layer untiled)')
    unknown = [name for name in self.offload if name not in OFFLOADABLE]
    if unknown:
      raise ConfigError(f'model.execution.offload names {", ".join(unknown)}; choose among: {", ".join(OFFLOADABLE)}')
    if self.offload and self.remat not in ('full', 'projections'):
      raise ConfigError(f'model.execution.offload moves to host memory what remat keeps for the backward pass; with '
                        f'remat={self.remat} set model.execution.remat=full (layer inputs) or projections')
    if self.attention_block_q <= 0 or self.attention_block_k <= 0:
      raise ConfigError(f'model.execution.attention_block_q={self.attention_block_q} and attention_block_k='
                        f'{self.attention_block_k} must be positive (the flash kernels\' block sizes)')


@dataclass(frozen=True)
class ModelConfig:
  family: str = 'gpt'  # a name in lm.models.FAMILIES: gpt | bert | t5 | llama | mistral | qwen2 | qwen3 | gemma2 |
  # gpt_neox | olmo | olmo2 | olmo3 | mixtral | qwen2_moe | qwen3_moe | olmoe
  vocab_size: int = 264  # model vocabulary; may exceed the tokenizer's to pad for sharding
  d_model: int = 256  # the residual stream's width
  num_layers: int = 4  # encoder layers for t5
  num_decoder_layers: int | None = None  # t5 only; default num_layers
  num_heads: int = 4  # attention (query) heads
  num_kv_heads: int | None = None  # grouped-query attention: key/value heads, dividing num_heads (default num_heads)
  head_dim: int | None = None  # default d_model // num_heads
  d_ff: int | None = None  # default 4 * d_model
  max_len: int = 256  # rows of the learned position table
  position: Position = 'learned'
  rope: RopeConfig = field(default_factory=RopeConfig)  # rotary positions and their scaling
  relative_buckets: int = 32  # T5's relative position buckets
  relative_max_distance: int = 128  # T5: distances beyond this share the last bucket
  type_vocab_size: int = 0  # BERT token-type (segment A/B) embeddings when > 0
  scale_attention: bool = True  # divide logits by sqrt(head_dim) (T5 does not)
  init: Init = 'scaled_normal'  # N(0, init_std), residual outputs / sqrt(2 layers) | fan_in (Mesh-TF, T5)
  nsp: bool = False  # BERT: pretrain on next-sentence pairs with an NSP head beside masked LM
  num_labels: int = 0  # fine-tuning: outputs of the family's sequence classifier (1: a regression score); 0: none
  norm: Norm = 'layernorm'
  norm_eps: float = 1e-5
  norm_position: NormPosition = 'pre'
  activation: Activation = 'gelu'  # the MLP's; the *glu ones are gated (two input projections)
  swiglu_alpha: float = 1.702  # clamped_swiglu: the gate's sigmoid slope
  swiglu_limit: float = 7.0  # clamped_swiglu: the gate clamped above, the up projection to [-limit, limit]
  use_bias: bool = True  # biases on every projection and norm (routed experts and their router too)
  qkv_bias: bool = False  # biases on the query, key and value projections even without use_bias (Qwen2)
  qk_norm: bool = False  # RMSNorm of the queries and keys before the rotation (eps norm_eps)
  qk_norm_scope: QkNormScope = 'head'  # over each head's features (Qwen3) or all heads' at once (OLMo 2)
  clip_qkv: float = 0.0  # > 0: query, key and value projections clipped to [-c, c] (OLMo)
  sliding_window: int = 0  # > 0: causal self-attention sees the keys fewer than this many positions back (Mistral)
  global_every: int = 0  # with sliding_window: every n-th layer (the n-th, 2n-th, ...) attends globally (Gemma 2: 2)
  global_layers: tuple[int, ...] = ()  # or these layers (0-based) attend globally: any pattern (an HF layer_types)
  attn_logit_softcap: float = 0.0  # > 0: attention logits through c * tanh(logits / c) (Gemma 2: 50)
  final_logit_softcap: float = 0.0  # > 0: output logits soft-capped so, in the loss and in sampling (Gemma 2: 30)
  attention_sinks: bool = False  # a learned logit per query head joins each softmax's denominator, with no value
  # (GPT-OSS's sinks)
  attention_scale_dim: int | None = None  # logits times this^-0.5 instead of head_dim^-0.5 (Gemma 2's
  # query_pre_attn_scalar)
  norm_plus_one: bool = False  # every RMSNorm (query/key norms too) scales by (1 + w), w starting at 0 (Gemma)
  parallel_residual: bool = False  # attention and MLP both read the block's input, their outputs added to it
  # (GPT-J, GPT-NeoX's use_parallel_residual)
  quantization: Quantization = 'none'  # int8: the attention and MLP projections' forward matmuls in int8; with
  # model.lora their frozen kernels are also stored in int8 with per-channel scales (QLoRA's way)
  tie_embeddings: bool = True  # the output layer is the token embedding transposed
  scale_embeddings: bool = False  # token embeddings times sqrt(d_model) (Vaswani et al. 3.4); a tied T5 output
  # layer then reads the table without its d_model^-0.5 rescale
  dropout: float = 0.0  # dropout on the embeddings and each branch's output
  attention_dropout: float = 0.0  # dropout on the attention weights (the xla path only)
  init_std: float = 0.02  # the normal init's standard deviation
  param_dtype: ParamDtype = 'float32'  # the params' (and their optimizer state's); compute in execution.dtype
  execution: ExecutionConfig = field(default_factory=ExecutionConfig)  # how the step computes
  parametrization: Parametrization = 'standard'
  mup: MupConfig = field(default_factory=MupConfig)  # parametrization=mup: its base shapes
  moe: MoeConfig = field(default_factory=MoeConfig)  # routed experts in place of some layers' MLP
  mla: MlaConfig = field(default_factory=MlaConfig)  # multi-head latent attention (DeepSeek) in place of q/k/v
  mtp: MtpConfig = field(default_factory=MtpConfig)  # modules predicting tokens further ahead (DeepSeek-V3)
  lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters; the rest frozen

  def with_execution(self, **changes: Any) -> ModelConfig:
    """This model computed otherwise (`ExecutionConfig`'s fields), its params unchanged."""
    return dataclasses.replace(self, execution=dataclasses.replace(self.execution, **changes))

  @property
  def base_width(self) -> int:
    """The width every width-dependent constant is taken at: the μP base, else d_model itself."""
    return self.mup.base_width if self.parametrization == 'mup' else self.d_model

  @property
  def embedding_scale(self) -> float:
    return self.base_width ** 0.5 if self.scale_embeddings else 1.0

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def resolved_kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def value_head_dim(self) -> int:
    """Each value head's features: the query/key heads' but under latent attention (`model.mla.v_head_dim`)."""
    return (self.mla.kv_lora_rank and self.mla.v_head_dim) or self.resolved_head_dim

  @property
  def resolved_d_ff(self) -> int:
    return self.d_ff or 4 * self.d_model

  @property
  def global_layer_indices(self) -> tuple[int, ...]:
    """The layers that attend globally while the others keep `sliding_window` (`global_layers` or every
    `global_every`-th); () without a window pattern."""
    if self.global_layers:
      return tuple(sorted(self.global_layers))
    every = self.global_every
    return tuple(i for i in range(self.num_layers) if every and (i + 1) % every == 0)

  @property
  def resolved_decoder_layers(self) -> int:
    return self.num_decoder_layers or self.num_layers


# Device mesh sizes, a field per axis of lm/mesh_axes.py (`slices`: TPU slices joined over the data-center
# network); -1 takes the devices of a slice left over. Which axes exceed 1 picks the strategy.
MeshConfig = dataclasses.make_dataclass(
  'MeshConfig', [(a.attr, int, field(default=a.default)) for a in MESH_AXES] +
  [(a.slices_field, int, field(default=1)) for a in MESH_AXES if a.slices_field], frozen=True)
MeshConfig.__module__ = __name__


@dataclass(frozen=True)
class DataConfig:
  """Where documents come from, how they become tokens, and how the grain pipeline reads them."""
  source: Source = 'embedded'  # embedded (Python's docs and stdlib) | text / jsonl / parquet (local `paths`) |
  # tfds (`name`) | hf (`name`: a local folder save_to_disk wrote, or of data files) | tokenized (`name`: shards
  # lm data tokenize wrote)
  paths: tuple[str, ...] = ()  # globs of local files: UTF-8 text (a document each), JSONL (a document a line;
  # .gz and .zst too) or Parquet (a document a row)
  name: str | None = None  # tfds: dataset with config and version, e.g. c4/en:3.1.0 (prepared as ArrayRecord); hf:
  # the dataset's folder
  data_dir: str | None = None  # tfds: a local path or a gs:// URI, passed through untouched
  train_split: str = 'train'  # tfds splits, and an hf DatasetDict's (a single hf Dataset splits by val_fraction)
  val_split: str = 'validation'  # the held-out split of a tfds or hf source
  text_key: str = 'text'  # the feature (tfds), field (jsonl) or column (parquet, hf) holding the text
  skip_bad_records: bool = False  # jsonl: a line that is not JSON or UTF-8, or lacks text_key, is skipped and logged
  # (with a count) instead of stopping the run
  tokenizer: str = 'byte'  # byte | sentencepiece:PATH | hf:PATH (tokenizer.json or an HF model directory)
  seq_len: int = 256  # tokens per row
  val_fraction: float = 0.02  # held out by a hash of each document's name (seed-independent); text files too few to
  # split that way hold out their last pieces instead; 0: no validation split
  max_chars: int = 2048  # embedded/text: documents cut at line breaks into records of at most this many characters
  streams: int = 16  # record streams read, tokenized and packed side by side, interleaved row by row
  unique_tokens: int = 0  # > 0: train on the source's first documents up to this many tokens, repeated in epochs
  workers: int = 0  # grain worker processes packing and masking; 0: one background thread
  prefetch: int = 8  # batches buffered ahead of the train step
  # Further held-out sets, each read whole (tokenizer, text_key, max_chars and data_dir as above), logged as
  # val/NAME/loss and val/NAME/bpb: NAME=embedded | NAME=text:GLOB | NAME=jsonl:GLOB | NAME=parquet:GLOB[:COLUMN] |
  # NAME=hf:PATH[:SPLIT] | NAME=tokenized:DIR | NAME=tfds:DATASET:SPLIT
  evals: tuple[str, ...] = ()
  # Training documents from several sources (as data.evals writes them; text / jsonl / embedded: their training
  # split by data.val_fraction, tfds: the split named), each packed into its own rows, rows drawn by data.weights
  mixture: tuple[str, ...] = ()
  # Each source's share of training tokens per stage, a stage from a step on: [a=0.7 b=0.3, 1000 a=0.5 b=0.5]
  weights: tuple[str, ...] = ()  # data.mixture's shares in stages: [a=0.5 b=0.5, STEP a=0.2 b=0.8]


@dataclass(frozen=True)
class HeldOutSet:
  """One entry of `data.evals`."""
  name: str
  source: Source
  location: str = ''  # text / jsonl / parquet: a glob; tfds: the dataset with config and version; hf, tokenized:
  # its folder
  split: str = ''  # tfds; hf (optional)
  column: str = ''  # parquet: the column holding the text ('': data.text_key)


SOURCE_FORMS = ('NAME=embedded, NAME=text:GLOB, NAME=jsonl:GLOB, NAME=parquet:GLOB[:COLUMN], NAME=hf:PATH[:SPLIT], '
                'NAME=tokenized:DIR or NAME=tfds:DATASET:SPLIT')
SOURCE_EXAMPLES = {'evals': 'data.evals=[c4=tfds:c4/en:3.1.0:validation,code=text:eval/*.py]',
                   'mixture': 'data.mixture=[web=tfds:c4/en:3.1.0:train,code=text:src/**/*.py]'}


def held_out_sets(data: DataConfig) -> tuple[HeldOutSet, ...]:
  """`data.evals` parsed; a ConfigError naming the entry when one is malformed or a name repeats."""
  return named_sources(data, 'evals')


def parse_source(spec: str, name: str = '') -> HeldOutSet | None:
  """`KIND:LOCATION[:PART]` as a named source writes it (SOURCE_FORMS), or None when it is malformed."""
  source, _, location = spec.partition(':')
  split = column = ''
  if source == 'tfds':
    location, _, split = location.rpartition(':')
  if source == 'parquet':
    location, _, column = location.partition(':')
  if source == 'hf':
    location, _, split = location.partition(':')
  if (source not in typing.get_args(Source) or (source == 'embedded') != (location == '')
          or (source == 'tfds' and not split.replace('_', '').isalpha())):
    return None
  return HeldOutSet(name, source, location, split, column)


def named_sources(data: DataConfig, field: str) -> tuple[HeldOutSet, ...]:
  """`data.evals` or `data.mixture` parsed; a ConfigError naming the entry when one is malformed or a name
  repeats."""
  sets: list[HeldOutSet] = []
  for entry in getattr(data, field):
    name, sep, spec = str(entry).partition('=')
    held = parse_source(spec, name)
    if not sep or not name.replace('_', '').replace('-', '').isalnum() or held is None:
      raise ConfigError(f'data.{field} entry {entry!r}: write {SOURCE_FORMS}, e.g. {SOURCE_EXAMPLES[field]}')
    if any(other.name == name for other in sets):
      raise ConfigError(f'data.{field} names {name!r} twice; give each source its own name')
    sets.append(held)
  return tuple(sets)


def _source_spec(values: dict) -> dict:
  """`data.source` written as a named source's spec (`parquet:GLOB[:COLUMN]`, `jsonl:GLOB`, `text:GLOB`,
  `hf:PATH[:SPLIT]`) -> the fields it stands for."""
  data = values.get('data')
  spec = data.get('source') if isinstance(data, dict) else None
  if not isinstance(spec, str) or ':' not in spec:
    return values
  held = parse_source(spec)
  if held is None or held.source == 'tfds':
    raise ConfigError(f'data.source={spec}: write text:GLOB, jsonl:GLOB, parquet:GLOB[:COLUMN], hf:PATH[:SPLIT] or '
                      f'tokenized:DIR (a TFDS dataset: data.source=tfds data.name=DATASET)')
  field = 'name' if held.source in ('hf', 'tokenized') else 'paths'
  if data.get(field):
    raise ConfigError(f'data.source={spec} names its data, and data.{field} is set too; keep one')
  location = held.location if field == 'name' else [held.location]
  out = {**values, 'data': {**data, 'source': held.source, field: location}}
  if held.column:
    out['data']['text_key'] = held.column
  if held.split:
    out['data']['train_split'] = held.split
  return out


def mixture_stages(data: DataConfig) -> tuple[tuple[int, tuple[float, ...]], ...]:
  """`data.weights` parsed: (from step, each `data.mixture` source's weight in order) per stage; a ConfigError
  naming the stage and the fix for a malformed one, an unknown source, a negative weight or an all-zero stage."""
  names = [source.name for source in named_sources(data, 'mixture')]
  stages: list[tuple[int, tuple[float, ...]]] = []
  for i, stage in enumerate(data.weights):
    words = str(stage).split()
    step = int(words.pop(0)) if words and words[0].isdigit() else 0
    where = f'data.weights stage {i + 1} ({stage!r})'
    weights = dict.fromkeys(names, 0.0)
    for word in words:
      name, sep, value = word.partition('=')
      try:
        weight = float(value) if sep else float('nan')
      except ValueError:
        weight = float('nan')
      if name not in weights:
        raise ConfigError(f'{where} names {name!r}, no data.mixture source ({", ".join(names)})')
      if not 0 <= weight < float('inf'):  # NaN too
        raise ConfigError(f'{where}: {word!r} is not NAME=WEIGHT with a weight >= 0')
      weights[name] = weight
    if sum(weights.values()) <= 0:
      raise ConfigError(f'{where} gives every source weight 0; give some source a positive share')
    if (i == 0) != (step == 0) or (stages and step <= stages[-1][0]):
      raise ConfigError(f'{where}: the first stage starts at step 0 and each later one at a larger step, written '
                        f'first, e.g. data.weights=[a=0.7 b=0.3, 1000 a=0.5 b=0.5]')
    stages.append((step, tuple(weights.values())))
  return tuple(stages)


@dataclass(frozen=True)
class OptimConfig:
  name: OptimizerName = 'adamw'
  learning_rate: float = 1e-3  # peak
  warmup_steps: int = 100  # linear warmup from 0 to the peak rate
  schedule: Schedule = 'cosine'  # after warmup
  decay_steps: int | None = None  # the schedule's length; default: train.steps
  min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
  decay_fraction: float = 0.2  # wsd: the decay's share of the schedule's length (the last steps)
  decay_shape: DecayShape = 'linear'  # wsd: the decay's shape
  b1: float = 0.9  # adamw, lion, muon's AdamW part, schedule_free_adamw (its interpolation)
  b2: float = 0.95  # adamw, lion, muon's AdamW part, schedule_free_adamw
  eps: float = 1e-8  # Adam-like optimizers' epsilon
  weight_decay: float = 0.1  # decoupled; adafactor's weight_decay_rate
  decay_exclude: tuple[str, ...] = ('bias', 'scale', 'embedding')  # param-name parts never decayed
  grad_clip: float = 1.0  # global norm; 0 disables
  factored_min_dim: int = 128  # adafactor: second moments factored over dimensions at least this long
  decay_rate: float = 0.8  # adafactor: the second moment's decay, 1 - (step + 1)^-decay_rate
  clipping_threshold: float = 1.0  # adafactor: updates clipped to this RMS; 0: not clipped
  parameter_scale: bool = True  # adafactor: steps relative to each parameter's RMS
  muon_momentum: float = 0.95  # muon (hidden matrices; AdamW without decay on embeddings, norms, biases)
  ns_steps: int = 5  # muon: Newton-Schulz iterations
  muon_rms: float = 0.2  # muon: its update's RMS, matched to AdamW's so one learning rate serves both parts; 0: shape
  weight_lr_power: float = 2.0  # schedule_free_adamw: how later iterates weigh in the average
  lr_multipliers: tuple[str, ...] = ()  # REGEX=FACTOR: params whose path (a/b/kernel) matches get lr x FACTOR


@dataclass(frozen=True)
class CheckpointConfig:
  """When a run writes checkpoints and which it keeps."""
  every: int = 500  # 0: only at the end
  every_minutes: float = 0.0  # also when this long has passed since the last save (checked at log steps)
  keep: int = 2  # the latest N
  keep_every: int = 0  # K > 0: a checkpoint at every K-th step too, kept for good (e.g. for scaling plots)
  at: tuple[int, ...] = ()  # further steps checkpointed, each kept for good (e.g. a ladder's branch points)

  def check(self) -> None:
    if self.keep <= 0:
      raise ConfigError(f'train.checkpoint.keep={self.keep} must be positive')
    if any(step < 1 for step in self.at):
      raise ConfigError(f'train.checkpoint.at={list(self.at)} must list steps >= 1')
    if self.every < 0 or self.keep_every < 0 or self.every_minutes < 0:
      raise ConfigError(f'train.checkpoint.every={self.every}, train.checkpoint.keep_every={self.keep_every} and '
                        f'train.checkpoint.every_minutes={self.every_minutes} must be >= 0 (0: off)')


@dataclass(frozen=True)
class WandbConfig:
  """The Weights & Biases run of `train.trackers=[..., wandb]` (its mode from WANDB_MODE: online, offline)."""
  project: str = 'lm'  # the W&B project
  entity: str | None = None  # a team or user; None: the API key's default
  tags: tuple[str, ...] = ()  # the W&B run's tags


@dataclass(frozen=True)
class HarnessConfig:
  """lm-eval-harness tasks evaluated in the training loop (the eval extra), recorded as eval/<task>/<metric>."""
  tasks: tuple[str, ...] = ()  # e.g. hellaswag,piqa
  every: int = 0  # steps between them, and after the last; 0: train.eval_every
  limit: int | None = None  # N documents of each task, drawn with a fixed seed (lm eval --subset N); None: all
  num_fewshot: int | None = None  # None: each task's own default
  data_dir: str | None = None  # local task files (lm eval --data-dir); None: the harness loads from the Hub

  def check(self) -> None:
    if self.every < 0 or (self.limit is not None and self.limit < 1) or (self.num_fewshot or 0) < 0:
      raise ConfigError('train.harness.every and train.harness.num_fewshot must be >= 0 and '
                        'train.harness.limit >= 1')


@dataclass(frozen=True)
class DistillConfig:
  """Knowledge distillation (Hinton et al. 2015; `lm.train.distill`): a frozen teacher scores every batch in the
  train step, on the student's mesh in its own dtype. The loss is (1 - weight) x the data's token loss + weight x
  temperature^2 x the KL divergence of the temperature-softened distributions per target token; each is logged
  (`loss`, `distill_loss`)."""
  teacher: str | None = None  # a run dir (RUN/checkpoints/STEP), an HF model directory or a PEFT adapter; None: off
  weight: float = 0.5  # the divergence's share of the loss; 1: the teacher alone, 0: the data alone
  temperature: float = 1.0  # both models' logits divided by it (the loss scaled by its square, as Hinton's)
  divergence: Divergence = 'forward'  # forward: KL(teacher || student), mass-covering; reverse: mode-seeking
  top_k: int = 0  # 0: every token; K: the teacher's K likeliest tokens per position, renormalised (the sparse targets
  # of logits cached offline, as MaxText's top-k), against the student's log-probabilities there (forward only)

  def check(self) -> None:
    if self.teacher is None:
      if self != DistillConfig():
        raise ConfigError('train.distill fields are set but train.distill.teacher is not; name a teacher (a run '
                          'dir or an HF model directory) or drop them')
      return
    if not 0 <= self.weight <= 1 or not self.temperature > 0:
      raise ConfigError(f'train.distill.weight={self.weight} must be in [0, 1] and train.distill.temperature='
                        f'{self.temperature} > 0')
    if self.top_k < 0 or (self.top_k and self.divergence != 'forward'):
      raise ConfigError(f'train.distill.top_k={self.top_k} keeps the teacher\'s likeliest tokens: a count >= 0, with '
                        f'train.distill.divergence=forward (not {self.divergence})')


@dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000  # optimizer steps in all (a resume continues to this)
  global_batch: int = 16  # sequences per optimizer step, over all devices and microbatches
  microbatches: int = 1  # gradient accumulation
  seed: int = 0  # params init, data order and masking
  z_loss: float = 0.0  # weight of log(Z)^2 in the training loss (PaLM's z-loss)
  log_every: int = 10  # steps between logged records
  eval_every: int = 100  # steps between held-out evaluations (and at step 0 and the end)
  eval_at: tuple[int, ...] = ()  # further steps evaluated (e.g. a wsd ladder's budgets' last steps, on its stable run)
  eval_batches: int = 4  # per held-out set and evaluation, at most (a smaller set is read whole); -1: all; 0: none
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # when checkpoints are written, kept
  local_checkpoint_dir: str | None = None  # a directory on each host's own disk: the fast local checkpoint tier
  local_checkpoint_every: int = 0  # steps between local checkpoints (with train.local_checkpoint_dir)
  optimizer_offload: bool = False  # optimizer state in host memory (pinned_host) between steps, moved in to update
  param_offload: bool = False  # params in host memory between steps, moved in for the step (and for evaluation)
  run_dir: str = 'runs/{name}'  # where everything goes; {name} is the config's name; a gs:// URI works
  resume: bool = False  # continue from the run dir's latest checkpoint (--resume)
  progress: bool = True  # progress bar when stdout is a terminal
  peak_flops: float | None = None  # per device, for MFU; default from the device kind
  causal_attention_flops: CausalFlops = 'half'  # count the masked half of causal attention in MFU (full) or not
  init_from: str | None = None  # start from these params (our run dir or an HF model directory), fresh optimizer
  init_from_ema: bool = False  # init_from a run: take its params' moving average (train.ema_decay) instead
  branch_from: str | None = None  # continue this checkpoint's whole state (RUN or RUN/checkpoints/STEP) in a new run
  on_nonfinite: NonFinite = 'stop'  # a NaN/inf loss or gradient: stop (error, no later checkpoint) | skip the update
  on_spike: OnSpike = 'off'  # a loss or gradient-norm spike: off | skip the update | rollback to the last checkpoint
  spike_window: int = 128  # steps whose loss and gradient norm the running mean and deviation cover
  spike_threshold: float = 6.0  # a spike: this many standard deviations above the window's mean (either value)
  rollback_skip_batches: int = 0  # on_spike=rollback: batches skipped after the spike's own, before training on
  max_rollbacks: int = 3  # on_spike=rollback: a spike after this many rollbacks stops the run
  hang_timeout_minutes: float = 0.0  # no step done for this long (after the first): stacks to RUN/hang-P.txt, exit
  join_timeout_minutes: float = 5.0  # a multi-process job whose processes have not all joined by then: exit
  ema_decay: float = 0.0  # a moving average of the params (e.g. 0.999), evaluated beside them; 0: none
  slow_step_factor: float = 3.0  # say when an interval's step time is this many times the median (0: never)
  watch_every: int = 0  # N > 0: RMS of params, grads and updates per layer group every N steps (watch/...)
  noise_scale: bool = False  # the gradient noise scale B_simple from the microbatches' gradients (gns/*)
  batch_ramp: tuple[str, ...] = ()  # 'BATCH@AT' points, e.g. [32@1000,64@3000]: BATCH sequences a step after AT
  batch_ramp_unit: RampUnit = 'steps'  # what a batch_ramp point's AT counts: optimizer steps or training tokens
  batch_ramp_lr: RampRate = 'sqrt'  # the learning rate times (batch / global_batch)^(1/2 | 1 | 0); sqrt suits Adam
  batch_ramp_growth: RampGrowth = 'accumulate'  # a larger batch as more microbatches of the same rows, or more rows
  profile: str | None = None  # 'START:COUNT': a jax.profiler trace of COUNT steps from step START in RUN/profile/
  profile_all_hosts: bool = False  # the trace on every process (default: process 0's)
  harness: HarnessConfig = field(default_factory=HarnessConfig)  # lm-eval-harness tasks in the loop
  distill: DistillConfig = field(default_factory=DistillConfig)  # a teacher's logits as (part of) the target
  trackers: tuple[Tracker, ...] = ('tensorboard',)  # where metrics go besides metrics.jsonl: tensorboard, wandb
  wandb: WandbConfig = field(default_factory=WandbConfig)  # the W&B run, with wandb among train.trackers


@dataclass(frozen=True)
class Config:
  name: str = 'gpt_tiny'  # the run's name: a preset's file name unless set; train.run_dir's {name}
  model: ModelConfig = field(default_factory=ModelConfig)
  mesh: MeshConfig = field(default_factory=MeshConfig)
  data: DataConfig = field(default_factory=DataConfig)
  optim: OptimConfig = field(default_factory=OptimConfig)
  train: TrainConfig = field(default_factory=TrainConfig)

  @property
  def run_dir(self) -> epath.Path:
    """A local path or a URI (gs://...): run-dir I/O goes through etils.epath."""
    return epath.Path(self.train.run_dir.format(name=self.name))

  def to_dict(self) -> dict[str, Any]:
    return _plain(dataclasses.asdict(self))

  def to_yaml(self) -> str:
    return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (tuple, list)):
    return [_plain(v) for v in x]
  return x


# ---------------------------------------------------------------- building from dicts

def _coerce(value: Any, hint: Any, where: str) -> Any:
  """Converts a YAML/CLI value to the field's declared type, or raises ConfigError."""
  origin = typing.get_origin(hint)
  if origin is Literal:
    choices = typing.get_args(hint)
    if value is None:  # `null` or `~`: the choice that means nothing, where there is one
      value = next((word for word in ('none', 'off') if word in choices), value)
    if value not in choices:
      raise ConfigError(f'{where}={value!r} is not supported; choose one of: {", ".join(map(str, choices))}')
    return value
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(hint)
    if value is None or (isinstance(value, str) and value.lower() in ('none', 'null')):
      if type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    return _coerce(value, inner[0], where)
  if origin is tuple:
    if isinstance(value, str):
      value = [v for v in value.split(',') if v]
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f'{where}: expected a list, got {value!r}')
    (item, _) = typing.get_args(hint)
    return tuple(_coerce(v, item, where) for v in value)
  if hint is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ('true', 'false', '1', '0', 'yes', 'no', 'on', 'off'):
      return value.lower() in ('true', '1', 'yes', 'on')
    raise ConfigError(f'{where}: expected true or false, got {value!r}')
  if hint is int:
    if isinstance(value, bool):
      raise ConfigError(f'{where}: expected an integer, got {value!r}')
    try:
      as_float = float(value)
    except (TypeError, ValueError):
      raise ConfigError(f'{where}: expected an integer, got {value!r}') from None
    if as_float != int(as_float):
      raise ConfigError(f'{where}: expected an integer, got {value!r}')
    return int(as_float)
  if hint is float:
    try:
      return float(value)
    except (TypeError, ValueError):
      raise ConfigError(f'{where}: expected a number, got {value!r}') from None
  if hint is str:
    if isinstance(value, (dict, list)):
      raise ConfigError(f'{where}: expected a string, got {value!r}')
    return str(value)
  raise TypeError(f'unsupported config type {hint} at {where}')


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    where = f'{prefix}{unknown[0]}'
    choices = ', '.join(sorted(names))
    raise ConfigError(f'unknown config key {where!r}; valid keys{" of " + prefix[:-1] if prefix else ""}: {choices}')
  kwargs = {}
  for name, value in values.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      if not isinstance(value, dict):
        raise ConfigError(f'{prefix}{name}: expected a section of keys, got {value!r}')
      kwargs[name] = _build(hint, value, f'{prefix}{name}.')
    else:
      kwargs[name] = _coerce(value, hint, f'{prefix}{name}')
  return cls(**kwargs)


def merge(base: dict, update: dict) -> dict:
  """`update` laid over `base`, section by section."""
  out = dict(base)
  for key, value in update.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = merge(out[key], value)
    else:
      out[key] = value
  return out


def preset_path(name_or_path: str) -> epath.Path:
  """Resolves `gpt_tiny`, `gpt_tiny.yaml` or a path (or URI) to an existing YAML file."""
  path = epath.Path(name_or_path)
  if path.suffix in ('.yaml', '.yml') and path.exists():
    return path
  candidate = CONFIG_DIR / f'{path.stem if path.suffix else name_or_path}.yaml'
  if candidate.exists():
    return epath.Path(candidate)
  known = ', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))
  raise ConfigError(f'config file {name_or_path!r} not found; pass a path to a YAML file or one of: {known}')


def _load_yaml(name_or_path: str, seen: tuple[str, ...] = ()) -> dict:
  path = preset_path(name_or_path)
  if str(path) in seen:
    raise ConfigError(f'config {path} inherits from itself through `base`; remove the cycle')
  try:
    values = yaml.load(path.read_text(), YamlLoader) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f'config file {path} is not valid YAML: {str(e).splitlines()[0]}') from None
  if not isinstance(values, dict):
    raise ConfigError(f'config file {path} must hold a mapping of keys, not {type(values).__name__}')
  values = upgrade(values)
  values.setdefault('name', path.stem)
  base = values.pop('base', None)
  if base is not None:
    parent = _load_yaml(str(base) if Path(str(base)).is_absolute() else str(base), seen + (str(path),))
    parent.pop('name', None)
    values = merge(parent, values)
  return values


class YamlLoader(yaml.SafeLoader):
  """YAML 1.2's integers and booleans: 1.1's base 60 would read `train.profile=10:5` as 605, and its booleans
  `train.on_spike=off` as false."""


YamlLoader.yaml_implicit_resolvers = {
  first: [(tag, regexp) for tag, regexp in resolvers if tag not in ('tag:yaml.org,2002:int', 'tag:yaml.org,2002:bool')]
  for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver('tag:yaml.org,2002:int', re.compile(
  r'^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$'), list('-+0123456789'))
YamlLoader.add_implicit_resolver('tag:yaml.org,2002:bool', re.compile(r'^(?:true|True|TRUE|false|False|FALSE)$'),
                                 list('tTfF'))


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
  """`['model.d_model=512', 'train.steps=10']` -> nested dict of raw values."""
  out: dict = {}
  for item in overrides:
    key, sep, raw = item.partition('=')
    if not sep or not key:
      raise ConfigError(f'override {item!r} is not of the form key.sub=value (e.g. train.steps=100)')
    value = yaml.load(raw, YamlLoader) if raw else ''
    node = out
    parts = key.split('.')
    for part in parts[:-1]:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f'override {item!r} conflicts with an earlier override of {part!r}')
    node[parts[-1]] = value
  return upgrade(out)


# Path-valued fields: `~` and $VARS expand as a shell would (it does not after `key=`); URIs stay as written.
PATH_FIELDS = ('data.data_dir', 'data.name', 'data.paths', 'data.tokenizer', 'train.run_dir', 'train.init_from',
               'train.branch_from', 'train.harness.data_dir')

# Earlier spellings of grouped fields -> where they live now: presets, overrides and the config.yaml of run dirs
# written before the grouping load through `upgrade`.
RENAMED = {
  **{f'model.rope_{name}': f'model.rope.{name}' for name in (  # the fields of the flat spelling; later ones have none
    'theta', 'scaling', 'factor', 'original_max_len', 'low_freq_factor', 'high_freq_factor', 'beta_fast', 'beta_slow',
    'attention_factor')},
  **{f'model.mup_{f.name}': f'model.mup.{f.name}' for f in dataclasses.fields(MupConfig)},
  **{f'model.{name}': f'model.execution.{name}' for name in (  # the fields grouped; later ones have no flat spelling
    'dtype', 'attention_impl', 'attention_block_q', 'attention_block_k', 'scan_layers', 'remat', 'loss_chunk')},
  'train.checkpoint_every': 'train.checkpoint.every',
  'train.checkpoint_every_minutes': 'train.checkpoint.every_minutes',
  'train.keep_checkpoints': 'train.checkpoint.keep', 'train.keep_every': 'train.checkpoint.keep_every',
  'train.checkpoint_at': 'train.checkpoint.at',
  'train.evals': 'train.harness.tasks', 'train.evals_every': 'train.harness.every',
  'train.evals_limit': 'train.harness.limit', 'train.evals_num_fewshot': 'train.harness.num_fewshot',
  'train.evals_data_dir': 'train.harness.data_dir',
}


def upgrade(values: dict) -> dict:
  """`values` (nested, as YAML or overrides give them) with every earlier spelling (`RENAMED`) moved to its
  group; a ConfigError when one dict sets a field under both spellings."""
  out = copy.deepcopy(values)
  for old, new in RENAMED.items():
    *path, key = old.split('.')
    section = _section(out, path)
    if section is None or key not in section or isinstance(section[key], dict):
      continue
    *new_path, new_key = new.split('.')
    target = _section(out, new_path, create=True)
    if new_key in target:
      raise ConfigError(f'{old} and {new} are both set; {old} is the earlier spelling of {new}: keep one')
    target[new_key] = section.pop(key)
  return out


def _section(values: dict, path: list[str], create: bool = False) -> dict | None:
  """The dict at `path` inside `values` (made when `create`), or None when it is absent or not a dict."""
  for part in path:
    if create and part not in values:
      values[part] = {}
    values = values.get(part)
    if not isinstance(values, dict):
      return None
  return values


def inference_mesh(mesh: dict, overrides: list[str] | tuple[str, ...] = ()) -> dict:
  """The mesh to run a trained model on: a config's mesh section with the `mesh.*` overrides; the data axis takes
  the devices fsdp and tensor leave (training's data size was its batch's split, not these devices') unless an
  override sets it."""
  values = parse_overrides(overrides).get('mesh', {})
  mesh = merge(mesh, values)
  if 'data' not in values and -1 not in (mesh.get('fsdp'), mesh.get('tensor')):
    mesh['data'] = -1
  return mesh


def cache_dir() -> Path:
  """Where lm keeps what it can rebuild (the harness's task index, decompressed corpora): $LM_CACHE_DIR, else
  ~/.cache/lm."""
  return Path(os.environ.get('LM_CACHE_DIR') or Path.home() / '.cache' / 'lm')


def expand_path(value: str) -> str:
  """`~/x`, `$HOME/x` -> absolute local paths; `gs://...` and other URIs unchanged; a tokenizer spec's path
  (`hf:~/tok`) expanded after its scheme."""
  scheme, sep, rest = value.partition(':')
  if sep and scheme in ('sentencepiece', 'hf'):
    return f'{scheme}:{expand_path(rest)}'
  if '://' in value:
    return value
  return os.path.expandvars(os.path.expanduser(value))


def _expand_paths(values: dict) -> dict:
  values = copy.deepcopy(values)
  for dotted in PATH_FIELDS:
    *path, key = dotted.split('.')
    section = _section(values, path)
    value = section.get(key) if section else None
    if isinstance(value, str):
      section[key] = expand_path(value)
    elif isinstance(value, list):
      section[key] = [expand_path(v) if isinstance(v, str) else v for v in value]
  return values


# Checks that need more than this module knows (the model families, the attention implementations): their layer
# registers them (`lm.models`), and every config loaded after runs them.
_CHECKS: list[Callable[[Config], None]] = []


def register_check(check: Callable[[Config], None]) -> None:
  """Run `check` on every config built from now on (`from_dict`, `load_config`)."""
  if check not in _CHECKS:
    _CHECKS.append(check)


def from_dict(values: dict) -> Config:
  """A Config from nested values (earlier spellings upgraded), validated by every check: this module's and the
  registered ones."""
  config = _build(Config, _expand_paths(_source_spec(upgrade(values))), '')
  validate(config)
  for check in _CHECKS:
    check(config)
  return config


def checked(config: Config) -> Config:
  """`config` (changed in code) when it passes every check `from_dict` runs; else the first one's ConfigError."""
  validate(config)
  for check in _CHECKS:
    check(config)
  return config


def load_config(name_or_path: str = 'gpt_tiny', overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Loads a preset by name or path, applies `key.sub=value` overrides, validates."""
  values = merge(_load_yaml(name_or_path), parse_overrides(overrides))
  return from_dict(values)


def preset_slice(name_or_path: str) -> str | None:
  """The TPU slice a preset is sized for: its header's `# Slice: v5p-1024 ...` line (the scaling-table presets
  carry one, and their mesh, remat and microbatches fit it); None when the header names none."""
  for line in preset_path(name_or_path).read_text().splitlines():
    if not line.startswith('#'):
      return None
    if line.startswith('# Slice:'):
      return line.removeprefix('# Slice:').split()[0]
  return None


# ---------------------------------------------------------------- validation

def _get(config: Config, dotted: str) -> Any:
  section, name = dotted.split('.')
  return getattr(getattr(config, section), name)


def profile_steps(spec: str) -> tuple[int, int]:
  """(first, count) of `train.profile='START:COUNT'`; never step 1, which compiles the step."""
  start, _, count = str(spec).partition(':')
  if not (start.strip().isdigit() and count.strip().isdigit()) or int(start) < 2 or int(count) < 1:
    raise ConfigError(f'train.profile={spec} must be START:COUNT with START >= 2 (step 1 compiles the program) '
                      f'and COUNT >= 1, e.g. train.profile=10:5')
  return int(start), int(count)


def _check_sequence_split(config: Config) -> None:
  """mesh.sequence > 1 (context parallelism) cuts each sequence into 2 x mesh.sequence equal chunks (the
  load-balanced causal layout); what ring attention serves is checked with the attention implementations'
  capabilities (`lm.ops.attention.capabilities`)."""
  n = config.mesh.sequence
  if n > 1 and config.data.seq_len % (2 * n):  # (-1, the devices left over, is checked with the mesh)
    raise ConfigError(f'data.seq_len={config.data.seq_len} does not split into 2 x mesh.sequence = {2 * n} equal '
                      f'chunks (the balanced causal layout); make it a multiple of {2 * n}')


def lr_multipliers(o: OptimConfig) -> tuple[tuple[re.Pattern, float], ...]:
  """`optim.lr_multipliers` parsed: (pattern, factor) in order; a path takes the product of every match's."""
  out = []
  for item in o.lr_multipliers:
    pattern, _, factor = item.rpartition('=')
    try:
      out.append((re.compile(pattern), float(factor)))
    except (re.error, ValueError):
      raise ConfigError(f'optim.lr_multipliers entry {item!r} is not REGEX=FACTOR (e.g. '
                        f'optim.lr_multipliers=[embed=0.1,lm_head/kernel=2])') from None
    if not pattern or out[-1][1] <= 0:
      raise ConfigError(f'optim.lr_multipliers entry {item!r} needs a pattern and a positive factor')
  return tuple(out)


def _check_window_and_softcap(config: Config) -> None:
  m = config.model
  if m.sliding_window < 0 or m.attn_logit_softcap < 0:
    raise ConfigError(f'model.sliding_window={m.sliding_window} and model.attn_logit_softcap={m.attn_logit_softcap} '
                      f'must be >= 0 (0: none)')
  if m.sliding_window > m.max_len:
    raise ConfigError(f'model.sliding_window={m.sliding_window} is larger than the context model.max_len={m.max_len}; '
                      f'lower it, or set it to 0 for full attention')
  if m.global_every < 0 or (m.global_every and not m.sliding_window):
    raise ConfigError(f'model.global_every={m.global_every} makes every n-th layer global among windowed ones: it '
                      f'must be >= 0 and needs model.sliding_window > 0')
  if m.global_layers and (m.global_every or not m.sliding_window or len(set(m.global_layers)) < len(m.global_layers)
                          or not all(0 <= i < m.num_layers for i in m.global_layers)):
    raise ConfigError(f'model.global_layers={list(m.global_layers)} names the layers that attend globally among '
                      f'windowed ones: distinct indices in [0, {m.num_layers}), with model.sliding_window > 0 and '
                      f'without model.global_every')
  if m.rope.local_theta and not (m.sliding_window and m.global_layer_indices):
    raise ConfigError(f'model.rope.local_theta={m.rope.local_theta} rotates windowed layers apart from global ones, '
                      f'but this model has no such mix; set model.sliding_window with model.global_every (or '
                      f'model.global_layers), or drop model.rope.local_theta')
  if m.final_logit_softcap < 0 or (m.attention_scale_dim is not None and m.attention_scale_dim <= 0):
    raise ConfigError(f'model.final_logit_softcap={m.final_logit_softcap} must be >= 0 and model.attention_scale_dim='
                      f'{m.attention_scale_dim} positive (or null)')


def _check_sizes(config: Config) -> None:
  """Every size and count is positive."""
  m, d, t = config.model, config.data, config.train
  positive = {
    'model.vocab_size': m.vocab_size, 'model.d_model': m.d_model, 'model.num_layers': m.num_layers,
    'model.num_heads': m.num_heads, 'model.max_len': m.max_len, 'data.seq_len': d.seq_len,
    'data.max_chars': d.max_chars,
    'train.steps': t.steps, 'train.global_batch': t.global_batch, 'train.microbatches': t.microbatches,
    'train.log_every': t.log_every, 'train.eval_every': t.eval_every,
  }
  for key, value in positive.items():
    if value <= 0:
      raise ConfigError(f'{key}={value} must be positive')
  if any(step < 1 for step in t.eval_at):
    raise ConfigError(f'train.eval_at={list(t.eval_at)} must list steps >= 1')


def _check_model(config: Config) -> None:
  """The model section: heads, positions, windows and soft-caps, rope scaling, dropouts."""
  m, d = config.model, config.data
  if m.head_dim is None and m.d_model % m.num_heads:
    raise ConfigError(
      f'model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}; '
      f'pick heads that divide the width or set model.head_dim')
  if m.num_kv_heads is not None and (m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads):
    raise ConfigError(f'model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} '
                      f'(each key/value head serves a group of query heads)')
  m.rope.check(m.position, m.mla.rope_head_dim if m.mla.kv_lora_rank else m.resolved_head_dim)
  m.mla.check(m)
  m.mtp.check()
  m.lora.check()
  if m.parallel_residual and m.norm_position != 'pre':
    raise ConfigError(f'model.parallel_residual=true adds the branches of pre-norm blocks, but '
                      f'model.norm_position={m.norm_position}; set model.norm_position=pre')
  if m.qk_norm_scope != 'head' and not m.qk_norm:
    raise ConfigError(f'model.qk_norm_scope={m.qk_norm_scope} scopes a query/key norm, but model.qk_norm=false; '
                      f'set model.qk_norm=true or drop model.qk_norm_scope')
  if m.norm_plus_one and m.norm != 'rmsnorm':
    raise ConfigError(f'model.norm_plus_one=true scales an RMSNorm by (1 + w), but model.norm={m.norm}; '
                      f'set model.norm=rmsnorm or drop model.norm_plus_one')
  if m.clip_qkv < 0:
    raise ConfigError(f'model.clip_qkv={m.clip_qkv} must be >= 0 (0: no clipping)')
  if (m.swiglu_alpha, m.swiglu_limit) != (1.702, 7.0) and m.activation != 'clamped_swiglu':
    raise ConfigError(f'model.swiglu_alpha and model.swiglu_limit shape the clamped_swiglu activation, but '
                      f'model.activation={m.activation}; set model.activation=clamped_swiglu or drop them')
  if m.swiglu_limit <= 0:
    raise ConfigError(f'model.swiglu_limit={m.swiglu_limit} must be > 0 (GPT-OSS: 7)')
  m.mup.check(m.parametrization, m.d_model)
  m.moe.check(m.num_layers)
  if m.quantization == 'int8' and m.moe.num_experts:
    raise ConfigError('model.quantization=int8 covers dense projections; the routed experts\' grouped matmuls '
                      '(model.moe) have no int8 path: drop one of them')
  _check_window_and_softcap(config)
  if m.position == 'learned' and d.seq_len > m.max_len:
    raise ConfigError(
      f'data.seq_len={d.seq_len} is longer than the position table model.max_len={m.max_len}; '
      f'raise model.max_len or lower data.seq_len')
  if m.num_labels < 0:
    raise ConfigError(f'model.num_labels={m.num_labels} must be >= 0 (0: no classifier head)')
  m.execution.check()
  for key in ('model.dropout', 'model.attention_dropout', 'data.val_fraction'):
    if not 0.0 <= _get(config, key) < 1.0:
      raise ConfigError(f'{key}={_get(config, key)} must lie in [0, 1)')


def _check_train(config: Config) -> None:
  """The training section: batches, checkpoint cadence, profiling, watching, in-loop evaluations."""
  o, t = config.optim, config.train
  if t.global_batch % t.microbatches:
    raise ConfigError(
      f'train.global_batch={t.global_batch} is not divisible by train.microbatches={t.microbatches}; '
      f'make the batch a multiple of the microbatch count')
  if t.profile is not None:
    profile_steps(t.profile)
  if t.slow_step_factor < 0:
    raise ConfigError(f'train.slow_step_factor={t.slow_step_factor} must be >= 0 (0: never)')
  if t.watch_every < 0:
    raise ConfigError(f'train.watch_every={t.watch_every} must be >= 0 (0: off)')
  if t.noise_scale and t.microbatches < 2:
    raise ConfigError(f'train.noise_scale=true compares each microbatch\'s gradient with the batch\'s, and '
                      f'train.microbatches={t.microbatches}; set train.microbatches=2 or more')
  if t.spike_window < 2:
    raise ConfigError(f'train.spike_window={t.spike_window} must be >= 2 (steps in the running mean and deviation)')
  if not t.spike_threshold > 0:
    raise ConfigError(f'train.spike_threshold={t.spike_threshold} must be > 0 (standard deviations above the mean)')
  if t.hang_timeout_minutes < 0 or not t.join_timeout_minutes > 0:
    raise ConfigError(f'train.hang_timeout_minutes={t.hang_timeout_minutes} must be >= 0 (0: off) and '
                      f'train.join_timeout_minutes={t.join_timeout_minutes} > 0')
  if t.rollback_skip_batches < 0 or t.max_rollbacks < 0:
    raise ConfigError(f'train.rollback_skip_batches={t.rollback_skip_batches} and '
                      f'train.max_rollbacks={t.max_rollbacks} must be >= 0')
  if t.eval_batches < -1 or o.warmup_steps < 0:
    raise ConfigError('optim.warmup_steps must be >= 0, train.eval_batches >= -1 (-1: every held-out set whole)')
  if len(set(t.trackers)) < len(t.trackers):
    raise ConfigError(f'train.trackers={list(t.trackers)} names a tracker twice; name each once')
  t.checkpoint.check()
  t.harness.check()
  t.distill.check()
  _check_local_tier(t)
  batch_schedule(config)


# ---------------------------------------------------------------- batch ramps (train.batch_ramp)

def batch_schedule(config: Config) -> tuple[tuple[int, int], ...]:
  """(after step, batch) of each stage of the run's batch, the first (0, train.global_batch), the rest
  `train.batch_ramp`'s points with token counts turned into the first step that reaches them; a ConfigError naming
  the point and the fix for a malformed, decreasing or indivisible one."""
  t = config.train
  stages = [(0, t.global_batch)]
  for point in t.batch_ramp:
    batch, sep, at = str(point).partition('@')
    try:
      batch, at = int(batch), int(float(at))
    except ValueError:
      sep = ''
    if not sep:
      raise ConfigError(f'train.batch_ramp point {point!r} is not BATCH@AT, e.g. 32@1000: 32 sequences a step '
                        f'after step 1000 (or token 1000 with train.batch_ramp_unit=tokens)')
    if t.batch_ramp_unit == 'tokens':
      done, tokens = stages[-1][0], tokens_after(stages, stages[-1][0], config.data.seq_len)
      at = done + max(0, -(-(at - tokens) // (stages[-1][1] * config.data.seq_len)))
    if batch <= stages[-1][1] or at <= stages[-1][0]:
      raise ConfigError(f'train.batch_ramp point {point!r} does not increase both the batch and the step (or token) '
                        f'past the stage before ({stages[-1][1]} after step {stages[-1][0]}); list larger batches '
                        f'at later points')
    if batch % t.global_batch:
      raise ConfigError(f'train.batch_ramp point {point!r}: {batch} is not a multiple of train.global_batch='
                        f'{t.global_batch}, the rows the mesh and the data split; ramp to whole multiples of it')
    if at >= t.steps:
      raise ConfigError(f'train.batch_ramp point {point!r} starts after step {at}, at or past train.steps='
                        f'{t.steps}; drop it or raise train.steps')
    stages.append((at, batch))
  return tuple(stages)


def batch_at(stages: tuple[tuple[int, int], ...], step: int) -> int:
  """The batch step `step` (counted from 1) takes."""
  return next(batch for after, batch in reversed(stages) if step > after)


def tokens_after(stages: tuple[tuple[int, int], ...], step: int, seq_len: int) -> int:
  """Training tokens of the steps up to and including `step`."""
  ends = [after for after, _ in stages[1:]] + [max(step, stages[-1][0])]
  return seq_len * sum(batch * max(0, min(step, end) - after) for (after, batch), end in zip(stages, ends))


def microbatches_at(config: Config, batch: int) -> int:
  """The microbatch count of a step of `batch` rows: train.microbatches, times the batch's growth under
  train.batch_ramp_growth=accumulate (each microbatch keeps its rows)."""
  t = config.train
  grown = t.batch_ramp_growth == 'accumulate'
  return t.microbatches * batch // t.global_batch if grown else t.microbatches


def ramp_rates(config: Config) -> tuple[tuple[int, float], ...]:
  """(after step, learning-rate factor) of each ramp stage after the first (train.batch_ramp_lr)."""
  power = {'sqrt': 0.5, 'linear': 1.0, 'none': 0.0}[config.train.batch_ramp_lr]
  return tuple((after, (batch / config.train.global_batch) ** power) for after, batch in batch_schedule(config)[1:])


def largest_batch(config: Config) -> Config:
  """`config` at its ramp's largest batch (no ramp): what a step's memory and a plan must fit."""
  batch = batch_schedule(config)[-1][1]
  t = dataclasses.replace(config.train, global_batch=batch, microbatches=microbatches_at(config, batch),
                          batch_ramp=())
  return dataclasses.replace(config, train=t)


def _check_local_tier(t: TrainConfig) -> None:
  if (t.local_checkpoint_dir is None) != (t.local_checkpoint_every == 0) or t.local_checkpoint_every < 0:
    raise ConfigError(f'train.local_checkpoint_dir={t.local_checkpoint_dir} and train.local_checkpoint_every='
                      f'{t.local_checkpoint_every} go together: set both (a directory and steps > 0) or neither')
  if t.local_checkpoint_dir is not None and '://' in t.local_checkpoint_dir:
    raise ConfigError(f'train.local_checkpoint_dir={t.local_checkpoint_dir} must be a path on each host\'s own disk '
                      f'(the persistent tier is train.run_dir)')
  if t.local_checkpoint_every and 0 < t.checkpoint.every <= t.local_checkpoint_every:
    raise ConfigError(f'train.local_checkpoint_every={t.local_checkpoint_every} must be below '
                      f'train.checkpoint.every={t.checkpoint.every}: the local tier is the more frequent one')


def _check_optim(config: Config) -> None:
  """The optimizer section: rates, betas and each optimizer's own knobs."""
  o = config.optim
  lr_multipliers(o)
  if o.learning_rate <= 0 or o.grad_clip < 0 or o.weight_decay < 0:
    raise ConfigError('optim.learning_rate must be > 0; optim.grad_clip and optim.weight_decay >= 0')
  ranges = {'optim.b1': (o.b1, 0, 1), 'optim.b2': (o.b2, 0, 1), 'optim.muon_momentum': (o.muon_momentum, 0, 1),
            'optim.decay_rate': (o.decay_rate, 0, 1)}
  for key, (value, low, high) in ranges.items():
    if not low <= value < high:
      raise ConfigError(f'{key}={value} must lie in [{low}, {high})')
  if o.eps <= 0 or o.ns_steps < 1 or o.factored_min_dim < 1 or o.clipping_threshold < 0 or o.muon_rms < 0 \
     or o.weight_lr_power < 0:
    raise ConfigError('optim.eps must be > 0, optim.ns_steps and optim.factored_min_dim >= 1, '
                      'optim.clipping_threshold, optim.muon_rms and optim.weight_lr_power >= 0')


def _check_start_and_schedule(config: Config) -> None:
  """How a run starts (init_from, branch_from, its moving average) and its schedule's shape."""
  o, t = config.optim, config.train
  if t.init_from_ema and t.init_from is None:
    raise ConfigError('train.init_from_ema=true takes the moving average of the run train.init_from names; set '
                      'train.init_from=RUN or drop it')
  if t.init_from is not None and t.branch_from is not None:
    raise ConfigError('train.init_from (params, a fresh optimizer) and train.branch_from (the whole state) both '
                      'set; choose one')
  if not 0.0 <= t.ema_decay < 1.0:
    raise ConfigError(f'train.ema_decay={t.ema_decay} must lie in [0, 1) (0: no moving average)')
  if not 0.0 <= o.min_lr_ratio <= 1.0 or not 0.0 < o.decay_fraction <= 1.0:
    raise ConfigError(f'optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1] and optim.decay_fraction='
                      f'{o.decay_fraction} in (0, 1]')
  length = o.decay_steps or t.steps
  if o.schedule == 'wsd' and o.warmup_steps > length - round(o.decay_fraction * length):
    raise ConfigError(f'optim.schedule=wsd: warmup ({o.warmup_steps} steps) runs into the decay (the last '
                      f'{round(o.decay_fraction * length)} of {length} steps); lower optim.warmup_steps or '
                      f'optim.decay_fraction')


def _check_data(config: Config) -> None:
  """The data section: sources, held-out sets, mixtures, the input pipeline."""
  d = config.data
  if d.source in ('text', 'jsonl', 'parquet') and not d.paths:
    suffix = {'text': 'txt'}.get(d.source, d.source)
    raise ConfigError(f'data.source={d.source} needs data.paths (globs of local files), e.g. '
                      f'data.paths=[corpus/*.{suffix}]')
  if d.source == 'tfds' and not d.name:
    raise ConfigError('data.source=tfds needs data.name (with config and version, e.g. data.name=c4/en:3.1.0)')
  if d.source == 'tokenized' and not d.name:
    raise ConfigError('data.source=tokenized needs data.name, the folder lm data tokenize wrote (or write '
                      'data.source=tokenized:DIR)')
  if d.source == 'hf' and not d.name:
    raise ConfigError('data.source=hf needs data.name, the dataset\'s folder (save_to_disk\'s, or of data files), '
                      'e.g. data.name=~/datasets/fineweb_sample')
  held_out_sets(d)
  if bool(d.mixture) != bool(d.weights):
    raise ConfigError('data.mixture and data.weights go together: the sources, then their shares of training '
                      'tokens (e.g. data.mixture=[a=text:a/*.txt,b=jsonl:b.jsonl] data.weights=[a=0.7 b=0.3])')
  mixture_stages(d)
  if d.evals and not config.train.eval_batches:
    raise ConfigError('data.evals needs train.eval_batches > 0 (batches per set and evaluation) or -1 (whole sets)')
  if d.streams < 1 or d.workers < 0 or d.prefetch < 1:
    raise ConfigError('data.streams and data.prefetch must be >= 1, data.workers >= 0')
  if d.unique_tokens and d.unique_tokens < d.seq_len:
    raise ConfigError(f'data.unique_tokens={d.unique_tokens} is less than one sequence (data.seq_len={d.seq_len}); '
                      f'cap the data at {d.seq_len} tokens or more, or 0 for no cap')
  if d.unique_tokens and d.mixture:
    raise ConfigError('data.unique_tokens caps data.source, and data.mixture draws from several; cap a single '
                      'source, or drop data.unique_tokens')


def _check_pipeline(config: Config) -> None:
  """A mesh with stages: a scanned stack with a layer for every stage (of each run of dense and routed layers),
  enough microbatches."""
  stages, m, t = axis_size(config.mesh, 'stage'), config.model, config.train
  if stages <= 1:
    return
  named = f'mesh.stage={config.mesh.stage}' + (f' x mesh.stage_slices={config.mesh.stage_slices}'
                                               if config.mesh.stage_slices > 1 else '')
  p = m.execution.pipeline
  fix = 'or set mesh.stage=1'
  if not m.execution.scan_layers:
    raise ConfigError(f'{named} pipelines the scanned layer stack; set model.execution.scan_layers=true '
                      f'{fix}')
  runs = [(routed, len(list(run))) for routed, run in itertools.groupby(m.moe.routed(i) for i in range(m.num_layers))]
  routed, shortest = min(runs, key=lambda run: run[1])
  if shortest < stages * p.repeats:
    what = f'model.num_layers={m.num_layers}' if len(runs) == 1 else \
        f'a run of {shortest} {"routed" if routed else "dense"} layer(s) (model.moe), pipelined on its own,'
    raise ConfigError(f'{what} cannot fill {named} x model.execution.pipeline.repeats={p.repeats} '
                      f'stages: each needs a layer; use fewer stages or repeats')
  if p.schedule == 'circular' and t.microbatches < stages:
    raise ConfigError(f'train.microbatches={t.microbatches} is below {named}: the circular schedule '
                      f'feeds a microbatch back to the first stage; use at least {stages} microbatches')
  if p.schedule == '1f1b' and m.mtp.depth:
    raise ConfigError(f'model.mtp.depth={m.mtp.depth} reads the stack\'s last states, which schedule=1f1b keeps in '
                      f'its last stage; use model.execution.pipeline.schedule=gpipe or circular')
  if p.schedule == '1f1b' and t.microbatches < stages:
    raise ConfigError(f'train.microbatches={t.microbatches} is below {named}: 1f1b then holds as many '
                      f'microbatches as gpipe, in more ticks; use at least {stages} microbatches or schedule=gpipe')
  if p.schedule == '1f1b' and m.moe.num_experts:
    _check_routed_1f1b(runs, m.moe)
  if t.distill.teacher is not None:
    raise ConfigError(f'train.distill.teacher runs a second model beside the pipelined stack, which {named} does not '
                      f'stage; distill {fix}')
  if t.noise_scale:
    raise ConfigError(f'train.noise_scale=true needs each microbatch\'s own gradient, which {named} '
                      f'never forms (the stages run them together); set train.noise_scale=false {fix}')


def _check_routed_1f1b(runs: list[tuple[bool, int]], moe: MoeConfig) -> None:
  """1F1B takes each stage's part of the routed layers' auxiliary loss in its backward pass: the routed layers must
  be the last run of the stack (the one that takes the loss), and their balance loss a sum over layers."""
  if [routed for routed, _ in runs].count(True) > 1 or not runs[-1][0]:
    raise ConfigError('model.execution.pipeline.schedule=1f1b runs routed layers (model.moe) only as the last run of '
                      'the stack; use schedule=gpipe or circular')
  if moe.balance_over == 'model':
    raise ConfigError('model.moe.balance_over=model averages every layer\'s load before the loss, which 1f1b\'s '
                      'stages cannot (each takes its own layers\' part); use balance_over=layer or schedule=gpipe')


def _check_mesh(config: Config) -> None:
  """Mesh sizes: positive or -1 (one axis at most) within a slice, positive slices."""
  within = [a.key for a in in_slice_axes()]
  for key in within:
    value = _get(config, key)
    if value == 0 or value < -1:
      raise ConfigError(f'{key}={value} must be a positive size or -1 (fill the remaining devices)')
  for axis in MESH_AXES:
    if axis.across_slices and _get(config, axis.key) < 1:
      raise ConfigError(f'{axis.key}={_get(config, axis.key)} must be a positive number of TPU slices')
    if axis.slices_field and _get(config, f'mesh.{axis.slices_field}') < 1:
      raise ConfigError(f'mesh.{axis.slices_field}={_get(config, f"mesh.{axis.slices_field}")} must be a positive '
                        f'number of TPU slices')
  if sum(_get(config, k) == -1 for k in within) > 1:
    raise ConfigError(f'only one of {", ".join(within)} may be -1')


def validate(config: Config) -> None:
  """Device-independent checks that need no family or tokenizer: the family's own are registered by `lm.models`
  (`register_check`) and run after these; mesh-dependent ones when the mesh is built."""
  _check_sizes(config)
  _check_model(config)
  _check_train(config)
  _check_optim(config)
  _check_start_and_schedule(config)
  _check_sequence_split(config)
  _check_data(config)
  _check_mesh(config)
  _check_pipeline(config)
  check_tokenizer_spec(config.data.tokenizer)


TOKENIZER_SPECS = ('byte', 'sentencepiece:PATH', 'hf:PATH')


def check_tokenizer_spec(spec: str) -> None:
  """A ConfigError unless `spec` has one of the TOKENIZER_SPECS forms (files are checked when loaded)."""
  kind, sep, path = spec.partition(':')
  if spec != 'byte' and not (kind in ('sentencepiece', 'hf') and sep and path):
    raise ConfigError(f'data.tokenizer={spec!r} is not a tokenizer; write one of: {", ".join(TOKENIZER_SPECS)}')
