"""Knowledge distillation (`train.distill`): the loss against a float64 NumPy reference of the two models' logits,
weight 0 as plain training, a 2-layer student beating itself without its 4-layer teacher, kill -9 and resume, and
a teacher of other tokens refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.assembly import assemble
from lm.config import ConfigError, load_config
from lm.jobs.pretraining import Pretraining
from lm.train.distill import Teacher
from lm.train.logging import read_metrics
from lm.train.step import PretrainingLoss
from tests.conftest import SMALL, built_once


def models(*overrides: str) -> tuple:
  """(student assembly, its params, a 3-layer teacher of the same tokens, the teacher's params, a batch)."""
  student = assemble(load_config('gpt_tiny', SMALL + ['mesh.data=1', *overrides]), jax.devices()[:1])
  teacher = assemble(load_config('gpt_tiny', SMALL + ['mesh.data=1', 'model.num_layers=3']), jax.devices()[:1])
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, 260, (4, 32))
  weights = (rng.random((4, 32)) > 0.2).astype(np.float32)
  batch = {'inputs': jnp.asarray(inputs), 'targets': jnp.asarray(np.roll(inputs, -1, 1)),
           'weights': jnp.asarray(weights)}
  return student, student.init_state().params, teacher, teacher.init_state(jax.random.key(7)).params, batch


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize('divergence, top_k', [('forward', 0), ('reverse', 0), ('forward', 20)])
@pytest.mark.variants
def test_the_loss_mixes_the_data_loss_with_the_kl_of_softened_logits_as_numpy_does(divergence, top_k):
  """(1 - w) x the token loss + w x T^2 x KL, forward or reverse, against float64 NumPy; with top_k, the teacher's
  k likeliest tokens renormalised against the student's whole-vocabulary log-probabilities at them."""
  student, params, teacher, teacher_params, batch = models(
    'train.distill.teacher=x', 'train.distill.weight=0.3', 'train.distill.temperature=2',
    f'train.distill.divergence={divergence}', f'train.distill.top_k={top_k}')
  loss = PretrainingLoss(student, Teacher(teacher, teacher_params))
  totals = loss.totals(batch)
  value, sums = loss(params, batch, jax.random.key(0), totals)
  logits = lambda a, p: np.asarray(a.family.apply(a.model, p, batch, deterministic=True, rngs={})['logits'].logits(),
                                   np.float64)
  s, t = log_softmax(logits(student, params) / 2), log_softmax(logits(teacher, teacher_params) / 2)
  if top_k:
    kept = np.argsort(-t, axis=-1)[..., :top_k]
    s, t = np.take_along_axis(s, kept, -1), log_softmax(np.take_along_axis(t, kept, -1))
  p, q = (t, s) if divergence == 'forward' else (s, t)
  weights = np.asarray(batch['weights'], np.float64)
  kl = 4 * np.sum(np.sum(np.exp(p) * (p - q), -1) * weights)
  full = log_softmax(logits(student, params))
  nll = -np.sum(np.take_along_axis(full, np.asarray(batch['targets'])[..., None], -1)[..., 0] * weights)
  np.testing.assert_allclose(float(sums['distill']), kl, rtol=1e-5)
  np.testing.assert_allclose(float(value), (0.7 * nll + 0.3 * kl) / weights.sum(), rtol=1e-5)
  metrics = loss.metrics(sums, totals)
  np.testing.assert_allclose([metrics['loss'], metrics['distill_loss']], [nll / weights.sum(), kl / weights.sum()],
                             rtol=1e-5)


@pytest.mark.long(0.3)
def test_at_weight_zero_the_gradients_are_plain_trainings():
  student, params, teacher, teacher_params, batch = models('train.distill.teacher=x', 'train.distill.weight=0')
  grad = lambda loss: jax.grad(lambda p: loss(p, batch, jax.random.key(0), loss.totals(batch))[0])(params)
  distilled, plain = grad(PretrainingLoss(student, Teacher(teacher, teacher_params))), grad(PretrainingLoss(student))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), distilled, plain)


def val_loss(run) -> float:
  return [r['val_loss'] for r in read_metrics(run) if 'val_loss' in r][-1]


@pytest.mark.long(0.5)
def test_a_student_beats_itself_without_the_teacher(tmp_path):
  """A 2-layer student distilled 30 steps from a 4-layer GPT trained 200 reaches a lower held-out loss than without
  it, and its distillation loss falls. (kill -9 and --resume during distillation: the LoRA run of
  tests/models/test_lora.py distils from its base.)"""
  held_out = ['train.eval_batches=4', 'train.eval_every=1000']

  def build(root):
    config = load_config('gpt_tiny', SMALL + held_out + ['model.num_layers=4', 'train.steps=200',
                                                         f'train.run_dir={root}'])
    Pretraining(config, jax.devices()[:1]).run()
  teacher = built_once('distill_teacher', build)
  student = SMALL + held_out + ['train.steps=30']
  for name, extra in (('plain', []), ('distilled', [f'train.distill.teacher={teacher}',
                                                    'train.distill.temperature=2'])):
    Pretraining(load_config('gpt_tiny', student + extra + [f'train.run_dir={tmp_path}/{name}']),
                jax.devices()[:1]).run()
  assert val_loss(teacher) < val_loss(tmp_path / 'distilled') < val_loss(tmp_path / 'plain') - 0.01
  records = [r for r in read_metrics(tmp_path / 'distilled') if 'loss' in r]
  assert records[-1]['distill_loss'] < 0.5 * records[0]['distill_loss']


def test_a_teacher_of_another_vocabulary_or_settings_out_of_range_are_refused_in_one_line():
  from lm.train.distill import check_teacher
  student = load_config('gpt_tiny', SMALL)
  with pytest.raises(ConfigError, match=r'=T has a vocabulary of 512 tokens and the student 264; distill from a '):
    check_teacher(student, load_config('gpt_tiny', SMALL + ['model.vocab_size=512']), 'train.distill.teacher=T')
  with pytest.raises(ConfigError, match='train.distill fields are set but train.distill.teacher is not'):
    load_config('gpt_tiny', ['train.distill.weight=0.2'])
  with pytest.raises(ConfigError, match=r'train.distill.weight=1.5 must be in \[0, 1\]'):
    load_config('gpt_tiny', ['train.distill.teacher=x', 'train.distill.weight=1.5'])
  with pytest.raises(ConfigError, match=r'train.distill.top_k=5 .* with train.distill.divergence=forward \(not rev'):
    load_config('gpt_tiny', ['train.distill.teacher=x', 'train.distill.top_k=5', 'train.distill.divergence=reverse'])
  from lm.jobs.glue.finetune import task_teacher
  from lm.jobs.glue.tasks import TASKS
  with pytest.raises(ConfigError, match=r'train.distill.top_k=5: GLUE learns the teacher\'s whole soft labels'):
    task_teacher(load_config('bert_tiny', ['train.distill.teacher=x', 'train.distill.top_k=5']), TASKS['rte'])
  with pytest.raises(ConfigError, match=r'train.distill.top_k=300 is more tokens than the vocabulary\'s 264'):
    check_teacher(load_config('gpt_tiny', SMALL + ['train.distill.teacher=x', 'train.distill.top_k=300']),
                  load_config('gpt_tiny', SMALL), 'train.distill.teacher=T')
  with pytest.raises(ConfigError, match='train.distill.teacher runs a second model beside the pipelined stack'):
    load_config('llama_tiny', ['mesh.stage=2', 'model.execution.scan_layers=true', 'train.microbatches=2',
                               'train.distill.teacher=x'])


def test_a_teacher_that_predicts_other_targets_is_refused_in_one_line(tmp_path):
  from lm.models import build_model, get_family
  from lm.storage.convert.hf import save_hf
  bert = load_config('bert_tiny', SMALL + ['model.vocab_size=264']).model
  save_hf(bert, nn.unbox(get_family(bert.family).init(build_model(bert), jax.random.key(1), 16)), tmp_path / 'bert')
  config = load_config('gpt_tiny', SMALL + [f'train.run_dir={tmp_path}/run', f'train.distill.teacher={tmp_path}/bert'])
  with pytest.raises(ConfigError, match=r'is a bert model, whose outputs predict other targets than the gpt student'):
    Pretraining(config, jax.devices()[:1])


@pytest.mark.parametrize('labels', [2, 1])
@pytest.mark.variants
def test_glue_soft_labels_are_the_classes_kl_or_the_scores_squared_error_as_numpy_gives(labels):
  """GLUE's TaskLoss with a teacher: classes, (1 - w) x cross-entropy + w x T^2 x KL(teacher || student); a
  regression score (STS-B), its squared error from the teacher's score."""
  from lm.jobs.glue.finetune import TaskLoss
  make = lambda *extra: assemble(load_config('bert_tiny', SMALL + [
    'mesh.data=1', f'model.num_labels={labels}', 'train.distill.teacher=x', 'train.distill.weight=0.4',
    'train.distill.temperature=0.5', *extra]), jax.devices()[:1])
  student, teacher = make(), make('model.num_layers=3')
  params, teacher_params = student.init_state().params, teacher.init_state(jax.random.key(5)).params
  rng = np.random.default_rng(1)
  batch = {'inputs': jnp.asarray(rng.integers(3, 260, (6, 16))), 'segment_ids': jnp.ones((6, 16), jnp.int32),
           'token_types': jnp.asarray(np.repeat([[0] * 8 + [1] * 8], 6, 0)),
           'labels': jnp.asarray(rng.random(6) * 5 if labels == 1 else rng.integers(0, 2, 6)),
           'weights': jnp.asarray([1, 1, 1, 0, 1, 1], jnp.float32)}
  head = student.family.task_head
  loss = TaskLoss(student, head, labels == 1, Teacher(teacher, teacher_params))
  value, sums = loss(params, batch, jax.random.key(0), loss.totals(batch))
  scores = lambda a, p: np.asarray(head.apply(a.model, p, batch, deterministic=True, rngs={}), np.float64)
  s, t = scores(student, params), scores(teacher, teacher_params)
  w, y = np.asarray(batch['weights'], np.float64), np.asarray(batch['labels'])
  if labels == 1:
    hard, soft = np.sum(w * (s[:, 0] - y) ** 2), np.sum(w * (s[:, 0] - t[:, 0]) ** 2)
  else:
    hard = -np.sum(w * np.take_along_axis(log_softmax(s), y[:, None], -1)[:, 0])
    p, q = log_softmax(t / 0.5), log_softmax(s / 0.5)
    soft = 0.25 * np.sum(w * np.sum(np.exp(p) * (p - q), -1))
  np.testing.assert_allclose(float(sums['distill']), soft, rtol=1e-5)
  np.testing.assert_allclose(float(value), (0.6 * hard + 0.4 * soft) / w.sum(), rtol=1e-5)


def test_the_compiled_step_takes_the_teachers_params_beside_the_state(tmp_path):
  """`lm compile`'s step (lowered with nothing read) holds the teacher's params as arguments: the compiled
  arguments exceed the student's alone by exactly their bytes, which `lm info` counts in its estimate."""
  from lm.models import build_model, get_family
  from lm.storage.convert.hf import save_hf
  from lm.train.step import compile_train_step
  teacher = load_config('gpt_tiny', SMALL + ['model.num_layers=3']).model
  params = nn.unbox(get_family(teacher.family).init(build_model(teacher), jax.random.key(1), 16))
  save_hf(teacher, params, tmp_path / 'teacher')
  sizes = [compile_train_step(assemble(load_config('gpt_tiny', SMALL + ['mesh.data=1', *extra]), jax.devices()[:1])
                              ).memory_analysis().argument_size_in_bytes
           for extra in ([], [f'train.distill.teacher={tmp_path / "teacher"}'])]
  assert sizes[1] - sizes[0] == sum(x.size * 4 for x in jax.tree.leaves(params))
  from lm.planning.compile import model_report
  student = load_config('gpt_tiny', SMALL + ['mesh.data=-1', f'train.distill.teacher={tmp_path / "teacher"}'])
  memory = model_report(student)['memory_per_device']
  assert memory['teacher params'] == sizes[1] - sizes[0]
  assert memory['total (estimate)'] == sum(v for k, v in memory.items() if k != 'total (estimate)')
