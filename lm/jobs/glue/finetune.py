"""Fine-tuning one GLUE task: a pretrained model plus its family's task head, BERT's recipe, best-on-dev.

The source (`--init`) is one of our run dirs or an HF model directory: it fixes the model and the
tokenizer. The config is the source's (or `--config`'s) with the recipe's defaults layered under the
user's overrides: AdamW (weight decay 0.01 off biases and norms, eps 1e-6, clip 1.0), 10% linear
warmup then linear decay to 0, batch 32, 3 epochs, max_len 128 (`data.seq_len`). Batches cycle
through seeded per-epoch shuffles, so a training set smaller than the batch still trains. Dev is
evaluated every `train.eval_every` steps (default: each epoch) and the state checkpointed as often
(`train.checkpoint.every`), so `--resume` continues a stopped or killed run exactly; the params with the
best main metric are kept and predict the dev and test files.

The task's folder `<run_dir>/<task>/` is a run dir (config.yaml, checkpoints/ with the latest state for
`--resume`, best/ with the best params, metrics.jsonl), so `train.init_from` and `lm convert --to-hf` read a
fine-tuned model (its best params) like any other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from lm.assembly import Assembly, assemble
from lm.assembly.state import TrainState
from lm.storage.checkpoint import Checkpointer
from lm.config import Config, ConfigError, from_dict, load_config, merge, parse_overrides
from lm.data.pipeline import HostRows, global_rows
from lm.data.tokenizers import Tokenizer
from lm.jobs.finetuning import source_config
from lm.jobs.glue.data import SplitData
from lm.jobs.glue.metrics import task_metrics
from lm.jobs.glue.tasks import Task
from lm.models import get_family
from lm.models.task_heads import UNPARSEABLE, TaskHead
from lm.storage.run_dir import BEST, is_run_dir
from lm.train.init_from import initial_state
from lm.train.callbacks import Evaluate, KeepBest
from lm.train.distill import Distilled, Teacher, open_teacher
from lm.train.loop import Trainer
from lm.train.step import make_score_step

Features = dict[str, np.ndarray]

# BERT's recipe (Devlin et al. 2019; run_classifier.py): what a GLUE run gets unless the user overrides it.
RECIPE = {
  'optim': {'learning_rate': 2e-5, 'schedule': 'linear', 'min_lr_ratio': 0.0, 'b1': 0.9, 'b2': 0.999, 'eps': 1e-6,
            'weight_decay': 0.01, 'decay_exclude': ['bias', 'scale'], 'grad_clip': 1.0},
  'train': {'global_batch': 32, 'log_every': 10, 'eval_batches': 0, 'checkpoint': {'keep': 1},
            'resume': False},
  'data': {'seq_len': 128},
}
EPOCHS = 3


def default_run_dir(init: str) -> str:
  """Where a fine-tune of `init` writes unless train.run_dir says otherwise."""
  return _run_dir_of(source_config(init))


def _run_dir_of(source: Config) -> str:
  return f'runs/glue/{source.name}'


def finetune_config(task: Task, init: str, preset: str | None, overrides: list[str], num_train: int,
                    epochs: float = EPOCHS) -> Config:
  """The run's config: `preset` (default: the source's config) + the recipe + `overrides`; the model and
  tokenizer are the source's, with the task head's outputs; `train.steps` from epochs unless given."""
  source = source_config(init)
  values = load_config(preset).to_dict() if preset else source.to_dict()
  values['model'] = {**source.to_dict()['model'], 'num_labels': task_head(source).num_labels(task)}
  values['data'] = {**values['data'], 'tokenizer': source.data.tokenizer}
  values['name'] = f'{source.name}-{task.name}'
  values['train'] = {**values['train'], 'init_from': init, 'run_dir': _run_dir_of(source)}
  given = parse_overrides(overrides)
  values = merge(merge(values, RECIPE), given)
  _unsplit_sequences(values['mesh'], given.get('mesh', {}))
  values['data']['seq_len'] = min(values['data']['seq_len'], values['model']['max_len']) \
    if values['model'].get('position', 'learned') == 'learned' else values['data']['seq_len']
  batch = int(values['train']['global_batch'])
  steps_per_epoch = max(math.ceil(num_train / batch), 1)
  if 'steps' not in given.get('train', {}):
    values['train']['steps'] = max(round(epochs * steps_per_epoch), 1)
  steps = int(values['train']['steps'])
  if 'warmup_steps' not in given.get('optim', {}):
    values['optim']['warmup_steps'] = round(0.1 * steps)
  if 'eval_every' not in given.get('train', {}):
    values['train']['eval_every'] = min(steps_per_epoch, steps)
  if 'every' not in given.get('train', {}).get('checkpoint', {}):  # a killed run resumes from its last evaluation
    values['train']['checkpoint']['every'] = values['train']['eval_every']
  return from_dict(values)


def _unsplit_sequences(mesh: dict, given: dict) -> None:
  """Task heads read given positions of a row (BERT's [CLS], a decoder's last token), which a sequence split over
  the mesh would reorder: fine-tuning takes a source's sequence devices as data devices, and refuses a split."""
  n = int(mesh.get('sequence', 1))
  if n == 1:
    return
  if 'sequence' in given:
    raise ConfigError(f'GLUE fine-tuning does not split sequences over the mesh (mesh.sequence={n}); its rows are '
                      f'short: set mesh.sequence=1 and use mesh.data')
  data = int(mesh.get('data', -1))
  mesh['data'], mesh['sequence'] = (-1 if data == -1 else data * n), 1


def task_head(config: Config) -> TaskHead:
  head = get_family(config.model.family).task_head
  if head is None:
    raise ConfigError(f'the {config.model.family} family declares no task head; it cannot be fine-tuned on GLUE')
  return head


@dataclass(frozen=True)
class TaskLoss(Distilled):
  """The head's loss per example (classifier) or per target token (text to text), over the whole batch; with a
  `teacher` (`train.distill`), (1 - weight) x itself + weight x the divergence from the teacher's outputs (soft
  labels)."""
  assembly: Assembly
  head: TaskHead
  regression: bool
  teacher: Teacher | None = None

  def prepare(self, batch):
    return batch

  def totals(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {'weight': jnp.maximum(jnp.sum(batch['weights'].astype(jnp.float32)), 1.0)}

  def __call__(self, params, batch, rng, totals):
    outputs = self.head.apply(self.assembly.model, params, batch, deterministic=False, rngs={'dropout': rng})
    total, _ = self.head.loss(outputs, batch, self.regression)
    sums = {'loss': total}
    if self.teacher is not None:
      d = self.assembly.config.train.distill
      soft = self.head.soft_loss(outputs, self.teacher.task_outputs(batch), batch, self.regression, d.temperature,
                                 d.divergence)
      sums['distill'] = jax.lax.stop_gradient(soft)
      total = (1 - d.weight) * total + d.weight * soft
    return total / totals['weight'], sums

  def metrics(self, sums, totals):
    return {f'{name}_loss' if name == 'distill' else name: value / totals['weight'] for name, value in sums.items()}


def task_teacher(config: Config, task: Task) -> str | None:
  """`train.distill.teacher`, or its folder for `task` when it is a GLUE run of every task (RUN/TASK)."""
  teacher = config.train.distill.teacher
  if teacher is None:
    return None
  if config.train.distill.top_k:
    raise ConfigError(f'train.distill.top_k={config.train.distill.top_k}: GLUE learns the teacher\'s whole soft labels '
                      f'(a few classes, or a score); drop top_k')
  root = epath.Path(teacher)
  folder = root / task.name
  if is_run_dir(folder):
    return str(folder)
  if not is_run_dir(root) and root.is_dir() and any(is_run_dir(d) for d in root.iterdir()):
    raise ConfigError(f'train.distill.teacher={teacher} is a GLUE run without {task.name} ({folder} is no run); '
                      f'fine-tune the teacher on {task.name} first, or name one task\'s run')
  return teacher


def encode_examples(head: TaskHead, task: Task, tokenizer: Tokenizer, data: SplitData, max_len: int,
                    target_len: int) -> Features:
  """Fixed-length rows for every example: the head's layout and weights, and `labels` (class id or score;
  -1 / nan when the split has none)."""
  rows = []
  for example in data.examples:
    row = head.encode(tokenizer, task, example.texts, example.label, max_len, target_len)
    row['labels'] = np.asarray(_missing(task) if example.label is None else example.label,
                               np.float32 if task.regression else np.int32)
    rows.append(row)
  if not rows:
    raise ConfigError(f'{data.task.name} {data.split.name} holds no examples; check the file')
  return {key: np.stack([row[key] for row in rows]) for key in rows[0]}


def _missing(task: Task) -> float | int:
  return float('nan') if task.regression else -1


class FineTuner:
  """Trains `config` on one task's encoded train split through the one loop; evaluates and predicts the other
  splits. The task's folder holds the latest state (`checkpoints/`, for `--resume`) and the best params (`best/`)."""

  def __init__(self, config: Config, task: Task, train: Features, tokenizer: Tokenizer, target_len: int):
    self.config, self.task, self.train, self.tokenizer, self.target_len = config, task, train, tokenizer, target_len
    self.assembly = assemble(config)
    self.head = self.assembly.family.task_head
    self.task_dir = config.run_dir / task.name
    loss = TaskLoss(self.assembly, self.head, task.regression, open_teacher(self.assembly, task_teacher(config, task)))
    self.loop = Trainer(self.assembly, loss, run_dir=self.task_dir)
    self._infer = make_score_step(
      self.assembly, lambda model, params, batch: self.head.infer(model, params, batch, tokenizer, target_len))
    self.batch = config.train.global_batch
    self.metric = f'dev_{task.main_metric}'

  def predict(self, params: Any, features: Features) -> np.ndarray:
    """Class ids (-1: a decoded output that is no label) or regression scores for every row."""
    n, out = len(features['labels']), []
    for start in range(0, n, self.batch):
      rows = np.arange(start, start + self.batch) % n  # the last batch wraps: fixed shapes, one compile
      batch = global_rows(self.assembly.mesh, {k: v[rows] for k, v in features.items()})
      out.append(self._predict_batch(params, batch)[:min(self.batch, n - start)])
    return np.concatenate(out)

  def _predict_batch(self, params: Any, batch: dict[str, jax.Array]) -> np.ndarray:
    return self.head.predict(np.asarray(self._infer(params, batch)), self.task, self.tokenizer)

  def evaluate(self, params: Any, dev: dict[str, Features], step: int) -> dict[str, Any]:
    """The task's metrics on the dev splits as `dev_<metric>` (and, text to text, outputs that name no label)."""
    predictions = {name: self.predict(params, features) for name, features in dev.items()}
    scores = task_metrics(self.task, predictions, {name: f['labels'] for name, f in dev.items()})
    record: dict[str, Any] = {f'dev_{k}': v for k, v in scores.items()}
    # Outputs that name no label (a decoded text that is none), counted wrong: none from a classifier.
    record['dev_unparseable'] = sum(int(np.sum(p == UNPARSEABLE)) for p in predictions.values())
    note = f' ({record["dev_unparseable"]} outputs were no label)' if record['dev_unparseable'] else ''
    print(f'{self.task.name} step {step}: ' + ', '.join(f'{k} {v:.4f}' for k, v in scores.items()) + note, flush=True)
    return record

  def _start(self, init: str) -> TrainState:
    start = initial_state(self.assembly, init)
    if start.fresh:
      print(f'{self.task.name}: new {", ".join(start.fresh)}', flush=True)
    if start.reshaped:
      print(f'{self.task.name}: new head {", ".join(start.reshaped)} (the source\'s has another shape: another '
            f'task\'s labels)', flush=True)
    return start.state

  def run(self, init: str, dev: dict[str, Features]) -> dict[str, Any] | None:
    """Trains from `init` (or resumes, under `train.resume`), evaluating `dev` (split name -> features) every
    `train.eval_every` steps and at the end, and keeping the best params. Returns {'step', 'metrics',
    'predictions'} of the best evaluation, or None when a SIGTERM stopped the run."""
    cfg, t = self.config, self.config.train
    best = Checkpointer(self.task_dir / BEST, keep=1, async_save=False, create=False)
    stream = HostRows(self.train, self.batch, t.seed, self.assembly.mesh)
    try:
      self.loop.run(stream, lambda: self._start(init),
                    [Evaluate(lambda params, step: self.evaluate(params, dev, step), t.eval_every,
                              params_of=self.assembly.params_of),
                     KeepBest(best, self.metric, t.eval_every, cfg.to_dict())])
      if self.loop.stopped_at is not None:
        return None
      step = best.latest_step()
      params = best.restore_params(step, self.assembly.abstract_params)
      scores = {k[len('dev_'):]: v for k, v in best.saved_metrics(step).items() if k != 'dev_unparseable'}
    finally:
      best.close()
    return {'step': step, 'metrics': scores,
            'predictions': {name: self.predict(params, features) for name, features in dev.items()}}

  def best_params(self) -> Any:
    """The checkpointed best params, on this run's mesh."""
    saved = Checkpointer(self.task_dir / BEST, create=False, async_save=False)
    try:
      return saved.restore_params(saved.latest_step(), self.assembly.abstract_params)
    finally:
      saved.close()
