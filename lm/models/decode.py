"""KV-cached decoding on arrays: prefill the prompt in one call, then one token per step.

Decoder-only models (GPT, Llama): prompts are left-padded to a common length (segment id 0 on the padding,
positions counting real tokens only) so every row's next token lands in the same cache slot. Encoder-decoders
(T5): prompts are the encoder inputs; the encoder runs once and the decoder starts from `decoder_start_id` on its
cache. The steps run inside one jitted `lax.while_loop` that stops when every row has emitted EOS. Which of the two
a model is comes from its family record (`Family.decoding`, a `Decoding`: its prefill and its step, the loop asking
nothing else of the model); `lm.jobs.generate` is the text front end.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ConfigError


@dataclass(frozen=True)
class Sampling:
  """Greedy at temperature 0; otherwise softmax(logits / temperature) over the `top_k` likeliest
  tokens, cut to the smallest set whose probability reaches `top_p` (nucleus)."""
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self) -> None:
    if self.temperature < 0:
      raise ConfigError(f'temperature={self.temperature} must be >= 0 (0 decodes greedily)')
    if self.top_k is not None and self.top_k < 1:
      raise ConfigError(f'top_k={self.top_k} must be a positive number of tokens')
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ConfigError(f'top_p={self.top_p} must lie in (0, 1]')


def sample_logits(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
  """Next tokens [batch] drawn from logits [batch, vocab]."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32)
  if sampling.top_k is None and sampling.top_p is None:
    return jax.random.categorical(rng, logits / sampling.temperature, axis=-1).astype(jnp.int32)
  values, indices = jax.lax.top_k(logits, min(sampling.top_k or logits.shape[-1], logits.shape[-1]))
  values = values / sampling.temperature  # sorted, likeliest first
  if sampling.top_p is not None:
    probs = jax.nn.softmax(values, axis=-1)
    likelier = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
    values = jnp.where(likelier < sampling.top_p, values, -jnp.inf)
  choice = jax.random.categorical(rng, values, axis=-1)
  return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
  """Token ids and segment ids (1 real, 0 padding) [batch, longest], padded on the left or the right."""
  length = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  segment_ids = np.zeros((len(prompts), length), np.int32)
  for row, prompt in enumerate(prompts):
    cols = slice(length - len(prompt), length) if left else slice(0, len(prompt))
    tokens[row, cols], segment_ids[row, cols] = prompt, 1
  return tokens, segment_ids


def init_cache(model: nn.Module, batch: int, length: int, context: tuple[jax.Array, jax.Array] | None = None
               ) -> Any:
  """A zeroed cache for `length` decoder tokens (the params `init` also builds are dead code under jit)."""
  tokens = jnp.zeros((batch, length), jnp.int32)
  if context is None:
    return model.init(jax.random.key(0), tokens, decode=True)['cache']
  return model.init(jax.random.key(0), context[0], tokens, decode=True, method='decode')['cache']


def take_cache_rows(model: nn.Module, cache: Any, rows: jax.Array) -> Any:
  """The cache of a decoder-only `model` with its batch rows taken at `rows` (repeats allowed): one prefilled
  context continued by several rows. Each leaf's batch axis is where its shape differs from a cache of twice the
  batch (axis 1 under scanned layers), read abstractly."""
  batch, length = next((x.shape[-4], x.shape[-3]) for x in jax.tree.leaves(cache) if x.ndim >= 4)  # keys
  twice = jax.eval_shape(lambda: init_cache(model, 2 * batch, length))
  axes = jax.tree.map(lambda x, y: next((i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n), None),
                      cache, twice)
  return jax.tree.map(lambda x, axis: x if axis is None else jnp.take(x, rows, axis=axis), cache, axes)


def _cached_call(model: nn.Module, params: Any, cache: Any, tokens: jax.Array, segment_ids: jax.Array,
                 positions: jax.Array | None, context: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, Any]:
  """Appends `tokens` [batch, length] to the cache; logits [batch, vocab] after the last one, and the new cache."""
  variables = {'params': params, 'cache': cache}
  if context is None:
    logits, mutated = model.apply(variables, tokens, segment_ids, positions, decode=True, mutable=['cache'])
  else:
    encoded, encoded_segment_ids = context
    logits, mutated = model.apply(variables, encoded, tokens, encoded_segment_ids, segment_ids, decode=True,
                                  mutable=['cache'], method='decode')
  return logits[:, -1], mutated['cache']


class Decoding:
  """How a family samples: `prefill` runs the prompt batch once into a fresh cache, `step` feeds one token per
  row. Instances are hashable (a static argument of the jitted loop)."""
  kind: ClassVar[str]  # causal (a decoder continues its prompt) | seq2seq (the prompt is the encoder's input)
  shares_context: ClassVar[bool]  # prompt and new tokens share the decoder's positions (prompts left-padded)
  input_ends_with_eos: ClassVar[bool]  # the prompt ends with EOS, as the model's inputs did in training

  def __eq__(self, other: object) -> bool:
    return type(self) is type(other)

  def __hash__(self) -> int:
    return hash(type(self))

  def prefill(self, model: nn.Module, params: Any, prompt: jax.Array, prompt_segment_ids: jax.Array,
              max_new_tokens: int, decoder_start_id: jax.Array) -> tuple[jax.Array, Any, Any]:
    """(logits [batch, vocab] of the first new token, the cache, what `step` needs beside it)."""
    raise NotImplementedError

  def step(self, model: nn.Module, params: Any, cache: Any, token: jax.Array, t: jax.Array, state: Any
           ) -> tuple[jax.Array, Any]:
    """(logits [batch, vocab], cache) after feeding `token` [batch], the `t`-th new token (from 1)."""
    raise NotImplementedError


class DecoderOnly(Decoding):
  """Prompts left-padded to a common length (positions counting real tokens only), so every row's next token
  lands in the same cache slot."""
  kind, shares_context, input_ends_with_eos = 'causal', True, False

  def prefill(self, model, params, prompt, prompt_segment_ids, max_new_tokens, decoder_start_id):
    lengths = prompt_segment_ids.sum(axis=1)
    positions = jnp.maximum(jnp.cumsum(prompt_segment_ids, axis=1) - 1, 0)  # padding takes position 0
    cache = init_cache(model, prompt.shape[0], prompt.shape[1] + max_new_tokens - 1, None)
    logits, cache = _cached_call(model, params, cache, prompt, prompt_segment_ids, positions, None)
    return logits, cache, lengths

  def step(self, model, params, cache, token, t, state):
    positions = (state + t - 1)[:, None]  # real tokens before the fed one
    return _cached_call(model, params, cache, token[:, None], jnp.ones_like(token[:, None]), positions, None)


class EncoderDecoder(Decoding):
  """The encoder runs once on the prompts; the decoder starts from `decoder_start_id` on its own cache."""
  kind, shares_context, input_ends_with_eos = 'seq2seq', False, True

  def prefill(self, model, params, prompt, prompt_segment_ids, max_new_tokens, decoder_start_id):
    context = (model.apply({'params': params}, prompt, prompt_segment_ids, method='encode'), prompt_segment_ids)
    first = jnp.full((prompt.shape[0], 1), decoder_start_id, jnp.int32)
    cache = init_cache(model, prompt.shape[0], max_new_tokens, context)
    logits, cache = _cached_call(model, params, cache, first, jnp.ones_like(first), None, context)
    return logits, cache, context

  def step(self, model, params, cache, token, t, state):
    return _cached_call(model, params, cache, token[:, None], jnp.ones_like(token[:, None]), None, state)


@functools.partial(jax.jit, static_argnames=('model', 'decoding', 'max_new_tokens', 'sampling', 'keep_logits'))
def decode_batch(model: nn.Module, params: Any, prompt: jax.Array, prompt_segment_ids: jax.Array, rng: jax.Array,
                 *, decoding: Decoding, max_new_tokens: int, sampling: Sampling, eos_id: int, pad_id: int,
                 decoder_start_id: int, keep_logits: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """The jitted loop on arrays: prompts [batch, length] as `pad_prompts` lays them out (left-padded where the
  `decoding` shares the prompt's context).

  Returns new tokens [batch, max_new_tokens], padding after each row's EOS and wherever the loop
  stopped early, and with `keep_logits` the float32 logits [batch, max_new_tokens, vocab] each was
  drawn from (zeros for steps never run). Token ids are traced, so new values do not recompile;
  `eos_id=-1` never stops.
  """
  batch = prompt.shape[0]

  def choose(logits: jax.Array, t: jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    token = jnp.where(done, pad_id, sample_logits(logits, jax.random.fold_in(rng, t), sampling))
    return token, done | (token == eos_id)

  logits, cache, state = decoding.prefill(model, params, prompt, prompt_segment_ids, max_new_tokens,
                                          decoder_start_id)
  token, done = choose(logits, jnp.int32(0), jnp.zeros((batch,), bool))
  out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
  kept = jnp.zeros((batch, max_new_tokens, logits.shape[-1]), jnp.float32).at[:, 0].set(logits) if keep_logits else None

  def unfinished(carry: tuple) -> jax.Array:
    t, _, _, done, _, _ = carry
    return (t < max_new_tokens) & ~jnp.all(done)

  def step(carry: tuple) -> tuple:
    t, cache, token, done, out, kept = carry
    logits, cache = decoding.step(model, params, cache, token, t, state)
    token, done = choose(logits, t, done)
    kept = None if kept is None else kept.at[:, t].set(logits.astype(jnp.float32))
    return t + 1, cache, token, done, out.at[:, t].set(token), kept

  *_, out, kept = jax.lax.while_loop(unfinished, step, (jnp.int32(1), cache, token, done, out, kept))
  return out, kept


DECODER_ONLY, ENCODER_DECODER = DecoderOnly(), EncoderDecoder()
