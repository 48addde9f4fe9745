"""Document sources as random-access sequences of text: what grain reads records from.

`data.source` picks one: the embedded corpus (Python's own docs and stdlib, no download), local text files (one
document each), local JSONL (one document per line, under `data.text_key`; gzip or zstd compressed:
`lm.data.compressed`), local Parquet files (one document per row, in the `data.text_key` column:
`lm.data.parquet`), or a TFDS dataset prepared as ArrayRecord (`tfds.data_source`, no TensorFlow at run time).
Local files are read when a record is asked for, never all at once; the embedded corpus and local files hold out a
fixed validation set chosen by a hash of each document's name, TFDS uses its own splits.

The embedded corpus and text files are cut at line breaks into records of at most
`data.max_chars` characters (a stdlib module would otherwise fill hundreds of consecutive rows and
the shuffle could not mix it with others); JSONL lines and TFDS records are taken as they are.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import glob
import json
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Literal, Protocol, Sequence

import numpy as np

from lm.config import ConfigError, DataConfig, HeldOutSet, named_sources
from lm.data.compressed import seekable
from lm.data.hf_datasets import HfDocuments, load, split_of
from lm.data.parquet import ParquetDocuments, ParquetRows
from lm.data.shards import TokenizedDocuments, check_tokenizer, corpus_id, read_manifest

Split = Literal['train', 'validation']
_SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test'}


class Documents(Protocol):
  """grain's RandomAccessDataSource: `len` and the text of record `i`, or its (ids, bytes per token) when the
  source is tokenized already (None: a bad record skipped, which readers leave out)."""

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> str | tuple[np.ndarray, np.ndarray] | None: ...


@functools.lru_cache(maxsize=1)
def embedded_documents() -> list[tuple[str, str]]:
  """(name, text) of English text on every machine with Python, no download: the pydoc topics and stdlib
  sources. `pydoc_data.topics` holds the language reference that `help()` shows; the stdlib modules add
  docstrings, comments and code. Test suites are left out (fixtures, odd encodings)."""
  docs: list[tuple[str, str]] = []
  try:
    from pydoc_data.topics import topics
    docs += [(f'pydoc/{key}', text) for key, text in sorted(topics.items())]
  except ImportError:  # some distributions strip pydoc_data; the sources alone still suffice
    pass
  root = Path(sysconfig.get_paths()['stdlib'])
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    for filename in sorted(filenames):
      if filename.endswith('.py'):
        path = Path(dirpath) / filename
        docs.append((f'stdlib/{path.relative_to(root).as_posix()}', path.read_text('utf-8', errors='replace')))
  if not docs:
    raise ConfigError(f'no embedded corpus found under {root}; use data.source=text with data.paths')
  return docs


JSONL_SUFFIXES = ('.jsonl', '.json', '.jsonl.gz', '.json.gz', '.jsonl.zst', '.json.zst')


def files_source(patterns: Sequence[str]) -> str:
  """The `data.source` of local files by their globs' endings: jsonl (plain or compressed), parquet, else text."""
  if all(p.endswith(JSONL_SUFFIXES) for p in patterns):
    return 'jsonl'
  return 'parquet' if all(p.endswith('.parquet') for p in patterns) else 'text'


def is_validation(name: str, fraction: float) -> bool:
  """Fixed held-out split by a hash of the document name: the same for every seed and run."""
  return zlib.crc32(name.encode('utf-8')) % 10_000 < fraction * 10_000


def split_documents(docs: list[tuple[str, str]], val_fraction: float
                    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
  train = [d for d in docs if not is_validation(d[0], val_fraction)]
  val = [d for d in docs if is_validation(d[0], val_fraction)]
  _check_split(len(train), len(val), len(docs), val_fraction)
  return train, val


def held_by_name(prefix: str, count: int, fraction: float) -> np.ndarray:
  """`is_validation` of the names PREFIX + '0', PREFIX + '1', ... (rows of a file or dataset), each hash running on
  from the prefix's."""
  start = zlib.crc32(prefix.encode('utf-8'))
  hashes = np.fromiter((zlib.crc32(str(i).encode(), start) for i in range(count)), np.uint32, count)
  return hashes % 10_000 < fraction * 10_000


def split_rows(held: np.ndarray, split: Split, fraction: float) -> np.ndarray:
  """The rows of `split` given which rows are held out; a ConfigError when that split is empty."""
  rows = np.flatnonzero(held == (split == 'validation'))
  if not len(rows):
    _check_split(int((~held).sum()), int(held.sum()), len(held), fraction)
  return rows


def _check_split(train: int, val: int, total: int, fraction: float) -> None:
  if not val or not train:
    raise ConfigError(f'data.val_fraction={fraction} leaves {train} training and {val} validation '
                      f'documents of {total}; choose a fraction that leaves both non-empty')


def local_files(patterns: Sequence[str], where: str = 'data.paths') -> list[str]:
  paths = sorted({p for pattern in patterns for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                  if os.path.isfile(p)})
  if not paths:
    raise ConfigError(f'{where}={list(patterns)} matched no files; check the globs')
  return paths


class TextList:
  """Documents held in memory (the embedded corpus)."""

  def __init__(self, texts: list[str]):
    self.texts = texts

  def __len__(self) -> int:
    return len(self.texts)

  def __getitem__(self, index: int) -> str:
    return self.texts[index]


def chunk_bounds(data: bytes | str, max_size: int) -> list[tuple[int, int]]:
  """[start, end) pieces of `data` of at most `max_size`, cut after line breaks where a line allows it."""
  newline = b'\n' if isinstance(data, bytes) else '\n'
  bounds, start, end = [], 0, 0
  while end < len(data):
    line_end = data.find(newline, end)
    line_end = len(data) if line_end < 0 else line_end + 1
    if line_end - start <= max_size:
      end = line_end
      continue
    if end == start:  # one line longer than a piece: cut it (on a UTF-8 character boundary)
      end = start + max_size
      while isinstance(data, bytes) and end > start + 1 and data[end] & 0xC0 == 0x80:
        end -= 1
    bounds.append((start, end))
    start = end
  if start < len(data):
    bounds.append((start, len(data)))
  return bounds


class TextFiles:
  """UTF-8 files, each cut into pieces (byte ranges) of at most `max_chars` bytes, read when asked for."""

  def __init__(self, paths: list[str], max_chars: int):
    self.paths, self.max_chars = paths, max_chars
    pieces = [(f, start, end) for f, path in enumerate(paths)
              for start, end in chunk_bounds(Path(path).read_bytes(), max_chars)]
    self.file = np.array([p[0] for p in pieces], np.int32)
    self.bounds = np.array([p[1:] for p in pieces], np.int64).reshape(-1, 2)

  def __len__(self) -> int:
    return len(self.file)

  def split_tail(self, fraction: float, split: Split) -> TextFiles:
    """The pieces of one split when there are too few files to split by file: the last
    max(1, round(fraction x pieces)) pieces are held out, the rest train."""
    held = max(1, round(fraction * len(self)))
    if held >= len(self):
      raise ConfigError(f'data.paths holds {len(self)} piece(s) of data.max_chars={self.max_chars}, too few to hold '
                        f'some out for validation; add text, lower data.max_chars, or set train.eval_batches=0 and '
                        f'data.val_fraction=0')
    rows = slice(len(self) - held, None) if split == 'validation' else slice(0, len(self) - held)
    part = copy.copy(self)
    part.file, part.bounds = self.file[rows], self.bounds[rows]
    return part

  def __getitem__(self, index: int) -> str:
    start, end = self.bounds[index]
    with open(self.paths[self.file[index]], 'rb') as f:
      f.seek(start)
      return f.read(end - start).decode('utf-8', errors='replace')


class JsonLines:
  """One JSON object per line of local files (plain, or gzip / zstd: `lm.data.compressed`); the document is its
  `text_key` field, read when asked for.

  Only the byte offset of each line is kept (8 bytes a document), so memory stays flat as files grow.
  """

  def __init__(self, paths: list[str], lines: list[tuple[int, int]], text_key: str, skip_bad: bool = False):
    self.paths, self.text_key, self.skip_bad, self.skipped = paths, text_key, skip_bad, 0
    self.files = [seekable(p) for p in paths]
    self.file = np.array([f for f, _ in lines], np.int32)
    self.offset = np.array([o for _, o in lines], np.int64)

  def __len__(self) -> int:
    return len(self.offset)

  def __getitem__(self, index: int) -> str | None:
    """The document; None for a bad line when skipping them (data.skip_bad_records), else a ConfigError."""
    f, offset = self.file[index], self.offset[index]
    with open(self.files[f], 'rb') as handle:
      handle.seek(offset)
      line = handle.readline()
    try:
      record = json.loads(line)
    except UnicodeDecodeError:
      return self._bad(f, offset, 'is not UTF-8', 'fix or drop the line')
    except json.JSONDecodeError as e:
      return self._bad(f, offset, f'is not JSON ({e.msg})', 'fix or drop the line')
    if not isinstance(record, dict) or self.text_key not in record:
      keys = ', '.join(record) if isinstance(record, dict) else type(record).__name__
      return self._bad(f, offset, f'has no {self.text_key!r} field (it has: {keys})', 'set data.text_key')
    return str(record[self.text_key])

  def _bad(self, f: int, offset: int, problem: str, fix: str) -> None:
    where = self._where(f, offset)
    if not self.skip_bad:
      raise ConfigError(f'{where} {problem}; {fix}, or set data.skip_bad_records=true to skip such lines')
    self.skipped += 1
    print(f'data: skipped {where}: it {problem} ({self.skipped:,} bad records skipped by this reader)', flush=True)

  def _where(self, f: int, offset: int) -> str:
    """`PATH line N` of the line at `offset` (its decompressed stream's, for a compressed file)."""
    with open(self.files[f], 'rb') as handle:
      line = handle.read(offset).count(b'\n') + 1
    return f'{self.paths[f]} line {line}'


def jsonl_lines(paths: list[str]) -> list[tuple[str, int, int]]:
  """(name, file index, byte offset) of every non-empty line (of the decompressed stream of a compressed file)."""
  out = []
  for f, path in enumerate(paths):
    before = len(out)
    with open(seekable(path), 'rb') as handle:
      offset = 0
      for n, line in enumerate(handle):
        if line.strip():
          out.append((f'{path}:{n}', f, offset))
        offset += len(line)
    if len(out) == before:  # most often a download or a write that failed
      raise ConfigError(f'{path} holds no lines; remove it or narrow the glob')
  return out


class TfdsDocuments:
  """A TFDS split prepared as ArrayRecord, read with `tfds.data_source`; the document is `text_key`."""

  def __init__(self, cfg: DataConfig, split: str):
    import tensorflow_datasets as tfds
    where = f'data.name={cfg.name}' + (f' in data.data_dir={cfg.data_dir}' if cfg.data_dir else '')
    try:
      self.source = tfds.data_source(cfg.name, split=split, data_dir=cfg.data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise ConfigError(f'{where}: no such prepared dataset; check data.name (with its config and version, '
                        f'e.g. c4/en:3.1.0) and data.data_dir, or prepare it (lm data build for local files)') from None
    except ValueError as e:
      message = str(e).splitlines()[0]
      raise ConfigError(f'{where}: {message}; set data.train_split / data.val_split') from None
    except FileNotFoundError as e:
      raise ConfigError(f'{where}: {e}; prepare the dataset in ArrayRecord format') from None
    features = list(self.source.dataset_info.features.keys())
    if cfg.text_key not in features:
      raise ConfigError(f'data.text_key={cfg.text_key!r} is not a feature of {cfg.name}; its features: '
                        f'{", ".join(features)}')
    self.text_key = cfg.text_key

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> str:
    value = self.source[index][self.text_key]
    return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


def open_documents(cfg: DataConfig, split: Split) -> Documents:
  """The documents of one split of the configured source."""
  if cfg.source == 'tfds':
    return TfdsDocuments(cfg, cfg.train_split if split == 'train' else cfg.val_split)
  if cfg.source == 'hf':
    return hf_documents(cfg.name, cfg, split)
  if cfg.source == 'tokenized':
    return tokenized_documents(cfg.name, cfg, split)
  if cfg.source == 'embedded':
    train, val = split_documents(embedded_documents(), cfg.val_fraction)
    return TextList([text[a:b] for _, text in (train if split == 'train' else val)
                     for a, b in chunk_bounds(text, cfg.max_chars)])
  paths = local_files(cfg.paths)
  if cfg.source == 'text':
    held = [is_validation(p, cfg.val_fraction) for p in paths]
    if cfg.val_fraction == 0 or all(held) or not any(held):  # too few files to split by file: split pieces
      if cfg.val_fraction == 0:
        return TextFiles(paths if split == 'train' else [], cfg.max_chars)
      return TextFiles(paths, cfg.max_chars).split_tail(cfg.val_fraction, split)
    return TextFiles([p for p, v in zip(paths, held) if v == (split == 'validation')], cfg.max_chars)
  if cfg.source == 'parquet':
    return parquet_documents(paths, cfg.text_key, cfg.val_fraction, split)
  lines = jsonl_lines(paths)
  held = [is_validation(name, cfg.val_fraction) for name, _, _ in lines]
  if not held.count(split == 'validation'):  # the split asked for: a mixture source may hold none out
    _check_split(held.count(False), held.count(True), len(lines), cfg.val_fraction)
  return JsonLines(paths, [(f, o) for (_, f, o), v in zip(lines, held) if v == (split == 'validation')], cfg.text_key,
                   cfg.skip_bad_records)


def parquet_documents(paths: list[str], column: str, fraction: float, split: Split | None) -> ParquetDocuments:
  """The rows of Parquet files in one split by `fraction` (by a hash of each row's name, as `jsonl` splits its
  lines), or every row (`split=None`)."""
  table = ParquetRows(paths, column)
  if split is None:
    return ParquetDocuments(table, np.arange(table.total))
  held = np.concatenate([held_by_name(f'{path}:', int(end - start), fraction)
                         for path, start, end in zip(paths, table.file_starts, table.file_starts[1:])])
  return ParquetDocuments(table, split_rows(held, split, fraction))


def hf_documents(path: str, cfg: DataConfig, split: Split | None, named: str = '', where: str = '') -> HfDocuments:
  """A local Hugging Face dataset's documents (`data.text_key`): its split `named`; else a DatasetDict's
  data.train_split or data.val_split; else a single Dataset's `split` by data.val_fraction (None: every row)."""
  where = where or f'data.name={path}'
  loaded = load(path, where)
  if named or isinstance(loaded, dict):  # a DatasetDict is a dict of splits
    dataset = split_of(loaded, named or (cfg.train_split if split == 'train' else cfg.val_split), path, where)
    return HfDocuments(dataset, cfg.text_key, np.arange(len(dataset)), where)
  dataset = split_of(loaded, None, path, where)
  if split is None:
    return HfDocuments(dataset, cfg.text_key, np.arange(len(dataset)), where)
  held = held_by_name(f'{path}:', len(dataset), cfg.val_fraction)
  return HfDocuments(dataset, cfg.text_key, split_rows(held, split, cfg.val_fraction), where)


def tokenized_documents(folder: str, cfg: DataConfig, split: Split | None, where: str = '') -> TokenizedDocuments:
  """A shard folder's documents: one split by data.val_fraction (by a hash of each document's number under the
  corpus's id), or every document (`split=None`); the run's tokenizer must be the one the shards were made with."""
  where = where or f'data.name={folder}'
  manifest = read_manifest(folder, where)
  check_tokenizer(manifest, cfg.tokenizer, where)
  count = manifest['documents']
  if split is None:
    return TokenizedDocuments(folder, manifest, np.arange(count))
  held = held_by_name(f'{corpus_id(manifest)}:', count, cfg.val_fraction)
  return TokenizedDocuments(folder, manifest, split_rows(held, split, cfg.val_fraction))


def held_out_documents(held: HeldOutSet, cfg: DataConfig) -> Documents:
  """Every document of a `data.evals` set (embedded: its validation split), read with `cfg`'s settings."""
  if held.source == 'tfds':
    return TfdsDocuments(dataclasses.replace(cfg, name=held.location), held.split)
  if held.source == 'embedded':
    return open_documents(dataclasses.replace(cfg, source='embedded'), 'validation')
  if held.source == 'hf':
    return hf_documents(held.location, cfg, None, held.split, f'data.evals set {held.name}')
  if held.source == 'tokenized':
    return tokenized_documents(held.location, cfg, None, f'data.evals set {held.name}')
  paths = local_files([held.location], f'data.evals set {held.name}')
  if held.source == 'text':
    return TextFiles(paths, cfg.max_chars)
  if held.source == 'parquet':
    return parquet_documents(paths, held.column or cfg.text_key, 0.0, None)
  return JsonLines(paths, [(f, o) for _, f, o in jsonl_lines(paths)], cfg.text_key, cfg.skip_bad_records)


def mixture_documents(cfg: DataConfig) -> list[Documents]:
  """The training documents of each `data.mixture` source, in order (text, jsonl, embedded: their training split
  by `data.val_fraction`; tfds: the split named)."""
  out = []
  for source in named_sources(cfg, 'mixture'):
    if source.source == 'tfds':
      documents = TfdsDocuments(dataclasses.replace(cfg, name=source.location), source.split)
    elif source.source == 'hf':
      documents = hf_documents(source.location, cfg, 'train', source.split, f'data.mixture source {source.name}')
    else:
      documents = open_documents(dataclasses.replace(cfg, source=source.source, paths=(source.location,),
                                                     name=source.location, text_key=source.column or cfg.text_key),
                                 'train')
    if len(documents) == 0:
      raise ConfigError(f'data.mixture source {source.name} holds no training documents; point it at data')
    out.append(documents)
  return out
