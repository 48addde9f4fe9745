"""lm's model behind lm-eval-harness: the harness's `TemplateLM` interface on the family's scoring seam and the
KV-cached sampler, sharded over the mesh.

The harness owns tasks, prompts, few-shot sampling and metrics; this module only turns its requests into
scores. Requests are sorted by length and bucketed into a few fixed shapes (2^k and 3 * 2^(k-1) up to the model's
context), so a whole task compiles a handful of programs; a context with several continuations (multiple choice)
is computed once (a decoder's KV cache, an encoder-decoder's encoding); each batch is split over the mesh's batch
axes and every process receives every score (each process hands the harness the same lists).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from lm.assembly import Assembly
from lm.data.pipeline import global_rows
from lm.data.tokenizers import Tokenizer
from lm.jobs.generate import generate
from lm.models.decode import Sampling
from lm.models.family import scoring_of
from lm.parallel.rules import axis_size
from lm.train.step import make_score_step

Pair = tuple[Sequence[int], Sequence[int]]
SHORTEST = 16  # the smallest row: shorter ones are padded to it
SHORTEST_CONTINUATION = 4  # the smallest continuation row of a shared context
DEFAULT_GEN_TOKENS = 256  # the harness's default max_gen_toks


def bucket_length(tokens: int, max_length: int, shortest: int = SHORTEST) -> int:
  """The row length `tokens` positions are padded to: the next of 2^k and 3 * 2^(k-1) (at most half again as
  long; two shapes per doubling), at least `shortest`, at most `max_length`."""
  power = 1 << max(tokens - 1, 0).bit_length()
  length = power * 3 // 4 if tokens <= power * 3 // 4 else power
  return min(max(shortest, length), max_length)


class Scorer:
  """(log-probability, greedy) of continuations given contexts, as token ids, in request order. Where the family
  shares contexts and a context has several continuations (a multiple-choice question's), the context is
  computed once: `batch_size` continuations per call, after the contexts they continue."""

  def __init__(self, assembly: Assembly, params: Any, pad_id: int, batch_size: int, max_length: int):
    self.shards = axis_size(assembly.mesh, 'batch')
    self.scoring, self.mesh, self.params, self.pad_id = scoring_of(assembly.family), assembly.mesh, params, pad_id
    self.rows = -(-batch_size // self.shards) * self.shards  # whole rows on every data-parallel shard
    self.max_length = max_length
    self.step = make_score_step(assembly)
    self.shared_step = make_score_step(assembly, self.scoring.score_shared)

  def __call__(self, pairs: Sequence[Pair]) -> list[tuple[float, bool]]:
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, _) in enumerate(pairs):
      groups.setdefault(tuple(context), []).append(i)
    sharable = lambda members: self.shared_step is not None and len(members) > 1 and all(
      self.scoring.length(len(pairs[i][0]), len(pairs[i][1])) <= self.max_length for i in members)
    shared = [m for m in groups.values() if sharable(m)]
    alone = sorted(i for m in groups.values() if not sharable(m) for i in m)
    self._score_alone(pairs, alone, out)
    if shared:
      self._score_shared(pairs, shared, out)
    return out

  def _score_alone(self, pairs: Sequence[Pair], members: list[int], out: list[tuple[float, bool]]) -> None:
    """One row per pair (the context cut from the left to fit `max_length`)."""
    lengths = {i: bucket_length(self.scoring.length(len(pairs[i][0]), len(pairs[i][1])), self.max_length)
               for i in members}
    order = sorted(members, key=lambda i: -lengths[i])  # longest first: a too-long input fails early
    start = 0
    while start < len(order):
      length = lengths[order[start]]
      chunk = [i for i in order[start:start + self.rows] if lengths[i] == length]
      start += len(chunk)
      batch = [pairs[i] for i in chunk] + [([self.pad_id], [self.pad_id])] * (self.rows - len(chunk))
      self._collect(self.step, self.scoring.rows(batch, length, self.pad_id), chunk, out)

  def _score_shared(self, pairs: Sequence[Pair], groups: list[list[int]], out: list[tuple[float, bool]]) -> None:
    """Calls of `contexts` contexts (the rows over the usual number of continuations per context, a power of
    two) and their continuations, `self.rows` of them, grouped by the contexts' padded length."""
    usual = 1 << (int(np.median([len(m) for m in groups])) - 1).bit_length()
    contexts = max(self.shards, -(-self.rows // usual // self.shards) * self.shards)
    context_length = lambda m: bucket_length(self.scoring.shared_context_length(len(pairs[m[0]][0])),
                                               self.max_length)
    groups = sorted(groups, key=lambda m: (-context_length(m), -max(len(pairs[i][1]) for i in m)))
    start = 0
    while start < len(groups):
      length, chunk, rows = context_length(groups[start]), [], 0
      while (start < len(groups) and len(chunk) < contexts and context_length(groups[start]) == length
             and (not chunk or rows + len(groups[start]) <= self.rows)):
        chunk.append(groups[start])
        rows += len(groups[start])
        start += 1
      members = [(i, c) for c, m in enumerate(chunk) for i in m]  # (pair, its context's row)
      for first in range(0, len(members), self.rows):  # a context with more continuations than rows: several calls
        part, owners = (list(x) for x in zip(*members[first:first + self.rows]))
        continuation = bucket_length(max(len(pairs[i][1]) for i in part), self.max_length, SHORTEST_CONTINUATION)
        rows_batch = self.scoring.shared_rows(
          [pairs[m[0]][0] for m in chunk] + [[self.pad_id]] * (contexts - len(chunk)),
          [pairs[i][1] for i in part] + [[self.pad_id]] * (self.rows - len(part)),
          owners + [0] * (self.rows - len(part)), length, continuation, self.pad_id)
        self._collect(self.shared_step, rows_batch, part, out)

  def _collect(self, step: Any, rows: dict[str, np.ndarray], members: list[int],
               out: list[tuple[float, bool]]) -> None:
    scores = step(self.params, global_rows(self.mesh, rows))
    logprob, greedy = np.asarray(scores['logprob']), np.asarray(scores['greedy'])
    for row, i in enumerate(members):
      out[i] = (float(logprob[row]), bool(greedy[row]))


class HarnessLM(TemplateLM):
  """An lm model as the harness's `LM`: backend `causal` for decoder-only families, `seq2seq` for
  encoder-decoders. Token ids come from lm's tokenizer; `max_length` is the harness's (contexts are cut from the
  left to fit)."""

  def __init__(self, assembly: Assembly, params: Any, tokenizer: Tokenizer, *, batch_size: int, max_length: int):
    super().__init__()
    self.assembly, self.params, self.lm_tokenizer = assembly, params, tokenizer
    self.decoding = assembly.family.decoding
    self.backend = self.decoding.kind  # the harness's name: causal | seq2seq
    self._max_length = max_length
    self.batch_size = batch_size
    self.scorer = Scorer(assembly, params, tokenizer.pad_id, batch_size, max_length)

  def set_params(self, params: Any) -> None:
    """Scores and generations from here on use `params` (the same shapes: nothing recompiles)."""
    self.params = self.scorer.params = params

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def eot_token_id(self) -> int:
    return self.lm_tokenizer.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is scored after: BOS where the tokenizer has one, else EOS (GPT-2's)."""
    bos = self.lm_tokenizer.bos_id
    return self.eot_token_id if bos is None else bos

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
    """Ids of `string`; an encoder-decoder's encoder input ends with EOS (as a Hugging Face T5 tokenizer's
    special tokens do), never a decoder target (`add_special_tokens=False`)."""
    ids = self.lm_tokenizer.encode(string).tolist()
    if self.decoding.input_ends_with_eos and add_special_tokens is not False:
      ids.append(self.eot_token_id)
    return ids

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.lm_tokenizer.decode(list(ids))

  def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                            disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
    results = self.scorer([(context, continuation) for _, context, continuation in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
    """Sum over disjoint windows of the model's length, each after one token of context (the harness's own
    windowing: `get_rolling_token_windows`, context length 1)."""
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      tokens = self.tok_encode(string, add_special_tokens=False)
      for window in harness_utils.get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                           max_seq_len=self.max_length, context_len=1):
        windows.append(harness_utils.make_disjoint_window(window))
        owner.append(i)
    totals = np.zeros(len(requests))
    for i, (logprob, _) in zip(owner, self.scorer(windows)):
      totals[i] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', (req.args[0],), float(total))
    return [float(t) for t in totals]

  def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
    """Greedy continuations through the KV-cached sampler, cut at the first stop string (the harness's
    `until`, EOS included) and at `max_gen_toks` tokens. Requests sharing generation settings run as a batch."""
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    out = [''] * len(requests)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(requests[members[0]].args[1], DEFAULT_GEN_TOKENS)
      until = handle_stop_sequences(kwargs['until'], eos=None)  # generation stops at the EOS id itself
      max_gen_toks = kwargs['max_gen_toks']
      if kwargs['do_sample']:
        raise ValueError('lm eval generates greedily; this task asks for sampling (do_sample=true)')
      budget = self.max_length - (max_gen_toks if self.decoding.shares_context else 0)
      for start in range(0, len(members), self.batch_size):
        chunk = members[start:start + self.batch_size]
        prompts = [self.tok_encode(requests[i].args[0])[-budget:] for i in chunk]
        rows = generate(self.assembly.model, self.params, prompts, max_new_tokens=max_gen_toks,
                        sampling=Sampling(), eos_id=self.eot_token_id, pad_id=self.lm_tokenizer.pad_id)
        for i, row in zip(chunk, rows):
          out[i] = postprocess_generated_text(generation=self.tok_decode(row), stop=until, think_end_token=None)
          self.cache_hook.add_partial('generate_until', requests[i].args, out[i])
    return out
