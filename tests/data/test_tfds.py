"""A corpus of real text built into TFDS (ArrayRecord) with `lm data build`, a SentencePiece model trained on
it with `lm tokenizer train`, and every family trained from it; exact resume; one-line errors."""
import json
import os
import signal

import jax
import numpy as np
import pytest

from lm import cli
from lm.config import load_config
from lm.data.sources import embedded_documents
from lm.train.logging import read_metrics
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL, built_once


@pytest.fixture(scope='module')
def corpus():
  """(data_dir, tokenizer spec): 400 documents of the embedded corpus as JSONL -> TFDS -> SentencePiece."""
  data = lambda root: ['data.source=tfds', 'data.name=lm_test_corpus', f'data.data_dir={root / "data"}']

  def build(root):
    with open(root / 'docs.jsonl', 'w') as f:
      for name, text in embedded_documents()[::5][:400]:
        f.write(json.dumps({'text': text[:6000], 'name': name}) + '\n')
    assert cli.main(['data', 'build', '--name', 'lm_test_corpus', '--from', str(root / 'docs.jsonl'),
                     '--data-dir', str(root / 'data'), '--val-fraction', '0.1']) == 0
    assert cli.main(['tokenizer', 'train', '--config', 'gpt_tiny', *data(root), '--vocab-size', '1000',
                     '--sentinels', '100', '--out', str(root / 'sp')]) == 0
  root = built_once('tfds_corpus', build)
  return data(root) + [f'data.tokenizer=sentencepiece:{root / "sp.model"}', 'model.vocab_size=1024']


@pytest.mark.long(1)
@pytest.mark.parametrize('preset, extra', [('gpt_tiny', []), ('bert_tiny', ['model.max_len=32']),
                                           ('t5_tiny', ['model.d_ff=128'])])
def test_every_family_trains_from_the_tfds_corpus(corpus, preset, extra, tmp_path):
  config = load_config(preset, SMALL + extra + corpus + ['train.steps=40', 'train.eval_every=40',
                                                         'train.eval_batches=2', f'train.run_dir={tmp_path}'])
  records = Pretraining(config, jax.devices()[:1]).run()
  evals = [r['val_loss'] for r in records if 'val_loss' in r]
  assert evals[-1] < evals[0] - 1.0, evals


def losses_and_params(config, run_dir, *, preempt_at=None, resume=False):
  trainer = Pretraining(config(f'train.run_dir={run_dir}', f'train.resume={str(resume).lower()}'), jax.devices()[:1])
  if preempt_at is not None:
    step_fn, calls = trainer.loop.train_step, []

    def preempt(*args):
      calls.append(1)
      if len(calls) == preempt_at:
        os.kill(os.getpid(), signal.SIGTERM)
      return step_fn(*args)
    trainer.loop.train_step = preempt
  trainer.run()
  return trainer


@pytest.mark.long(0.2)
def test_resume_after_sigterm_is_exact(corpus, tmp_path):
  """Preempted at step 20 and resumed: every step's loss and the final params equal 40 steps straight."""
  config = lambda *o: load_config('gpt_tiny', SMALL + corpus + ['train.steps=40', 'train.eval_batches=0',
                                                                 'train.checkpoint.every=100', 'optim.decay_steps=40',
                                                                 *o])
  straight = losses_and_params(config, tmp_path / 'a')
  first = losses_and_params(config, tmp_path / 'b', preempt_at=20)
  assert int(first.final_state.step) == 20
  resumed = losses_and_params(config, tmp_path / 'b', resume=True)
  loss = lambda run: {r['step']: r['loss'] for r in read_metrics(tmp_path / run) if 'loss' in r}
  assert sorted(loss('a')) == list(range(1, 41)) and loss('a') == loss('b')
  for x, y in zip(jax.tree.leaves(straight.final_state.params), jax.tree.leaves(resumed.final_state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('overrides, message', [
  (['data.name=no_such_corpus'], 'data.name=no_such_corpus in data.data_dir='),
  (['data.val_split=test'], "Unknown split 'test'"),
  (['data.data_dir=/no/such/dir'], 'no such prepared dataset'),
  (['data.text_key=body'], "data.text_key='body' is not a feature of lm_test_corpus; its features: text"),
])
def test_bad_tfds_settings_are_one_line_errors(corpus, overrides, message, capsys):
  assert cli.main(['train', '--config', 'gpt_tiny', *corpus, *overrides]) == 2
  err = capsys.readouterr().err
  assert err.startswith('lm: error: ') and message in err and err.count('\n') == 1, err


def test_building_over_an_existing_dataset_is_refused(corpus, tmp_path, capsys):
  data_dir = corpus[2].split('=', 1)[1]
  (tmp_path / 'x.txt').write_text('some text\n')
  assert cli.main(['data', 'build', '--name', 'lm_test_corpus', '--from', str(tmp_path / 'x.txt'),
                   '--data-dir', data_dir]) == 2
  assert 'already exists; choose another --name or remove it' in capsys.readouterr().err
  from lm.config import ConfigError
  from lm.data.build import build_tfds
  with pytest.raises(ConfigError, match='lower snake_case'):
    build_tfds('Bad-Name', [str(tmp_path / 'x.txt')], data_dir)
