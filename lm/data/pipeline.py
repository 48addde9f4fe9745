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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.config import Config, ConfigError
from lm.data.objectives import Objective
from lm.data.packing import TokenStream
from lm.data.sources import load_documents, split_documents
from lm.data.tokenizers import Tokenizer, get_tokenizer
from lm.models import get_family
from lm.parallel.rules import batch_sharding


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
               mesh: Mesh, name: str = 'train'):
    num_rows = stream.num_rows(objective.row_len, objective.overlap)
    if num_rows < global_batch:
      raise ConfigError(f'the {name} split has {num_rows} rows, fewer than train.global_batch={global_batch}; '
                        f'lower the batch or data.seq_len, or add data')
    self.stream, self.objective, self.num_rows = stream, objective, num_rows
    self.global_batch, self.seed, self.mesh = global_batch, seed, mesh
    self.batches_per_epoch = num_rows // global_batch
    self.local_rows = local_row_range(batch_sharding(mesh, 1), global_batch)
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
    return {key: jax.make_array_from_process_local_data(batch_sharding(self.mesh, value.ndim), value,
                                                        (self.global_batch, *value.shape[1:]))
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


def tokenize(docs: list[tuple[str, str]], tokenizer: Tokenizer, order_seed: int | None,
             with_bos: bool = True) -> TokenStream:
  """Documents in a seeded random order (or as given when `order_seed` is None), packed end to end."""
  order = np.arange(len(docs)) if order_seed is None else np.random.default_rng(order_seed).permutation(len(docs))
  return TokenStream.from_documents([tokenizer.encode(docs[i][1]) for i in order],
                                    tokenizer.bos_id if with_bos else None, tokenizer.eos_id)


def make_objective(config: Config, tokenizer: Tokenizer) -> Objective:
  """The pretraining objective the config's family declares (causal LM, masked LM, span corruption)."""
  return get_family(config.model.family).objective(config, tokenizer)


def feature_specs(config: Config) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Per-row shape and dtype of every feature the config's objective produces."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = make_objective(config, tokenizer)
  doc = np.full(2 * objective.row_len, tokenizer.first_regular_id, np.int32)
  stream = TokenStream.from_documents([doc], tokenizer.bos_id, tokenizer.eos_id)
  features = objective(stream, np.zeros(1, np.int64), np.zeros((1, 3), np.int64))
  return {k: (v.shape[1:], v.dtype) for k, v in features.items()}


def build_batches(config: Config, mesh: Mesh) -> tuple[Tokenizer, Batches, Batches]:
  """Tokenizer, training batches (shuffled from the seed) and validation batches (fixed order)."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = make_objective(config, tokenizer)
  train_docs, val_docs = split_documents(load_documents(config.data), config.data.val_fraction)
  batch, seed, with_bos = config.train.global_batch, config.train.seed, objective.with_bos
  train = Batches(tokenize(train_docs, tokenizer, seed, with_bos), objective, batch, seed, mesh)
  # Validation rows (and their masks): a fixed order from seed 0 whatever the run's seed, so runs compare.
  val = Batches(tokenize(val_docs, tokenizer, None, with_bos), objective, batch, 0, mesh, 'validation')
  return tokenizer, train, val
