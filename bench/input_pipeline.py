"""Input pipeline throughput against what the train step consumes, and host memory as the data grows.

  python bench/input_pipeline.py [--batches 200] [--work DIR]

Rows: gpt_tiny's pipeline alone (grain: read, tokenize, pack, batch, global arrays) on the embedded corpus (bytes)
and, tokenized by a SentencePiece model, on the same documents as a TFDS dataset, Parquet files, zstd JSON lines, a
Hugging Face dataset saved to disk and shards `lm data tokenize` wrote, with a background thread (workers 0) and 2
worker processes, in tokens/s; the train step's consumption in tokens/s; the peak resident memory of a process
reading each form at 1x, 10x and 100x the documents (2k, 20k, 200k); and `lm data tokenize`'s tokens/s with 1 and
2 workers. Each measurement runs in its own process. Prints tables, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BASE_RECORDS = 2000


def pipeline_rate(overrides: list[str], batches: int) -> dict:
  import jax

  from lm.config import load_config
  from functools import partial

  from lm.data.pipeline import training_batches
  from lm.models import make_objective
  from lm.parallel.mesh import make_mesh
  config = load_config('gpt_tiny', ['mesh.data=1', 'train.eval_batches=0', *overrides])
  _, train = training_batches(config, make_mesh(config.mesh, jax.devices()[:1]), partial(make_objective, config))
  for _ in range(10):  # warm up: workers started, buffers filled once
    jax.block_until_ready(next(train))
  t0 = time.perf_counter()
  for _ in range(batches):
    jax.block_until_ready(next(train))
  seconds = time.perf_counter() - t0
  tokens = batches * config.train.global_batch * config.data.seq_len
  return {'tokens_per_sec': tokens / seconds, 'peak_rss_mib': peak_rss_mib()}


def peak_rss_mib() -> float:
  """This process's peak resident memory since it started: VmHWM (getrusage's ru_maxrss would carry the parent's
  peak over fork and exec, Linux's accounting, so every measurement would read the preparing parent's 2 GiB)."""
  for line in Path('/proc/self/status').read_text().splitlines():
    if line.startswith('VmHWM:'):
      return int(line.split()[1]) / 1024
  raise RuntimeError('no VmHWM in /proc/self/status (Linux only)')


def step_rate(steps: int) -> dict:
  import jax

  from lm.config import load_config
  from lm.jobs.pretraining import Pretraining
  config = load_config('gpt_tiny', ['mesh.data=1', 'train.eval_batches=0'])
  trainer = Pretraining(config, jax.devices()[:1])
  state, batch = trainer.init_state(), next(trainer.train_batches)
  for _ in range(2):
    state, metrics = trainer.train_step(state, batch)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = trainer.train_step(state, batch)
  jax.block_until_ready(metrics)
  return {'tokens_per_sec': steps * config.train.global_batch * config.data.seq_len / (time.perf_counter() - t0)}


FORMS = ('tfds', 'parquet', 'jsonl.zst', 'hf', 'tokenized')


def prepare(work: Path) -> dict[tuple[str, int], list[str]]:
  """The overrides reading each form of 1x, 10x and 100x BASE_RECORDS embedded-corpus records (a SentencePiece
  model trained on them), keyed by (form, scale); built once in `work`."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard

  from lm import cli
  from lm.data.sources import embedded_documents
  texts = [text[:1500] for _, text in embedded_documents()][:BASE_RECORDS]
  model = work / 'sp.model'
  tokenizer = [f'data.tokenizer=sentencepiece:{model}', 'model.vocab_size=8192']
  corpora = {}
  for scale in (1, 10, 100):
    name, docs = f'bench_corpus_{scale}x', [texts[i % len(texts)] for i in range(scale * BASE_RECORDS)]
    lines = ''.join(json.dumps({'text': d}) + '\n' for d in docs)
    if not (work / 'data' / name).exists():
      (work / f'{name}.jsonl').write_text(lines)
      assert cli.main(['data', 'build', '--name', name, '--from', str(work / f'{name}.jsonl'),
                       '--data-dir', str(work / 'data')]) == 0
      (work / f'{name}.jsonl').unlink()
    if not model.exists():
      assert cli.main(['tokenizer', 'train', '--config', 'gpt_tiny', 'data.source=tfds', f'data.name={name}',
                       f'data.data_dir={work / "data"}', '--vocab-size', '8000', '--out', str(work / 'sp')]) == 0
    if not (work / f'{name}.parquet').exists():
      pq.write_table(pa.table({'text': docs}), work / f'{name}.parquet', row_group_size=1000)
      (work / f'{name}.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
      datasets.Dataset.from_dict({'text': docs}).save_to_disk(work / f'{name}_hf')
      assert cli.main(['data', 'tokenize', f'parquet:{work / name}.parquet', '--tokenizer', f'sentencepiece:{model}',
                       '--out', str(work / f'{name}_shards'), '--no-progress']) == 0
    corpora.update({
      ('tfds', scale): ['data.source=tfds', f'data.name={name}', f'data.data_dir={work / "data"}'],
      ('parquet', scale): [f'data.source=parquet:{work / name}.parquet'],
      ('jsonl.zst', scale): [f'data.source=jsonl:{work / name}.jsonl.zst'],
      ('hf', scale): [f'data.source=hf:{work / name}_hf'],
      ('tokenized', scale): [f'data.source=tokenized:{work / name}_shards']})
  return {key: overrides + tokenizer for key, overrides in corpora.items()}


def tokenize_rate(work: Path, workers: int) -> dict:
  """`lm data tokenize` on the 10x Parquet corpus: tokens/s over its wall time (a process of its own)."""
  import shutil
  out = work / f'tokenize_{workers}'
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.perf_counter()
  subprocess.run([sys.executable, '-m', 'lm.cli', 'data', 'tokenize', f'parquet:{work}/bench_corpus_10x.parquet',
                  '--tokenizer', f'sentencepiece:{work / "sp.model"}', '--out', str(out), '--workers', str(workers),
                  '--shard-documents', '2000', '--no-progress'], check=True, capture_output=True)
  seconds = time.perf_counter() - t0
  manifest = json.loads((out / 'manifest.json').read_text())
  return {'workers': workers, 'tokens_per_sec': sum(s['tokens'] for s in manifest['shards']) / seconds}


def measure(kind: str, overrides: list[str], amount: int) -> dict:
  """Runs one measurement in a fresh process (clean memory, no shared caches)."""
  out = subprocess.run([sys.executable, __file__, '--measure', kind, '--amount', str(amount), '--', *overrides],
                       capture_output=True, text=True, check=True, env={'JAX_PLATFORMS': 'cpu', **_environ()})
  return json.loads(out.stdout.strip().splitlines()[-1])


def _environ() -> dict[str, str]:
  import os
  return dict(os.environ)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--batches', type=int, default=200)
  parser.add_argument('--work', default='/tmp/lm_bench_input_pipeline', help='where the TFDS corpora are built')
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'input_pipeline.json'))
  parser.add_argument('--measure', choices=('pipeline', 'step'), help=argparse.SUPPRESS)
  parser.add_argument('--amount', type=int, help=argparse.SUPPRESS)
  parser.add_argument('overrides', nargs='*', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    result = pipeline_rate(args.overrides, args.amount) if args.measure == 'pipeline' else step_rate(args.amount)
    print(json.dumps(result))
    return

  work = Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  corpora = prepare(work)
  step = measure('step', [], 20)['tokens_per_sec']
  rows = []
  sources = [('embedded, bytes', [])] + [(f'{form}, sentencepiece', corpora[form, 1]) for form in FORMS]
  for source, overrides in sources:
    for workers in (0, 2):
      r = measure('pipeline', [*overrides, f'data.workers={workers}'], args.batches)
      rows.append({'source': source, 'workers': workers, 'records': None, **r, 'x_step': r['tokens_per_sec'] / step})
  for (form, scale), overrides in corpora.items():  # memory with workers 0; the largest corpus's rate with 2 too
    for workers in (0, 2) if scale == 100 else (0,):
      r = measure('pipeline', [*overrides, f'data.workers={workers}'], args.batches)
      rows.append({'source': f'{form}, sentencepiece', 'workers': workers, 'records': scale * BASE_RECORDS, **r,
                   'x_step': r['tokens_per_sec'] / step})
  tokenizing = [tokenize_rate(work, workers) for workers in (1, 2)]

  print(f'train step (gpt_tiny) consumes {step:,.0f} tokens/s\n')
  print('| source | workers | records | pipeline tokens/s | x step | peak RSS MiB |\n|---|---|---|---|---|---|')
  for r in rows:
    records = f'{r["records"]:,}' if r['records'] else '-'
    memory = f'{r["peak_rss_mib"]:,.0f}' if r['workers'] == 0 else '-'  # the workers' own memory is theirs
    print(f'| {r["source"]} | {r["workers"]} | {records} | {r["tokens_per_sec"]:,.0f} | {r["x_step"]:.1f} | '
          f'{memory} |')
  print('\n| lm data tokenize (20k documents, Parquet, SentencePiece) | tokens/s |\n|---|---|')
  for r in tokenizing:
    print(f'| {r["workers"]} worker(s) | {r["tokens_per_sec"]:,.0f} |')
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({'step_tokens_per_sec': step, 'rows': rows, 'tokenize': tokenizing}, indent=2) + '\n')
  print(f'\nwrote {out}')


if __name__ == '__main__':
  main()
