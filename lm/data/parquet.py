"""Parquet files as random-access documents: one row a document, its text in one column (FineWeb, FineWeb-Edu and
DCLM's `text`; the other columns are never read).

Only the row counts of each file's row groups are read up front (Parquet's footer), so memory stays flat in the
corpus size; a document is read by decoding its row group's text column, and the last few decoded groups are kept,
so documents of one group read together cost one decode.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

from lm.config import ConfigError

CACHED_GROUPS = 4  # decoded row groups kept per reader (each process and grain worker has its own)


def _open(path: str):
  import pyarrow.lib
  import pyarrow.parquet as pq
  try:
    return pq.ParquetFile(path)
  except (pyarrow.lib.ArrowException, OSError) as e:
    raise ConfigError(f'{path}: not a readable Parquet file ({str(e).splitlines()[0]}); check the file or '
                      f'the glob') from None


class ParquetRows:
  """The rows of Parquet files, in file order, as (group start) offsets: row r of the corpus lies in row group
  `searchsorted(starts, r)` of file `group_file[...]`."""

  def __init__(self, paths: list[str], column: str):
    self.paths, self.column = paths, column
    starts, group_file, group_index, file_starts, total = [], [], [], [], 0
    for f, path in enumerate(paths):
      meta = _open(path).metadata
      names = meta.schema.names
      if column not in names:
        raise ConfigError(f'{path} has no column {column!r} (its columns: {", ".join(names)}); set data.text_key '
                          f'or name the column (NAME=parquet:GLOB:COLUMN)')
      if meta.num_rows == 0:
        raise ConfigError(f'{path} holds no rows; remove it or narrow the glob')
      file_starts.append(total)
      for g in range(meta.num_row_groups):
        starts.append(total)
        group_file.append(f)
        group_index.append(g)
        total += meta.row_group(g).num_rows
    self.starts = np.array(starts, np.int64)
    self.group_file = np.array(group_file, np.int32)
    self.group_index = np.array(group_index, np.int32)
    self.file_starts = np.array(file_starts + [total], np.int64)
    self.total = total


class ParquetDocuments:
  """Documents `rows` (indices into `ParquetRows`) of Parquet files: the text of each row's column."""

  def __init__(self, table: ParquetRows, rows: np.ndarray):
    self.table, self.rows = table, rows
    self._files: dict[int, object] = {}
    self._groups: collections.OrderedDict[int, list] = collections.OrderedDict()
    # The pipeline's streams read from threads of their own: one file handle must not serve two reads at once.
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> str:
    row = int(self.rows[index])
    group = int(np.searchsorted(self.table.starts, row, side='right')) - 1
    with self._lock:
      texts = self._group(group)
    text = texts[row - int(self.table.starts[group])]
    return '' if text is None else str(text)

  def _group(self, group: int) -> list:
    if group in self._groups:
      self._groups.move_to_end(group)
      return self._groups[group]
    f = int(self.table.group_file[group])
    if f not in self._files:
      self._files[f] = _open(self.table.paths[f])
    column = self._files[f].read_row_group(int(self.table.group_index[group]), columns=[self.table.column])
    texts = column.column(0).to_pylist()
    self._groups[group] = texts
    if len(self._groups) > CACHED_GROUPS:
      self._groups.popitem(last=False)
    return texts

  def __getstate__(self) -> dict:
    """Pickled for grain's worker processes without open files or decoded groups."""
    return {'table': self.table, 'rows': self.rows}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state['table'], state['rows'])
