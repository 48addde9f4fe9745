"""`lm finetune` end to end: pretrain each family on the embedded corpus, fine-tune on learnable synthetic
tasks in GLUE's files, and check the metrics and every file the run writes."""
import csv
import json
import os
import subprocess
import sys

import zipfile

import numpy as np
import orbax.checkpoint as ocp
import pytest
import sentencepiece as spm
import tokenizers
import torch
import transformers
import yaml
from scipy import stats
from sklearn.metrics import f1_score

from flax import traverse_util

from lm import cli
from lm.assembly import assemble
from lm.config import load_config
from lm.jobs.glue.tasks import TASKS
from lm.models import get_family
from lm.models.lora import ADAPTERS
from lm.storage.checkpoint import Checkpointer
from lm.storage.convert.hf import load_hf
from lm.storage.source import ModelSource
from tests.jobs.glue import synthetic
from tests.jobs.glue.test_data import FILES, write_glue_files

QUIET = ['train.progress=false']


def lm(*argv: str) -> str:
  """Runs `lm` as a user would: one process on the host's one CPU device, XLA fully optimising (the suite's
  8 simulated devices at optimisation level 0 run these few hundred steps ~3x slower)."""
  env = {**os.environ, 'XLA_FLAGS': ''}
  done = subprocess.run([sys.executable, '-m', 'lm.cli', *argv], env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


# (preset, pretraining overrides, fine-tuning overrides): the fewest steps that learn the pair task with margin.
# BERT's pair task needs its masked-LM pretraining (after 5 steps it stays at chance), here on rows as long as the
# fine-tuning's (MRPC dev accuracy 0.995 in 100 steps, then STS-B pearson 0.834; 150 steps gave 0.985 and 0.842).
# The decoders and T5 learn it from a few pretraining steps (GPT: 0.99 dev accuracy at 120 steps, Llama 0.985 at 50,
# T5 0.98 at 30). Pretraining runs no validation: the fine-tuning needs only its checkpoint.
FAMILIES = {
  'bert': ('bert_tiny', ['train.steps=200', 'data.seq_len=32'],
           ['optim.learning_rate=3e-4', 'data.seq_len=32', 'train.steps=100', 'train.eval_every=50']),
  'gpt': ('gpt_tiny', ['train.steps=10', 'data.seq_len=128'],
          ['optim.learning_rate=1e-3', 'data.seq_len=32', 'train.steps=120', 'train.eval_every=40']),
  'llama': ('llama_tiny', ['train.steps=10', 'data.seq_len=128'],
            ['optim.learning_rate=3e-4', 'data.seq_len=32', 'train.steps=100', 'train.eval_every=50']),
  't5': ('t5_tiny', ['train.steps=10', 'data.seq_len=128'],
         ['optim.learning_rate=3e-4', 'data.seq_len=64', 'train.steps=30', 'train.eval_every=15']),
}


@pytest.fixture(scope='module')
def glue_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('glue')
  synthetic.write_rte(root)
  synthetic.write_mrpc(root)
  synthetic.write_stsb(root)
  return root


def pretrain(family: str, run) -> str:
  preset, overrides, _ = FAMILIES[family]
  lm('train', '--config', preset, f'train.run_dir={run}', *QUIET, *overrides, 'train.eval_batches=0')
  return str(run)


def read_tsv(path):
  with open(path, newline='') as f:
    return list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))


def dev_labels(glue_dir, folder):
  return [row[-1] for row in read_tsv(glue_dir / folder / 'dev.tsv')[1:]]


# Pair task per family (BERT in MRPC's layout, the decoders in RTE's), and whether STS-B's regression is checked too.
PAIR_TASK = {'bert': ('mrpc', 'MRPC', {'0', '1'}), 'gpt': ('rte', 'RTE', {'entailment', 'not_entailment'}),
             'llama': ('rte', 'RTE', {'entailment', 'not_entailment'}),
             't5': ('rte', 'RTE', {'entailment', 'not_entailment'})}
# STS-B fine-tuning overrides, starting from the pair task's fine-tuned model (RoBERTa's recipe for STS-B, from
# MNLI): BERT's regression head is new (the pair task's has two outputs), its encoder already compares the pair.
# From the pretrained models alone BERT needs 600 steps at 1e-4, T5 100.
REGRESSION = {'bert': ['optim.learning_rate=3e-4', 'data.seq_len=32', 'train.steps=50', 'train.eval_every=50'],
              't5': ['optim.learning_rate=3e-4', 'data.seq_len=64', 'train.steps=50', 'train.eval_every=50']}


@pytest.mark.long(3)
@pytest.mark.parametrize('family', list(FAMILIES))
def test_each_family_learns_the_pair_task_and_writes_glue_files(family, glue_dir, tmp_path):
  """Pretrained on the embedded corpus, then fine-tuned: BERT's pooled [CLS], GPT's and Llama's last token, T5
  writing the label's name. Neither sentence alone tells the label, so the model must compare the pair."""
  task, folder, labels = PAIR_TASK[family]
  out, init = tmp_path / 'ft', pretrain(family, tmp_path / 'pretrained')
  lm('finetune', '--task', task, '--data-dir', str(glue_dir), '--init', init, f'train.run_dir={out}', *QUIET,
     *FAMILIES[family][2])
  if family in REGRESSION:
    check_regression(family, glue_dir, str(out / task), tmp_path / 'stsb')

  results = json.loads((out / task / 'eval_results.json').read_text())
  assert results['task'] == task and results['split'] == 'dev'
  assert set(results['metrics']) == {'accuracy'} | ({'f1'} if task == 'mrpc' else set())
  rows = read_tsv(out / task / 'dev_predictions.tsv')
  truth = [row[0] for row in read_tsv(glue_dir / 'MRPC' / 'dev.tsv')[1:]] if task == 'mrpc' \
    else dev_labels(glue_dir, folder)
  assert rows[0] == ['index', 'prediction', 'label'] and len(rows) == len(truth) + 1
  assert [r[2] for r in rows[1:]] == truth and [r[0] for r in rows[1:]] == [str(i) for i in range(len(truth))]
  accuracy = np.mean([r[1] == r[2] for r in rows[1:]])
  assert results['metrics']['accuracy'] == pytest.approx(accuracy)  # the reported metric is the written predictions'
  assert accuracy >= 0.9, f'{family}: dev accuracy {accuracy}'
  if task == 'mrpc':
    assert results['metrics']['f1'] == pytest.approx(f1_score([r[2] for r in rows[1:]], [r[1] for r in rows[1:]],
                                                               pos_label='1'))
  # The best step is the one whose dev record is best; its checkpoint is the one kept.
  main = 'f1' if task == 'mrpc' else 'accuracy'
  records = [json.loads(line) for line in (out / task / 'metrics.jsonl').read_text().splitlines()]
  dev = {r['step']: r[f'dev_{main}'] for r in records if f'dev_{main}' in r}
  assert dev[results['step']] == max(dev.values())
  assert [p.name for p in (out / task / 'best').iterdir()] == [str(results['step'])]
  assert [p.name for p in (out / task / 'checkpoints').iterdir()] == [str(records[-1]['step'])]  # the last state

  submission = read_tsv(out / 'submission' / f'{folder}.tsv')
  assert submission[0] == ['index', 'prediction'] and len(submission) == 21
  assert {r[1] for r in submission[1:]} <= labels
  assert (out / task / 'curves.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def check_regression(family, glue_dir, init, out):
  """The family (sharing the pair test's pretraining) learns the overlap score: BERT through the one-output
  regression head (MSE), T5 as text on STS-B's 0.2 grid."""
  log = lm('finetune', '--task', 'stsb', '--data-dir', str(glue_dir), '--init', init, f'train.run_dir={out}', *QUIET,
     *REGRESSION[family])
  if family == 'bert':  # the pair task's 2-way classifier gives way to a 1-output one; the pooler is kept
    assert "stsb: new head classifier/bias, classifier/kernel (the source's has another shape" in log
  results = json.loads((out / 'stsb' / 'eval_results.json').read_text())
  rows = read_tsv(out / 'stsb' / 'dev_predictions.tsv')[1:]
  predicted, truth = np.array([[float(r[1]), float(r[2])] for r in rows]).T
  np.testing.assert_allclose(truth, [float(y) for y in dev_labels(glue_dir, 'STS-B')])
  # BERT's scores are written with 3 decimals (T5's exactly, on the 0.2 grid): the file's correlations match to that.
  tolerance = {'abs': 1e-3} if family == 'bert' else {}
  assert results['metrics']['pearson'] == pytest.approx(stats.pearsonr(predicted, truth)[0], **tolerance)
  assert results['metrics']['spearman'] == pytest.approx(stats.spearmanr(predicted, truth)[0], **tolerance)
  assert results['metrics']['pearson'] >= 0.8
  if family == 't5':  # T5 writes scores on its 0.2 grid, one decimal
    assert all(abs(5 * p - round(5 * p)) < 1e-9 for p in predicted)
  scores = [float(r[1]) for r in read_tsv(out / 'submission' / 'STS-B.tsv')[1:]]
  assert len(scores) == 20 and all(0 <= s <= 5 for s in scores)


def save_hf_bert(directory):
  """A BERT saved by transformers with a WordPiece vocab.txt that the `tokenizers` library trained on the
  GLUE test files: what `--init` gets from the Hub, built offline."""
  directory.mkdir(parents=True, exist_ok=True)
  wordpiece = tokenizers.BertWordPieceTokenizer(lowercase=True)
  texts = [text for lines, examples in FILES.values() for _, row, _ in examples for text in row]
  wordpiece.train_from_iterator(texts * 4, vocab_size=200, min_frequency=1)
  wordpiece.save_model(str(directory))
  vocab = len((directory / 'vocab.txt').read_text().splitlines())
  torch.manual_seed(0)
  config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)
  transformers.BertForMaskedLM(config).save_pretrained(directory, safe_serialization=True)
  (directory / 'tokenizer_config.json').write_text(json.dumps({'do_lower_case': True}))
  return directory


@pytest.fixture(scope='module')
def hf_bert(tmp_path_factory):
  return save_hf_bert(tmp_path_factory.mktemp('hf_bert'))


@pytest.fixture(scope='module')
def glue_files(tmp_path_factory):
  return write_glue_files(tmp_path_factory.mktemp('glue_files'))


SUBMISSION = {  # leaderboard file -> (its test file, the predictions it may hold)
  'CoLA': ('CoLA/test.tsv', {'0', '1'}), 'SST-2': ('SST-2/test.tsv', {'0', '1'}),
  'MRPC': ('MRPC/test.tsv', {'0', '1'}), 'QQP': ('QQP/test.tsv', {'0', '1'}), 'WNLI': ('WNLI/test.tsv', {'0', '1'}),
  'STS-B': ('STS-B/test.tsv', None), 'MNLI-m': ('MNLI/test_matched.tsv', set(TASKS['mnli'].labels)),
  'MNLI-mm': ('MNLI/test_mismatched.tsv', set(TASKS['mnli'].labels)),
  'QNLI': ('QNLI/test.tsv', {'entailment', 'not_entailment'}),
  'RTE': ('RTE/test.tsv', {'entailment', 'not_entailment'}),
  'AX': ('diagnostic/diagnostic.tsv', set(TASKS['mnli'].labels)),
}
METRICS = {'cola': {'matthews_corr'}, 'sst2': {'accuracy'}, 'mrpc': {'f1', 'accuracy'}, 'stsb': {'pearson', 'spearman'},
           'qqp': {'f1', 'accuracy'}, 'mnli': {'accuracy_matched', 'accuracy_mismatched'}, 'qnli': {'accuracy'},
           'rte': {'accuracy'}, 'wnli': {'accuracy'}}


@pytest.mark.long(1)
def test_glue_from_an_hf_bert_writes_every_leaderboard_file(hf_bert, glue_files, tmp_path, capsys):
  """`--task glue` from an HF directory: nine tasks (STS-B through the regression head), AX with MNLI's model,
  the leaderboard's file names and formats, the zip and the summary. Each training set is smaller than the
  batch: it cycles. The run then teaches a fine-tune (train.distill)."""
  out = tmp_path / 'glue'
  assert cli.main(['finetune', '--task', 'glue', '--data-dir', str(glue_files), '--init', str(hf_bert),
                   f'train.run_dir={out}', 'train.steps=2', 'train.global_batch=8', 'data.seq_len=32',
                   'train.log_every=1', *QUIET]) == 0
  for task, keys in METRICS.items():
    results = json.loads((out / task / 'eval_results.json').read_text())
    assert results['task'] == task and results['split'] == 'dev' and set(results['metrics']) == keys
    records = [json.loads(line) for line in (out / task / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in records if 'loss' in r] == [1, 2]
  for split in ('matched', 'mismatched'):
    rows = read_tsv(out / 'mnli' / f'dev_{split}_predictions.tsv')
    assert rows[0] == ['index', 'prediction', 'label'] and len(rows) == 2
  assert read_tsv(out / 'stsb' / 'dev_predictions.tsv')[1][2] == '3.800'  # as the dev file writes it
  assert read_tsv(out / 'cola' / 'dev_predictions.tsv')[1][2] == '0'
  for name, (test_file, allowed) in SUBMISSION.items():
    rows = read_tsv(out / 'submission' / f'{name}.tsv')
    expected = read_tsv(glue_files / test_file)[1:]
    assert rows[0] == ['index', 'prediction'] and [r[0] for r in rows[1:]] == [r[0] for r in expected], name
    if allowed is None:
      assert all(0 <= float(r[1]) <= 5 for r in rows[1:])
    else:
      assert {r[1] for r in rows[1:]} <= allowed, name
  with zipfile.ZipFile(out / 'submission.zip') as z:
    assert sorted(z.namelist()) == sorted(f'{name}.tsv' for name in SUBMISSION)
  summary = json.loads((out / 'glue_summary.json').read_text())
  assert set(summary['tasks']) == set(METRICS) and 0 <= summary['score'] <= 1

  # The GLUE run teaches a new RTE fine-tune (its rte folder found by task); the HF BERT, with no task head, cannot.
  distil = ['finetune', '--task', 'rte', '--data-dir', str(glue_files), '--init', str(hf_bert), 'train.steps=2',
            'train.global_batch=8', 'data.seq_len=32', 'train.log_every=1', *QUIET]
  assert cli.main([*distil, f'train.run_dir={tmp_path}/distilled', f'train.distill.teacher={out}']) == 0
  records = [json.loads(line) for line in (tmp_path / 'distilled' / 'rte' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if r.get('distill_loss', 0) > 0] == [1, 2]
  capsys.readouterr()
  assert cli.main([*distil, f'train.run_dir={tmp_path}/refused', f'train.distill.teacher={hf_bert}']) == 2
  assert 'has no task outputs (model.num_labels) and the student 2; distill from a model fine-tuned' in \
    capsys.readouterr().err
  mrpc = [a if a != 'rte' else 'mrpc' for a in distil]
  assert cli.main([*mrpc, f'train.run_dir={tmp_path}/refused', f'train.distill.teacher={tmp_path}/distilled']) == 2
  assert 'is a GLUE run without mrpc' in capsys.readouterr().err


@pytest.mark.long(1)
def test_a_sweep_of_lora_fine_tunes_reports_mean_std_and_best(hf_bert, glue_files, tmp_path, capsys):
  """A sweep (with adapters: model.lora) reports its points' mean, std and best; each point's best params store the
  adapters and the task head alone, and open with the HF base's weights as they were."""
  out = tmp_path / 'runs'
  argv = ['finetune', '--task', 'rte', '--data-dir', str(glue_files), '--init', str(hf_bert),
          '--sweep', 'optim.learning_rate=1e-4,1e-3', 'train.seed=0,1', f'train.run_dir={out}',
          'train.steps=1', 'train.global_batch=8', 'data.seq_len=32', 'model.lora.rank=4', *QUIET]
  assert cli.main(argv) == 0
  report = json.loads((out / 'sweep' / 'sweep_results.json').read_text())['rte']
  points = {label: m['accuracy'] for label, m in report['points'].items()}
  assert sorted(points) == ['learning_rate=1e-3,seed=0', 'learning_rate=1e-3,seed=1', 'learning_rate=1e-4,seed=0',
                            'learning_rate=1e-4,seed=1']
  for label, accuracy in points.items():
    config = load_config(str(out / 'sweep' / label / 'rte' / 'config.yaml'))
    assert f'learning_rate={config.optim.learning_rate:.0e}'.replace('e-0', 'e-') in label
    assert f'seed={config.train.seed}' in label and config.train.steps == 1
    assert json.loads((out / 'sweep' / label / 'rte' / 'eval_results.json').read_text())['metrics'] == \
      {'accuracy': accuracy}
  assert report['mean'] == pytest.approx(np.mean(list(points.values())))
  assert report['std'] == pytest.approx(np.std(list(points.values()), ddof=1))
  assert report['best'] == max(points.values()) and points[report['best_point']] == report['best']
  capsys.readouterr()
  assert cli.main(argv) == 0  # a rerun skips the finished points and reports the same
  assert capsys.readouterr().out.count('done, skipped') == 4
  assert json.loads((out / 'sweep' / 'sweep_results.json').read_text())['rte'] == report

  point = out / 'sweep' / report['best_point'] / 'rte'
  best = point / 'best' / str(Checkpointer(point / 'best', create=False).latest_step()) / 'params'
  stored = traverse_util.flatten_dict(dict(ocp.PyTreeCheckpointer().metadata(best).item_metadata))
  held = {path for path, leaf in stored.items() if leaf is not None}
  head = get_family('bert').per_sequence_params()
  assert held and all(path[-1] in ADAPTERS or path[0] in head for path in held)
  opened = traverse_util.flatten_dict(ModelSource(point).params(assemble(load_config(str(point / 'config.yaml'))).mesh))
  base = traverse_util.flatten_dict(load_hf(hf_bert)[1])
  assert set(opened) - set(base) == held
  for path, value in base.items():
    np.testing.assert_array_equal(opened[path], value, err_msg=str(path))


@pytest.mark.parametrize('problem, argv, message', [
  ('no task folder', ['--task', 'cola'], 'CoLA'),
  ('no split file', ['--task', 'rte', 'remove:RTE/dev.tsv'], 'dev.tsv'),
  ('unknown task', ['--task', 'mnli2'], 'mnli2'),
  ('wrong columns', ['--task', 'stsb', 'rte-as:STS-B/train.tsv'], 'columns'),
  ('init is no model', ['--task', 'rte', 'init:empty'], 'neither a run directory'),
  ('init holds no params', ['--task', 'rte', 'init:untrained'], 'holds no checkpoint yet'),
])
def test_bad_input_is_one_line_naming_the_fix(problem, argv, message, glue_dir, tmp_path, capsys):
  import shutil
  data, init, out = tmp_path / 'data', tmp_path / 'init', tmp_path / 'out'
  shutil.copytree(glue_dir, data)
  init.mkdir()
  edits = [a for a in argv if ':' in a]
  for edit in edits:
    action, path = edit.split(':')
    if action == 'remove':
      (data / path).unlink()
    elif action == 'init' and path == 'untrained':  # a run dir with its config but no checkpoint
      (init / 'config.yaml').write_text(load_config('bert_tiny').to_yaml())
    elif action == 'rte-as':
      (data / path).write_text((data / 'RTE' / 'train.tsv').read_text())
  args = [a for a in argv if a not in edits]
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*'))
  code = cli.main(['finetune', *args, '--data-dir', str(data), '--init', str(init), f'train.run_dir={out}', *QUIET])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and message in err, (problem, err)
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*')) == before  # nothing written anywhere


def save_hf_t5(directory, version):
  """A T5 as transformers saves it, with a SentencePiece spiece.model (T5's ids: pad 0, eos 1, unk 2) trained
  on the synthetic tasks' words and T5's GLUE prefixes: v1.0 (ReLU, tied embeddings) or v1.1 (gated GELU,
  untied head), as `google/t5-v1_1-*` on the Hub."""
  directory.mkdir(parents=True)
  words = [*synthetic.WORDS, 'rte', 'sentence1:', 'sentence2:', 'entailment', 'not_entailment', 'stsb']
  texts = [' '.join(np.random.default_rng(i).permutation(words)) for i in range(500)]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(directory / 'spiece'),
                                 vocab_size=40, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, model_type='unigram')
  (directory / 'spiece.vocab').unlink()
  (directory / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'T5Tokenizer'}))
  torch.manual_seed(0)
  config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj='relu' if version == 'v1_0' else 'gated-gelu',
                                 tie_word_embeddings=version == 'v1_0', decoder_start_token_id=0)
  transformers.T5ForConditionalGeneration(config).save_pretrained(directory, safe_serialization=True)
  return directory


@pytest.mark.long(1)
@pytest.mark.parametrize('version', ['v1_0', 'v1_1'])
def test_an_hf_t5_directory_fine_tunes_text_to_text(version, glue_dir, tmp_path):
  """`--init` an HF T5 directory: the run takes its architecture (v1.0 or v1.1) and its spiece.model, fine-tunes
  text to text, and writes a label for every dev example."""
  hf, out = save_hf_t5(tmp_path / 'hf', version), tmp_path / 'ft'
  assert cli.main(['finetune', '--task', 'rte', '--data-dir', str(glue_dir), '--init', str(hf), f'train.run_dir={out}',
                   *QUIET, 'train.steps=4', 'train.eval_every=4', 'data.seq_len=64']) == 0
  config = yaml.safe_load((out / 'rte' / 'config.yaml').read_text())
  assert config['model']['family'] == 't5' and config['model']['vocab_size'] >= 64
  assert config['model']['tie_embeddings'] == (version == 'v1_0')
  assert config['model']['activation'] == ('relu' if version == 'v1_0' else 'geglu_tanh')
  assert config['data']['tokenizer'].endswith('spiece.model') or 'hf:' in config['data']['tokenizer']
  rows = read_tsv(out / 'rte' / 'dev_predictions.tsv')[1:]
  assert len(rows) == 200 and {r[1] for r in rows} <= {'entailment', 'not_entailment'}  # no label: the first
