"""`lm generate`: sample continuations from a run dir or an HF directory (`lm.jobs.generate`)."""
from __future__ import annotations

import argparse


def cmd_generate(args: argparse.Namespace) -> int:
  import jax

  from lm.jobs.generate import generate_text
  from lm.models.decode import Sampling
  from lm.storage.source import open_model
  sampling = Sampling(args.temperature, args.top_k, args.top_p)
  _, assembly, params = open_model(args.run, ema=args.ema, flag='--run', overrides=args.overrides)
  texts = generate_text(assembly.config, params, args.prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                        rng=jax.random.key(args.seed))
  for prompt, text in zip(args.prompt, texts):
    print(f'--- {prompt!r}\n{text}', flush=True)
  return 0


def register(sub: argparse._SubParsersAction) -> None:
  gen = sub.add_parser('generate', help='sample continuations from a trained run (KV-cached decoding)')
  gen.add_argument('--run', required=True, help='a run directory with a checkpoint (trained or imported)')
  gen.add_argument('--prompt', action='append', required=True, help='prompt text (T5: the encoder input); repeatable')
  gen.add_argument('--max-new-tokens', type=int, default=200)
  gen.add_argument('--temperature', type=float, default=0.0,
                   help='softmax temperature; 0 decodes greedily (default %(default)s)')
  gen.add_argument('--top-k', type=int, default=None,
                   help='sample among the k likeliest tokens (default %(default)s: all)')
  gen.add_argument('--top-p', type=float, default=None,
                   help='sample among the likeliest tokens holding mass p (default %(default)s: all)')
  gen.add_argument('--seed', type=int, default=0)
  gen.add_argument('--ema', action='store_true', help='sample from the params\' moving average (a run trained '
                                                      'with train.ema_decay)')
  gen.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides, e.g. mesh.tensor=2')
  gen.set_defaults(fn=cmd_generate, joins_job=True)
