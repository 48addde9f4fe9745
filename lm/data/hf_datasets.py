"""Hugging Face datasets on local disk as random-access documents (`data.source=hf`, `NAME=hf:PATH[:SPLIT]`): a
folder `save_to_disk` wrote (a Dataset, or a DatasetDict of splits), or a folder of data files (JSON lines, CSV,
Parquet, text) that `load_dataset` turns into Arrow once, kept in lm's cache. Either way the rows are read from
memory-mapped Arrow files, so memory stays flat in the dataset's size; nothing is downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path

from lm.config import ConfigError, cache_dir


def load(path: str, where: str):
  """The Dataset or DatasetDict at `path`; a ConfigError naming `where` when there is none."""
  os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # a local folder only: never the Hub
  import datasets
  datasets.disable_progress_bars()
  folder = Path(os.path.expanduser(path))
  if not folder.is_dir():
    raise ConfigError(f'{where}: no folder {path}; save a dataset there with save_to_disk, or point at a folder of '
                      f'data files')
  if (folder / 'dataset_dict.json').exists() or (folder / 'state.json').exists():
    try:
      return datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as e:
      raise ConfigError(f'{where}: {path} is not a whole saved dataset ({str(e).splitlines()[0]}); save it '
                        f'again with save_to_disk') from None
  try:
    return datasets.load_dataset(str(folder), cache_dir=str(cache_dir() / 'hf_datasets'))
  except (FileNotFoundError, ValueError, datasets.exceptions.DataFilesNotFoundError) as e:
    raise ConfigError(f'{where}: {path} holds neither a saved dataset nor data files load_dataset reads '
                      f'({str(e).splitlines()[0]})') from None


def split_of(loaded, split: str | None, path: str, where: str):
  """`loaded`'s split `split` (a DatasetDict's), or the one Dataset when `split` is None."""
  import datasets
  if isinstance(loaded, datasets.DatasetDict):
    if split not in loaded:
      raise ConfigError(f'{where}: {path} has no split {split!r} (its splits: {", ".join(loaded)}); name one of them')
    return loaded[split]
  if split is not None:
    raise ConfigError(f'{where}: {path} is one dataset without splits, so there is no split {split!r} to take; '
                      f'leave the split out')
  return loaded


class HfDocuments:
  """Rows `rows` of a Dataset: the text of each row's `column`."""

  def __init__(self, dataset, column: str, rows, where: str):
    if column not in dataset.column_names:
      raise ConfigError(f'{where}: no column {column!r} (its columns: {", ".join(dataset.column_names)}); set '
                        f'data.text_key')
    self.dataset, self.column, self.rows = dataset.select_columns([column]), column, rows

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> str:
    text = self.dataset[int(self.rows[index])][self.column]
    return '' if text is None else str(text)
