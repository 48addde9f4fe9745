"""Global batches from a token stream: deterministic order, resumable, built per process.

Batch `step` holds rows `perm_epoch[i*B:(i+1)*B]` of a permutation drawn from (seed, epoch),
so the position in the data is just the number of batches served. Each process builds only
the rows its devices hold and assembles the global array with
`jax.make_array_from_process_local_data`, so the same code runs on one host or many.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import Config, ConfigError
from lm.data.objectives import CausalLM, MaskedLM, NextSentencePairs, Objective, SpanCorruption
from lm.data.packing import TokenStream
from lm.data.sources import load_documents, split_documents
from lm.data.tokenizers import Tokenizer, get_tokenizer

def local_row_range(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
  """The contiguous block of batch rows this process's devices hold under `sharding`."""
  rows_only = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0] if sharding.spec else None))
  ranges = [idx[0].indices(global_batch)[:2]
            for idx in rows_only.addressable_devices_indices_map((global_batch,)).values()]
  lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
  if len({i for start, stop in ranges for i in range(start, stop)}) != hi - lo:
    raise ValueError('this process holds a non-contiguous part of the batch; order the mesh so that '
                     'each host owns a contiguous block of the data axes')
  return lo, hi


class Batches:
  """Iterator of global batches (dicts of jax.Array [B, ...]) with `get_state`/`set_state`."""

  def __init__(self, stream: TokenStream, objective: Objective, global_batch: int, seed: int,
               sharding: NamedSharding, name: str = 'train'):
    num_rows = stream.num_rows(objective.row_len, objective.overlap)
    if num_rows < global_batch:
      raise ConfigError(f'the {name} split has {num_rows} rows, fewer than train.global_batch={global_batch}; '
                        f'lower the batch or data.seq_len, or add data')
    self.stream, self.objective, self.num_rows = stream, objective, num_rows
    self.global_batch, self.seed, self.sharding = global_batch, seed, sharding
    self.batches_per_epoch = num_rows // global_batch
    self.local_rows = local_row_range(sharding, global_batch)
    self.step = 0
    self._epoch_permutation: tuple[int, np.ndarray] = (-1, np.empty(0))

  def rows(self, step: int) -> np.ndarray:
    """Global row ids of batch `step`."""
    epoch, index = divmod(step, self.batches_per_epoch)
    if self._epoch_permutation[0] != epoch:
      self._epoch_permutation = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
    return self._epoch_permutation[1][index * self.global_batch:(index + 1) * self.global_batch]

  def batch(self, step: int) -> dict[str, jax.Array]:
    lo, hi = self.local_rows
    keys = np.stack([np.full(hi - lo, self.seed), np.full(hi - lo, step), np.arange(lo, hi)], axis=1)
    local = self.objective(self.stream, self.rows(step)[lo:hi], keys)
    return {key: jax.make_array_from_process_local_data(self._sharding(value.ndim), value,
                                                        (self.global_batch, *value.shape[1:]))
            for key, value in local.items()}

  def _sharding(self, ndim: int) -> NamedSharding:
    """Rows split as in `sharding`; any further dims whole."""
    return NamedSharding(self.sharding.mesh, PartitionSpec(self.sharding.spec[0], *[None] * (ndim - 1)))

  def __iter__(self) -> 'Batches':
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = self.batch(self.step)
    self.step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {'step': self.step, 'seed': self.seed, 'num_rows': self.num_rows}

  def set_state(self, state: dict[str, Any]) -> None:
    if state['seed'] != self.seed or state['num_rows'] != self.num_rows:
      raise ConfigError(f'the checkpoint\'s data position (seed {state["seed"]}, {state["num_rows"]} rows) does not '
                        f'match this run (seed {self.seed}, {self.num_rows} rows); resume with the same data and seed')
    self.step = int(state['step'])


def tokenize(docs: list[tuple[str, str]], tokenizer: Tokenizer, order_seed: int | None,
             with_bos: bool = True) -> TokenStream:
  """Documents in a seeded random order (or as given when `order_seed` is None), packed end to end."""
  order = np.arange(len(docs)) if order_seed is None else np.random.default_rng(order_seed).permutation(len(docs))
  return TokenStream.from_documents([tokenizer.encode(docs[i][1]) for i in order],
                                    tokenizer.bos_id if with_bos else None, tokenizer.eos_id)


def make_objective(config: Config, tokenizer: Tokenizer) -> Objective:
  """The family's pretraining objective: causal LM (gpt), masked LM (bert), span corruption (t5)."""
  m, seq_len = config.model, config.data.seq_len
  if tokenizer.vocab_size > m.vocab_size:
    raise ConfigError(f'model.vocab_size={m.vocab_size} is smaller than the {config.data.tokenizer} '
                      f'tokenizer\'s {tokenizer.vocab_size} ids; raise model.vocab_size')
  if m.family == 'bert':
    masked_lm = MaskedLM(seq_len, first_regular_id=tokenizer.first_regular_id, vocab_size=tokenizer.vocab_size,
                         mask_id=tokenizer.mask_id)
    if config.data.nsp:
      return NextSentencePairs(masked_lm, cls_id=tokenizer.bos_id, sep_id=tokenizer.eos_id)
    return masked_lm
  if m.family == 't5':
    objective = SpanCorruption(seq_len, first_sentinel=m.vocab_size - 1, eos_id=tokenizer.eos_id,
                               decoder_start_id=tokenizer.pad_id)
    spans = objective.lengths.spans
    if m.vocab_size - spans < tokenizer.vocab_size:
      raise ConfigError(f'span corruption of {seq_len}-token inputs needs {spans} sentinel ids above the '
                        f'tokenizer\'s {tokenizer.vocab_size}, but model.vocab_size={m.vocab_size}; '
                        f'raise model.vocab_size to at least {tokenizer.vocab_size + spans}')
    return objective
  return CausalLM(seq_len)


def feature_specs(config: Config) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Per-row shape and dtype of every feature the config's objective produces."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = make_objective(config, tokenizer)
  doc = np.full(2 * objective.row_len, tokenizer.first_regular_id, np.int32)
  stream = TokenStream.from_documents([doc], tokenizer.bos_id, tokenizer.eos_id)
  features = objective(stream, np.zeros(1, np.int64), np.zeros((1, 3), np.int64))
  return {k: (v.shape[1:], v.dtype) for k, v in features.items()}


def build_batches(config: Config, sharding: NamedSharding) -> tuple[Tokenizer, Batches, Batches]:
  """Tokenizer, training batches (shuffled from the seed) and validation batches (fixed order)."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = make_objective(config, tokenizer)
  train_docs, val_docs = split_documents(load_documents(config.data), config.data.val_fraction)
  batch, seed, with_bos = config.train.global_batch, config.train.seed, config.model.family != 't5'
  train = Batches(tokenize(train_docs, tokenizer, seed, with_bos), objective, batch, seed, sharding)
  # Validation rows (and their masks): a fixed order from seed 0 whatever the run's seed, so runs compare.
  val = Batches(tokenize(val_docs, tokenizer, None, with_bos), objective, batch, 0, sharding, 'validation')
  return tokenizer, train, val
