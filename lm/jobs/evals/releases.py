"""The original release files of seven harness tasks, converted to the fields of the Hugging Face datasets the
harness's task configs read (`<split>.jsonl`), so the harness's own prompts and metrics apply unchanged.

A task folder under `--data-dir` holds either layout; the original one is found by its file names
(`../shared/EVAL-NOTES.md` lists them). The ARC tree serves both ARC tasks from one `arc/` folder.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lm.config import ConfigError

Row = dict[str, Any]
Converter = Callable[[Path], tuple[list[Row], list[Path]]]  # a release file -> (dataset rows, the files read)


def read_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
  """(line number, row) of a JSON-lines file; a one-line error naming the file and line that is not JSON."""
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          yield number, json.loads(line)
        except json.JSONDecodeError as e:
          raise ConfigError(f'{path}:{number}: not a JSON object ({e.msg}); each line must be one JSON row') from None


def field(path: Path, number: int, row: Row, name: str) -> Any:
  if not isinstance(row, dict) or name not in row:
    raise ConfigError(f'{path}:{number}: no field {name!r}; the original release\'s rows have it')
  return row[name]


def _same_fields(names: tuple[str, ...]) -> Converter:
  """A release whose rows already carry the dataset's fields (checked, then kept as they are)."""
  def convert(path: Path) -> tuple[list[Row], list[Path]]:
    return [{name: field(path, n, row, name) for name in names} for n, row in read_jsonl(path)], [path]
  return convert


def _piqa(path: Path) -> tuple[list[Row], list[Path]]:
  """PIQA: goal/sol1/sol2 rows, their labels one per line in `<split>-labels.lst` beside them."""
  labels_path = path.with_name(path.stem + '-labels.lst')
  if not labels_path.is_file():
    raise ConfigError(f'{labels_path} not found: PIQA\'s labels for {path.name} come in that file, one per line')
  labels = [line.strip() for line in labels_path.read_text().splitlines() if line.strip()]
  rows = list(read_jsonl(path))
  if len(labels) != len(rows):
    raise ConfigError(f'{labels_path} holds {len(labels)} labels for the {len(rows)} rows of {path}; they must pair')
  return [{'goal': field(path, n, r, 'goal'), 'sol1': field(path, n, r, 'sol1'), 'sol2': field(path, n, r, 'sol2'),
           'label': int(label)} for (n, r), label in zip(rows, labels)], [path, labels_path]


def _arc(path: Path) -> tuple[list[Row], list[Path]]:
  """ARC: {id, question: {stem, choices: [{text, label}]}, answerKey} -> question, choices {text, label}."""
  out = []
  for n, row in read_jsonl(path):
    question = field(path, n, row, 'question')
    choices = field(path, n, question, 'choices')
    out.append({'id': field(path, n, row, 'id'), 'question': field(path, n, question, 'stem'),
                'choices': {'text': [field(path, n, c, 'text') for c in choices],
                            'label': [field(path, n, c, 'label') for c in choices]},
                'answerKey': field(path, n, row, 'answerKey')})
  return out, [path]


def _boolq(path: Path) -> tuple[list[Row], list[Path]]:
  """BoolQ: question, title, answer (bool), passage -> SuperGLUE's question, passage, idx, label (0/1)."""
  return [{'question': field(path, n, r, 'question'), 'passage': field(path, n, r, 'passage'), 'idx': i,
           'label': int(bool(field(path, n, r, 'answer')))} for i, (n, r) in enumerate(read_jsonl(path))], [path]


def _sciq(path: Path) -> tuple[list[Row], list[Path]]:
  """SciQ: one JSON list per split."""
  try:
    rows = json.loads(path.read_text(encoding='utf-8'))
  except json.JSONDecodeError as e:
    raise ConfigError(f'{path}: not JSON ({e.msg}); SciQ\'s release is one JSON list per split') from None
  names = ('question', 'distractor1', 'distractor2', 'distractor3', 'correct_answer', 'support')
  return [{name: field(path, n, row, name) for name in names} for n, row in enumerate(rows, 1)], [path]


HELLASWAG = ('ind', 'activity_label', 'ctx_a', 'ctx_b', 'ctx', 'endings', 'source_id', 'split', 'split_type',
             'label')

# task -> (its folder under --data-dir, {split: (file pattern within the folder, converter)})
RELEASES: dict[str, tuple[str, dict[str, tuple[str, Converter]]]] = {
  'hellaswag': ('hellaswag', {'train': ('hellaswag_train.jsonl', _same_fields(HELLASWAG)),
                              'validation': ('hellaswag_val.jsonl', _same_fields(HELLASWAG))}),
  'piqa': ('piqa', {'train': ('train.jsonl', _piqa), 'validation': ('valid.jsonl', _piqa)}),
  'arc_easy': ('arc', {split: (f'ARC-V1-Feb2018*/ARC-Easy/ARC-Easy-{name}.jsonl', _arc)
                       for split, name in (('train', 'Train'), ('validation', 'Dev'), ('test', 'Test'))}),
  'arc_challenge': ('arc', {split: (f'ARC-V1-Feb2018*/ARC-Challenge/ARC-Challenge-{name}.jsonl', _arc)
                            for split, name in (('train', 'Train'), ('validation', 'Dev'), ('test', 'Test'))}),
  'lambada_openai': ('lambada_openai', {'test': ('lambada_test.jsonl', _same_fields(('text',)))}),
  'winogrande': ('winogrande', {'train': ('winogrande_1.1/train_xl.jsonl',
                                          _same_fields(('sentence', 'option1', 'option2', 'answer'))),
                                'validation': ('winogrande_1.1/dev.jsonl',
                                               _same_fields(('sentence', 'option1', 'option2', 'answer')))}),
  'boolq': ('boolq', {'train': ('train.jsonl', _boolq), 'validation': ('dev.jsonl', _boolq)}),
  'sciq': ('sciq', {'train': ('train.json', _sciq), 'validation': ('valid.json', _sciq), 'test': ('test.json', _sciq)}),
}


def task_folder(data_dir: Path, task: str) -> Path:
  """Where `task`'s files live: `data_dir/<task>`, or the shared folder of its original release (`arc/`)."""
  own = data_dir / task
  if own.is_dir() or task not in RELEASES:
    return own
  return data_dir / RELEASES[task][0]


def release_files(folder: Path, task: str) -> dict[str, Path]:
  """{split: file} of `task`'s original release found in `folder` (empty when the folder holds none): at its
  place in the release's tree, or with the tree's top folders left out (`winogrande/dev.jsonl` for
  `winogrande/winogrande_1.1/dev.jsonl`), as a user may unpack it."""
  if task not in RELEASES:
    return {}
  found = {}
  for split, (pattern, _) in RELEASES[task][1].items():
    parts = pattern.split('/')
    for tail in ('/'.join(parts[i:]) for i in range(len(parts))):
      matches = sorted(folder.glob(tail))
      if matches:
        found[split] = matches[-1]  # ARC's tree may be unpacked under a dated name
        break
  return found


def convert_release(task: str, files: dict[str, Path], into: Path) -> list[Path]:
  """Writes `into/<split>.jsonl` in the Hugging Face dataset's fields from the release `files`; returns every
  release file read."""
  into.mkdir(parents=True, exist_ok=True)
  converters = RELEASES[task][1]
  read = []
  for split, path in files.items():
    rows, inputs = converters[split][1](path)
    (into / f'{split}.jsonl').write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows),
                                         encoding='utf-8')
    read += inputs
  return read
