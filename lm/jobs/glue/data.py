"""Reading a GLUE split into examples: GLUE's TSV files as its download script lays them out, or TFDS glue/<task>.

The TSV files are tab-separated with no quoting at all (MRPC, QQP and SST-2 text holds raw `"`, which a CSV
reader would mangle), may carry a BOM and CRLF line ends, and old QQP files hold malformed rows (skipped and
counted). Labels become class ids through the task's explicit label maps, so TFDS's MNLI order cannot leak in.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from lm.config import ConfigError
from lm.jobs.glue.tasks import AX, Split, Task

_SKIPS_MALFORMED = ('qqp',)  # tasks whose files have known malformed rows, skipped rather than rejected
_DIR_FIX = "pass the directory GLUE's download script wrote (holding CoLA/, SST-2/, ...) or use --source tfds"


@dataclass(frozen=True)
class Example:
  index: str  # the file's id column, or the 0-based row number among the examples read when it has none
  texts: tuple[str, ...]  # text A (and B)
  label: int | float | None  # class id, or the score for regression; None for test splits


@dataclass(frozen=True)
class SplitData:
  task: Task
  split: Split
  examples: list[Example]
  skipped: int  # malformed rows skipped (QQP only)


def split_path(task: Task, split: Split, data_dir: str | Path | None) -> Path:
  """`DIR/<folder>/<file>.tsv`; for AX, `DIR/AX.tsv` when `DIR/diagnostic/diagnostic.tsv` is absent."""
  if data_dir is None:
    raise ConfigError(f'--source tsv needs --data-dir; {_DIR_FIX}')
  root = Path(data_dir)
  path = root / task.folder / f'{split.file}.tsv'
  if task.name == AX.name and not path.is_file() and (root / 'AX.tsv').is_file():
    return root / 'AX.tsv'
  return path


def read_tsv(task: Task, split_name: str, data_dir: str | Path | None) -> SplitData:
  """One split from GLUE's TSV files; ConfigError names the file (and line) of anything that does not fit."""
  split = task.split(split_name)
  path = split_path(task, split, data_dir)
  if not path.is_file():
    _raise_missing(task, path, Path(data_dir))
  try:
    text = path.read_bytes().decode('utf-8-sig')
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 (byte {e.start}); pass the file GLUE's download script wrote") from None
  layout, examples, skipped, first = split.layout, [], 0, True
  for number, line in enumerate(text.split('\n'), start=1):
    line = line.removesuffix('\r')
    if not line:
      continue
    fields = line.split('\t')
    if first:
      first = False
      if len(fields) != layout.columns:
        raise ConfigError(f'{path} has {len(fields)} tab-separated columns where {layout.columns} were expected; '
                          f"it does not look like {task.folder}'s {split.name} file: check --data-dir and --task")
      if layout.header:
        continue
    elif len(fields) != layout.columns:
      if task.name in _SKIPS_MALFORMED:
        skipped += 1
        continue
      raise ConfigError(f'{path}:{number} has {len(fields)} tab-separated columns where {layout.columns} were '
                        f'expected; fix or remove that row')
    index = fields[layout.index] if layout.index is not None else str(len(examples))
    label = None if layout.label is None else _label(task, fields[layout.label], f'{path}:{number}')
    examples.append(Example(index, tuple(fields[i] for i in layout.texts), label))
  return SplitData(task, split, examples, skipped)


def _raise_missing(task: Task, path: Path, root: Path) -> NoReturn:
  if task.name == AX.name:
    raise ConfigError(f'neither {path} nor {root / "AX.tsv"} exists; put GLUE\'s diagnostic file at either')
  if not (root / task.folder).is_dir():
    raise ConfigError(f'--data-dir {root} has no {task.folder}/ folder; {_DIR_FIX}')
  raise ConfigError(f'{path} is missing; GLUE\'s download script writes it: re-run it for {task.folder}, '
                    f'or use --source tfds')


def _label(task: Task, raw: str, where: str) -> int | float:
  try:
    return task.label_id(raw)
  except ValueError:
    allowed = ', '.join(task.labels) if task.labels else 'a number (the 0-5 similarity score)'
    raise ConfigError(f'{where}: label {raw!r} is not one of {allowed}; fix that row, or check that the '
                      f"file is {task.folder}'s") from None


def read_tfds(task: Task, split_name: str, data_dir: str | None = None) -> SplitData:
  """One split of TFDS `glue/<task>` prepared as ArrayRecord; `data_dir` (may be gs://) goes to TFDS untouched."""
  import tensorflow_datasets as tfds
  split = task.split(split_name)
  where = (f'TFDS {task.tfds} split {split.tfds_split} in '
           + (f'--data-dir {data_dir}' if data_dir else "TFDS's default data dir"))
  fix = (f'prepare it with `tfds build {task.tfds} --file_format=array_record'
         + (f' --data_dir={data_dir}`' if data_dir else '`') + ", or use --source tsv with GLUE's files")
  try:
    source = tfds.data_source(task.tfds, split=split.tfds_split, data_dir=data_dir, download=False)
  except tfds.core.registered.DatasetNotFoundError:
    raise ConfigError(f'{where}: no such prepared dataset; {fix}') from None
  except (ValueError, FileNotFoundError, NotImplementedError) as e:
    raise ConfigError(f'{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; {fix}') from None
  examples = [Example(str(int(record['idx'])), tuple(_text(record[key]) for key in task.text_keys),
                      _tfds_label(task, record['label'])) for record in source]
  return SplitData(task, split, examples, 0)


def _text(value: bytes | str) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _tfds_label(task: Task, value: int | float) -> int | float | None:
  """TFDS's label -> ours: -1 is no label (test splits); class numbers go through TFDS's class order."""
  if task.regression:
    return None if float(value) == -1 else float(value)
  return None if int(value) == -1 else task.label_id(task.tfds_labels[int(value)])


def read_split(task: Task, split_name: str, data_dir: str | None, source: str = 'tsv') -> SplitData:
  """A split from `source`: 'tsv' (GLUE's files under `data_dir`) or 'tfds' (glue/<task>)."""
  if source == 'tsv':
    return read_tsv(task, split_name, data_dir)
  if source == 'tfds':
    return read_tfds(task, split_name, data_dir)
  raise ConfigError(f"--source {source} is not a GLUE data source; choose tsv (GLUE's files) or tfds (glue/<task>)")
