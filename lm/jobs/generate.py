"""`lm generate`: text in, text out, through the KV-cached loop of `lm.models.decode`.

Prompts are laid out as the family record's `decoding` needs (left-padded for a decoder-only model, encoder inputs
for an encoder-decoder); T5's span sentinels are named in prompts and outputs as `<extra_id_N>`.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lm.config import Config, ConfigError, ModelConfig
from lm.data.objectives import span_sentinels
from lm.data.tokenizers import Tokenizer, get_tokenizer
from lm.models import FAMILIES, build_model, get_family
from lm.models.decode import Decoding, Sampling, decode_batch, pad_prompts


def decoding(cfg: ModelConfig) -> Decoding:
  """How the family samples (`lm.models.decode.Decoding`); a ConfigError when it cannot."""
  mode = get_family(cfg.family).decoding
  if cfg.num_labels:
    raise ConfigError(f'this {cfg.family} model is a fine-tuned classifier (model.num_labels={cfg.num_labels}); it '
                      f'scores sequences instead of generating text')
  if mode is None:
    able = [name for name, f in FAMILIES.items() if f.decoding]
    raise ConfigError(f'model.family={cfg.family!r} cannot generate text; generation needs one of: {", ".join(able)}')
  return mode


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
  if mode.shares_context and cfg.position == 'learned' and longest + max_new_tokens > cfg.max_len:
    raise ConfigError(f'a {longest}-token prompt plus max_new_tokens={max_new_tokens} exceeds the position table '
                      f'model.max_len={cfg.max_len}; shorten the prompt or lower max_new_tokens')


def _run(model: nn.Module, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling,
         eos_id: int | None, pad_id: int, rng: jax.Array | None, decoder_start_id: int | None, keep_logits: bool
         ) -> tuple[list[list[int]], np.ndarray | None]:
  _check_prompts(model.cfg, prompts, max_new_tokens)
  if rng is None and sampling.temperature > 0:
    raise ConfigError('sampling at temperature > 0 needs an explicit rng key')
  mode = decoding(model.cfg)
  tokens, segment_ids = pad_prompts(prompts, pad_id, left=mode.shares_context)
  out, logits = decode_batch(model, params, tokens, segment_ids, jax.random.key(0) if rng is None else rng,
                             decoding=mode, max_new_tokens=max_new_tokens, sampling=sampling,
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

_SENTINEL = re.compile(r'<extra_id_(\d+)>')


def _sentinels(config: Config, tokenizer: Tokenizer) -> np.ndarray:
  """An encoder-decoder's span sentinel ids (<extra_id_N> is entry N); none for decoders or small vocabularies."""
  if decoding(config.model).shares_context:
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
  mode = decoding(config.model)
  if mode.shares_context:
    return [tokenizer.bos_id, *tokenizer.encode(text).tolist()]
  sentinels = _sentinels(config, tokenizer)
  ids = []
  for i, part in enumerate(_SENTINEL.split(text)):  # text, sentinel number, text, ...
    if i % 2 and int(part) >= len(sentinels):
      raise ConfigError(f'<extra_id_{part}> is beyond the {len(sentinels)} sentinels of this model')
    ids += [int(sentinels[int(part)])] if i % 2 else tokenizer.encode(part).tolist()
  return ids + ([tokenizer.eos_id] if mode.input_ends_with_eos else [])


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
