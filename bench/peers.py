"""lm against PyTorch on one config, in one run: interleaved rounds, median step times, ratios; writes JSON.

  python bench/peers.py [--config gpt_bench] [--rounds 3] [--steps 10] [--flax-python PATH] [--out FILE]

Each contender is one long-lived worker process, built and warmed up (compiled) once; each round asks every
worker in turn to time `--steps` synchronised steps while the others wait, so they never share the cores and
drift on the machine hits them alike. Contenders: lm fp32 and bf16 (`model.execution.dtype=bfloat16`), and Hugging Face
GPT-2 of the same shape (`peer_gpt2_config`: same width, depth, heads, vocabulary, tied embeddings, tanh GELU,
dropout, AdamW settings and gradient clipping) in PyTorch eager fp32, `torch.compile` fp32 and eager bf16
autocast; HF Flax GPT-2 too with `--flax-python`, a Python whose environment has `transformers<5` (the
last with Flax models) and this jax.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import timing
from timing import interleaved, time_calls

CONTENDERS = ('lm fp32', 'lm bf16', 'torch eager fp32', 'torch.compile fp32', 'torch eager bf16 autocast')
FLAX = 'HF Flax GPT-2 fp32'


def peer_gpt2_config(config: Any) -> dict[str, Any]:
  """GPT2Config arguments for the model lm's `config` describes (a GPT family config)."""
  m = config.model
  return dict(vocab_size=m.vocab_size, n_positions=m.max_len, n_embd=m.d_model, n_layer=m.num_layers,
              n_head=m.num_heads, n_inner=m.resolved_d_ff, activation_function='gelu_new',
              resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.attention_dropout,
              layer_norm_epsilon=m.norm_eps, tie_word_embeddings=m.tie_embeddings, bos_token_id=0, eos_token_id=0)


def lm_worker(config_name: str, overrides: list[str]) -> Callable[[], None]:
  import jax

  from lm.config import load_config
  from lm.jobs.pretraining import Pretraining
  trainer = Pretraining(load_config(config_name, overrides))
  state, batch = trainer.init_state(), next(trainer.train_batches)

  def step() -> None:
    nonlocal state
    state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
  return step


def torch_worker(config_name: str, mode: str) -> Callable[[], None]:
  import torch
  import transformers

  from lm.config import load_config
  config = load_config(config_name)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**peer_gpt2_config(config))).train()
  o = config.optim
  opt = torch.optim.AdamW(model.parameters(), lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps,
                          weight_decay=o.weight_decay)
  tokens = torch.randint(0, config.model.vocab_size, (config.train.global_batch, config.data.seq_len))
  forward = torch.compile(model) if mode == 'torch.compile fp32' else model

  def step() -> None:
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=mode.endswith('autocast')):
      loss = forward(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if o.grad_clip > 0:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
  return step


FLAX_WORKER = '''
import json, sys
import jax, jax.numpy as jnp, optax, transformers
cfg = json.loads(sys.argv[1])
model = transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(**cfg['gpt2']), seed=0)
o = cfg['optim']
tx = optax.adamw(o['learning_rate'], b1=o['b1'], b2=o['b2'], eps=o['eps'], weight_decay=o['weight_decay'])
if o['grad_clip'] > 0:
  tx = optax.chain(optax.clip_by_global_norm(o['grad_clip']), tx)
tokens = jax.random.randint(jax.random.key(0), (cfg['batch'], cfg['seq']), 0, cfg['gpt2']['vocab_size'])
def loss_fn(params):
  logits = model(tokens, params=params, train=False).logits[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
@jax.jit
def train(params, opt_state):
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss
state = [model.params, tx.init(model.params)]
def step():
  params, opt_state, loss = train(*state)
  jax.block_until_ready(loss)
  state[:] = [params, opt_state]
'''


def serve(step: Callable[[], None]) -> None:
  """Warm up (compile) with two steps, then answer each `run N` line on stdin with N step times as JSON."""
  time_calls(step, 0, warmup=2)
  print('ready', flush=True)
  for line in sys.stdin:
    print(json.dumps(time_calls(step, int(line.split()[1]), warmup=0).times), flush=True)


def wait_ready(name: str, worker: subprocess.Popen) -> None:
  for line in worker.stdout:
    if line.strip() == 'ready':
      return
  raise SystemExit(f'peers: the {name} worker exited (code {worker.wait()}) before it was ready; its error is above')


def time_round(worker: subprocess.Popen, steps: int) -> list[float]:
  worker.stdin.write(f'run {steps}\n')
  worker.stdin.flush()
  return json.loads(worker.stdout.readline())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='gpt_bench', help='a GPT config (the peers are GPT-2)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=10, help='timed steps per contender per round')
  parser.add_argument('--only', nargs='+', choices=CONTENDERS, default=list(CONTENDERS))
  parser.add_argument('--flax-python', help='a Python with transformers<5 (HF Flax GPT-2) and this jax')
  parser.add_argument('--out', help='JSON path (default bench/results/peers_<config>.json)')
  parser.add_argument('--worker', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    serve(lm_worker(args.config, ['model.execution.dtype=bfloat16'] if args.worker == 'lm bf16' else [])
          if args.worker.startswith('lm') else torch_worker(args.config, args.worker))
    return

  from lm.config import load_config
  from lm.report import format_lines, write_json
  config = load_config(args.config)
  if config.model.family != 'gpt':
    raise SystemExit(f'peers: --config {args.config} is a {config.model.family} model; the peers are GPT-2: '
                     'give a GPT config (e.g. gpt_bench)')
  commands = {name: [sys.executable, __file__, '--config', args.config, '--worker', name] for name in args.only}
  if args.flax_python:
    spec = {'gpt2': peer_gpt2_config(config), 'optim': {k: getattr(config.optim, k) for k in
                                                         ('learning_rate', 'b1', 'b2', 'eps', 'weight_decay',
                                                          'grad_clip')},
            'batch': config.train.global_batch, 'seq': config.data.seq_len}
    commands[FLAX] = [args.flax_python, '-c', inspect.getsource(timing) + FLAX_WORKER + inspect.getsource(serve)
                      + 'serve(step)\n', json.dumps(spec)]
  workers = {}
  for name, command in commands.items():  # one at a time: compiling two at once would slow both
    workers[name] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    wait_ready(name, workers[name])
  times = interleaved(args.rounds, {name: functools.partial(time_round, worker, args.steps)
                                    for name, worker in workers.items()})
  for worker in workers.values():
    worker.stdin.close()
    worker.wait(timeout=60)

  tokens = config.train.global_batch * config.data.seq_len
  speed = {name: tokens / statistics.median(t) for name, t in times.items()}
  best_peer = max((s for name, s in speed.items() if not name.startswith('lm')), default=None)
  best_lm = max((s for name, s in speed.items() if name.startswith('lm')), default=None)
  rows = [(name, f'{s:,.0f} tokens/s' + (f'   lm best ÷ this {best_lm / s:.2f}' if best_lm else ''))
          for name, s in sorted(speed.items(), key=lambda kv: -kv[1])]
  print(f'{args.config}: {config.model.num_layers} layers, d {config.model.d_model}, vocab '
        f'{config.model.vocab_size}, seq {config.data.seq_len}, batch {config.train.global_batch}; '
        f'{args.rounds} interleaved rounds of {args.steps} steps, median of round medians')
  print(format_lines(rows))
  result = {'config': args.config, 'rounds': args.rounds, 'steps': args.steps, 'tokens_per_step': tokens,
            'round_median_step_s': times, 'tokens_per_sec': speed,
            'lm_best_over_best_peer': best_lm / best_peer if best_lm and best_peer else None}
  out = write_json(args.out or Path(__file__).parent / 'results' / f'peers_{args.config}.json', result)
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
