"""lm eval's engine against lm-eval-harness's own Hugging Face backend (torch), in one run: the same GPT-2
weights, tokenizer, requests and batch size; interleaved rounds, median requests/s and the ratio; writes JSON.

  python bench/eval_throughput.py [--config gpt_bench] [--docs 200] [--rounds 3] [--batch-size 32] [--out FILE]

The model is an HF GPT-2 of the config's shape with random weights and a byte-level BPE tokenizer trained on the
embedded corpus, converted into an lm run dir (`lm convert --from-hf`), so both engines hold the same weights.
The requests are the harness's own: a four-way multiple-choice task (a task YAML, `output_type:
multiple_choice`, the shape of hellaswag and arc) on embedded-corpus text, contexts of 40-600 characters and
endings of 10-80, built once by the harness. Each round times every engine's `loglikelihood` over all of them
(the first, untimed call compiles lm's few bucket shapes); the largest relative difference between the two
engines' log-likelihoods is reported beside the speeds.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from timing import interleaved

TASK = """task: bench_choice
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list: [{metric: acc}]
"""


def write_task(folder: Path, docs: int) -> Path:
  """The task YAML and its JSONL: `docs` documents of a context and four endings cut from the embedded corpus."""
  import numpy as np

  from lm.data.sources import embedded_documents
  rng = np.random.default_rng(0)
  texts = [text for _, text in embedded_documents() if len(text) > 800]
  rows = []
  for i in range(docs):
    text = texts[i % len(texts)]
    cut = int(rng.integers(40, 600))
    ends = [int(rng.integers(10, 80)) for _ in range(4)]
    starts = [cut] + [int(rng.integers(0, len(text) - 80)) for _ in range(3)]
    rows.append({'context': text[:cut], 'choices': [text[s:s + e] for s, e in zip(starts, ends)], 'gold': 0})
  (folder / 'test.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  task = folder / 'bench_choice.yaml'
  task.write_text(TASK.replace('DATA', str(folder / 'test.jsonl')))
  return task


def build_models(config_name: str, folder: Path, batch_size: int) -> tuple[Any, Any, int]:
  """(lm's HarnessLM, the harness's HFLM, max length) on one random GPT-2 of the config's shape."""
  import tokenizers
  import transformers
  from lm_eval.models.huggingface import HFLM

  from lm import cli
  from lm.config import load_config
  from lm.data.sources import embedded_documents
  from lm.data.tokenizers import get_tokenizer
  from lm.jobs.evals.engine import HarnessLM
  from lm.jobs.evals.run import load_checkpoint
  m = load_config(config_name).model
  hf, run = folder / 'hf', folder / 'run'
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator([text for _, text in embedded_documents()[::20]], vocab_size=m.vocab_size,
                          special_tokens=['<|endoftext|>'])
  transformers.set_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config(
    vocab_size=m.vocab_size, n_embd=m.d_model, n_layer=m.num_layers, n_head=m.num_heads, n_positions=m.max_len,
    n_inner=m.resolved_d_ff, activation_function='gelu_new', bos_token_id=0, eos_token_id=0,
  )).save_pretrained(hf, safe_serialization=True)
  bpe.save_model(str(hf))
  (hf / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'GPT2Tokenizer', 'bos_token': '<|endoftext|>',
                                                        'eos_token': '<|endoftext|>', 'unk_token': '<|endoftext|>'}))
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 0
  assembly, params, _ = load_checkpoint(run)
  ours = HarnessLM(assembly, params, get_tokenizer(assembly.config.data.tokenizer), batch_size=batch_size,
                   max_length=m.max_len)
  theirs = HFLM(pretrained=str(hf), batch_size=batch_size, device='cpu', max_length=m.max_len, dtype='float32')
  return ours, theirs, m.max_len


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='gpt_bench', help='a GPT config: the model shape')
  parser.add_argument('--docs', type=int, default=200, help='documents (four requests each)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--batch-size', type=int, default=32)
  parser.add_argument('--out', help='JSON path (default bench/results/eval_throughput_<config>.json)')
  args = parser.parse_args()
  os.environ.setdefault('TQDM_DISABLE', '1')
  logging.getLogger('lm_eval').setLevel(logging.ERROR)  # its per-request truncation notes
  import numpy as np

  from lm.jobs.evals.tasks import task_manager
  from lm.report import format_lines, write_json
  with tempfile.TemporaryDirectory() as tmp:
    folder = Path(tmp)
    task = task_manager().load([str(write_task(folder, args.docs))])['tasks']['bench_choice']
    task.build_all_requests(rank=0, world_size=1)
    requests = task.instances
    ours, theirs, max_length = build_models(args.config, folder, args.batch_size)
    engines = {'lm (JAX)': ours, 'harness HF backend (torch)': theirs}
    scores = {name: [r[0] for r in model.loglikelihood(requests, disable_tqdm=True)]  # warm-up: lm compiles
              for name, model in engines.items()}

    def timed(model: Any):
      def one_round() -> list[float]:
        start = time.perf_counter()
        model.loglikelihood(requests, disable_tqdm=True)
        return [time.perf_counter() - start]
      return one_round
    medians = interleaved(args.rounds, {name: timed(model) for name, model in engines.items()})
  a, b = (np.array(s) for s in scores.values())
  rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-9)))
  per_second = {name: len(requests) / statistics.median(times) for name, times in medians.items()}
  ratio = per_second['lm (JAX)'] / per_second['harness HF backend (torch)']
  print(f'{args.config}: {len(requests)} requests ({args.docs} documents x 4 choices), batch {args.batch_size}, '
        f'max length {max_length}; {args.rounds} interleaved rounds')
  print(format_lines([(name, f'{value:,.1f} requests/s') for name, value in per_second.items()]
                     + [('ratio', f'{ratio:.2f}x'), ('max relative difference of log-likelihoods', f'{rel:.1e}')]))
  out = write_json(args.out or Path(__file__).parent / 'results' / f'eval_throughput_{args.config}.json',
                   {'config': args.config, 'requests': len(requests), 'batch_size': args.batch_size,
                    'rounds': {name: times for name, times in medians.items()}, 'requests_per_second': per_second,
                    'ratio': ratio, 'max_relative_difference': rel})
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
