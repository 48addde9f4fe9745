"""The GLUE tasks as data: file layouts, label sets, metrics, T5's text casting, leaderboard names.

Every label map is explicit: `labels` are the strings GLUE's files write, in class-id order;
`tfds_labels` is the order TFDS `glue/<task>` numbers them in (MNLI differs), and `t5_labels` the
targets of T5's text-to-text casting, in class-id order. Facts from GLUE's download script, the TFDS
builder, BERT's run_classifier.py and T5's preprocessors (see the GLUE notes in the design docs).
"""
from __future__ import annotations

from dataclasses import dataclass

from lm.config import ConfigError


@dataclass(frozen=True)
class Layout:
  """One file kind: its column count, whether it opens with a header, and 0-based columns (-1: the last)."""
  columns: int
  header: bool
  texts: tuple[int, ...]  # text A (and B)
  label: int | None = None  # None: the file has no labels (test files)
  index: int | None = None  # the example id submissions echo; None: the row number


@dataclass(frozen=True)
class Split:
  """A file of a task: `DIR/<folder>/<file>.tsv`, read with `layout`."""
  name: str  # train, dev, dev_matched, test_mismatched, ...
  file: str
  layout: Layout
  tfds_split: str  # the split of TFDS glue/<task> holding the same examples
  submission: str | None = None  # test splits: the leaderboard file's name (without .tsv)


@dataclass(frozen=True)
class Task:
  name: str  # lower case, as the CLI and output folders spell it
  folder: str  # GLUE's folder name
  splits: tuple[Split, ...]
  text_keys: tuple[str, ...]  # feature names of text A (and B), as TFDS and T5 name them
  labels: tuple[str, ...]  # label strings as GLUE's files write them, in class-id order; () for regression
  metrics: tuple[str, ...]  # keys of eval_results.json, the main one first
  tfds_labels: tuple[str, ...] = ()  # TFDS's class order, in GLUE's label strings
  t5_labels: tuple[str, ...] = ()  # T5 targets in class-id order
  t5_prefix: str = ''  # default: the task name
  tfds_name: str = ''  # default: glue/<name>

  @property
  def regression(self) -> bool:
    return not self.labels

  @property
  def num_outputs(self) -> int:
    """Classifier outputs: one per class, or one score for regression."""
    return len(self.labels) or 1

  @property
  def main_metric(self) -> str:
    return self.metrics[0]

  @property
  def prefix(self) -> str:
    return self.t5_prefix or self.name

  @property
  def tfds(self) -> str:
    return self.tfds_name or f'glue/{self.name}'

  def split(self, name: str) -> Split:
    for split in self.splits:
      if split.name == name:
        return split
    raise ConfigError(f'GLUE task {self.name} has no split {name!r}; its splits: '
                      f'{", ".join(s.name for s in self.splits)}')

  def splits_of(self, kind: str) -> tuple[Split, ...]:
    """The train, dev or test splits (MNLI has two of dev and test)."""
    return tuple(s for s in self.splits if s.name.split('_')[0] == kind)

  def label_id(self, label: str) -> int | float:
    """A label as the file writes it -> its class id (or the float score)."""
    if self.regression:
      return float(label)
    if label not in self.labels:
      raise ValueError(f'label {label!r} is not one of {", ".join(self.labels)}')
    return self.labels.index(label)

  def t5_input(self, texts: tuple[str, ...]) -> str:
    """`"<prefix> k1: v1 k2: v2"` with the feature keys in alphabetical order, as T5's glue preprocessor."""
    pairs = sorted(zip(self.text_keys, texts))
    return ' '.join([self.prefix] + [f'{key}: {value}' for key, value in pairs])

  def t5_target(self, label: int | float) -> str:
    """The target text: a label name, or for regression the score rounded to the nearest 0.2 with one decimal."""
    if self.regression:
      return f'{round(float(label) * 5) / 5:.1f}'  # Python rounds half to even, as T5's np.round
    return self.t5_labels[int(label)]

  def from_t5(self, text: str) -> int | float | None:
    """A decoded output -> class id or score; None when it is not exactly a label (counted wrong)."""
    text = text.strip()
    if self.regression:
      try:
        return float(text)
      except ValueError:
        return None
    return self.t5_labels.index(text) if text in self.t5_labels else None


def _split(name: str, layout: Layout, tfds_split: str, submission: str | None = None) -> Split:
  return Split(name, name, layout, tfds_split, submission)


def _standard(name: str, folder: str, train: Layout, test: Layout, submission: str, **fields) -> Task:
  """A task with train.tsv, dev.tsv (laid out like train) and test.tsv."""
  return Task(name, folder, (_split('train', train, 'train'), _split('dev', train, 'validation'),
                             _split('test', test, 'test', submission)), **fields)


_BINARY = ('0', '1')
_NLI2 = ('entailment', 'not_entailment')
_NLI3 = ('entailment', 'neutral', 'contradiction')
_PAIR_WITH_INDEX = Layout(columns=4, header=True, texts=(1, 2), label=3, index=0)  # index s1 s2 label
_PAIR_TEST = Layout(columns=3, header=True, texts=(1, 2), index=0)
_MNLI_TEST = Layout(columns=10, header=True, texts=(8, 9), index=0)
_MNLI_DEV = Layout(columns=16, header=True, texts=(8, 9), label=-1, index=0)

TASKS: dict[str, Task] = {t.name: t for t in (
  _standard('cola', 'CoLA', Layout(columns=4, header=False, texts=(3,), label=1),
            Layout(columns=2, header=True, texts=(1,), index=0), 'CoLA',
            text_keys=('sentence',), labels=_BINARY, metrics=('matthews_corr',),
            tfds_labels=_BINARY, t5_labels=('unacceptable', 'acceptable')),
  _standard('sst2', 'SST-2', Layout(columns=2, header=True, texts=(0,), label=1),
            Layout(columns=2, header=True, texts=(1,), index=0), 'SST-2',
            text_keys=('sentence',), labels=_BINARY, metrics=('accuracy',),
            tfds_labels=_BINARY, t5_labels=('negative', 'positive')),
  _standard('mrpc', 'MRPC', Layout(columns=5, header=True, texts=(3, 4), label=0),
            Layout(columns=5, header=True, texts=(3, 4), index=0), 'MRPC',
            text_keys=('sentence1', 'sentence2'), labels=_BINARY, metrics=('f1', 'accuracy'),
            tfds_labels=_BINARY, t5_labels=('not_equivalent', 'equivalent')),
  _standard('stsb', 'STS-B', Layout(columns=10, header=True, texts=(7, 8), label=-1, index=0),
            Layout(columns=9, header=True, texts=(7, 8), index=0), 'STS-B',
            text_keys=('sentence1', 'sentence2'), labels=(), metrics=('pearson', 'spearman')),
  _standard('qqp', 'QQP', Layout(columns=6, header=True, texts=(3, 4), label=5, index=0),
            Layout(columns=3, header=True, texts=(1, 2), index=0), 'QQP',
            text_keys=('question1', 'question2'), labels=_BINARY, metrics=('f1', 'accuracy'),
            tfds_labels=_BINARY, t5_labels=('not_duplicate', 'duplicate')),
  Task('mnli', 'MNLI', (
    _split('train', Layout(columns=12, header=True, texts=(8, 9), label=-1, index=0), 'train'),
    _split('dev_matched', _MNLI_DEV, 'validation_matched'),
    _split('dev_mismatched', _MNLI_DEV, 'validation_mismatched'),
    _split('test_matched', _MNLI_TEST, 'test_matched', 'MNLI-m'),
    _split('test_mismatched', _MNLI_TEST, 'test_mismatched', 'MNLI-mm')),
    text_keys=('premise', 'hypothesis'), labels=_NLI3, metrics=('accuracy_matched', 'accuracy_mismatched'),
    tfds_labels=_NLI3, t5_labels=_NLI3),
  _standard('qnli', 'QNLI', _PAIR_WITH_INDEX, _PAIR_TEST, 'QNLI',
            text_keys=('question', 'sentence'), labels=_NLI2, metrics=('accuracy',),
            tfds_labels=_NLI2, t5_labels=_NLI2),
  _standard('rte', 'RTE', _PAIR_WITH_INDEX, _PAIR_TEST, 'RTE',
            text_keys=('sentence1', 'sentence2'), labels=_NLI2, metrics=('accuracy',),
            tfds_labels=_NLI2, t5_labels=_NLI2),
  _standard('wnli', 'WNLI', _PAIR_WITH_INDEX, _PAIR_TEST, 'WNLI',
            text_keys=('sentence1', 'sentence2'), labels=_BINARY, metrics=('accuracy',),
            tfds_labels=_BINARY, t5_labels=('not_entailment', 'entailment')),
)}

# The diagnostic set: test-only, predicted with the MNLI model; at DIR/diagnostic/diagnostic.tsv or DIR/AX.tsv.
AX = Task('ax', 'diagnostic', (Split('test', 'diagnostic', _PAIR_TEST, 'test', 'AX'),),
          text_keys=('premise', 'hypothesis'), labels=_NLI3, metrics=(), tfds_labels=_NLI3, t5_labels=_NLI3,
          t5_prefix='mnli')

GLUE_ORDER = ('cola', 'sst2', 'mrpc', 'stsb', 'qqp', 'mnli', 'qnli', 'rte', 'wnli')


def get_task(name: str) -> Task:
  key = name.lower().replace('-', '')
  if key not in TASKS:
    raise ConfigError(f'--task {name} is not a GLUE task; choose one of: {", ".join(GLUE_ORDER)}, or glue for all')
  return TASKS[key]
