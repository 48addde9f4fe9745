"""gzip- and zstd-compressed JSON lines (Dolma's `*.json.gz`, DCLM's `*.jsonl.zst`) as seekable files.

A compressed stream cannot be read from the middle, and the pipeline reads documents in a shuffled order: each file
is decompressed once, streaming (memory flat in its size), into lm's cache (`lm.config.cache_dir`), under a name
keyed by the file's path, size and modification time. Every run, resume and process after the first seeks in that
copy; a damaged or truncated stream is named and leaves nothing behind.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path
from typing import Iterator

from lm.config import ConfigError, cache_dir

KINDS = {'.gz': 'gzip', '.zst': 'zstd'}
CHUNK = 1 << 20


def compression(path: str) -> str | None:
  """'gzip' or 'zstd' by the file's suffix, else None."""
  return KINDS.get(Path(path).suffix)


def seekable(path: str) -> str:
  """`path` itself when it is not compressed, else its decompressed copy (made on first use)."""
  kind = compression(path)
  if kind is None:
    return path
  stat = os.stat(path)
  key = hashlib.sha256(f'{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}'.encode()).hexdigest()[:20]
  copy = cache_dir() / 'decompressed' / f'{key}-{Path(path).stem}'
  if copy.exists():
    return str(copy)
  copy.parent.mkdir(parents=True, exist_ok=True)
  partial = copy.with_name(f'{copy.name}.partial-{os.getpid()}')
  try:
    with open(partial, 'wb') as out:
      for chunk in _decompressed(path, kind):
        out.write(chunk)
  except (EOFError, OSError, zlib.error, ValueError) as e:
    partial.unlink(missing_ok=True)
    raise ConfigError(f'{path}: a damaged or truncated {kind} stream ({str(e).splitlines()[0] or type(e).__name__}); '
                      f'download it again or leave it out of the glob') from None
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  os.replace(partial, copy)  # whole or absent: another process racing here writes the same bytes
  return str(copy)


def _decompressed(path: str, kind: str) -> Iterator[bytes]:
  """The decompressed bytes of every frame (gzip: member) in turn; EOFError when the stream stops mid-frame."""
  if kind == 'gzip':
    with gzip.open(path, 'rb') as source:  # raises EOFError itself on a truncated member
      while chunk := source.read(CHUNK):
        yield chunk
    return
  import zstandard
  context = zstandard.ZstdDecompressor()
  frame, between_frames = context.decompressobj(), True
  with open(path, 'rb') as source:
    while data := source.read(CHUNK):
      while data:  # zstandard's stream reader would end quietly at a truncation: each frame's end is checked here
        try:
          out = frame.decompress(data)
        except zstandard.ZstdError as e:
          raise ValueError(str(e)) from None
        yield out
        between_frames, data = frame.eof, frame.unused_data if frame.eof else b''
        if frame.eof:
          frame = context.decompressobj()
  if not between_frames:
    raise EOFError('the file ends inside a frame')
