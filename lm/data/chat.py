"""Chat data for supervised fine-tuning: JSON lines of `messages` (role/content, as OpenAI and HF chat data hold
them) or `prompt`/`completion` pairs, rendered with a Jinja chat template (an HF tokenizer's own, or a file) into
tokens and the weight of each token in the loss.

Templates render as transformers' `apply_chat_template` renders them (a sandboxed Jinja environment with the same
globals and filters, the tokenizer's special tokens as variables), and the rendered text is tokenized without
adding special tokens. The assistant's tokens are those overlapping an assistant span of the text: the blocks a
template marks with `{% generation %}` (transformers' rule, token for token), or, in a template without the
markers, what each assistant turn adds to the text rendered up to its prompt (`add_generation_prompt=True`),
without the whitespace that ends it (the separator templates put after a turn's end marker).
"""
from __future__ import annotations

import glob
import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np

from lm.config import ConfigError

ROLES = ('system', 'user', 'assistant', 'tool')
Message = dict[str, str]
TrainOn = Literal['assistant', 'all']


def _environment() -> Any:
  """Jinja as transformers configures it for chat templates (untrusted code: sandboxed), with `{% generation %}`
  recording the character spans of what it encloses while `tracking` is active."""
  import jinja2
  from jinja2.ext import Extension
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar('spans', default=None)

  class Generation(Extension):
    tags = {'generation'}

    def parse(self, parser: Any) -> Any:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_mark'), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
      text = caller()
      if (tracked := spans.get()) is not None:
        start = len(''.join(tracked[0]))
        tracked[1].append((start, start + len(text)))
      return text

  def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))

  @contextmanager
  def tracking(blocks: list[str], found: list[tuple[int, int]]) -> Iterator[None]:
    token = spans.set((blocks, found))
    try:
      yield
    finally:
      spans.reset(token)
  return env, tracking


@dataclass
class ChatTemplate:
  """A Jinja chat template and the variables it renders with (the tokenizer's special tokens)."""
  source: str
  variables: dict[str, str]
  where: str  # for messages: the file or tokenizer it came from

  def __post_init__(self):
    import jinja2
    env, self._tracking = _environment()
    try:
      self._template = env.from_string(self.source)
    except jinja2.TemplateSyntaxError as e:
      raise ConfigError(f'chat template {self.where} does not parse (line {e.lineno}: {e.message}); fix the '
                        f'template or pass another with --chat-template FILE') from None
    self.marked = re.search(r'\{%-?\s*generation\s*-?%\}', self.source) is not None

  def render(self, messages: list[Message], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The chat's text and the character spans its `{% generation %}` blocks enclose."""
    import jinja2
    blocks: list[str] = []
    found: list[tuple[int, int]] = []
    try:
      with self._tracking(blocks, found):
        for block in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self.variables):
          blocks.append(block)
    except jinja2.TemplateError as e:
      raise ConfigError(f'chat template {self.where} failed on a chat: {e}') from None
    return ''.join(blocks), found

  def assistant_spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The chat's text and the character spans of its assistant turns (see the module's docstring)."""
    text, spans = self.render(messages)
    if self.marked:
      return text, spans
    spans = []
    for i, message in enumerate(messages):
      if message['role'] != 'assistant':
        continue
      prompt, _ = self.render(messages[:i], add_generation_prompt=True)
      turn, _ = self.render(messages[:i + 1])
      if not (text.startswith(turn) and turn.startswith(prompt)):
        raise ConfigError(f'chat template {self.where} does not render a chat\'s first turns as the start of the '
                          f'whole chat, so its assistant turns cannot be found; mark them with '
                          f'{{% generation %}} ... {{% endgeneration %}} or pass --train-on all')
      spans.append((len(prompt), len(turn.rstrip())))  # the separator after a turn's end marker is not its own
    return text, spans


def load_template(tokenizer_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate:
  """The chat template of an HF tokenizer directory (`chat_template.jinja`, or `chat_template` in
  tokenizer_config.json), or `template_file`, with the directory's special tokens as variables."""
  directory = Path(tokenizer_dir)
  config_file = directory / 'tokenizer_config.json'
  settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
  variables = {key: value.get('content') if isinstance(value, dict) else value for key, value in settings.items()
               if key.endswith('_token') and isinstance(value, (str, dict))}
  if template_file is not None:
    if not Path(template_file).is_file():
      raise ConfigError(f'--chat-template {template_file} does not exist; pass a Jinja chat template file')
    return ChatTemplate(Path(template_file).read_text(), variables, str(template_file))
  if (directory / 'chat_template.jinja').is_file():
    return ChatTemplate((directory / 'chat_template.jinja').read_text(), variables,
                        str(directory / 'chat_template.jinja'))
  source = settings.get('chat_template')
  if isinstance(source, list):  # named templates: the default one
    source = next((t['template'] for t in source if t.get('name') == 'default'), None)
  if not isinstance(source, str):
    raise ConfigError(f'{directory} has no chat template (chat_template.jinja or chat_template in '
                      f'tokenizer_config.json); pass one with --chat-template FILE')
  return ChatTemplate(source, variables, f'of {directory}')


def _chat(record: Any, where: str) -> list[Message]:
  """A record's messages: `messages`, or `prompt` (+ optional `system`) and `completion` as user and assistant
  turns."""
  if not isinstance(record, dict):
    raise ConfigError(f'{where}: a record must be a JSON object with messages, or prompt and completion')
  if 'messages' in record:
    messages = record['messages']
    if not isinstance(messages, list) or not messages:
      raise ConfigError(f'{where}: messages must be a non-empty list of {{"role": ..., "content": ...}}')
  elif 'prompt' in record and 'completion' in record:
    messages = [{'role': 'user', 'content': record['prompt']}, {'role': 'assistant', 'content': record['completion']}]
    if 'system' in record:
      messages.insert(0, {'role': 'system', 'content': record['system']})
  else:
    raise ConfigError(f'{where}: a record needs messages, or prompt and completion (it has '
                      f'{", ".join(sorted(record)) or "no fields"})')
  for message in messages:
    if not isinstance(message, dict) or not isinstance(message.get('content'), str):
      raise ConfigError(f'{where}: each message needs a role and a string content')
    if message.get('role') not in ROLES:
      raise ConfigError(f'{where}: unknown role {message.get("role")!r}; choose one of: {", ".join(ROLES)}')
  if not any(m['role'] == 'assistant' for m in messages):
    raise ConfigError(f'{where}: a chat with no assistant turn has nothing to learn; add one or drop the record')
  return [{'role': m['role'], 'content': m['content']} for m in messages]


def json_records(pattern: str, what: str) -> list[tuple[Any, str]]:
  """Every record of the JSON-lines files `pattern` matches (a glob), in file and line order, with where it is
  (FILE:LINE); `what` names a record in the line for a file without any."""
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise ConfigError(f'--data {pattern} matches no file; pass a JSON-lines file or a glob')
  records = []
  for path in paths:
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
      if not line.strip():
        continue
      try:
        records.append((json.loads(line), f'{path}:{number}'))
      except json.JSONDecodeError as e:
        raise ConfigError(f'{path}:{number}: not JSON ({e.msg}); each line must be one JSON record') from None
  if not records:
    raise ConfigError(f'--data {pattern} holds no records; write one JSON {what} per line')
  return records


def read_chats(pattern: str) -> list[list[Message]]:
  """Every chat of the JSON-lines files `pattern` matches; a bad record is one line naming its file and line."""
  return [_chat(record, where) for record, where in json_records(pattern, 'chat')]


def token_weights(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """1 for each token whose characters overlap a span (spans and tokens in text order), else 0: transformers' rule
  for `return_assistant_tokens_mask`."""
  weights = np.zeros(len(offsets), np.float32)
  i = 0
  for t, (start, end) in enumerate(offsets):
    while i < len(spans) and start >= spans[i][1]:
      i += 1
    if i == len(spans):
      break
    if end > spans[i][0]:
      weights[t] = 1.0
  return weights


def encode_chat(tokenizer: Any, template: ChatTemplate, messages: list[Message], train_on: TrainOn = 'assistant'
                ) -> tuple[np.ndarray, np.ndarray]:
  """The chat's token ids (the rendered text, no special tokens added) and each token's weight in the loss."""
  if not hasattr(tokenizer, 'encode_with_offsets'):
    raise ConfigError('chat fine-tuning needs an HF tokenizer (data.tokenizer=hf:DIR or an HF model as --init)')
  text, spans = template.assistant_spans(messages) if train_on == 'assistant' else (template.render(messages)[0], [])
  ids, offsets = tokenizer.encode_with_offsets(text)
  weights = token_weights(offsets, spans) if train_on == 'assistant' else np.ones(len(ids), np.float32)
  return ids, weights


def pack_chats(chats: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
               ) -> tuple[dict[str, np.ndarray], int]:
  """Rows of `seq_len` (input, target) pairs, first fit in order: a chat of n tokens gives its n - 1 pairs (the
  target's weight is its token's), placed whole in the first row with room; segment ids number a row's chats from
  1 and positions restart at each, so no chat attends to another; padding has segment 0 and weight 0. A chat of
  more than seq_len + 1 tokens keeps its first seq_len + 1. Returns the features and how many chats were cut."""
  room: list[int] = []
  placed: list[list[int]] = []  # per row, the chats in it
  cut = 0
  for i, (ids, _) in enumerate(chats):
    need = min(len(ids) - 1, seq_len)
    cut += len(ids) - 1 > seq_len
    free = np.flatnonzero(np.asarray(room, np.int64) >= need) if room else np.array([], np.int64)
    if free.size:
      room[free[0]] -= need
      placed[free[0]].append(i)
    else:
      room.append(seq_len - need)
      placed.append([i])
  n = len(placed)
  out = {'inputs': np.full((n, seq_len), pad_id, np.int32), 'targets': np.full((n, seq_len), pad_id, np.int32),
         'weights': np.zeros((n, seq_len), np.float32), 'segment_ids': np.zeros((n, seq_len), np.int32),
         'positions': np.zeros((n, seq_len), np.int32)}
  for row, members in enumerate(placed):
    at = 0
    for segment, i in enumerate(members, 1):
      ids, weights = chats[i]
      length = min(len(ids) - 1, seq_len)
      span = slice(at, at + length)
      out['inputs'][row, span], out['targets'][row, span] = ids[:length], ids[1:length + 1]
      out['weights'][row, span], out['segment_ids'][row, span] = weights[1:length + 1], segment
      out['positions'][row, span] = np.arange(length)
      at += length
  return out, cut
