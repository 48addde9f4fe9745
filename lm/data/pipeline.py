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

With `data.mixture` each source runs this per stream up to packing, and the stream draws its rows from the
sources' rows by weight (`lm.data.mixture`). Held-out sets (the validation split, `data.evals`) are read in
order and whole: each stream keeps its last row, padded, then yields padding rows (no weight) until the reader
stops, and every token carries its UTF-8 byte count for bits per byte.
"""
from __future__ import annotations

import itertools
import json
import weakref
from typing import Any, Callable, Iterator, Sequence

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.config import Config, ConfigError, DataConfig, held_out_sets
from lm.data.mixture import Mixture
from lm.data.objectives import Objective, Rows
from lm.data.sources import Documents, Split, held_out_documents, mixture_documents, open_documents
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


class _Positioned:
  """(sequence position, text) -> (the record's key: `base` + position, text); says once, when the first record
  of a training source's second epoch is read (by one stream of one process), that the source came round."""

  def __init__(self, base: int = 0, size: int = 0, name: str | None = None):
    self.base, self.size, self.name = base, size, name

  def __call__(self, index: int, text: str) -> tuple[int, str]:
    if self.name is not None and index == self.size:
      print(f'data: {self.name} starts its second epoch, in a new order (its {self.size:,} records all dealt out '
            f'to the streams)', flush=True)
    return self.base + index, text


class _Tokenize:
  """(stream index, text) -> tokens with, per token, its record (the stream index) and its offset in it, and
  with `with_bytes` its UTF-8 byte count (BOS and EOS: 0)."""

  def __init__(self, tokenizer: Tokenizer, with_bos: bool, with_bytes: bool):
    self.tokenizer, self.with_bos, self.with_bytes = tokenizer, with_bos, with_bytes

  def __call__(self, record: tuple[int, str | tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    index, text = record
    t = self.tokenizer
    if isinstance(text, tuple):  # tokenized ahead (lm.data.shards)
      ids, nbytes = text
    else:
      ids, nbytes = t.encode_with_bytes(text) if self.with_bytes else (t.encode(text), None)
    bos = [t.bos_id] if self.with_bos else []
    tokens = np.concatenate([bos, ids, [t.eos_id]]).astype(np.int32)
    out = {'tokens': tokens, 'record': np.full(len(tokens), index, np.int64),
           'offset': np.arange(len(tokens), dtype=np.int64)}
    if self.with_bytes:
      out['bytes'] = np.concatenate([np.zeros(len(bos)), nbytes, [0]]).astype(np.int32)
    return out


def _readable(record: tuple[int, str | None]) -> bool:
  """False for a bad record its source skipped (data.skip_bad_records)."""
  return record[1] is not None


def _full_row(row: dict[str, np.ndarray]) -> bool:
  """False only for the padded last row of a finite split."""
  return bool(row['tokens_segment_ids'][-1] != 0)


class _Packed(grain.IterDataset):
  """grain's concat-then-split packing, its state restored as it was saved. A checkpoint stores the state as JSON,
  which turns the (-1, -1) slices meaning "no remainder" into lists; grain compares them with the tuple, takes the
  list for a remainder and, resumed, skips a document (a mixture source not yet read holds none)."""

  def __init__(self, parent: grain.IterDataset, lengths: dict[str, int]):
    super().__init__(parent)
    self.packed = grain.experimental.ConcatThenSplitIterDataset(parent, length_struct=lengths)

  def __iter__(self) -> _PackedIterator:
    return _PackedIterator(self.packed.__iter__())


class _PackedIterator(grain.DatasetIterator):

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    slices = {key: tuple(value) for key, value in state['remainder_slices'].items()}
    self._parent.set_state({**state, 'remainder_slices': slices})


class _Mix(grain.IterDataset):
  """Stream `stream`'s rows drawn from its sources' rows by a `Mixture` (each stream giving `rows_per_step` rows
  a step)."""

  def __init__(self, parents: Sequence[grain.IterDataset], mixture: Mixture, stream: int, rows_per_step: int):
    super().__init__(list(parents))
    self.mixture, self.stream, self.rows_per_step = mixture, stream, rows_per_step

  def __iter__(self) -> _MixIterator:
    return _MixIterator([parent.__iter__() for parent in self._parents], self)


class _MixIterator(grain.DatasetIterator):

  def __init__(self, parents: list[grain.DatasetIterator], mix: _Mix):
    super().__init__(parents)
    self.mix = mix
    self.row = 0  # rows of this stream yielded

  def __next__(self) -> dict[str, np.ndarray]:
    mix = self.mix
    source = mix.mixture.source_of(self.row, mix.stream, mix.rows_per_step)
    self.row += 1
    return next(self._parents[source])

  def get_state(self) -> dict[str, Any]:
    return {'parents': [parent.get_state() for parent in self._parents], 'row': self.row}

  def set_state(self, state: dict[str, Any]) -> None:
    for parent, parent_state in zip(self._parents, state['parents'], strict=True):
      parent.set_state(parent_state)
    self.row = state['row']


class _PadForever(grain.IterDataset):
  """The parent's elements, then all-zero copies of its last one forever: every stream of a finite split keeps
  yielding rows (padding, segment id 0, never weighted) until the reader stops, so streams of different
  lengths zip whole and every process yields the same number of batches."""

  def __iter__(self) -> _PadForeverIterator:
    return _PadForeverIterator(self._parent.__iter__())


class _PadForeverIterator(grain.DatasetIterator):
  """Evaluation reads a fresh iterator each time; its state is never saved mid-padding."""

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self._last: dict[str, np.ndarray] | None = None
    self._padding: dict[str, np.ndarray] | None = None

  def __next__(self) -> dict[str, np.ndarray]:
    if self._padding is None:
      try:
        self._last = next(self._parent)
        return self._last
      except StopIteration:
        if self._last is None:  # an empty stream has no row to shape padding after
          raise
        self._padding = {key: np.zeros_like(value) for key, value in self._last.items()}
    return self._padding

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)


class _Features:
  """A batch of packed rows -> the objective's features, each row's randomness keyed by where it starts."""

  def __init__(self, objective: Objective, seed: int):
    self.objective, self.seed = objective, seed

  def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = Rows(batch['tokens'], batch['tokens_segment_ids'], batch['tokens_positions'], batch.get('bytes'))
    keys = np.stack([np.full(len(rows.tokens), self.seed), batch['record'][:, 0], batch['offset'][:, 0]], axis=1)
    return self.objective(rows, keys)


def records(documents: Documents, shuffle_seed: int | None, stream: int, streams: int, source: int = 0,
            name: str | None = None) -> grain.MapDataset:
  """(record key, text) of the records stream `stream` of `streams` reads. With `shuffle_seed` (training) the
  documents are shuffled and repeated forever, every epoch in a new order (the start of the second said once,
  naming the source `name`); without, read once in order. Stream k takes positions k, k + S, ...: within each
  epoch the streams' shares are disjoint and cover every document once. The key is the position, plus
  `source` x 2^40 for a mixture's sources after the first (rows of different sources draw different masks)."""
  ds = grain.MapDataset.source(documents)
  if shuffle_seed is not None:
    ds = ds.shuffle(seed=shuffle_seed).repeat()
  positioned = _Positioned(source << 40, len(documents), name if shuffle_seed is not None else None)
  return ds.map_with_index(positioned)[stream::streams]


def stream_layout(global_batch: int, streams: int, process_index: int, process_count: int) -> tuple[range, int]:
  """(the streams this process runs, how many streams there are): the most streams, at most `streams`
  (or the process count if larger), that divide the global batch and split evenly over the processes."""
  total = max(s for s in range(1, global_batch + 1)
              if global_batch % s == 0 and s % process_count == 0 and s <= max(streams, process_count))
  per_process = total // process_count
  return range(process_index * per_process, (process_index + 1) * per_process), total


def _concatenate(parts: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
  return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def batch_dataset(documents: Documents | Sequence[Documents], tokenizer: Tokenizer, objective: Objective, *,
                  shuffle_seed: int | None, key_seed: int, global_batch: int, streams: int = 16,
                  process_index: int = 0, process_count: int = 1, evaluation: bool = False,
                  mixture: Mixture | None = None, name: str = 'the training split') -> grain.IterDataset:
  """This process's rows of each global batch, as features, before prefetching; rows keyed from `key_seed`.
  `evaluation`: a finite split read whole, its targets' bytes counted (`target_bytes`), each stream's last
  row kept (padded) and then padding rows forever, so the reader stops at the first batch without weight.
  `mixture`: `documents` holds its sources' documents, each packed into its own rows, rows drawn by it."""
  mine, total = stream_layout(global_batch, streams, process_index, process_count)
  tokenize = _Tokenize(tokenizer, objective.with_bos, with_bytes=evaluation)
  lengths = {key: objective.row_len for key in ('tokens', 'record', 'offset', *(('bytes',) if evaluation else ()))}

  def source_rows(documents: Documents, stream: int, source: int, name: str) -> grain.IterDataset:
    ds = records(documents, shuffle_seed, stream, total, source, name).filter(_readable).map(tokenize)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    ds = _Packed(ds, lengths)
    return _PadForever(ds) if evaluation else ds.filter(_full_row)

  def stream_rows(stream: int) -> grain.IterDataset:
    if mixture is None:
      ds = source_rows(documents, stream, 0, name)
    else:
      ds = _Mix([source_rows(docs, stream, j, f'data.mixture source {source}')
                 for j, (docs, source) in enumerate(zip(documents, mixture.names, strict=True))],
               mixture, stream, global_batch // total)
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
    """Up to `count` (-1: all) batches from the start of the split (a fresh iterator: evaluation sees the same
    rows)."""
    iterator = iter(self.dataset)
    try:
      for _, local in zip(range(count) if count >= 0 else itertools.count(), iterator):
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


def _process(mesh: Mesh, global_batch: int, process_index: int | None, process_count: int | None
             ) -> tuple[int, int]:
  """(index, count) of this process, JAX's by default, checked to hold its equal share of the batch rows."""
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  lo, hi = local_row_range(batch_sharding(mesh, 1), global_batch)
  if (lo, hi) != (index * (hi - lo), (index + 1) * (hi - lo)):
    raise ConfigError(f'process {index} of {count} holds batch rows [{lo}, {hi}), not its equal share in '
                      f'process order; build the mesh with the data axes outermost across hosts')
  return index, count


def _evaluation_batches(documents: Documents, config: Config, mesh: Mesh, tokenizer: Tokenizer, objective: Objective,
                        process: tuple[int, int]) -> Batches:
  """A held-out set in order, whole, masked from seed 0 whatever the run's seed (so runs compare)."""
  dataset = batch_dataset(documents, tokenizer, objective, shuffle_seed=None, key_seed=0,
                          global_batch=config.train.global_batch,
                          # a finite set cannot feed more streams than it has records
                          streams=min(config.data.streams, len(documents)), process_index=process[0],
                          process_count=process[1], evaluation=True)
  return Batches(dataset, mesh, config.train.global_batch, 0, config.data.prefetch)


def training_batches(config: Config, mesh: Mesh, objective_for: ObjectiveFor, process_index: int | None = None,
                     process_count: int | None = None) -> tuple[Tokenizer, Batches]:
  """Tokenizer and training batches (shuffled from the seed, endless) of the objective `objective_for` gives for the
  config's tokenizer (its data.mixture when set). Process index and count default to JAX's."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = objective_for(tokenizer)
  process = _process(mesh, config.train.global_batch, process_index, process_count)
  d, seed = config.data, config.train.seed
  mixture = Mixture.of(d)
  sources = _documents(d, 'train') if mixture is None else mixture_documents(d)
  if d.unique_tokens:
    sources, total = capped(sources, tokenizer, d.unique_tokens)
    print(f'data: data.unique_tokens={d.unique_tokens:,}: the first {len(sources):,} documents of data.source '
          f'({total:,} tokens), repeated in epochs, each in a new order', flush=True)
  return tokenizer, Batches(batch_dataset(sources, tokenizer, objective, shuffle_seed=seed, key_seed=seed,
                                          global_batch=config.train.global_batch, streams=d.streams,
                                          process_index=process[0], process_count=process[1], mixture=mixture),
                            mesh, config.train.global_batch, d.workers, d.prefetch)


def validation_batches(config: Config, mesh: Mesh, objective_for: ObjectiveFor, process_index: int | None = None,
                       process_count: int | None = None) -> Batches | None:
  """The validation split's batches (in order), or None when `train.eval_batches` is 0."""
  if not config.train.eval_batches:
    return None
  tokenizer = get_tokenizer(config.data.tokenizer)
  process = _process(mesh, config.train.global_batch, process_index, process_count)
  return _evaluation_batches(_documents(config.data, 'validation'), config, mesh, tokenizer, objective_for(tokenizer),
                             process)


class Capped:
  """The first `count` documents of a source (`data.unique_tokens`)."""

  def __init__(self, documents: Documents, count: int):
    self.documents, self.count = documents, count

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> Any:
    if not 0 <= index < self.count:
      raise IndexError(index)
    return self.documents[index]


def capped(documents: Documents, tokenizer: Tokenizer, unique_tokens: int) -> tuple[Capped, int]:
  """The shortest run of the source's first documents that holds `unique_tokens` tokens (each with its EOS), and
  how many it holds; the whole source when it holds fewer."""
  total = 0
  for count in range(len(documents)):
    text = documents[count]
    if text is None:
      continue
    total += (len(text[0]) if isinstance(text, tuple) else len(tokenizer.encode(text))) + 1
    if total >= unique_tokens:
      return Capped(documents, count + 1), total
  return Capped(documents, len(documents)), total


def _documents(d: DataConfig, split: Split) -> Documents:
  found = open_documents(d, split)
  if len(found) == 0:
    raise ConfigError(f'the {split} split of data.source={d.source} holds no documents; add data')
  return found


def held_out_batches(config: Config, mesh: Mesh, objective_for: ObjectiveFor, process_index: int | None = None,
                     process_count: int | None = None) -> dict[str, Batches]:
  """name -> batches of each `data.evals` set, read like the validation split."""
  tokenizer = get_tokenizer(config.data.tokenizer)
  objective = objective_for(tokenizer)
  process = _process(mesh, config.train.global_batch, process_index, process_count)
  out = {}
  for held in held_out_sets(config.data):
    documents = held_out_documents(held, config.data)
    if len(documents) == 0:
      raise ConfigError(f'data.evals set {held.name} holds no documents; point it at data')
    out[held.name] = _evaluation_batches(documents, config, mesh, tokenizer, objective, process)
  return out


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
