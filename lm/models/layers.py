"""The layer library every family composes: each module does one job and names its axes.

Parameters carry logical axis names through `nn.with_logical_partitioning`; key
activations are pinned with `constrain(x, (...))`. Mesh axes never appear here.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lm.config import LoraConfig, ModelConfig
from lm.models.parametrization import Init
from lm.models.rope import Rope, rotary
from lm.ops import mixed
from lm.ops.int8 import frozen_int8_matmul, int8_matmul, quantize_kernel
from lm.ops.attention import attention
from lm.ops.unembed import Unembedding
from lm.parallel.rules import constrain

Dtype = Any
Initializer = Callable[..., jax.Array]

KERNEL_SCALE = 'kernel_scale'  # an int8 base's per-output-channel scales, beside its int8 `kernel`
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}
STANDARD = Init(ModelConfig())  # a layer built alone: the default model's standard init


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (x,)


def _matmul_2d(x: jax.Array, kernel: jax.Array, axis: tuple[int, ...], dtype: Dtype, quantized: bool = False
               ) -> jax.Array:
  """Contracts `axis` of x with the leading dims of kernel as one [tokens, in] x [in, out] matmul in `dtype`
  (float32 accumulation, `mixed.einsum`); `quantized`: in int8 (`lm.ops.int8`, trailing contracted axes).

  Keeping both the input and the output gradient 2D makes the kernel gradient a single
  matmul contracting over tokens, which XLA:CPU runs without materialising a transposed
  copy of the (fused) output gradient.
  """
  n_in = len(axis)
  if axis != tuple(range(x.ndim - n_in, x.ndim)):  # contract leading axes: let einsum order them
    letters = 'abcdefghijklmnop'[:x.ndim]
    k_in = ''.join(letters[a] for a in axis)
    k_out = 'uvwxyz'[:kernel.ndim - n_in]
    x_out = ''.join(c for i, c in enumerate(letters) if i not in axis)
    return mixed.einsum(f'{letters},{k_in}{k_out}->{x_out}{k_out}', x, kernel, dtype=dtype)
  batch_shape, out_shape = x.shape[:x.ndim - n_in], kernel.shape[n_in:]
  x2, k2 = x.reshape(-1, math.prod(kernel.shape[:n_in])), kernel.reshape(-1, math.prod(out_shape))
  y = int8_matmul(x2, k2, dtype) if quantized else mixed.einsum('ti,io->to', x2, k2, dtype=dtype)
  return y.reshape(batch_shape + out_shape)


class DenseGeneral(nn.Module):
  """Linear map contracting `axis` of the input onto `features` (which may be several dims)."""
  features: int | tuple[int, ...]
  kernel_axes: tuple[str, ...]
  axis: int | tuple[int, ...] = -1
  use_bias: bool = False
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.normal(0.02)
  quantized: bool = False  # the matmul in int8 (model.quantization=int8)
  lora: LoraConfig | None = None  # low-rank adapters, when `lora.targets` names this module

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = _tuple(self.features)
    axis = tuple(a % x.ndim for a in _tuple(self.axis))
    kernel_shape = tuple(x.shape[a] for a in axis) + features
    if self.quantized and self.lora is not None:  # a frozen base in int8: QLoRA's way
      y = self._frozen_int8(x, kernel_shape, axis)
    else:
      kernel = self.param('kernel', nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
                          kernel_shape, self.param_dtype)
      y = _matmul_2d(x, kernel, axis, self.dtype, self.quantized)
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[len(axis):]),
                        features, self.param_dtype)
      y = y + bias.astype(self.dtype)
    if self.lora is not None and self.name in self.lora.targets:
      y = y + self._adapted(x, kernel_shape[:len(axis)], features, axis)
    return y

  def _frozen_int8(self, x: jax.Array, kernel_shape: tuple[int, ...], axis: tuple[int, ...]) -> jax.Array:
    """x times the kernel stored as int8 values (`kernel`) and per-output-channel float32 scales (`kernel_scale`:
    the kernel's shape with the contracted axes 1), both drawn from one float init (a base from train.init_from
    is quantized as it loads: `lm.models.lora.as_stored`)."""
    n_in = len(axis)
    if axis != tuple(range(x.ndim - n_in, x.ndim)):
      raise NotImplementedError('an int8 base contracts its input\'s trailing axes')
    scale_shape = (1,) * n_in + kernel_shape[n_in:]
    drawn: dict[str, jax.Array] = {}

    def draw(key: jax.Array, part: int) -> jax.Array:  # the values' init draws; the scales' reuses that draw
      if not drawn:
        drawn['values'], drawn['scales'] = quantize_kernel(self.kernel_init(key, kernel_shape, jnp.float32),
                                                           scale_shape)
      return drawn['values' if part == 0 else 'scales']
    values = self.param('kernel', nn.with_logical_partitioning(lambda key: draw(key, 0), self.kernel_axes))
    scales = self.param(KERNEL_SCALE, nn.with_logical_partitioning(
      lambda key: draw(key, 1), (None,) * n_in + tuple(self.kernel_axes[n_in:])))
    batch_shape, features = x.shape[:x.ndim - n_in], kernel_shape[n_in:]
    x2 = x.reshape(-1, math.prod(kernel_shape[:n_in]))
    y = frozen_int8_matmul(x2, values.reshape(x2.shape[1], -1), scales.reshape(1, -1), self.dtype)
    return y.reshape(batch_shape + features)

  def _adapted(self, x: jax.Array, ins: tuple[int, ...], features: tuple[int, ...], axis: tuple[int, ...]
               ) -> jax.Array:
    """The adapters' (alpha / rank) x (x A) B: A `lora_a` [*in, rank], B `lora_b` [rank, *out], in full precision
    (never int8) and their input dropped out while training (a 'dropout' rng given)."""
    lora, n_in = self.lora, len(ins)
    bound = math.prod(ins) ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)): U(+-1/sqrt(fan in))
    uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
    a = self.param('lora_a', nn.with_logical_partitioning(uniform, (*self.kernel_axes[:n_in], None)),
                   (*ins, lora.rank), self.param_dtype)
    b = self.param('lora_b', nn.with_logical_partitioning(nn.initializers.zeros, (None, *self.kernel_axes[n_in:])),
                   (lora.rank, *features), self.param_dtype)
    if lora.dropout:
      x = nn.Dropout(lora.dropout)(x, deterministic=not self.has_rng('dropout'))
    low = _matmul_2d(x, a, axis, self.dtype)
    return _matmul_2d(low, b, (low.ndim - 1,), self.dtype) * jnp.asarray(lora.scale, self.dtype)


def gathered(table: jax.Array, axes: tuple[str | None, str]) -> jax.Array:
  """A lookup table with its feature axis whole (gathered over fsdp, as a dense layer's weight is) before a
  gather by token: rows sharded on features cannot take the batch-sharded gradient of the lookup without
  a full copy (XLA's "involuntary full rematerialization"); the row axis keeps its sharding."""
  return constrain(table, (axes[0], None))


class Embed(nn.Module):
  """Token embedding table [vocab, embed]; `attend` reuses it as the tied output layer."""
  num_embeddings: int
  features: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  inits: Init = STANDARD
  axes: tuple[str | None, str] = ('vocab', 'embed')
  scale: float = 1.0  # applied to looked-up rows only, not to the tied output layer

  def setup(self) -> None:
    self.embedding = self.param(
      'embedding', nn.with_logical_partitioning(self.inits('embedding', self.axes), self.axes),
      (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    rows = jnp.take(gathered(self.embedding, self.axes), ids, axis=0)
    return (rows * self.scale if self.scale != 1.0 else rows).astype(self.dtype)

  def unembed(self, x: jax.Array, bias: jax.Array | None = None, chunk: int = 0, softcap: float = 0.0
              ) -> Unembedding:
    """The tied output layer on hidden states `x` [batch, length, embed]: logits against the table."""
    return Unembedding(x, self.embedding, bias, layout='vd', axes=self.axes, dtype=self.dtype, chunk=chunk,
                       softcap=softcap)


class LMHead(nn.Module):
  """An untied output layer: its kernel [embed, vocab] applied by `Unembedding.logits` or the tiled loss."""
  vocab_size: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  inits: Init = STANDARD
  chunk: int = 0  # the tiled loss's sequence positions per tile
  softcap: float = 0.0  # > 0: logits soft-capped

  @nn.compact
  def __call__(self, x: jax.Array) -> Unembedding:
    axes = ('embed', 'vocab')
    kernel = self.param('kernel', nn.with_logical_partitioning(self.inits('readout', axes), axes),
                        (x.shape[-1], self.vocab_size), self.param_dtype)
    return Unembedding(x, kernel, None, layout='dv', axes=axes, dtype=self.dtype, chunk=self.chunk,
                       softcap=self.softcap)


class LayerNorm(nn.Module):
  """LayerNorm in float32 (mean and variance), optional scale and bias (neither: OLMo's non-parametric norm)."""
  eps: float = 1e-5
  use_bias: bool = True
  use_scale: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = x.shape[-1]
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.eps)
    if self.use_scale:
      scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
                         (features,), self.param_dtype)
      y = y * scale.astype(jnp.float32)
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                        (features,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.dtype)


class RMSNorm(nn.Module):
  """Root-mean-square norm (no mean, no bias), as in T5 and LLaMA; computed in float32."""
  eps: float = 1e-6
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  # the normalised trailing axes' logical names: ('embed',); ('kv',) per head; ('heads', 'kv') all heads at once
  axes: tuple[str, ...] = ('embed',)
  plus_one: bool = False  # scale by (1 + w), w starting at 0 (Gemma)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    over = tuple(range(-len(self.axes), 0))
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=over, keepdims=True) + self.eps)
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param('scale', nn.with_logical_partitioning(init, self.axes), x.shape[over[0]:], self.param_dtype)
    scale = scale.astype(jnp.float32)
    return (y * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


NORMS: dict[str, Callable[..., nn.Module]] = {  # keys: lm.config.Norm
  'layernorm': LayerNorm, 'rmsnorm': RMSNorm,
  'nonparametric_layernorm': functools.partial(LayerNorm, use_scale=False, use_bias=False)}


def make_norm(kind: str, eps: float, dtype: Dtype, param_dtype: Dtype, name: str, plus_one: bool = False
              ) -> nn.Module:
  extra = {'plus_one': True} if plus_one else {}  # RMSNorm's (1 + w) (model.norm_plus_one)
  return NORMS[kind](eps=eps, dtype=dtype, param_dtype=param_dtype, name=name, **extra)


# Keys: lm.config.Activation, plain here and gated in GATED.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  'gelu': lambda x: jax.nn.gelu(x, approximate=False),
  'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
  'relu': jax.nn.relu,
  'silu': jax.nn.silu,
}
# act(x W0) * (x W1); clamped_swiglu's gate is a clamped sigmoid of slope alpha (`gated_unit`)
GATED = {'geglu': 'gelu', 'geglu_tanh': 'gelu_tanh', 'swiglu': 'silu', 'reglu': 'relu', 'clamped_swiglu': 'silu'}


def gated_unit(activation: str, alpha: float = 1.702, limit: float = 7.0
               ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A gated MLP's unit of (g, u) = (x W0, x W1): act(g) * u, or for clamped_swiglu GPT-OSS's
  (clip(u, -limit, limit) + 1) * g' sigmoid(alpha g'), g' = min(g, limit)."""
  if activation == 'clamped_swiglu':
    def clamped(g: jax.Array, u: jax.Array) -> jax.Array:
      g = jnp.minimum(g, limit)
      return (jnp.clip(u, -limit, limit) + 1) * g * jax.nn.sigmoid(alpha * g)
    return clamped
  act = ACTIVATIONS[GATED[activation]]
  return lambda g, u: act(g) * u


class Mlp(nn.Module):
  """Position-wise feed-forward: embed -> mlp -> embed, plain or gated."""
  d_ff: int
  activation: str = 'gelu'
  use_bias: bool = True
  inits: Init = STANDARD
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  quantized: bool = False  # its matmuls in int8
  swiglu: tuple[float, float] = (1.702, 7.0)  # clamped_swiglu's (alpha, limit)
  lora: LoraConfig | None = None  # adapters on the projections it names

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, quantized=self.quantized,
                 lora=self.lora)
    init = self.inits('mlp_in', ('embed', 'mlp'))
    if self.activation in GATED:
      gate = DenseGeneral(self.d_ff, ('embed', 'mlp'), kernel_init=init, name='wi_0', **dense)(x)
      up = DenseGeneral(self.d_ff, ('embed', 'mlp'), kernel_init=init, name='wi_1', **dense)(x)
      h = gated_unit(self.activation, *self.swiglu)(gate, up)
    else:
      h = DenseGeneral(self.d_ff, ('embed', 'mlp'), kernel_init=init, name='wi', **dense)(x)
      h = ACTIVATIONS[self.activation](h)
    h = constrain(h, ('batch', 'length', 'mlp'))
    out = DenseGeneral(x.shape[-1], ('mlp', 'embed'), kernel_init=self.inits('mlp_out', ('mlp', 'embed')),
                       name='wo', **dense)(h)
    return checkpoint_name(out, 'mlp_out')


def in_chunks(mlp: nn.Module, x: jax.Array, chunks: int) -> jax.Array:
  """`mlp(x)` for a position-wise `mlp`, scanned over `chunks` interleaved slices of x's positions (slice j holds
  positions j, j + chunks, ...: a length sharded over devices stays sharded) with each slice rematerialised, so only
  one slice's intermediates are live, in the forward and the backward pass. Lengths it does not divide (a decode
  step) run whole."""
  batch, length, features = x.shape
  if chunks == 1 or length % chunks:
    return mlp(x)
  slices = jnp.moveaxis(x.reshape(batch, length // chunks, chunks, features), 2, 0)
  step = nn.remat(lambda module, carry, h: (carry, module(h)), prevent_cse=False)
  _, out = nn.scan(step, variable_broadcast='params', split_rngs={'params': False, 'dropout': True},
                   length=chunks)(mlp, None, slices)
  return jnp.moveaxis(out, 0, 2).reshape(batch, length, out.shape[-1])


class Attention(nn.Module):
  """Multi-head attention (self or cross) with per-head projections; the kernel comes from `impl`.

  `num_kv_heads` < `num_heads` is grouped-query attention: each key/value head serves
  num_heads / num_kv_heads query heads. `rope` rotates queries and keys by their `positions`
  (`lm.models.rope`).

  With `decode=True`, self-attention keeps a key/value cache ('cache' collection): `init` with a
  [batch, max_len] input sizes it; each later call appends its tokens at the cache index and
  attends to everything cached so far. Cached segment ids mask left padding.
  """
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None  # default num_heads
  rope: Rope | None = None  # None: no rotary positions
  use_bias: bool = True
  qkv_bias: bool = False  # biases on the query, key and value projections even without use_bias
  qk_norm_eps: float | None = None  # RMSNorm of the queries and keys (before the rotation); None: none
  qk_norm_all_heads: bool = False  # that norm over all heads' features at once (OLMo 2), not each head's
  qk_norm_plus_one: bool = False  # that norm scales by (1 + w) (Gemma 3)
  clip: float = 0.0  # > 0: query, key and value projections clipped to [-clip, clip] (OLMo), after any qk norm
  window: int = 0  # > 0: a causal query sees the keys fewer than this many positions back
  softcap: float = 0.0  # > 0: logits soft-capped to (-softcap, softcap)
  sinks: bool = False  # a learned sink logit per query head ('sinks' [heads], float32, starting at 0)
  impl: str = 'xla'
  block_q: int = 128  # kernel block sizes (flash)
  block_k: int = 128
  logit_scale: float | None = None  # None: 1/sqrt(head_dim)
  dropout_rate: float = 0.0
  inits: Init = STANDARD
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  quantized: bool = False  # its projections in int8
  lora: LoraConfig | None = None  # adapters on the projections it names
  # (x, positions) -> queries, keys, values in place of the projections: latent attention (`lm.models.mla`), whose
  # params it makes in this module; with absorbed=True (decoding) the latent form, whose keys alone are cached
  latent: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]] | None = None

  @nn.compact
  def __call__(self, x_q: jax.Array, x_kv: jax.Array, *, causal: bool, segment_ids: jax.Array | None = None,
               kv_segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               bias: jax.Array | None = None, deterministic: bool = True, decode: bool = False,
               global_layer: bool | jax.Array = False) -> jax.Array:
    """`global_layer` (traced in a scanned stack) lifts the window: the layer attends to every earlier key."""
    dense = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, quantized=self.quantized,
                 lora=self.lora)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(x_q.shape[1], dtype=jnp.int32), x_q.shape[:2])
    expand = None  # decoding latent attention: the value expansion applied after attending to the latents
    if self.latent is not None and decode:  # the cache keeps each token's latent and rotated key part alone
      q, k, expand = self.latent(x_q, positions, absorbed=True)
      v = k[..., :0]  # the values are the keys' latent part, sliced from the cache
    elif self.latent is not None:
      q, k, v = self.latent(x_q, positions)
    else:
      q, k, v = self._projections(x_q, x_kv, positions, global_layer)
    q = checkpoint_name(constrain(q, ('batch', 'length', 'heads', 'kv')), 'query_proj')
    k = checkpoint_name(constrain(k, ('batch', 'length', 'kv_heads', 'kv')), 'key_proj')
    v = checkpoint_name(constrain(v, ('batch', 'length', 'kv_heads', 'kv')), 'value_proj')
    mask = None
    window = self.window if causal and global_layer is not True else 0
    if decode:
      k, v, kv_segment_ids, mask = self._extend_cache(k, v, segment_ids, window, global_layer)
      if expand is not None:
        v = k[..., :expand.shape[0]]
      window = 0  # in the cache's mask
      causal = False  # the cache mask already orders queries after the keys they may see
      if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng('dropout')
    sinks = self.param('sinks', nn.with_logical_partitioning(nn.initializers.zeros, ('heads',)), (self.num_heads,),
                       jnp.float32) if self.sinks else None
    attend = lambda window: attention(
      q, k, v, causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, mask=mask, bias=bias,
      scale=self.head_dim ** -0.5 if expand is not None and self.logit_scale is None else self.logit_scale,
      window=window, softcap=self.softcap,
      impl='xla' if decode else self.impl,  # one query per step: no kernel to gain from
      dropout_rate=0.0 if deterministic else self.dropout_rate, dropout_rng=dropout_rng, block_q=self.block_q,
      block_k=self.block_k, sinks=sinks)
    if window and isinstance(global_layer, jax.Array):  # a scanned layer: both programs, one runs
      out = jax.lax.cond(global_layer, lambda: attend(0), lambda: attend(window))
    else:
      out = attend(window)
    if expand is not None:
      out = mixed.einsum('blhr,rhv->blhv', out, expand, dtype=self.dtype)
    out = constrain(out, ('batch', 'length', 'heads', 'kv'))
    out_axes = ('heads', 'kv', 'embed')
    out = DenseGeneral(x_q.shape[-1], out_axes, axis=(-2, -1), kernel_init=self.inits('attention_out', out_axes),
                       name='out', **dense)(out)
    return checkpoint_name(out, 'attention_out')

  def _projections(self, x_q: jax.Array, x_kv: jax.Array, positions: jax.Array, global_layer: bool | jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of their own projections, normed, clipped and rotated as the fields ask."""
    dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, quantized=self.quantized, lora=self.lora)
    kv_heads = self.num_kv_heads or self.num_heads
    projection = {**dense, 'use_bias': self.use_bias or self.qkv_bias}
    q_axes = ('embed', 'heads', 'kv')
    q = DenseGeneral((self.num_heads, self.head_dim), q_axes, kernel_init=self.inits('query', q_axes),
                     name='query', **projection)(x_q)
    kv_shape, kv_axes = (kv_heads, self.head_dim), ('embed', 'kv_heads', 'kv')
    kv_init = self.inits('key_value', kv_axes)
    k = DenseGeneral(kv_shape, kv_axes, kernel_init=kv_init, name='key', **projection)(x_kv)
    v = DenseGeneral(kv_shape, kv_axes, kernel_init=kv_init, name='value', **projection)(x_kv)
    if self.qk_norm_eps is not None:
      norm = lambda name, heads: RMSNorm(self.qk_norm_eps, self.dtype, self.param_dtype, name=name,
                                         axes=(heads, 'kv') if self.qk_norm_all_heads else ('kv',),
                                         plus_one=self.qk_norm_plus_one)
      q, k = norm('query_norm', 'heads')(q), norm('key_norm', 'kv_heads')(k)
    if self.clip:  # after the norms (OLMoE, the one released model with both)
      q, k, v = (jnp.clip(a, -self.clip, self.clip) for a in (q, k, v))
    if self.rope is not None:
      windowed = bool(self.window) and (jnp.logical_not(global_layer) if isinstance(global_layer, jax.Array)
                                        else not global_layer)
      q, k = rotary(q, positions, self.rope, windowed), rotary(k, positions, self.rope, windowed)
    return q, k, v

  def _extend_cache(self, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, window: int,
                    global_layer: bool | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Writes this call's keys/values at the cache index; returns the keys/values to attend to and their mask
    (causal, and within `window` slots when it is > 0: the cache holds a row's tokens in consecutive slots).

    A layer that is always windowed (not one of a scanned stack that has global layers too: those share one cache
    shape, so they keep every slot and mask) keeps only its last `window` tokens, in a ring: a call attends to the
    ring and its own tokens, then overwrites the oldest slots."""
    ring = bool(window) and not isinstance(global_layer, jax.Array)
    initialising = not self.has_variable('cache', 'cached_key')
    slots = min(k.shape[1], window) if ring and initialising else k.shape[1]
    cached_k = self.variable('cache', 'cached_key', jnp.zeros, (k.shape[0], slots, *k.shape[2:]), k.dtype)
    cached_v = self.variable('cache', 'cached_value', jnp.zeros, (v.shape[0], slots, *v.shape[2:]), v.dtype)
    cached_seg = self.variable('cache', 'segment_ids', jnp.zeros, (k.shape[0], slots), jnp.int32)
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    if initialising:
      return k, v, jnp.ones(k.shape[:2], jnp.int32), None
    length, i = k.shape[1], index.value
    seg = jnp.ones(k.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    index.value = i + length
    q_index = i + jnp.arange(length)
    if ring and cached_k.value.shape[1] == window:
      return self._extend_ring(k, v, seg, q_index, cached_k, cached_v, cached_seg, window)
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k.astype(cached_k.value.dtype), (0, i, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v.astype(cached_v.value.dtype), (0, i, 0, 0))
    cached_seg.value = jax.lax.dynamic_update_slice(cached_seg.value, seg, (0, i))
    offset = q_index[:, None] - jnp.arange(cached_k.value.shape[1])[None, :]  # [q, slots]
    visible = (offset >= 0) & ((offset < window) | global_layer) if window else offset >= 0
    return cached_k.value, cached_v.value, cached_seg.value, visible[None, None]

  def _extend_ring(self, k: jax.Array, v: jax.Array, seg: jax.Array, q_index: jax.Array, cached_k: Any,
                   cached_v: Any, cached_seg: Any, window: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The ring's keys then this call's (so a prompt longer than the window still sees its own last `window`
    tokens); then this call's last `window` tokens overwrite the slots index mod window."""
    # which token each slot holds: the ring is written in order, so slot s holds the latest index = s mod window
    start = q_index[0]
    slot = jnp.arange(window)
    held = start - 1 - (start - 1 - slot) % window
    held = jnp.where(held >= 0, held, -window)  # never written: out of every query's window
    kv_index = jnp.concatenate([held, q_index])
    offset = q_index[:, None] - kv_index[None, :]
    visible = (offset >= 0) & (offset < window)
    keys = jnp.concatenate([cached_k.value, k.astype(cached_k.value.dtype)], axis=1)
    values = jnp.concatenate([cached_v.value, v.astype(cached_v.value.dtype)], axis=1)
    segments = jnp.concatenate([cached_seg.value, seg], axis=1)
    kept = min(k.shape[1], window)
    written = q_index[-kept:] % window
    cached_k.value = cached_k.value.at[:, written].set(k[:, -kept:].astype(cached_k.value.dtype))
    cached_v.value = cached_v.value.at[:, written].set(v[:, -kept:].astype(cached_v.value.dtype))
    cached_seg.value = cached_seg.value.at[:, written].set(seg[:, -kept:])
    return keys, values, segments, visible[None, None]


def relative_position_bucket(relative_position: jax.Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jax.Array:
  """T5's buckets of (key - query) offsets: exact for small ones, log-spaced up to `max_distance`."""
  bucket = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  large = max_exact + (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
                       / np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
  """T5 relative position bias [1, heads, q_len, k_len], one table per stack shared by its layers."""
  num_heads: int
  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True
  inits: Init = STANDARD
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, q_len: int, k_len: int, q_offset: jax.Array | int = 0) -> jax.Array:
    axes = ('heads', 'relpos_buckets')
    table = self.param('rel_embedding', nn.with_logical_partitioning(self.inits('relative', axes), axes),
                       (self.num_heads, self.num_buckets), self.param_dtype)
    relative = jnp.arange(k_len)[None, :] - (q_offset + jnp.arange(q_len))[:, None]
    buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
    values = jnp.take(table.astype(self.dtype), buckets, axis=1)  # [heads, q, k]
    return values[None]


class LearnedPositions(nn.Module):
  """Learned absolute position table [max_len, embed], indexed by per-token positions."""
  max_len: int
  features: int
  inits: Init = STANDARD
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    axes = ('position', 'embed')
    table = self.param('embedding', nn.with_logical_partitioning(self.inits('embedding', axes), axes),
                       (self.max_len, self.features), self.param_dtype)
    return jnp.take(gathered(table, ('position', 'embed')), positions, axis=0).astype(self.dtype)


def sinusoidal_positions(positions: jax.Array, features: int, max_timescale: float = 1e4) -> jax.Array:
  """Vaswani et al. encodings, [..., features]: sin on the first half, cos on the second."""
  half = features // 2
  inv_freq = np.exp(-math.log(max_timescale) * np.arange(half) / max(half - 1, 1)).astype(np.float32)
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  enc = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  return jnp.pad(enc, [(0, 0)] * (enc.ndim - 1) + [(0, features - 2 * half)])
