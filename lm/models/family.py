"""What generic code knows of a model family: one record per family, registered in `lm.models.FAMILIES`.

A record says how to build and initialise the module, how a batch maps onto its call, which
objective pretrains it, which extra heads it trains (with their losses and metrics), its
forward FLOPs, how `lm.jobs.generate` decodes it, and which Hugging Face converter reads and writes
it. Step, loss, data pipeline, accounting, generation, conversion and config validation ask
the record and never the family's name. The three shapes of model share their record code
here (`DecoderOnly`, `Encoder`, `EncoderDecoder`); a family's own record sits in its model file.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lm.config import Config, ConfigError, ModelConfig
from lm.data.objectives import CausalLM, Objective
from lm.models.decode import DECODER_ONLY, ENCODER_DECODER, Decoding, init_cache, take_cache_rows
from lm.models.task_heads import Classifier, TaskHead, TextToText
from lm.ops.scores import continuation_scores

if TYPE_CHECKING:
  from lm.data.tokenizers import Tokenizer

Batch = dict[str, jax.Array]


@dataclass(frozen=True)
class Head:
  """A per-sequence output trained beside the token loss by softmax cross-entropy (BERT's NSP).

  The model's outputs carry its logits [batch, classes] under `name`; the batch carries its labels
  under `labels`. Metrics: '{name}_loss' and '{name}_accuracy' per sequence.
  """
  name: str
  labels: str
  params: tuple[str, ...]  # top-level param modules it owns: initialised fresh when a source lacks them
  enabled: Callable[[ModelConfig], bool]


@dataclass(frozen=True)
class KernelSizes:
  """Weights of the dense kernels by the tokens they see (`lm.assembly.accounting.kernel_sizes`)."""
  encoder: int  # under the top-level 'encoder' module (the stacks of T5 and BERT)
  other: int  # every other per-token kernel: decoder stacks, output and MLM layers
  cross_kv: int  # cross-attention key/value projections: they see encoder tokens
  per_sequence: int  # heads that read one position per row
  output: int  # a tied output layer, whose weights are the embedding table

  @property
  def per_token(self) -> int:
    """Everything a single-stack model runs on each token."""
    return self.encoder + self.other + self.cross_kv + self.output


class Family:
  """The record base: subclasses set the class attributes and override what differs."""
  name: ClassVar[str]
  module: ClassVar[type[nn.Module]]
  hf_converter: ClassVar[str | None] = None  # module with ARCHITECTURE (the transformers class), load, save
  decoding: ClassVar[Decoding | None] = None  # how `lm.jobs.generate` samples from it; None: it cannot
  heads: ClassVar[tuple[Head, ...]] = ()
  task_head: ClassVar[TaskHead | None] = None  # how it fine-tunes on sequence tasks (GLUE); None: it cannot
  # The norm whose output alone feeds a tied output layer (μP's 1/m readout multiplier folds into it on export);
  # None: no such norm
  readout_norm: ClassVar[tuple[str, ...] | None] = None

  def build(self, cfg: ModelConfig) -> nn.Module:
    return self.module(cfg)

  def init_inputs(self, length: int) -> tuple[jax.Array, ...]:
    """Dummy positional inputs of `length` tokens that make `init` create every parameter."""
    return (jnp.zeros((1, length), jnp.int32),)

  def init(self, model: nn.Module, rng: jax.Array, length: int) -> Any:
    """Boxed (logically partitioned) params."""
    return model.init({'params': rng, 'dropout': rng}, *self.init_inputs(length))['params']

  def apply(self, model: nn.Module, params: Any, batch: Batch, *, deterministic: bool,
            rngs: dict[str, jax.Array]) -> dict[str, Any]:
    """Outputs for a batch: 'logits', the output layer unapplied (an `Unembedding`: the token loss applies it,
    whole or in tiles), scored against batch['targets'] with batch['weights'], and the logits of each active
    head under its name."""
    raise NotImplementedError

  def objective(self, config: Config, tokenizer: Tokenizer) -> Objective:
    raise NotImplementedError

  def scoring_rows(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], length: int, pad_id: int
                   ) -> dict[str, np.ndarray]:
    """A batch that `score` reads: one row per (context, continuation) pair of token ids, `length` positions
    (the context is cut from the left to fit, as lm-eval-harness does)."""
    raise ConfigError(f'the {self.name} family is not a generative model: it gives no log-likelihood of a '
                      f'continuation; score with a decoder-only or encoder-decoder model')

  def scoring_length(self, context: int, continuation: int) -> int:
    """Positions a row of `scoring_rows` needs for a pair of these token counts (before any cut)."""
    raise NotImplementedError

  # Whether `score_shared` computes a context once for all its continuations (`shared_scoring_rows`).
  shares_contexts: ClassVar[bool] = False

  def shared_context_length(self, context: int) -> int:
    """Positions a context of `context` tokens takes in a context row of `shared_scoring_rows`."""
    raise NotImplementedError

  def shared_scoring_rows(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                          owners: Sequence[int], context_length: int, continuation_length: int, pad_id: int
                          ) -> dict[str, np.ndarray]:
    """A batch that `score_shared` reads: each context once ('context_*' rows, `context_length` positions) and
    each continuation in a row of its own (`continuation_length` positions) with its context's row ('owner')."""
    raise NotImplementedError

  def score_shared(self, model: nn.Module, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """`score` of a `shared_scoring_rows` batch, per continuation row."""
    raise NotImplementedError

  def score(self, model: nn.Module, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """Per example of a `scoring_rows` batch: the continuation's summed log-probability ('logprob'), its token
    count ('tokens') and whether greedy decoding would produce it ('greedy')."""
    head = self.apply(model, params, batch, deterministic=True, rngs={})['logits']
    return continuation_scores(head.logits(), batch['targets'], batch['weights'])

  def forward_flops(self, k: KernelSizes, cfg: ModelConfig, seq_len: int,
                    pairs: Callable[[int], float]) -> float:
    """Forward matmul FLOPs of one row of `seq_len` tokens; `pairs(n)` counts a causal n x n square."""
    raise NotImplementedError

  def validate(self, config: Config) -> None:
    """Checks beyond the generic ones in `lm.config.validate`; raise ConfigError naming the fix."""

  def active_heads(self, cfg: ModelConfig) -> tuple[Head, ...]:
    return tuple(h for h in self.heads if h.enabled(cfg))

  def num_blocks(self, cfg: ModelConfig) -> int:
    """Transformer blocks in the model (every stack's)."""
    return cfg.num_layers

  def per_sequence_params(self) -> frozenset[str]:
    """Top-level param modules of the heads (pretraining and fine-tuning): they read one position per row,
    and start fresh when a source checkpoint lacks them."""
    task = self.task_head.params if self.task_head else ()
    return frozenset(p for h in self.heads for p in h.params) | frozenset(task)

  def converter(self) -> ModuleType:
    if self.hf_converter is None:
      raise ConfigError(f'the {self.name} family has no Hugging Face converter')
    return importlib.import_module(self.hf_converter)


def check_vocabulary(config: Config, tokenizer: Tokenizer) -> None:
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(f'model.vocab_size={config.model.vocab_size} is smaller than the {config.data.tokenizer} '
                      f'tokenizer\'s {tokenizer.vocab_size} ids; raise model.vocab_size')


def _attention_flops(cfg: ModelConfig, pairs: float) -> float:
  """Scores and the weighted sum of values: 2 * 2 * query heads * head_dim per query-key pair."""
  return 4 * cfg.num_heads * cfg.resolved_head_dim * pairs


class DecoderOnly(Family):
  """Causal LMs (GPT, Llama): `module(tokens, segment_ids, positions, deterministic, decode)` gives logits;
  `module.classify` a classifier's scores from the last real token."""
  decoding = DECODER_ONLY
  task_head = Classifier(params=('score',))
  readout_norm = ('decoder', 'final_norm')

  def init(self, model, rng, length):
    """A classifier's params (`model.num_labels`) are made by `classify`: `score`, no output layer."""
    method = 'classify' if model.cfg.num_labels else None
    return model.init({'params': rng, 'dropout': rng}, *self.init_inputs(length), method=method)['params']

  def apply(self, model, params, batch, *, deterministic, rngs):
    return {'logits': model.apply({'params': params}, batch['inputs'], segment_ids=batch.get('segment_ids'),
                                  positions=batch.get('positions'), deterministic=deterministic, rngs=rngs,
                                  unembed=False)}

  def objective(self, config, tokenizer):
    check_vocabulary(config, tokenizer)
    return CausalLM(config.data.seq_len)

  def scoring_rows(self, pairs, length, pad_id):
    """Context and continuation in one row: inputs are its tokens but the last, targets its tokens but the
    first, weighted over the continuation."""
    rows = {k: np.zeros((len(pairs), length), np.int32) for k in ('inputs', 'targets', 'segment_ids', 'weights')}
    rows['inputs'][:], rows['targets'][:] = pad_id, pad_id
    for i, (context, continuation) in enumerate(pairs):
      whole = (list(context) + list(continuation))[-(length + 1):]
      n = len(whole) - 1
      rows['inputs'][i, :n], rows['targets'][i, :n] = whole[:-1], whole[1:]
      rows['segment_ids'][i, :n] = 1
      rows['weights'][i, max(n - len(continuation), 0):n] = 1
    rows['positions'] = np.broadcast_to(np.arange(length, dtype=np.int32), (len(pairs), length)).copy()
    return rows

  def scoring_length(self, context, continuation):
    return context + continuation - 1

  shares_contexts = True

  def shared_context_length(self, context):
    return context - 1  # the last token starts the continuation's row

  def shared_scoring_rows(self, contexts, continuations, owners, context_length, continuation_length, pad_id):
    """Each context but its last token, left-padded as the sampler's prompts are, prefills a KV cache; each
    continuation row then feeds its context's last token and its own tokens but the last (right-padded, at the
    positions after its context) and is scored on its own tokens."""
    rows = {f'context_{k}': np.zeros((len(contexts), context_length), np.int32)
            for k in ('inputs', 'segment_ids', 'positions')}
    rows['context_inputs'][:] = pad_id
    for i, context in enumerate(contexts):
      n = len(context) - 1
      if n:
        rows['context_inputs'][i, -n:], rows['context_segment_ids'][i, -n:] = context[:-1], 1
        rows['context_positions'][i, -n:] = np.arange(n)
    for k in ('inputs', 'targets', 'segment_ids', 'weights', 'positions'):
      rows[k] = np.zeros((len(continuations), continuation_length), np.int32)
    rows['inputs'][:], rows['targets'][:] = pad_id, pad_id
    for i, (continuation, owner) in enumerate(zip(continuations, owners)):
      context, n = contexts[owner], len(continuation)
      rows['inputs'][i, :n], rows['targets'][i, :n] = [context[-1], *continuation[:-1]], continuation
      rows['segment_ids'][i, :n], rows['weights'][i, :n] = 1, 1
      rows['positions'][i, :n] = len(context) - 1 + np.arange(n)  # padding at 0: inside any position table
    rows['owner'] = np.asarray(owners, np.int32)
    return rows

  def score_shared(self, model, params, batch):
    contexts = batch['context_inputs']
    cache = init_cache(model, contexts.shape[0], contexts.shape[1] + batch['inputs'].shape[1])
    _, filled = model.apply({'params': params, 'cache': cache}, contexts, batch['context_segment_ids'],
                            batch['context_positions'], decode=True, unembed=False, mutable=['cache'])
    cache = take_cache_rows(model, filled['cache'], batch['owner'])
    head, _ = model.apply({'params': params, 'cache': cache}, batch['inputs'], batch['segment_ids'],
                          batch['positions'], decode=True, unembed=False, mutable=['cache'])
    return continuation_scores(head.logits(), batch['targets'], batch['weights'])

  def forward_flops(self, k, cfg, seq_len, pairs):
    return 2 * (k.per_token * seq_len + k.per_sequence) + _attention_flops(cfg, cfg.num_layers * pairs(seq_len))


class Encoder(Family):
  """Bidirectional encoders (BERT): every query sees every key of its segment."""

  def forward_flops(self, k, cfg, seq_len, pairs):
    return 2 * (k.per_token * seq_len + k.per_sequence) + \
        _attention_flops(cfg, cfg.num_layers * seq_len * seq_len)


class EncoderDecoder(Family):
  """Encoder-decoders (T5): `module(inputs, decoder_inputs, segment_ids, decoder_segment_ids, deterministic)`,
  with `encode` and `decode` methods for cached generation; fine-tuned text to text."""
  decoding = ENCODER_DECODER
  task_head = TextToText()

  def num_blocks(self, cfg):
    return cfg.num_layers + cfg.resolved_decoder_layers

  def validate(self, config):
    if config.mesh.sequence > 1:  # ring attention is self-attention; cross-attention would gather the encoder
      raise ConfigError(f'{self.name} does not split its sequences over a mesh axis (its decoder cross-attends to '
                        f'encoder tokens of another length): set mesh.sequence=1 and shard with data, fsdp, tensor')

  def init_inputs(self, length):
    tokens = jnp.zeros((1, length), jnp.int32)
    return tokens, tokens

  def apply(self, model, params, batch, *, deterministic, rngs):
    return {'logits': model.apply({'params': params}, batch['inputs'], batch['decoder_inputs'],
                                  segment_ids=batch.get('segment_ids'),
                                  decoder_segment_ids=batch.get('decoder_segment_ids'),
                                  deterministic=deterministic, rngs=rngs, unembed=False)}

  def target_length(self, seq_len: int) -> int:
    """Decoder tokens of a row whose encoder sees `seq_len` tokens."""
    raise NotImplementedError

  def scoring_rows(self, pairs, length, pad_id):
    """The context to the encoder, the continuation as the decoder's targets behind the decoder start (the pad
    id, T5's): `length` positions each."""
    rows = {k: np.zeros((len(pairs), length), np.int32)
            for k in ('inputs', 'segment_ids', 'decoder_inputs', 'decoder_segment_ids', 'targets', 'weights')}
    for k in ('inputs', 'decoder_inputs', 'targets'):
      rows[k][:] = pad_id
    for i, (context, continuation) in enumerate(pairs):
      context, continuation = list(context)[-length:], list(continuation)[:length]
      rows['inputs'][i, :len(context)], rows['segment_ids'][i, :len(context)] = context, 1
      n = len(continuation)
      rows['decoder_inputs'][i, :n] = [pad_id] + continuation[:-1]
      rows['targets'][i, :n] = continuation
      rows['decoder_segment_ids'][i, :n], rows['weights'][i, :n] = 1, 1
    return rows

  def scoring_length(self, context, continuation):
    return max(context, continuation)

  shares_contexts = True

  def shared_context_length(self, context):
    return context

  def shared_scoring_rows(self, contexts, continuations, owners, context_length, continuation_length, pad_id):
    """Each context once, as the encoder's input; each continuation as `scoring_rows` has it, with its context's
    row ('owner')."""
    rows = {k: np.zeros((len(contexts), context_length), np.int32) for k in ('context_inputs', 'context_segment_ids')}
    rows['context_inputs'][:] = pad_id
    for i, context in enumerate(contexts):
      rows['context_inputs'][i, :len(context)], rows['context_segment_ids'][i, :len(context)] = context, 1
    for k in ('decoder_inputs', 'decoder_segment_ids', 'targets', 'weights'):
      rows[k] = np.zeros((len(continuations), continuation_length), np.int32)
    rows['decoder_inputs'][:], rows['targets'][:] = pad_id, pad_id
    for i, continuation in enumerate(continuations):
      n = len(continuation)
      rows['decoder_inputs'][i, :n], rows['targets'][i, :n] = [pad_id, *continuation[:-1]], continuation
      rows['decoder_segment_ids'][i, :n], rows['weights'][i, :n] = 1, 1
    rows['owner'] = np.asarray(owners, np.int32)
    return rows

  def score_shared(self, model, params, batch):
    """The contexts encoded once; each continuation's row decoded against its context's encoding."""
    encoded = model.apply({'params': params}, batch['context_inputs'], batch['context_segment_ids'],
                          method='encode')
    owner = batch['owner']
    head = model.apply({'params': params}, encoded[owner], batch['decoder_inputs'],
                       batch['context_segment_ids'][owner], batch['decoder_segment_ids'], unembed=False,
                       method='decode')
    return continuation_scores(head.logits(), batch['targets'], batch['weights'])

  def forward_flops(self, k, cfg, seq_len, pairs):
    enc, dec = seq_len, self.target_length(seq_len)
    dense = (k.encoder + k.cross_kv) * enc + (k.other + k.output) * dec
    attention = cfg.num_layers * enc * enc + cfg.resolved_decoder_layers * (pairs(dec) + dec * enc)
    return 2 * (dense + k.per_sequence) + _attention_flops(cfg, attention)
