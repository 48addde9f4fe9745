"""KV-cached sampling: prefill the prompt in one call, then one token per step.

How depends on the family record's `decoding`. Decoder-only models (GPT, Llama): prompts are
left-padded to a common length (segment id 0 on the padding, positions counting real tokens
only) so every row's next token lands in the same cache slot. Encoder-decoders (T5): prompts are
the encoder inputs; the encoder runs once and the decoder starts from `decoder_start_id` on its
cache. The steps run inside one jitted `lax.while_loop` that stops when every row has emitted EOS.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import Config, ConfigError, ModelConfig
from lm.data.objectives import span_sentinels
from lm.data.tokenizers import Tokenizer, get_tokenizer
from lm.models import FAMILIES, build_model, get_family
from lm.models.family import Decoding
from lm.parallel.mesh import make_mesh
from lm.run_dir import load_params, read_config


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


def decoding(cfg: ModelConfig) -> Decoding:
  """How the family samples ('decoder' or 'encoder_decoder'); a ConfigError when it cannot."""
  mode = get_family(cfg.family).decoding
  if cfg.num_labels:
    raise ConfigError(f'this {cfg.family} model is a fine-tuned classifier (model.num_labels={cfg.num_labels}); it '
                      f'scores sequences instead of generating text')
  if mode is None:
    able = [name for name, f in FAMILIES.items() if f.decoding]
    raise ConfigError(f'model.family={cfg.family!r} cannot generate text; generation needs one of: {", ".join(able)}')
  return mode


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
  """Token ids and segment ids (1 real, 0 padding) [batch, longest], padded on the left or the right."""
  length = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  segment_ids = np.zeros((len(prompts), length), np.int32)
  for row, prompt in enumerate(prompts):
    cols = slice(length - len(prompt), length) if left else slice(0, len(prompt))
    tokens[row, cols], segment_ids[row, cols] = prompt, 1
  return tokens, segment_ids


def _init_cache(model: nn.Module, batch: int, length: int, context: tuple[jax.Array, jax.Array] | None) -> Any:
  """A zeroed cache for `length` decoder tokens (the params `init` also builds are dead code under jit)."""
  tokens = jnp.zeros((batch, length), jnp.int32)
  if context is None:
    return model.init(jax.random.key(0), tokens, decode=True)['cache']
  return model.init(jax.random.key(0), context[0], tokens, decode=True, method='decode')['cache']


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


@functools.partial(jax.jit, static_argnames=('model', 'max_new_tokens', 'sampling', 'keep_logits'))
def decode_batch(model: nn.Module, params: Any, prompt: jax.Array, prompt_segment_ids: jax.Array, rng: jax.Array,
                 *, max_new_tokens: int, sampling: Sampling, eos_id: int, pad_id: int, decoder_start_id: int,
                 keep_logits: bool = False) -> tuple[jax.Array, jax.Array | None]:
  """The jitted loop on arrays: prompts [batch, length] as `pad_prompts` lays them out (left-padded for GPT).

  Returns new tokens [batch, max_new_tokens], padding after each row's EOS and wherever the loop
  stopped early, and with `keep_logits` the float32 logits [batch, max_new_tokens, vocab] each was
  drawn from (zeros for steps never run). Token ids are traced, so new values do not recompile;
  `eos_id=-1` never stops.
  """
  batch = prompt.shape[0]
  if decoding(model.cfg) == 'encoder_decoder':
    context = (model.apply({'params': params}, prompt, prompt_segment_ids, method='encode'), prompt_segment_ids)
    first, first_positions, lengths = jnp.full((batch, 1), decoder_start_id, jnp.int32), None, None
    first_segment_ids = jnp.ones_like(first)
    cache = _init_cache(model, batch, max_new_tokens, context)
  else:
    context, first, first_segment_ids = None, prompt, prompt_segment_ids
    lengths = prompt_segment_ids.sum(axis=1)
    first_positions = jnp.maximum(jnp.cumsum(prompt_segment_ids, axis=1) - 1, 0)  # padding takes position 0
    cache = _init_cache(model, batch, prompt.shape[1] + max_new_tokens - 1, None)

  def choose(logits: jax.Array, t: jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    token = jnp.where(done, pad_id, sample_logits(logits, jax.random.fold_in(rng, t), sampling))
    return token, done | (token == eos_id)

  logits, cache = _cached_call(model, params, cache, first, first_segment_ids, first_positions, context)
  token, done = choose(logits, jnp.int32(0), jnp.zeros((batch,), bool))
  out = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token)
  kept = jnp.zeros((batch, max_new_tokens, logits.shape[-1]), jnp.float32).at[:, 0].set(logits) if keep_logits else None

  def unfinished(carry: tuple) -> jax.Array:
    t, _, _, done, _, _ = carry
    return (t < max_new_tokens) & ~jnp.all(done)

  def step(carry: tuple) -> tuple:
    t, cache, token, done, out, kept = carry
    positions = None if lengths is None else (lengths + t - 1)[:, None]  # real tokens before the fed one
    logits, cache = _cached_call(model, params, cache, token[:, None], jnp.ones((batch, 1), jnp.int32),
                                 positions, context)
    token, done = choose(logits, t, done)
    kept = None if kept is None else kept.at[:, t].set(logits.astype(jnp.float32))
    return t + 1, cache, token, done, out.at[:, t].set(token), kept

  *_, out, kept = jax.lax.while_loop(unfinished, step, (jnp.int32(1), cache, token, done, out, kept))
  return out, kept


def _check_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
  mode = decoding(cfg)
  if max_new_tokens < 1:
    raise ConfigError(f'max_new_tokens={max_new_tokens} must be at least 1')
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ConfigError('every prompt needs at least one token; pass non-empty prompts')
  ids = np.concatenate([np.asarray(p) for p in prompts])
  if ids.min() < 0 or ids.max() >= cfg.vocab_size:
    raise ConfigError(f'prompt ids must lie in [0, model.vocab_size={cfg.vocab_size}); got {ids.min()}..{ids.max()}')
  longest = max(len(p) for p in prompts)
  if mode == 'decoder' and cfg.position == 'learned' and longest + max_new_tokens > cfg.max_len:
    raise ConfigError(f'a {longest}-token prompt plus max_new_tokens={max_new_tokens} exceeds the position table '
                      f'model.max_len={cfg.max_len}; shorten the prompt or lower max_new_tokens')


def _run(model: nn.Module, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
         eos_id: int | None, pad_id: int, rng: jax.Array | None, decoder_start_id: int | None, keep_logits: bool
         ) -> tuple[list[list[int]], np.ndarray | None]:
  _check_prompts(model.cfg, prompts, max_new_tokens)
  if rng is None and sampling.temperature > 0:
    raise ConfigError('sampling at temperature > 0 needs an explicit rng key')
  tokens, segment_ids = pad_prompts(prompts, pad_id, left=decoding(model.cfg) == 'decoder')
  out, logits = decode_batch(model, params, tokens, segment_ids, jax.random.key(0) if rng is None else rng,
                             max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_id=-1 if eos_id is None else eos_id, pad_id=pad_id,
                             decoder_start_id=pad_id if decoder_start_id is None else decoder_start_id,
                             keep_logits=keep_logits)
  rows = [list(map(int, row)) for row in np.asarray(out)]
  if eos_id is not None:
    rows = [row[:row.index(eos_id) + 1] if eos_id in row else row for row in rows]
  return rows, None if logits is None else np.asarray(logits)


def generate(model: nn.Module, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_id: int | None = None, pad_id: int = 0,
             rng: jax.Array | None = None, decoder_start_id: int | None = None) -> list[list[int]]:
  """New token ids per prompt, up to `max_new_tokens` and ending at the first `eos_id` (kept).

  A decoder-only model continues each prompt; for an encoder-decoder the prompts are encoder inputs
  and the decoder starts from `decoder_start_id` (default `pad_id`, as in training). `rng` is needed
  when temperature > 0.
  """
  return _run(model, params, prompts, max_new_tokens, sampling, eos_id, pad_id, rng, decoder_start_id, False)[0]


def generate_with_logits(model: nn.Module, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                         sampling: Sampling = Sampling(), eos_id: int | None = None, pad_id: int = 0,
                         rng: jax.Array | None = None, decoder_start_id: int | None = None
                         ) -> tuple[list[list[int]], list[np.ndarray]]:
  """`generate`, plus per prompt the float32 logits [new tokens, vocab] each new token was drawn from."""
  rows, logits = _run(model, params, prompts, max_new_tokens, sampling, eos_id, pad_id, rng, decoder_start_id, True)
  return rows, [step_logits[:len(row)] for row, step_logits in zip(rows, logits)]


# ---------------------------------------------------------------- runs and text

def load_run(run_dir: str | Path, overrides: Sequence[str] = ()) -> tuple[Config, Any]:
  """A run's config (config.yaml with `key=value` overrides) and the params of its latest checkpoint,
  trained or imported, on this machine's devices: split over mesh.fsdp and mesh.tensor as configured,
  replicated over the data axis, which takes the devices left over."""
  config = read_config(run_dir, list(overrides))
  mesh = config.mesh
  if -1 not in (mesh.fsdp, mesh.tensor):
    mesh = dataclasses.replace(mesh, data=-1)
  _, params = load_params(run_dir, make_mesh(mesh))
  return config, params


_SENTINEL = re.compile(r'<extra_id_(\d+)>')


def _sentinels(config: Config, tokenizer: Tokenizer) -> np.ndarray:
  """An encoder-decoder's span sentinel ids (<extra_id_N> is entry N); none for decoders or small vocabularies."""
  if decoding(config.model) != 'encoder_decoder':
    return np.zeros(0, np.int64)
  try:
    return span_sentinels(tokenizer, config.model.vocab_size)
  except ValueError:
    return np.zeros(0, np.int64)


def encode_prompt(config: Config, tokenizer: Tokenizer, text: str) -> list[int]:
  """Prompt ids as training saw them: decoder-only documents open with BOS; encoder inputs end with EOS
  and may name span sentinels as <extra_id_N>."""
  if not text:
    raise ConfigError('a prompt is empty; pass some text with --prompt')
  if decoding(config.model) == 'decoder':
    return [tokenizer.bos_id, *tokenizer.encode(text).tolist()]
  sentinels = _sentinels(config, tokenizer)
  ids = []
  for i, part in enumerate(_SENTINEL.split(text)):  # text, sentinel number, text, ...
    if i % 2 and int(part) >= len(sentinels):
      raise ConfigError(f'<extra_id_{part}> is beyond the {len(sentinels)} sentinels of this model')
    ids += [int(sentinels[int(part)])] if i % 2 else tokenizer.encode(part).tolist()
  return ids + [tokenizer.eos_id]


def decode_ids(config: Config, tokenizer: Tokenizer, ids: Sequence[int]) -> str:
  """Text of generated ids; an encoder-decoder's span sentinels are shown as <extra_id_N>."""
  names = {int(s): f'<extra_id_{n}>' for n, s in enumerate(_sentinels(config, tokenizer))}
  text, run = [], []
  for i in ids:
    if i in names:
      text += [tokenizer.decode(run), names[i]]
      run = []
    else:
      run.append(i)
  return ''.join(text + [tokenizer.decode(run)])


def generate_text(config: Config, params: Any, prompts: Sequence[str], *, max_new_tokens: int,
                  sampling: Sampling = Sampling(), rng: jax.Array | None = None) -> list[str]:
  """Continuations (decoder-only) or decoder outputs (encoder-decoder) of text prompts, stopping at EOS."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  ids = [encode_prompt(config, tokenizer, text) for text in prompts]
  out = generate(build_model(config.model), params, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                 eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, rng=rng)
  return [decode_ids(config, tokenizer, row) for row in out]
