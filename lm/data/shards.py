"""Shards of a corpus tokenized ahead of training (`lm.data.tokenize` writes them; `data.source=tokenized:DIR`
reads them): DIR/shard-NNNNN.array_record holds a record per document (its token ids and the UTF-8 bytes each token
stands for, so bits per byte stay exact), DIR/manifest.json the sources, the tokenizer (its spec and a fingerprint
of how it encodes) and each shard (documents, tokens, file size). Training reads the shards by record, as any
source, with the manifest's tokenizer only.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from lm.config import ConfigError
from lm.data.tokenizers import fingerprint, get_tokenizer

FORMAT = 1
MANIFEST = 'manifest.json'


def encode_record(ids: np.ndarray, nbytes: np.ndarray) -> bytes:
  """A document's record: its token count (uint32), ids (int32) and each token's UTF-8 bytes (uint8)."""
  if len(nbytes) and int(np.max(nbytes)) > 255:
    raise ValueError(f'a token stands for {int(np.max(nbytes))} bytes, more than a shard records (255)')
  return (np.array([len(ids)], '<u4').tobytes() + np.asarray(ids, '<i4').tobytes()
          + np.asarray(nbytes, np.uint8).tobytes())


def decode_record(record: bytes) -> tuple[np.ndarray, np.ndarray] | None:
  """(ids, bytes per token) of a record; None for a document its source skipped (data.skip_bad_records)."""
  if not record:
    return None
  n = int(np.frombuffer(record[:4], '<u4')[0])
  ids = np.frombuffer(record[4:4 + 4 * n], '<i4').astype(np.int32)
  return ids, np.frombuffer(record[4 + 4 * n:], np.uint8).astype(np.int32)


def read_manifest(folder: str | Path, where: str) -> dict:
  """A complete shard folder's manifest; a ConfigError naming what is missing or damaged."""
  folder = Path(os.path.expanduser(str(folder)))
  if not (folder / MANIFEST).is_file():
    raise ConfigError(f'{where}: no {MANIFEST} in {folder}; write the shards with lm data tokenize')
  manifest = json.loads((folder / MANIFEST).read_text())
  missing = sum(entry is None for entry in manifest['shards'])
  if missing:
    raise ConfigError(f'{where}: {missing} of the {len(manifest["shards"])} shards in {folder} are not written yet; '
                      f'run the same lm data tokenize again to finish them')
  for entry in manifest['shards']:
    path = folder / entry['file']
    if not path.is_file() or path.stat().st_size != entry['size']:
      raise ConfigError(f'{where}: shard {path} is missing or damaged (not the {entry["size"]:,} bytes written); '
                        f'remove its entry from {MANIFEST} (or the folder) and run lm data tokenize again')
  return manifest


def corpus_id(manifest: dict) -> str:
  """A name for the corpus that moves with its folder (the validation split hashes documents under it)."""
  identity = json.dumps({k: manifest[k] for k in ('sources', 'tokenizer', 'shard_documents')}, sort_keys=True)
  return hashlib.sha256(identity.encode()).hexdigest()[:16]


class TokenizedDocuments:
  """Documents `rows` of a shard folder: (ids, bytes per token) each, or None for a skipped one."""

  def __init__(self, folder: str | Path, manifest: dict, rows: np.ndarray):
    from array_record.python.array_record_data_source import ArrayRecordDataSource
    folder = Path(os.path.expanduser(str(folder)))
    self.rows = rows
    self.source = ArrayRecordDataSource([str(folder / entry['file']) for entry in manifest['shards']])

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray] | None:
    return decode_record(self.source[int(self.rows[index])])


def check_tokenizer(manifest: dict, tokenizer_spec: str, where: str) -> None:
  """A ConfigError when the run's tokenizer encodes otherwise than the one the shards were made with."""
  made = manifest['tokenizer']
  if fingerprint(get_tokenizer(tokenizer_spec)) != made['fingerprint']:
    raise ConfigError(f'{where} was tokenized with {made["spec"]}, and the run\'s data.tokenizer={tokenizer_spec} '
                      f'encodes otherwise; set data.tokenizer={made["spec"]} or tokenize again')
