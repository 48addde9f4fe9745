"""How a model scores continuations (`lm eval`'s log-likelihoods and greedy checks): the rows a batch of
(context, continuation) pairs of token ids becomes, and the computation that reads rows sharing a context. One
`Scoring` per shape of generative model, named by its family record (`Family.scoring`); the scoring engine
(`lm.jobs.evals.engine`) asks it, never the shape. A plain batch of `rows` is scored by `Family.score`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from lm.models.decode import init_cache, take_cache_rows
from lm.ops.scores import continuation_scores

Batch = dict[str, jax.Array]
Pairs = Sequence[tuple[Sequence[int], Sequence[int]]]


class Scoring:
  """The row layouts of one shape of model."""

  def rows(self, pairs: Pairs, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """A batch that `Family.score` reads: one row per (context, continuation) pair of token ids, `length`
    positions (the context is cut from the left to fit, as lm-eval-harness does)."""
    raise NotImplementedError

  def length(self, context: int, continuation: int) -> int:
    """Positions a row of `rows` needs for a pair of these token counts (before any cut)."""
    raise NotImplementedError

  def shared_context_length(self, context: int) -> int:
    """Positions a context of `context` tokens takes in a context row of `shared_rows`."""
    raise NotImplementedError

  def shared_rows(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                  owners: Sequence[int], context_length: int, continuation_length: int, pad_id: int
                  ) -> dict[str, np.ndarray]:
    """A batch that `score_shared` reads: each context once ('context_*' rows, `context_length` positions) and
    each continuation in a row of its own (`continuation_length` positions) with its context's row ('owner')."""
    raise NotImplementedError

  def score_shared(self, model: nn.Module, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """`Family.score` of a `shared_rows` batch, per continuation row: each context computed once."""
    raise NotImplementedError


class Causal(Scoring):
  """Decoder-only models: a pair is one row of tokens; shared contexts prefill a KV cache."""

  def rows(self, pairs, length, pad_id):
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

  def length(self, context, continuation):
    return context + continuation - 1

  def shared_context_length(self, context):
    return context - 1  # the last token starts the continuation's row

  def shared_rows(self, contexts, continuations, owners, context_length, continuation_length, pad_id):
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


class Seq2Seq(Scoring):
  """Encoder-decoders: the context is the encoder's input, the continuation the decoder's targets."""

  def rows(self, pairs, length, pad_id):
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

  def length(self, context, continuation):
    return max(context, continuation)

  def shared_context_length(self, context):
    return context

  def shared_rows(self, contexts, continuations, owners, context_length, continuation_length, pad_id):
    """Each context once, as the encoder's input; each continuation as `rows` has it, with its context's
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


CAUSAL, SEQ2SEQ = Causal(), Seq2Seq()

