"""Knowledge distillation's teacher (`train.distill`): a model opened the one way (run dir, checkpoint, HF directory,
PEFT adapter), assembled from its own config on the student's mesh, so its params are sharded by the same rules and
it computes in its own dtype. The train step takes its params as an argument beside the state (never donated, never
differentiated) and scores each microbatch with it; `lm.ops.losses.distillation` compares the two models' logits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax

from lm.assembly import Assembly
from lm.config import Config, ConfigError
from lm.data.tokenizers import fingerprint, get_tokenizer
from lm.storage.source import ModelSource


@dataclass(frozen=True)
class Teacher:
  assembly: Assembly  # the teacher's own config on the student's mesh
  params: Any  # its params there: concrete arrays, or inside the step the traced argument they became

  def logits(self, batch: dict[str, jax.Array]) -> jax.Array:
    """[batch, length, vocab] for the student's (micro)batch, deterministic (no dropout), a constant to autodiff."""
    a = self.assembly
    head = a.family.apply(a.model, self.params, batch, deterministic=True, rngs={})['logits']
    return jax.lax.stop_gradient(head.logits())

  def task_outputs(self, batch: dict[str, jax.Array]) -> jax.Array:
    """Its fine-tuning head's outputs (`Family.task_head`: class scores, or a text-to-text model's logits)."""
    a = self.assembly
    return jax.lax.stop_gradient(a.family.task_head.apply(a.model, self.params, batch, deterministic=True, rngs={}))

  def with_params(self, params: Any) -> Teacher:
    return replace(self, params=params)


class Distilled:
  """What a step loss with a `teacher` field (None: none) hands the train step: the teacher's params as its
  `inputs` (an argument beside the state), and `bound(inputs)`, the loss reading them as that argument inside it."""
  teacher: Teacher | None

  @property
  def inputs(self) -> Any:
    return None if self.teacher is None else self.teacher.params

  def bound(self, inputs: Any) -> Any:
    return replace(self, teacher=self.teacher.with_params(inputs))


def open_teacher(student: Assembly, path: str | None = None) -> Teacher | None:
  """The teacher at `path` (default: the student's `train.distill.teacher`) on the student's mesh with its params,
  or None; a ConfigError naming the fix for a teacher that reads other batches, another vocabulary or has other
  outputs."""
  path = student.config.train.distill.teacher if path is None else path
  if path is None:
    return None
  source, teacher = _assembled(student, path, need_params=True)
  return Teacher(teacher, source.params(student.mesh))


def abstract_teacher(student: Assembly) -> Teacher | None:
  """`open_teacher` with its params' shapes, dtypes and shardings alone (nothing read): for lowering the step ahead
  of time (`lm compile`)."""
  path = student.config.train.distill.teacher
  if path is None:
    return None
  _, teacher = _assembled(student, path, need_params=False)
  return Teacher(teacher, teacher.abstract_params)


def _assembled(student: Assembly, path: str, need_params: bool) -> tuple[ModelSource, Assembly]:
  """(the teacher's source, its config assembled on the student's mesh), checked against the student."""
  config = student.config
  source = ModelSource(path, flag='train.distill.teacher=', need_params=need_params)
  named = f'train.distill.teacher={path}'
  check_teacher(config, source.config, named)
  teacher = source.assembly_on(student.mesh)
  if teacher.family.scoring is not student.family.scoring:
    raise ConfigError(f'{named} is a {teacher.family.name} model, whose outputs predict other targets than the '
                      f'{student.family.name} student\'s; distill from a teacher of the student\'s kind')
  labels, theirs = config.model.num_labels, teacher.config.model.num_labels
  if labels != theirs:
    raise ConfigError(f'{named} has {theirs or "no"} task outputs (model.num_labels) and the student '
                      f'{labels or "none"}; distill from a model fine-tuned on the student\'s task')
  return source, teacher


def check_teacher(student: Config, teacher: Config, named: str) -> None:
  """The teacher's tokens must be the student's: the same vocabulary size and tokenizer (encoding alike, wherever
  its files lie)."""
  vocab, theirs = student.model.vocab_size, teacher.model.vocab_size
  if student.train.distill.top_k > vocab:
    raise ConfigError(f'train.distill.top_k={student.train.distill.top_k} is more tokens than the vocabulary\'s '
                      f'{vocab}; keep at most {vocab} (or 0: all)')
  if vocab != theirs:
    raise ConfigError(f'{named} has a vocabulary of {theirs} tokens and the student {vocab}; distill from a teacher '
                      f'with the student\'s tokenizer and model.vocab_size')
  ours, its = student.data.tokenizer, teacher.data.tokenizer
  if ours != its and fingerprint(get_tokenizer(ours)) != fingerprint(get_tokenizer(its)):
    raise ConfigError(f'{named} reads tokens of the tokenizer {its} and the student of {ours}; distill from a '
                      f'teacher with the student\'s tokenizer (or set data.tokenizer to the teacher\'s)')
