"""`lm data tokenize SRC... --tokenizer T --out DIR`: any sources (`kind:LOCATION` as a named source writes them,
e.g. `parquet:fineweb/*.parquet`), in order, tokenized once into shards (`lm.data.shards`), shard k holding
documents [k D, (k + 1) D), in worker processes. Shards are written whole or not at all (a `.partial` file renamed
when complete) and the manifest after each, so a stopped run resumes where it stopped and its shards equal an
uninterrupted run's, whatever `--workers`.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from lm.config import ConfigError, DataConfig, HeldOutSet, parse_source
from lm.data.shards import MANIFEST, FORMAT, encode_record
from lm.data.sources import held_out_documents, local_files
from lm.data.tokenizers import Tokenizer, fingerprint, get_tokenizer

KINDS = ('text', 'jsonl', 'parquet', 'hf', 'tfds')  # each read whole (an hf DatasetDict: data.val_split's default)


def _sources(specs: Sequence[str]) -> list[HeldOutSet]:
  out = []
  for spec in specs:
    held = parse_source(spec, spec)
    if held is None or held.source not in KINDS:
      raise ConfigError(f'{spec!r}: write a source as text:GLOB, jsonl:GLOB, parquet:GLOB[:COLUMN], hf:PATH[:SPLIT], '
                        f'or tfds:DATASET:SPLIT')
    out.append(held)
  return out


class _Corpus:
  """The documents of several sources, end to end."""

  def __init__(self, specs: Sequence[str], cfg: DataConfig):
    self.parts = [held_out_documents(held, cfg) for held in _sources(specs)]
    self.starts = np.cumsum([0] + [len(p) for p in self.parts])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int) -> str | None:
    j = int(np.searchsorted(self.starts, index, side='right')) - 1
    return self.parts[j][index - int(self.starts[j])]


def _source_bytes(held: HeldOutSet) -> int | None:
  """The bytes of a file source's files (None for other kinds)."""
  if held.source not in ('text', 'jsonl', 'parquet'):
    return None
  return sum(os.path.getsize(p) for p in local_files([held.location], held.name))


def _identity(specs: Sequence[str], tokenizer_spec: str, tokenizer: Tokenizer, corpus: _Corpus,
              shard_documents: int, cfg: DataConfig) -> dict:
  """What a shard folder is made from: a resumed run must match it."""
  sources = [{'spec': spec, 'documents': len(part), 'bytes': _source_bytes(held)}
             for spec, held, part in zip(specs, _sources(specs), corpus.parts)]
  return {'format': FORMAT, 'sources': sources, 'text_key': cfg.text_key, 'max_chars': cfg.max_chars,
          'tokenizer': {'spec': tokenizer_spec, 'fingerprint': fingerprint(tokenizer)},
          'shard_documents': shard_documents}


_WORKER: dict = {}


def _start_worker(specs: Sequence[str], cfg: DataConfig, tokenizer_spec: str) -> None:
  _WORKER.update(corpus=_Corpus(specs, cfg), tokenizer=get_tokenizer(tokenizer_spec))


def _write_shard(job: tuple[str, int, int, int]) -> tuple[int, dict]:
  """Shard `k` (documents [start, stop)) written whole into `folder`; its manifest entry."""
  from array_record.python.array_record_module import ArrayRecordWriter
  folder, k, start, stop = job
  corpus, tokenizer = _WORKER['corpus'], _WORKER['tokenizer']
  name = f'shard-{k:05d}.array_record'
  partial = Path(folder) / f'{name}.partial'
  writer = ArrayRecordWriter(str(partial), 'group_size:1')
  tokens = 0
  try:
    for i in range(start, stop):
      text = corpus[i]
      if text is None:  # a bad record its source skipped: an empty record keeps the documents' numbering
        writer.write(b'')
        continue
      ids, nbytes = tokenizer.encode_with_bytes(text)
      writer.write(encode_record(ids, nbytes))
      tokens += len(ids)
  finally:
    writer.close()
  os.replace(partial, Path(folder) / name)
  return k, {'file': name, 'documents': stop - start, 'tokens': tokens,
             'size': os.path.getsize(Path(folder) / name)}


def _write_manifest(folder: Path, manifest: dict) -> None:
  partial = folder / f'{MANIFEST}.partial'
  partial.write_text(json.dumps(manifest, indent=1) + '\n')
  os.replace(partial, folder / MANIFEST)


def tokenize_corpus(specs: Sequence[str], tokenizer_spec: str, out: str | Path, *, workers: int = 0,
                    shard_documents: int = 10_000, cfg: DataConfig = DataConfig(),
                    progress: bool = True) -> dict:
  """Tokenizes the sources into shards in `out` (the shards a stopped run left are kept); its manifest."""
  from tqdm import tqdm
  if shard_documents < 1 or workers < 0:
    raise ConfigError('--shard-documents must be >= 1 and --workers >= 0')
  folder = Path(out)
  _start_worker(specs, cfg, tokenizer_spec)
  corpus = _WORKER['corpus']
  identity = _identity(specs, tokenizer_spec, _WORKER['tokenizer'], corpus, shard_documents, cfg)
  count = -(-len(corpus) // shard_documents)
  manifest = {**identity, 'documents': len(corpus), 'shards': [None] * count}
  if (folder / MANIFEST).exists():
    found = json.loads((folder / MANIFEST).read_text())
    if {k: found.get(k) for k in identity} != identity:
      raise ConfigError(f'{folder} holds shards of other sources, settings or another tokenizer; choose another '
                        f'--out or remove it (nothing was changed)')
    manifest = found
  folder.mkdir(parents=True, exist_ok=True)
  todo = [(str(folder), k, k * shard_documents, min((k + 1) * shard_documents, len(corpus)))
          for k in range(count) if manifest['shards'][k] is None]
  # A bar on a terminal; else a line each twentieth of the shards (a log stays short).
  bar = tqdm(total=count, initial=count - len(todo), unit='shard', desc='tokenizing') \
    if progress and sys.stdout.isatty() else None
  done = count - len(todo)
  for k, entry in _run(todo, workers, specs, cfg, tokenizer_spec):
    manifest['shards'][k] = entry
    _write_manifest(folder, manifest)
    done += 1
    if bar is not None:
      bar.update()
    elif progress and (done * 20 // count > (done - 1) * 20 // count or done == count):
      print(f'tokenizing: {done:,} of {count:,} shards written', flush=True)
  if bar is not None:
    bar.close()
  _write_manifest(folder, manifest)
  return manifest


def _run(jobs: list, workers: int, specs: Sequence[str], cfg: DataConfig, tokenizer_spec: str
         ) -> Iterator[tuple[int, dict]]:
  if workers == 0 or len(jobs) < 2:
    yield from map(_write_shard, jobs)
    return
  context = multiprocessing.get_context('spawn')  # no forked copies of the parent's threads
  with context.Pool(workers, initializer=_start_worker, initargs=(specs, cfg, tokenizer_spec)) as pool:
    yield from pool.imap_unordered(_write_shard, jobs)
