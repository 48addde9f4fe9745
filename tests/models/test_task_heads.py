"""Task heads: BERT's pair layout and truncation, a decoder's last-real-token classifier, the regression loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.config import load_config
from lm.data.tokenizers import get_tokenizer
from lm.models import abstract_params, build_model, get_family
from lm.jobs.glue.tasks import TASKS
from lm.models.task_heads import UNPARSEABLE, Classifier, TextToText, truncate_longest_first


def reference_truncate(a, b, budget):
  """BERT's run_classifier.py `_truncate_seq_pair`, verbatim in logic."""
  a, b = list(a), list(b)
  while len(a) + len(b) > budget:
    if len(a) > len(b):
      a.pop()
    else:
      b.pop()
  return [a, b]


@pytest.mark.parametrize('la, lb, budget', [(10, 3, 8), (3, 10, 8), (6, 6, 7), (5, 4, 20), (9, 9, 0)])
def test_truncation_is_berts_longest_first(la, lb, budget):
  a, b = list(range(la)), list(range(100, 100 + lb))
  assert truncate_longest_first([a, b], budget) == reference_truncate(a, b, budget)


def test_bert_pair_layout_and_token_types():
  tok = get_tokenizer('byte')
  head = get_family('bert').task_head
  features = head.encode(tok, TASKS['mrpc'], ('abcdef', 'xy'), 1, 9, 0)  # 9 - 3 specials: 'abcd' + 'xy'
  a, x = tok.encode('abcd').tolist(), tok.encode('xy').tolist()
  assert features['inputs'].tolist() == [tok.bos_id, *a, tok.eos_id, *x, tok.eos_id]
  assert features['token_types'].tolist() == [0] * 6 + [1] * 3
  assert features['segment_ids'].tolist() == [1] * 9
  single = head.encode(tok, TASKS['sst2'], ('ab',), None, 6, 0)
  assert single['inputs'].tolist() == [tok.bos_id, *tok.encode('ab').tolist(), tok.eos_id, tok.pad_id, tok.pad_id]
  assert single['token_types'].tolist() == [0] * 6 and single['segment_ids'].tolist() == [1, 1, 1, 1, 0, 0]
  assert features['weights'] == single['weights'] == 1.0  # one weight per row


@pytest.mark.parametrize('family', ['gpt', pytest.param('llama', marks=pytest.mark.long(0.2))])
def test_decoder_classifier_reads_the_last_real_token_whatever_the_padding(family):
  """Scores of a row are the same padded to 20 or 24 (GPT-2 pads with EOS, so the mask decides, not the ids),
  and equal those of the unpadded row without a mask (its last position)."""
  cfg = load_config(f'{family}_tiny', ['model.num_labels=3', 'model.d_model=64', 'model.num_layers=2',
                                       'model.num_heads=4', 'model.max_len=32', 'model.execution.scan_layers=false',
                                       'data.seq_len=32']).model
  head = get_family(family).task_head
  model = build_model(cfg)
  params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape, s.dtype) * 0.05,
                        abstract_params(model))
  tok = get_tokenizer('byte')
  rows = [head.encode(tok, TASKS['mrpc'], ('hello there', 'hi'), 0, n, 0) for n in (20, 24)]
  for row in rows:
    row['inputs'] = np.where(row['segment_ids'] > 0, row['inputs'], tok.eos_id)  # pad with EOS, as GPT-2 does
  scores = [np.asarray(head.infer(model, params, {k: jnp.asarray(v[None]) for k, v in row.items()}, tok, 0))
            for row in rows]
  np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5, atol=1e-6)
  real = int(rows[0]['segment_ids'].sum())
  unpadded = model.apply({'params': params}, jnp.asarray(rows[0]['inputs'][None, :real]), method='classify')
  np.testing.assert_allclose(scores[0], np.asarray(unpadded), rtol=1e-5, atol=1e-6)
  assert scores[0].shape == (1, 3)


@pytest.mark.parametrize('family', ['gpt', 'llama', 'bert'])
@pytest.mark.variants
def test_num_labels_adds_the_head_params_and_leaves_the_forward_unchanged(family):
  """A classifier config's params are the language model's with the head's in place of the output layer (HF's
  ...ForSequenceClassification layout), and its forward, given the LM's params, still gives the LM's logits."""
  overrides = ['model.d_model=32', 'model.num_layers=1', 'model.num_heads=2', 'model.max_len=16', 'data.seq_len=16']
  lm_cfg = load_config(f'{family}_tiny', overrides).model
  classifier_cfg = load_config(f'{family}_tiny', [*overrides, 'model.num_labels=2']).model
  lm_model, classifier = build_model(lm_cfg), build_model(classifier_cfg)
  lm_params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(1), s.shape, s.dtype) * 0.05,
                           abstract_params(lm_model))
  classifier_params = abstract_params(classifier)
  head = set(get_family(family).task_head.params)
  output_layer = {'lm_head'} if 'lm_head' in lm_params else set()
  assert set(classifier_params) == (set(lm_params) - output_layer) | head
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 16)))
  with_head = {**lm_params, **{k: jax.tree.map(jnp.zeros_like, v) for k, v in classifier_params.items()
                               if k not in lm_params}}
  np.testing.assert_array_equal(np.asarray(classifier.apply({'params': with_head}, tokens)),
                                np.asarray(lm_model.apply({'params': lm_params}, tokens)))


def test_regression_loss_is_squared_error_and_classification_is_cross_entropy():
  head = Classifier(params=())
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(5, 3)).astype(np.float32)
  labels, weights = np.array([0, 2, 1, 1, 0]), np.array([1, 1, 1, 0, 1], np.float32)
  total, weight = head.loss(jnp.asarray(scores), {'labels': jnp.asarray(labels), 'weights': jnp.asarray(weights)},
                            regression=False)
  s = scores.astype(np.float64)
  nll = np.log(np.exp(s).sum(-1)) - s[np.arange(5), labels]
  assert float(total) == pytest.approx((nll * weights).sum(), rel=1e-5) and float(weight) == 4
  targets = rng.uniform(0, 5, size=5).astype(np.float32)
  total, weight = head.loss(jnp.asarray(scores[:, :1]), {'labels': jnp.asarray(targets),
                                                        'weights': jnp.asarray(weights)}, regression=True)
  assert float(total) == pytest.approx((((s[:, 0] - targets) ** 2) * weights).sum(), rel=1e-5)
  np.testing.assert_array_equal(head.predict(scores, TASKS['mnli'], None), scores.argmax(-1))
  np.testing.assert_array_equal(head.predict(scores[:, :1], TASKS['stsb'], None), s[:, 0])


def test_text_to_text_targets_end_in_eos_and_the_decoder_starts_from_pad():
  tok = get_tokenizer('byte')
  assert TASKS['rte'].t5_input(('a', 'b')) == 'rte sentence1: a sentence2: b'
  row = TextToText().encode(tok, TASKS['rte'], ('a', 'b'), 0, 40, 12)  # label 0: entailment
  target = tok.encode('entailment').tolist()
  assert row['targets'].tolist() == target + [tok.eos_id, tok.pad_id]
  assert row['decoder_inputs'].tolist() == [tok.pad_id] + target + [tok.pad_id]
  assert row['weights'].tolist() == [1.0] * 11 + [0.0]
  assert row['inputs'][row['segment_ids'] > 0].tolist()[-1] == tok.eos_id


def test_text_to_text_reads_decoded_names_back_and_no_name_counts_wrong():
  """`predict` turns decoded ids (padding after EOS) into class ids, UNPARSEABLE where the text names no label."""
  tok, head = get_tokenizer('byte'), TextToText()
  rte, stsb = TASKS['rte'], TASKS['stsb']
  assert head.target_length(rte, tok) == len(tok.encode('not_entailment')) + 1
  assert head.num_labels(rte) == 0 and Classifier(params=()).num_labels(rte) == 2

  def decoded(*texts):
    ids = [tok.encode(t).tolist() + [tok.eos_id] for t in texts]
    return np.array([row + [tok.pad_id] * (20 - len(row)) for row in ids])
  predicted = head.predict(decoded('entailment', 'maybe', ' not_entailment ', 'Entailment'), rte, tok)
  assert predicted.tolist() == [0, UNPARSEABLE, 1, UNPARSEABLE]
  assert head.predict(decoded('3.2', 'five'), stsb, tok).tolist() == [3.2, -1.0]
