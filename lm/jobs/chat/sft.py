"""`lm finetune --task sft`: supervised fine-tuning on chat data through the one loop.

The source (`--init`: one of our run dirs or an HF model directory) fixes the model and the tokenizer, whose chat
template (or `--chat-template FILE`) renders the chats (`lm.data.chat`). The loss is the causal LM's on the
assistant's tokens (`--train-on all`: every token), several chats packed into a row with segment ids so none
attends to another. The recipe under the user's overrides: AdamW at 2e-5 with 3% warmup then linear decay to 0,
no weight decay, clip 1.0, batch 16, 3 epochs of the packed rows. The held-out chats (`--eval-data GLOB`, or
`--eval-fraction F` of the data) are evaluated every `train.eval_every` steps (default: each epoch), at the start
and at the end: the loss on their assistant tokens and, for the first `--eval-generate` of them, whether greedy
generation from the prompt before their last assistant turn gives that turn exactly (`eval/exact_match`), with a
few samples printed. `RUN/chat_template.jinja` keeps the template, so an export to HF carries it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from lm.assembly import assemble
from lm.config import Config, ConfigError, from_dict, load_config, merge, parse_overrides
from lm.data.chat import ChatTemplate, Message, TrainOn, encode_chat, load_template, pack_chats, read_chats
from lm.data.pipeline import HostRows, global_rows
from lm.jobs.finetuning import load_tokenizer, source_config
from lm.jobs.generate import decoding, generate
from lm.storage.run_dir import CHAT_TEMPLATE
from lm.train.callbacks import Callback, Evaluate
from lm.train.distill import open_teacher
from lm.train.init_from import initial_state
from lm.train.loop import Trainer
from lm.train.step import PretrainingLoss, make_eval_step

RECIPE = {
  'optim': {'learning_rate': 2e-5, 'schedule': 'linear', 'min_lr_ratio': 0.0, 'weight_decay': 0.0, 'grad_clip': 1.0},
  'train': {'global_batch': 16, 'log_every': 10, 'eval_batches': 0, 'checkpoint': {'keep': 1}, 'resume': False},
}
SAMPLES = 3  # generations printed at each evaluation


@dataclass(frozen=True)
class ChatOptions:
  """What `lm finetune --task sft` is given."""
  data: str
  init: str
  eval_data: str | None = None
  eval_fraction: float = 0.0
  eval_generate: int = 16  # held-out chats generated from at each evaluation (exact match)
  chat_template: str | None = None
  train_on: TrainOn = 'assistant'
  preset: str | None = None
  overrides: tuple[str, ...] = ()
  epochs: float = 3.0


def sft_config(options: ChatOptions, num_rows: int) -> Config:
  """`--config` (default: the source's) + the recipe + the overrides; the model and tokenizer are the source's;
  `train.steps` from epochs of the packed rows unless given."""
  source = source_config(options.init)
  if decoding(source.model).kind != 'causal':  # (a model that cannot generate at all is refused there)
    raise ConfigError(f'chat fine-tuning trains decoder-only models (each chat one causal sequence); --init '
                      f'{options.init} is a {source.model.family} encoder-decoder')
  values = load_config(options.preset).to_dict() if options.preset else source.to_dict()
  values['model'] = source.to_dict()['model']
  values['data'] = {**values['data'], 'tokenizer': source.data.tokenizer}
  values['name'] = f'{source.name}-sft'
  values['train'] = {**values['train'], 'init_from': options.init, 'run_dir': f'runs/sft/{source.name}'}
  given = parse_overrides(list(options.overrides))
  values = merge(merge(values, RECIPE), given)
  steps_per_epoch = max(math.ceil(num_rows / int(values['train']['global_batch'])), 1)
  if 'steps' not in given.get('train', {}):
    values['train']['steps'] = max(round(options.epochs * steps_per_epoch), 1)
  steps = int(values['train']['steps'])
  if 'warmup_steps' not in given.get('optim', {}):
    values['optim']['warmup_steps'] = math.ceil(0.03 * steps)
  if 'eval_every' not in given.get('train', {}):
    values['train']['eval_every'] = min(steps_per_epoch, steps)
  if 'every' not in given.get('train', {}).get('checkpoint', {}):
    values['train']['checkpoint']['every'] = values['train']['eval_every']
  return from_dict(values)


def split_chats(options: ChatOptions) -> tuple[list[list[Message]], list[list[Message]]]:
  """(training chats, held-out chats): `--eval-data`'s, or a seeded `--eval-fraction` of `--data`'s."""
  chats = read_chats(options.data)
  if options.eval_data is not None:
    return chats, read_chats(options.eval_data)
  if not 0 <= options.eval_fraction < 1:
    raise ConfigError(f'--eval-fraction {options.eval_fraction} must be in [0, 1)')
  held = math.ceil(options.eval_fraction * len(chats))
  order = np.random.default_rng(0).permutation(len(chats))
  if held >= len(chats):
    raise ConfigError(f'--eval-fraction {options.eval_fraction} holds out all {len(chats)} chats; lower it')
  return [chats[i] for i in sorted(order[held:])], [chats[i] for i in sorted(order[:held])]


class RunFiles(Callback):
  """Files a job keeps in its run dir (the chat template, the DPO settings), written once the run has started; a
  resumed run must have been trained with the same."""

  def __init__(self, run_dir: Any, files: dict[str, str]):
    self.run_dir, self.files = run_dir, files

  def start(self, step, state, history):
    for name, text in self.files.items():
      path = self.run_dir / name
      if step and path.exists() and path.read_text() != text:
        raise ConfigError(f'{self.run_dir} was trained with another {name}; resume it with the same one')
      if jax.process_index() == 0:
        path.write_text(text)
    return []


def chat_template(options: ChatOptions, source: Config) -> ChatTemplate:
  """`--chat-template`, else the template a chat fine-tune `--init` rendered with (RUN/chat_template.jinja), else
  the source tokenizer's own."""
  written = Path(options.init) / CHAT_TEMPLATE
  file = options.chat_template or (written if written.is_file() else None)
  return load_template(source.data.tokenizer.partition(':')[2], file)


class ChatEval:
  """The held-out chats' loss on their assistant tokens and the exact match of greedy generation."""

  def __init__(self, trainer: Trainer, tokenizer: Any, template: ChatTemplate, chats: list[list[Message]],
               train_on: TrainOn, generate_count: int):
    a = self.assembly = trainer.assembly
    self.tokenizer, self.batch = tokenizer, a.config.train.global_batch
    self.rows, _ = pack_chats([encode_chat(tokenizer, template, c, train_on) for c in chats], a.config.data.seq_len,
                              tokenizer.pad_id)
    self.eval_step = make_eval_step(a)
    self.prompts, self.answers = [], []
    for chat in chats[:generate_count]:
      last = max(i for i, m in enumerate(chat) if m['role'] == 'assistant')
      text, _ = template.render(chat[:last], add_generation_prompt=True)
      self.prompts.append(tokenizer.encode_with_offsets(text)[0].tolist())
      self.answers.append(chat[last]['content'])

  def loss(self, params: Any) -> float:
    n, sums = len(self.rows['inputs']), {'nll': 0.0, 'weight': 0.0}
    for start in range(0, n, self.batch):
      rows = np.arange(start, start + self.batch) % n  # the last batch wraps (one shape), its repeats unweighted
      batch = {k: v[rows] for k, v in self.rows.items()}
      batch['weights'] = batch['weights'] * (np.arange(start, start + self.batch) < n)[:, None]
      out = jax.device_get(self.eval_step(params, global_rows(self.assembly.mesh, batch)))
      sums = {k: sums[k] + float(out[k]) for k in sums}
    return sums['nll'] / max(sums['weight'], 1.0)

  def generations(self, params: Any) -> list[str]:
    longest = max(len(self.tokenizer.encode(a)) for a in self.answers) + 2
    t = self.tokenizer
    rows = generate(self.assembly.model, params, self.prompts, max_new_tokens=longest, eos_id=t.eos_id,
                    pad_id=t.pad_id)
    return [t.decode(row) for row in rows]

  def __call__(self, params: Any, step: int) -> dict[str, float]:
    record = {'eval/loss': self.loss(params)}
    if self.prompts:
      outputs = self.generations(params)
      record['eval/exact_match'] = float(np.mean([o.strip() == a.strip() for o, a in zip(outputs, self.answers)]))
      for output, answer in list(zip(outputs, self.answers))[:SAMPLES]:
        print(f'sft step {step} sample: {output!r} (reference {answer!r})', flush=True)
    print(f'sft step {step}: ' + ', '.join(f'{k} {v:.4f}' for k, v in record.items()), flush=True)
    return record


def finetune_sft(options: ChatOptions, devices: Sequence[jax.Device] | None = None
                 ) -> dict[str, Any] | None:
  """Fine-tunes `options.init` on the chats (on `devices`, default all); returns the last evaluation's record
  (None when a SIGTERM stopped the run, its state checkpointed for `--resume`)."""
  train, held_out = split_chats(options)
  probe = source_config(options.init)
  tokenizer = load_tokenizer(probe)
  template = chat_template(options, probe)
  seq_len = sft_config(options, 1).data.seq_len  # the run's rows: the steps follow from how many there are
  rows, cut = pack_chats([encode_chat(tokenizer, template, c, options.train_on) for c in train], seq_len,
                         tokenizer.pad_id)
  config = sft_config(options, len(rows['inputs']))
  if cut:
    print(f'sft: {cut} of {len(train)} chats are longer than data.seq_len={seq_len}; their ends are cut', flush=True)
  print(f'sft: {len(train)} chats in {len(rows["inputs"])} rows, {config.train.steps} steps of '
        f'{config.train.global_batch}; outputs in {config.run_dir}', flush=True)
  assembly = assemble(config, devices)
  trainer = Trainer(assembly, PretrainingLoss(assembly, open_teacher(assembly)), run_dir=config.run_dir)
  callbacks: list[Callback] = [RunFiles(config.run_dir, {CHAT_TEMPLATE: template.source})]
  if held_out:
    evaluate = ChatEval(trainer, tokenizer, template, held_out, options.train_on, options.eval_generate)
    callbacks.append(Evaluate(evaluate, config.train.eval_every, at_start=True, params_of=assembly.params_of))
  records = trainer.run(HostRows(rows, config.train.global_batch, config.train.seed, assembly.mesh),
                        lambda: initial_state(assembly, options.init).state, callbacks)
  if trainer.stopped_at is not None:
    return None
  evaluations = [r for r in records if 'eval/loss' in r]
  return evaluations[-1] if evaluations else {}
