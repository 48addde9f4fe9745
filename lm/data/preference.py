"""Preference pairs for DPO: JSON lines of `prompt`, `chosen` and `rejected`, tokenized as TRL's DPOTrainer does.

Strings are plain text (TRL's standard format): the tokenizer's own special tokens added, the EOS token appended
to a completion that does not end with it. Message lists (its conversational format: `prompt` the turns so far,
`chosen` and `rejected` the answers) go through the chat template: the prompt rendered with the generation prompt,
each answer rendered after it. A completion is what its prompt-and-completion tokens hold past the tokens they
share with the prompt's (TRL's rule, so a template that renders the prompt otherwise alone still splits cleanly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm.config import ConfigError
from lm.data.chat import ROLES, ChatTemplate, json_records


@dataclass(frozen=True)
class Pair:
  """One preference pair, tokenized: the prompt's ids and each completion's."""
  prompt: list[int]
  chosen: list[int]
  rejected: list[int]


def _messages(value: Any, where: str, field: str) -> list[dict[str, str]]:
  if not isinstance(value, list) or not value or not all(
      isinstance(m, dict) and isinstance(m.get('content'), str) for m in value):
    raise ConfigError(f'{where}: {field} must be a string or a non-empty list of {{"role": ..., "content": ...}}')
  for m in value:
    if m.get('role') not in ROLES:
      raise ConfigError(f'{where}: unknown role {m.get("role")!r}; choose one of: {", ".join(ROLES)}')
  return [{'role': m['role'], 'content': m['content']} for m in value]


def _record(record: Any, where: str) -> dict[str, Any]:
  """A record's prompt, chosen and rejected: three strings or three message lists."""
  if not isinstance(record, dict) or not all(k in record for k in ('prompt', 'chosen', 'rejected')):
    have = ', '.join(sorted(record)) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(f'{where}: a preference record needs prompt, chosen and rejected (it has {have or "none"})')
  fields = {k: record[k] for k in ('prompt', 'chosen', 'rejected')}
  if all(isinstance(v, str) for v in fields.values()):
    out = fields
  elif not any(isinstance(v, str) for v in fields.values()):
    out = {k: _messages(v, where, k) for k, v in fields.items()}
  else:
    raise ConfigError(f'{where}: prompt, chosen and rejected must be all strings or all message lists')
  return out


def read_pairs(pattern: str) -> tuple[list[tuple[dict[str, Any], str]], list[str]]:
  """Every record of the JSON-lines files `pattern` matches, with where it is (FILE:LINE), and where the records
  whose chosen and rejected are identical were: such a pair prefers nothing (TRL trains on it without effect), so
  a few are skipped; a set where half or more are is refused."""
  records = [(_record(record, where), where) for record, where in json_records(pattern, 'preference pair')]
  kept = [(r, where) for r, where in records if r['chosen'] != r['rejected']]
  skipped = [where for r, where in records if r['chosen'] == r['rejected']]
  if len(skipped) * 2 >= len(records):
    raise ConfigError(f'{skipped[0]}: {len(skipped)} of the {len(records)} pairs in {pattern} have identical chosen '
                      'and rejected, so the set prefers little or nothing; check which fields hold the two answers')
  return kept, skipped


def _shared(a: list[int], b: list[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def encode_pair(tokenizer: Any, template: ChatTemplate | None, record: dict[str, Any], where: str = '') -> Pair:
  """The pair's ids, as TRL's DPOTrainer tokenizes it (see the module's docstring)."""
  if isinstance(record['prompt'], str):
    encode = lambda text: tokenizer.encode_with_offsets(text, add_special_tokens=True)[0].tolist()
    eos = tokenizer.tokenizer.id_to_token(tokenizer.eos_id)
    ended = lambda text: text if text.endswith(eos) else text + eos
    prompt = encode(record['prompt'])
    chosen, rejected = (encode(record['prompt'] + ended(record[k])) for k in ('chosen', 'rejected'))
  else:
    if template is None:
      raise ConfigError(f'{where}: message lists need a chat template; pass --chat-template FILE')
    encode = lambda messages, more=False: tokenizer.encode_with_offsets(template.render(messages, more)[0])[0].tolist()
    prompt = encode(record['prompt'], True)
    chosen, rejected = (encode(record['prompt'] + record[k]) for k in ('chosen', 'rejected'))
  n = min(_shared(prompt, chosen), _shared(prompt, rejected))
  if n == len(chosen) or n == len(rejected):
    raise ConfigError(f'{where}: a completion adds no tokens after the prompt; give chosen and rejected some text')
  return Pair(prompt[:n], chosen[n:], rejected[n:])
