"""Harness tasks on local files: a folder per task under `--data-dir`, named as the task, holding
`<split>.jsonl` in the layout of the Hugging Face dataset the harness's task loads, or (seven tasks) the task's
original release files (`lm.jobs.evals.releases`). Each task gets a config that
`include:`s the harness's own (its prompts, splits, metrics and few-shot settings unchanged) and reads the local
files instead of the Hub."""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from lm_eval.tasks import TaskManager, manager
from lm_eval.tasks._index import Entry, Kind, TaskIndex

from lm.config import ConfigError, cache_dir
from lm.jobs.evals.releases import RELEASES, convert_release, release_files, task_folder
from lm.jobs.evals.tfds_tasks import convert_tfds

SPLITS = ('training_split', 'validation_split', 'test_split', 'fewshot_split')


def index_file() -> Path:
  """The installed harness's task index as JSON, named by its version and where its tasks live."""
  tasks = Path(manager.__file__).parent
  key = hashlib.sha256(str(tasks.resolve()).encode()).hexdigest()[:12]
  return cache_dir() / f'lm_eval-{version("lm-eval")}-tasks-{key}.json'


def _entry_json(entry: Entry) -> dict[str, Any]:
  return {'name': entry.name, 'kind': entry.kind.name, 'tags': sorted(entry.tags), 'cfg': entry.cfg,
          'yaml_path': None if entry.yaml_path is None else str(entry.yaml_path)}


def _entry(record: dict[str, Any]) -> Entry:
  path = record['yaml_path']
  return Entry(name=record['name'], kind=Kind[record['kind']], yaml_path=None if path is None else Path(path),
               cfg=record['cfg'], tags=set(record['tags']))


def _read_index(path: Path) -> dict[str, Entry] | None:
  try:
    return {name: _entry(record) for name, record in json.loads(path.read_text())['index'].items()}
  except (OSError, ValueError, KeyError, TypeError):
    return None


@functools.cache
def task_manager() -> TaskManager:
  """The harness's TaskManager of its installed tasks. The harness builds its index by parsing each of its ~14,000
  task YAMLs (~10 s, at every `lm eval` and in-loop evaluation); the index is kept in `index_file()` and the
  manager built from it (~0.5 s). A file that does not load is rebuilt, by one process while others wait."""
  path = index_file()
  index = _read_index(path)
  if index is None:
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      lock = open(path.with_suffix('.lock'), 'w')  # noqa: SIM115 (held until the index is written)
    except OSError:  # a read-only cache: every process builds the index
      return TaskManager()
    with lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      index = _read_index(path)  # written by another process while this one waited
      if index is None:
        built = TaskManager()
        records = {name: _entry_json(entry) for name, entry in built.task_index.items()}
        with tempfile.NamedTemporaryFile('w', dir=path.parent, suffix='.tmp', delete=False) as f:
          json.dump({'index': records}, f)  # then renamed: a reader sees the whole file or none
        os.replace(f.name, path)
        return built
  with mock.patch.object(TaskIndex, 'build', staticmethod(lambda paths, **_: index)):
    return TaskManager()  # its own bookkeeping (task, group and tag lists) over the stored index


def installed_task(manager: TaskManager, name: str) -> Any:
  """The harness's index entry of task `name`; a one-line error naming close names when it has none."""
  entry = manager.task_index.get(name)
  if entry is None:
    close = [t for t in manager.all_tasks if name in t or t in name][:8]
    hint = f' (close: {", ".join(close)})' if close else ''
    raise ConfigError(f'--tasks: lm-eval-harness has no task {name!r}{hint}; `lm eval --list-tasks` lists them')
  if entry.yaml_path is None or entry.kind.name.lower() != 'task':
    raise ConfigError(f'--tasks: {name!r} is a {entry.kind.name.lower()} of the harness, not one task; with '
                      f'--data-dir name its tasks one by one')
  return entry


def evaluated_split(cfg: dict[str, Any]) -> str:
  """The split the harness scores: the test split where the task names one, else the validation split."""
  return cfg.get('test_split') or cfg.get('validation_split')


def local_task_config(entry: Any, folder: Path) -> tuple[dict[str, Any], list[Path]]:
  """(a task config reading `folder`'s `<split>.jsonl`, the files it reads). Splits the harness's config names
  but the folder lacks are dropped, except the evaluated one (a ConfigError naming the file)."""
  cfg = entry.cfg or {}
  files: dict[str, str] = {}
  out: dict[str, Any] = {'include': str(entry.yaml_path), 'task': entry.name, 'dataset_path': 'json',
                         'dataset_name': None}
  needed = evaluated_split(cfg)
  for key in SPLITS:
    split = cfg.get(key)
    if not split:
      continue
    path = folder / f'{split}.jsonl'
    if path.is_file():
      files[split] = str(path.resolve())
    elif split == needed:
      raise ConfigError(f'{path} not found: {entry.name} is scored on its {split!r} split; write it there as JSON '
                        f'lines with the fields of the Hugging Face dataset {cfg.get("dataset_path")}')
    else:
      out[key] = None
  out['dataset_kwargs'] = {'data_files': files}
  return out, [Path(f) for f in files.values()]


def local_tasks(manager: TaskManager, tasks: list[str], data_dir: Path | str | None, into: Path,
                source: str = 'files') -> list[Path]:
  """Writes a config per task into `into` (to pass as the harness's include path), converting original
  releases (or, with source 'tfds', prepared TFDS datasets in `data_dir`) into `into/data/<task>/` first; returns
  the files read (the release's own where converted)."""
  configs, files = [], []
  for name in tasks:
    entry = installed_task(manager, name)
    if source == 'tfds':
      cfg, folder, originals = entry.cfg or {}, into / 'data' / name, []
      convert_tfds(name, [cfg[k] for k in SPLITS if cfg.get(k)], evaluated_split(cfg),
                   None if data_dir is None else str(data_dir), folder)
    else:
      folder, originals = _local_folder(entry, name, Path(data_dir), into)
    config, read = local_task_config(entry, folder)
    configs.append((name, config))
    files += originals or read
  into.mkdir(parents=True, exist_ok=True)
  for name, config in configs:
    (into / f'{name}.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
  return files


def _local_folder(entry: Any, name: str, data_dir: Path, into: Path) -> tuple[Path, list[Path]]:
  """(the folder of `name`'s `<split>.jsonl` files, the release files they were converted from, if any)."""
  folder = task_folder(data_dir, name)
  if not folder.is_dir():
    raise ConfigError(f'--data-dir {data_dir} has no folder {folder.name}/; put {name}\'s files there')
  needed = evaluated_split(entry.cfg or {})
  release = {} if (folder / f'{needed}.jsonl').is_file() else release_files(folder, name)
  if not release:
    return folder, []
  if needed not in release:
    pattern = RELEASES[name][1][needed][0]
    raise ConfigError(f'{folder}/{pattern} not found: {name} is scored on its {needed!r} split')
  return into / 'data' / name, convert_release(name, release, into / 'data' / name)


def sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()
