"""Global batches from a grain pipeline: shuffled records, per-process shards, tokenized, packed, masked.

A global batch of B rows is S streams x B/S consecutive rows. Stream k reads every S-th record of
the shuffled record sequence, so streams read disjoint records. Process p of P holds rows
[pB/P, (p+1)B/P) and so runs only streams [pS/P, (p+1)S/P): each host reads only its share of the
records, and the global batch is the same for any number of processes (up to S). Per stream:
  documents (`lm.data.sources`)        random access, read when asked for
  -> shuffle(seed), repeat             training only: a global permutation of the records, new each epoch
  -> [k::S]                            this stream's records
  -> tokenize                          [BOS] + ids + [EOS], with each token's record and offset in it
  -> concat-then-split                 documents packed end to end into rows of the objective's length
  -> batch(B/S)
then the process's streams are zipped into its rows, the objective applied (causal LM, MLM with
optional NSP, span corruption), batches prefetched by a background thread or data.workers
processes, and `jax.make_array_from_process_local_data` assembles the global batch.

Packing is concat-then-split (grain's `ConcatThenSplitIterDataset`): every row is full, so no
compute goes to padding, and a document longer than a row continues in the next one. Segment ids
and positions restart at each document and at each row start, so attention never crosses
documents (the semantics of the earlier in-memory packer). Packing several streams side by side
keeps one long document from filling a whole batch. Each row's randomness is keyed by
(seed, its first record, the offset there): the same row is masked the same way on any host
layout. The iterator's state (grain's, one JSON file per process) goes into every checkpoint, so a
resumed run reads on from the exact record.
"""
from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any, Callable, Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.config import Config, ConfigError
from lm.data.objectives import Objective, Rows
from lm.data.sources import Documents, Split, open_documents
from lm.data.tokenizers import Tokenizer, get_tokenizer
from lm.parallel.rules import batch_sharding


def local_row_range(sharding: NamedSharding, global_batch: int,
                    devices: Sequence[jax.Device] | None = None) -> tuple[int, int]:
  """The contiguous block of batch rows this process's devices (or `devices`: one process's, simulated) hold
  under `sharding`."""
  rows_only = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0] if sharding.spec else None))
  index = rows_only.devices_indices_map((global_batch,))
  ranges = [index[d][0].indices(global_batch)[:2] for d in (sharding.addressable_devices if devices is None
                                                            else devices)]
  lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
  if len({i for start, stop in ranges for i in range(start, stop)}) != hi - lo:
    raise ValueError('this process holds a non-contiguous part of the batch; order the mesh so that '
                     'each host owns a contiguous block of the data axes')
  return lo, hi


# The caller's objective for a tokenizer (the family's pretraining objective): data/ knows no model.
ObjectiveFor = Callable[[Tokenizer], Objective]


def _with_index(index: int, text: str) -> tuple[int, str]:
  return index, text


class _Tokenize:
  """(stream index, text) -> tokens with, per token, its record (the stream index) and its offset in it."""

  def __init__(self, tokenizer: Tokenizer, with_bos: bool):
    self.tokenizer, self.with_bos = tokenizer, with_bos

  def __call__(self, record: tuple[int, str]) -> dict[str, np.ndarray]:
    index, text = record
    t = self.tokenizer
    tokens = np.concatenate([[t.bos_id] if self.with_bos else [], t.encode(text), [t.eos_id]]).astype(np.int32)
    return {'tokens': tokens, 'record': np.full(len(tokens), index, np.int64),
            'offset': np.arange(len(tokens), dtype=np.int64)}


def _full_row(row: dict[str, np.ndarray]) -> bool:
  """False only for the padded last row of a finite split."""
  return bool(row['tokens_segment_ids'][-1] != 0)


class _Features:
  """A batch of packed rows -> the objective's features, each row's randomness keyed by where it starts."""

  def __init__(self, objective: Objective, seed: int):
    self.objective, self.seed = objective, seed

  def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = Rows(batch['tokens'], batch['tokens_segment_ids'], batch['tokens_positions'])
    keys = np.stack([np.full(len(rows.tokens), self.seed), batch['record'][:, 0], batch['offset'][:, 0]], axis=1)
    return self.objective(rows, keys)


def records(documents: Documents, shuffle_seed: int | None, stream: int, streams: int) -> grain.MapDataset:
  """(sequence position, text) of the records stream `stream` of `streams` reads. With `shuffle_seed`
  (training) the documents are shuffled and repeated forever, every epoch in a new order; without, read
  once in order. Stream k takes positions k, k + S, ...: within each epoch the streams' shares are disjoint
  and cover every document once."""
  ds = grain.MapDataset.source(documents)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed).repeat()
  return ds.map_with_index(_with_index)[stream::streams]


def stream_layout(global_batch: int, streams: int, process_index: int, process_count: int) -> tuple[range, int]:
  """(the streams this process runs, how many streams there are): the most streams, at most `streams`
  (or the process count if larger), that divide the global batch and split evenly over the processes."""
  total = max(s for s in range(1, global_batch + 1)
              if global_batch % s == 0 and s % process_count == 0 and s <= max(streams, process_count))
  per_process = total // process_count
  return range(process_index * per_process, (process_index + 1) * per_process), total


def _concatenate(parts: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
  return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def batch_dataset(documents: Documents, tokenizer: Tokenizer, objective: Objective, *, shuffle_seed: int | None,
                  key_seed: int, global_batch: int, streams: int = 16, process_index: int = 0,
                  process_count: int = 1) -> grain.IterDataset:
  """This process's rows of each global batch, as features, before prefetching; rows keyed from `key_seed`."""
  mine, total = stream_layout(global_batch, streams, process_index, process_count)
  tokenize = _Tokenize(tokenizer, objective.with_bos)
  lengths = {key: objective.row_len for key in ('tokens', 'record', 'offset')}

  def stream_rows(stream: int) -> grain.IterDataset:
    ds = records(documents, shuffle_seed, stream, total).map(tokenize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths).filter(_full_row)
    return ds.batch(global_batch // total, drop_remainder=True)
  rows = grain.experimental.ZipIterDataset([stream_rows(s) for s in mine], strict=False).map(_concatenate)
  return rows.map(_Features(objective, key_seed))


class Batches:
  """Global batches (dicts of jax.Array [B, ...]) of one split, each process building only its rows.

  `iterator` is the grain iterator whose state checkpoints save and restore.
  """

  def __init__(self, dataset: grain.IterDataset, mesh: Mesh, global_batch: int, workers: int, prefetch: int):
    if workers:
      from absl import flags
      if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags; we take their defaults
        flags.FLAGS.mark_as_parsed()
      dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                                 per_worker_buffer_size=prefetch))
    else:
      dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
    self.dataset, self.mesh, self.global_batch = dataset, mesh, global_batch
    self.iterator = iter(dataset)
    # Stop the prefetching thread or processes when these batches are dropped, or at exit at the latest.
    weakref.finalize(self, self.iterator.close)

  def _global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {key: jax.make_array_from_process_local_data(batch_sharding(self.mesh, value.ndim), value,
                                                        (self.global_batch, *value.shape[1:]))
            for key, value in local.items()}

  def __iter__(self) -> Batches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    return self._global(next(self.iterator))

  def first(self, count: int) -> Iterator[dict[str, jax.Array]]:
    """Up to `count` batches from the start of the split (a fresh iterator: evaluation sees the same rows)."""
    iterator = iter(self.dataset)
    try:
      for _, local in zip(range(count), iterator):
        yield self._global(local)
    finally:
      iterator.close()



def global_rows(mesh: Mesh, rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Rows every process holds whole (the same on each) -> global arrays split over the mesh's batch axes."""
  return {k: jax.make_array_from_callback(v.shape, batch_sharding(mesh, v.ndim), lambda index, v=v: v[index])
          for k, v in rows.items()}


class HostRows:
  """Endless global batches of `batch` rows from examples every process holds (fine-tuning sets): seeded
  per-epoch shuffles end to end, so a set smaller than the batch still trains. Its position (the next batch)
  is saved with checkpoints, as a grain iterator's is."""

  def __init__(self, examples: dict[str, np.ndarray], batch: int, seed: int, mesh: Mesh):
    self.examples, self.batch, self.seed, self.mesh = examples, batch, seed, mesh
    self.n = len(next(iter(examples.values())))
    self.next_batch = 0
    self._epochs: dict[int, np.ndarray] = {}

  def _epoch(self, e: int) -> np.ndarray:
    if e not in self._epochs:
      self._epochs = {e: np.random.default_rng([self.seed, e]).permutation(self.n)}  # batches run forward
    return self._epochs[e]

  def __iter__(self) -> HostRows:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    begin = self.next_batch * self.batch
    rows = np.array([self._epoch(i // self.n)[i % self.n] for i in range(begin, begin + self.batch)])
    self.next_batch += 1
    return global_rows(self.mesh, {k: v[rows] for k, v in self.examples.items()})

  def get_state(self) -> bytes:
    return json.dumps({'next_batch': self.next_batch}).encode()

  def set_state(self, state: bytes) -> None:
    self.next_batch = json.loads(state)['next_batch']

  def start_prefetch(self) -> None:
    """Called by grain's checkpoint handler after a restore: rows are built when asked for, nothing to start."""


def build_batches(config: Config, mesh: Mesh, objective_for: ObjectiveFor, process_index: int | None = None,
                  process_count: int | None = None) -> tuple[Tokenizer, Batches, Batches | None]:
  """Tokenizer, training batches (shuffled from the seed, endless) and validation batches (in order), or
  None for validation when `train.eval_batches` is 0, of the objective `objective_for` gives for the
  config's tokenizer. Process index and count default to JAX's."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = objective_for(tokenizer)
  process = (jax.process_index() if process_index is None else process_index,
             jax.process_count() if process_count is None else process_count)
  lo, hi = local_row_range(batch_sharding(mesh, 1), config.train.global_batch)
  if (lo, hi) != (process[0] * (hi - lo), (process[0] + 1) * (hi - lo)):
    raise ConfigError(f'process {process[0]} of {process[1]} holds batch rows [{lo}, {hi}), not its equal share in '
                      f'process order; build the mesh with the data axes outermost across hosts')
  d, seed = config.data, config.train.seed

  def batches(split: Split) -> Batches:
    documents = open_documents(d, split)
    if len(documents) == 0:
      raise ConfigError(f'the {split} split of data.source={d.source} holds no documents; add data')
    # Validation: in order and masked from seed 0 whatever the run's seed, so runs compare.
    train = split == 'train'
    dataset = batch_dataset(documents, tokenizer, objective, shuffle_seed=seed if train else None,
                            key_seed=seed if train else 0, global_batch=config.train.global_batch,
                            # a finite split cannot feed more streams than it has records
                            streams=d.streams if train else min(d.streams, len(documents)),
                            process_index=process[0], process_count=process[1])
    return Batches(dataset, mesh, config.train.global_batch, d.workers if train else 0, d.prefetch)
  val = None
  if config.train.eval_batches:
    val = batches('validation')
    with contextlib.closing(val.first(1)) as first:
      empty = next(first, None) is None
    if empty:
      raise ConfigError(f'the validation split yields no full batch of {hi - lo} rows of {objective.row_len} '
                        f'tokens; raise data.val_fraction (now {config.data.val_fraction}), lower '
                        f'train.global_batch or data.seq_len, add validation data, or set train.eval_batches=0')
  return tokenizer, batches('train'), val


class _ShapeTokenizer:
  """Stands in for the tokenizer where only feature shapes matter (they depend on lengths alone)."""
  vocab_size, pad_id, bos_id, eos_id, mask_id = 1, 0, 0, 0, 0
  special_ids = np.zeros(1, np.int64)

  def sentinel_ids(self, count: int) -> None:
    return None


def feature_specs(objective_for: ObjectiveFor) -> dict[str, tuple[tuple[int, ...], Any]]:
  """Per-row shape and dtype of every feature the objective produces (no tokenizer files needed)."""
  objective = objective_for(_ShapeTokenizer())
  zeros = np.zeros((2, objective.row_len), np.int32)
  features = objective(Rows(zeros, zeros + 1, zeros), np.zeros((2, 3), np.int64))
  return {k: (v.shape[1:], v.dtype) for k, v in features.items()}
