"""`lm tokenizer train` (SentencePiece), `lm data build` (local files as a TFDS dataset) and `lm data tokenize`
(sources as shards of token ids)."""
from __future__ import annotations

import argparse

from lm.commands.common import add_config, checked_config
from lm.config import Config


def data_config(args: argparse.Namespace) -> Config:
  """The config's data section, or local files named by --from (JSON lines, Parquet or text by their endings)."""
  from lm.data.sources import files_source
  extra = []
  if args.source_globs:
    extra = [f'data.source={files_source(args.source_globs)}', f'data.paths=[{",".join(args.source_globs)}]']
  return checked_config(args, extra)


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
  from lm.data.sources import open_documents
  from lm.data.tokenizer_training import train_sentencepiece
  documents = open_documents(data_config(args).data, 'train')
  print(f'training a {args.model_type} SentencePiece model of {args.vocab_size:,} pieces on {len(documents):,} '
        f'documents (at most {args.max_lines:,} lines)', flush=True)
  texts = (text for i in range(len(documents)) if (text := documents[i]) is not None)  # bad records skipped
  path = train_sentencepiece(texts, args.out, vocab_size=args.vocab_size,
                             model_type=args.model_type, sentinels=args.sentinels, max_lines=args.max_lines,
                             report=lambda message: print(message, flush=True))
  print(f'wrote {path}; use it with data.tokenizer=sentencepiece:{path}', flush=True)
  return 0


def cmd_data_build(args: argparse.Namespace) -> int:
  from lm.data.build import build_tfds
  counts = build_tfds(args.name, args.source_globs, args.data_dir, text_key=args.text_key,
                      val_fraction=args.val_fraction, max_chars=args.max_chars)
  print(f'built {args.name} in {args.data_dir}: {counts["train"]:,} train and {counts["validation"]:,} validation '
        f'records; train on it with data.source=tfds data.name={args.name} data.data_dir={args.data_dir}', flush=True)
  return 0


def cmd_data_tokenize(args: argparse.Namespace) -> int:
  from lm.config import DataConfig
  from lm.data.tokenize import tokenize_corpus
  cfg = DataConfig(text_key=args.text_key, max_chars=args.max_chars, skip_bad_records=args.skip_bad_records)
  manifest = tokenize_corpus(args.sources, args.tokenizer, args.out, workers=args.workers,
                             shard_documents=args.shard_documents, cfg=cfg, progress=args.progress)
  tokens = sum(shard['tokens'] for shard in manifest['shards'])
  print(f'{args.out}: {manifest["documents"]:,} documents, {tokens:,} tokens in {len(manifest["shards"]):,} shards; '
        f'train on them with data.source=tokenized:{args.out} data.tokenizer={args.tokenizer}', flush=True)
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  tokenizer = sub.add_parser('tokenizer', help='tokenizers').add_subparsers(dest='action', required=True)
  train_tok = tokenizer.add_parser('train', help='train a SentencePiece model on a data source')
  add_config(train_tok)
  train_tok.add_argument('--from', dest='source_globs', nargs='+', metavar='GLOB',
                         help='local text, JSON-lines (.gz, .zst) or Parquet files, not the config\'s data source')
  train_tok.add_argument('--vocab-size', type=int, required=True)
  train_tok.add_argument('--model-type', choices=('unigram', 'bpe'), default='unigram')
  train_tok.add_argument('--sentinels', type=int, default=0, help='add T5\'s <extra_id_0> ... <extra_id_{N-1}>')
  train_tok.add_argument('--max-lines', type=int, default=2_000_000, help='lines sampled for training')
  train_tok.add_argument('--out', required=True, help='model path (PATH.model and PATH.vocab are written)')
  train_tok.set_defaults(fn=cmd_tokenizer_train)

  data = sub.add_parser('data', help='datasets').add_subparsers(dest='action', required=True)
  build = data.add_parser('build', help='local JSON-lines, Parquet or text files -> a TFDS dataset (ArrayRecord)')
  build.add_argument('--name', required=True, help='dataset name, lower snake_case')
  build.add_argument('--from', dest='source_globs', nargs='+', required=True, metavar='GLOB')
  build.add_argument('--data-dir', required=True, help='TFDS data directory (a local path or gs:// URI)')
  build.add_argument('--text-key', default='text', help='the JSON field or Parquet column holding the text')
  build.add_argument('--val-fraction', type=float, default=0.02)
  build.add_argument('--max-chars', type=int, default=2048, help='text files are cut into records of this size')
  build.set_defaults(fn=cmd_data_build)

  tokenize = data.add_parser('tokenize', help='sources -> shards of token ids (data.source=tokenized:DIR)')
  tokenize.add_argument('sources', nargs='+', metavar='SRC',
                        help='text:GLOB, jsonl:GLOB, parquet:GLOB[:COLUMN], hf:PATH[:SPLIT] or tfds:DATASET:SPLIT')
  tokenize.add_argument('--tokenizer', required=True, help='as data.tokenizer: byte, sentencepiece:PATH or hf:PATH')
  tokenize.add_argument('--out', required=True, help='the shards\' folder (a stopped run resumes there)')
  tokenize.add_argument('--workers', type=int, default=0, help='worker processes tokenizing shards side by side')
  tokenize.add_argument('--shard-documents', type=int, default=10_000, help='documents per shard')
  tokenize.add_argument('--text-key', default='text', help='the JSON field or Parquet / HF column holding the text')
  tokenize.add_argument('--max-chars', type=int, default=2048, help='text files are cut into records of this size')
  tokenize.add_argument('--skip-bad-records', action='store_true', help='skip JSON lines that are not JSON or UTF-8')
  tokenize.add_argument('--no-progress', dest='progress', action='store_false')
  tokenize.set_defaults(fn=cmd_data_tokenize)
