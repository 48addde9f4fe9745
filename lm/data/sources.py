"""Document sources: the embedded corpus (Python's own docs and stdlib) and local text files."""
from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from pathlib import Path

from lm.config import ConfigError, DataConfig

Document = tuple[str, str]  # (stable name, text)

_SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test'}


def embedded_documents() -> list[Document]:
  """English text on every machine with Python, no download: the pydoc topics and stdlib sources.

  `pydoc_data.topics` holds the language reference that `help()` shows; the stdlib
  modules add docstrings, comments and code. Test suites are left out (fixtures, odd encodings).
  """
  docs: list[Document] = []
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


def text_documents(patterns: tuple[str, ...]) -> list[Document]:
  """One document per UTF-8 file matched by the globs, in sorted order."""
  paths = sorted({p for pattern in patterns for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                  if os.path.isfile(p)})
  if not paths:
    raise ConfigError(f'data.paths={list(patterns)} matched no files; check the globs')
  return [(p, Path(p).read_text('utf-8', errors='replace')) for p in paths]


def load_documents(cfg: DataConfig) -> list[Document]:
  if cfg.source == 'embedded':
    return embedded_documents()
  return text_documents(cfg.paths)


def is_validation(name: str, fraction: float) -> bool:
  """Fixed held-out split by a hash of the document name: the same for every seed and run."""
  return zlib.crc32(name.encode('utf-8')) % 10_000 < fraction * 10_000


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
  train = [d for d in docs if not is_validation(d[0], val_fraction)]
  val = [d for d in docs if is_validation(d[0], val_fraction)]
  if not val or not train:
    raise ConfigError(f'data.val_fraction={val_fraction} leaves {len(train)} training and {len(val)} validation '
                      f'documents of {len(docs)}; choose a fraction that leaves both non-empty')
  return train, val
