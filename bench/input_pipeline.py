"""Input pipeline throughput against what the train step consumes, and host memory as the data grows.

  python bench/input_pipeline.py [--batches 200] [--work DIR]

Rows: gpt_tiny's pipeline alone (grain: read, tokenize, pack, batch, global arrays) on the embedded
corpus (bytes) and on a TFDS corpus tokenized by a SentencePiece model, with a background thread
(workers 0) and with 1 and 2 worker processes, in tokens/s; the train step's consumption in
tokens/s; and the peak resident memory of a process reading TFDS corpora of 1x, 10x and 100x the
records. Each measurement runs in its own process. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import resource
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
  return {'tokens_per_sec': tokens / seconds, 'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


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


def prepare(work: Path) -> dict[int, list[str]]:
  """TFDS corpora of 1x, 10x, 100x BASE_RECORDS embedded-corpus records and a SentencePiece model on them."""
  from lm import cli
  from lm.data.sources import embedded_documents
  texts = [text[:1500] for _, text in embedded_documents()][:BASE_RECORDS]
  model = work / 'sp.model'
  corpora = {}
  for scale in (1, 10, 100):
    name = f'bench_corpus_{scale}x'
    if not (work / 'data' / name).exists():
      with open(work / f'{name}.jsonl', 'w') as f:
        for i in range(scale * BASE_RECORDS):
          f.write(json.dumps({'text': texts[i % len(texts)]}) + '\n')
      assert cli.main(['data', 'build', '--name', name, '--from', str(work / f'{name}.jsonl'),
                       '--data-dir', str(work / 'data')]) == 0
      (work / f'{name}.jsonl').unlink()
    corpora[scale] = ['data.source=tfds', f'data.name={name}', f'data.data_dir={work / "data"}',
                      f'data.tokenizer=sentencepiece:{model}', 'model.vocab_size=8192']
  if not model.exists():
    assert cli.main(['tokenizer', 'train', '--config', 'gpt_tiny', *corpora[1][:3], '--vocab-size', '8000',
                     '--out', str(work / 'sp')]) == 0
  return corpora


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
  for source, overrides in (('embedded, bytes', []), ('tfds, sentencepiece', corpora[1])):
    for workers in (0, 1, 2):
      r = measure('pipeline', [*overrides, f'data.workers={workers}'], args.batches)
      rows.append({'source': source, 'workers': workers, 'records': None, **r, 'x_step': r['tokens_per_sec'] / step})
  for scale, overrides in corpora.items():
    r = measure('pipeline', overrides, args.batches)
    rows.append({'source': 'tfds, sentencepiece', 'workers': 0, 'records': scale * BASE_RECORDS, **r,
                 'x_step': r['tokens_per_sec'] / step})

  print(f'train step (gpt_tiny) consumes {step:,.0f} tokens/s\n')
  print('| source | workers | records | pipeline tokens/s | x step | peak RSS MiB |\n|---|---|---|---|---|---|')
  for r in rows:
    records = f'{r["records"]:,}' if r['records'] else '-'
    print(f'| {r["source"]} | {r["workers"]} | {records} | {r["tokens_per_sec"]:,.0f} | {r["x_step"]:.1f} | '
          f'{r["peak_rss_mib"]:,.0f} |')
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({'step_tokens_per_sec': step, 'rows': rows}, indent=2) + '\n')
  print(f'\nwrote {out}')


if __name__ == '__main__':
  main()
