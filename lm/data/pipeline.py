"""Global batches from a token stream: deterministic order, resumable, built per process.

Batch `step` holds rows `perm_epoch[i*B:(i+1)*B]` of a permutation drawn from (seed, epoch),
so the position in the data is just the number of batches served. Each process builds only
the rows its devices hold and assembles the global array with
`jax.make_array_from_process_local_data`, so the same code runs on one host or many.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import Config, ConfigError
from lm.data.packing import TokenStream, causal_lm_rows
from lm.data.sources import load_documents, split_documents
from lm.data.tokenizers import Tokenizer, get_tokenizer

RowFn = Callable[[TokenStream, np.ndarray], dict[str, np.ndarray]]


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

  def __init__(self, stream: TokenStream, make_rows: RowFn, num_rows: int, global_batch: int, seed: int,
               sharding: NamedSharding, name: str = 'train'):
    if num_rows < global_batch:
      raise ConfigError(f'the {name} split has {num_rows} rows, fewer than train.global_batch={global_batch}; '
                        f'lower the batch or data.seq_len, or add data')
    self.stream, self.make_rows, self.num_rows = stream, make_rows, num_rows
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
    local = self.make_rows(self.stream, self.rows(step)[lo:hi])
    return {key: jax.make_array_from_process_local_data(self.sharding, value, (self.global_batch, *value.shape[1:]))
            for key, value in local.items()}

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


def tokenize(docs: list[tuple[str, str]], tokenizer: Tokenizer, order_seed: int | None) -> TokenStream:
  """Documents in a seeded random order (or as given when `order_seed` is None), packed end to end."""
  order = np.arange(len(docs)) if order_seed is None else np.random.default_rng(order_seed).permutation(len(docs))
  return TokenStream.from_documents([tokenizer.encode(docs[i][1]) for i in order],
                                    tokenizer.bos_id, tokenizer.eos_id)


def build_batches(config: Config, sharding: NamedSharding) -> tuple[Tokenizer, Batches, Batches]:
  """Tokenizer, training batches (shuffled from the seed) and validation batches (fixed order)."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(f'model.vocab_size={config.model.vocab_size} is smaller than the {config.data.tokenizer} '
                      f'tokenizer\'s {tokenizer.vocab_size} ids; raise model.vocab_size')
  train_docs, val_docs = split_documents(load_documents(config.data), config.data.val_fraction)
  seq_len, batch, seed = config.data.seq_len, config.train.global_batch, config.train.seed
  make_rows = functools.partial(causal_lm_rows, seq_len=seq_len)
  train_stream = tokenize(train_docs, tokenizer, order_seed=seed)
  val_stream = tokenize(val_docs, tokenizer, order_seed=None)
  train = Batches(train_stream, make_rows, train_stream.num_rows(seq_len + 1, overlap=1), batch, seed, sharding)
  # Validation rows: a fixed permutation (seed 0 whatever the run's seed), so every run sees the same rows.
  val = Batches(val_stream, make_rows, val_stream.num_rows(seq_len + 1, overlap=1), batch, 0, sharding, 'validation')
  return tokenizer, train, val
