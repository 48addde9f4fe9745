"""Writes a LAMBADA-layout cloze set (`DIR/lambada_openai/lambada_test.jsonl`) cut from a corpus's held-out
documents, for the README's accuracy-against-compute figure: the real task files cannot be downloaded on the
machine that drew it. Each row is a passage whose last word (letters only, 4 or more, after a space) is the
target, so the harness's `lambada_openai` scores it unchanged (context: the text up to the last space; target:
the last word; greedy match and perplexity).

  python docs/results/cloze_set.py --out eval_data [data.source=embedded ...]
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from lm.config import load_config
from lm.data.sources import open_documents

_TARGET = re.compile(r'(?<= )[A-Za-z]{4,}(?=[\s.,;:])')


def cloze_rows(texts: list[str], per_document: int, context_chars: int, seed: int) -> list[dict[str, str]]:
  """Up to `per_document` passages per text: about `context_chars` characters that start on a word, a space, and a
  target word the passage ends with."""
  rng = random.Random(seed)
  rows = []
  for text in texts:
    targets = [m for m in _TARGET.finditer(text) if m.start() > context_chars]
    for m in sorted(rng.sample(targets, min(per_document, len(targets))), key=lambda m: m.start()):
      context = text[m.start() - context_chars:m.start() - 1]
      context = context[context.find(' ') + 1:].strip()
      rows.append({'text': f'{context} {m.group()}'})
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, type=Path, help='the --data-dir to write lambada_openai/ into')
  parser.add_argument('--per-document', type=int, default=3)
  parser.add_argument('--context-chars', type=int, default=300)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('overrides', nargs='*', help="data.* settings of the corpus (default: gpt_tiny's, the embedded one)")
  args = parser.parse_args()
  cfg = load_config('gpt_tiny', args.overrides).data
  documents = open_documents(cfg, 'validation')
  rows = cloze_rows([documents[i] for i in range(len(documents))], args.per_document, args.context_chars, args.seed)
  folder = args.out / 'lambada_openai'
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / 'lambada_test.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  print(f'{len(rows)} passages from {len(documents)} documents -> {folder / "lambada_test.jsonl"}')


if __name__ == '__main__':
  main()
