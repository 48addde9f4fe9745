"""Harness tasks from prepared TFDS datasets (`lm eval --source tfds`): each split TFDS holds is written as
`<split>.jsonl` in the fields of the Hugging Face dataset the harness's task reads, so the harness's own task
config scores it (as with a `--data-dir` of release files, lm.jobs.evals.releases).

TFDS stores a split shuffled (by its builder's example keys), so documents come in another order than the
release's: `--limit`, `--subset` and few-shot examples pick others. TFDS's `hellaswag` keeps the context only
joined (`context` = the release's `ctx`), without `ctx_a` and `ctx_b`: its rows get `ctx_a` = the joined context
and an empty `ctx_b`, so the prompt lacks the harness's capitalisation of `ctx_b`'s first word
(`ctx_a + " " + ctx_b.capitalize()`), and scores differ a little from the release files'.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm.config import ConfigError

Row = dict[str, Any]


def _text(value: Any) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _hellaswag(record: Row, index: int, split: str) -> Row:
  label = int(record['label'])
  context = _text(record['context'])
  return {'ind': index, 'activity_label': _text(record['activity_label']), 'ctx_a': context, 'ctx_b': '',
          'ctx': context, 'endings': [_text(e) for e in record['endings']], 'source_id': _text(record['source_id']),
          'split': split, 'split_type': _text(record['split_type']), 'label': '' if label < 0 else str(label)}


def _piqa(record: Row, index: int, split: str) -> Row:
  return {'goal': _text(record['goal']), 'sol1': _text(record['sol1']), 'sol2': _text(record['sol2']),
          'label': int(record['label'])}


ARC_LABELS = 'ABCDE'  # TFDS's ClassLabel names for ARC's choices and answer (digit labels made letters)


def _arc(record: Row, index: int, split: str) -> Row:
  choices = record['choices']
  return {'id': _text(record['id']), 'question': _text(record['question']),
          'choices': {'text': [_text(t) for t in choices['text']],
                      'label': [ARC_LABELS[int(i)] for i in choices['label']]},
          'answerKey': ARC_LABELS[int(record['answerKey'])]}


def _winogrande(record: Row, index: int, split: str) -> Row:
  label = int(record['label'])  # ClassLabel names '1', '2'; -1 on the test split
  return {'sentence': _text(record['sentence']), 'option1': _text(record['option1']),
          'option2': _text(record['option2']), 'answer': '' if label < 0 else str(label + 1)}


def _boolq(record: Row, index: int, split: str) -> Row:
  return {'question': _text(record['question']), 'passage': _text(record['passage']), 'idx': int(record['idx']),
          'label': int(record['label'])}


Converter = Callable[[Row, int, str], Row]
# harness task -> (TFDS name, {harness split: TFDS split} where they differ, converter)
TFDS_TASKS: dict[str, tuple[str, dict[str, str], Converter]] = {
  'hellaswag': ('hellaswag', {}, _hellaswag),
  'piqa': ('piqa', {}, _piqa),
  'arc_easy': ('ai2_arc/ARC-Easy', {}, _arc),
  'arc_challenge': ('ai2_arc/ARC-Challenge', {}, _arc),
  'winogrande': ('winogrande', {'train': 'train_xl'}, _winogrande),
  'boolq': ('super_glue/boolq', {}, _boolq),
}


def tfds_name(task: str) -> str:
  """The TFDS dataset that holds harness task `task`."""
  if task not in TFDS_TASKS:
    raise ConfigError(f'--source tfds: no TFDS dataset is known to hold {task!r} (these are: '
                      f'{", ".join(TFDS_TASKS)}); pass its files with --data-dir instead')
  return TFDS_TASKS[task][0]


def convert_tfds(task: str, splits: list[str], needed: str, data_dir: str | None, into: Path) -> list[Path]:
  """Writes `into/<split>.jsonl` for each harness split of `splits` the prepared TFDS dataset holds (`needed`, the
  scored one, must be there); returns the files written."""
  import tensorflow_datasets as tfds
  name, (_, renamed, convert) = tfds_name(task), TFDS_TASKS[task]
  where = f'TFDS {name} in ' + (f'--data-dir {data_dir}' if data_dir else "TFDS's default data dir")
  fix = (f'prepare it with `tfds build {name} --file_format=array_record'
         + (f' --data_dir={data_dir}`' if data_dir else '`') + ', or pass the release files with --data-dir')
  try:  # from the prepared files alone: TFDS's builder code for some (super_glue) imports TensorFlow
    builder = tfds.core.read_only_builder.builder_from_files(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise ConfigError(f'{where}: not prepared; {fix}') from None
  into.mkdir(parents=True, exist_ok=True)
  written = []
  for split in splits:
    tfds_split = renamed.get(split, split)
    if tfds_split not in builder.info.splits:
      if split == needed:
        raise ConfigError(f'{where} has no split {tfds_split!r}: {task} is scored on it; {fix}')
      continue
    try:
      source = builder.as_data_source(split=tfds_split)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
      raise ConfigError(f'{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; {fix}') from None
    path = into / f'{split}.jsonl'
    path.write_text(''.join(json.dumps(convert(record, i, split), ensure_ascii=False) + '\n'
                            for i, record in enumerate(source)), encoding='utf-8')
    written.append(path)
  return written
