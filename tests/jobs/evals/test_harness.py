"""`lm eval` against lm-eval-harness's own Hugging Face backend (torch) on the same GPT-2 weights, tokenizer, task
files and settings: the same requests, log-likelihoods within 1e-4 relative, every metric equal."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import transformers

from lm import cli
from lm.data.sources import embedded_documents
from lm.jobs.evals.run import Request, run
from lm.jobs.evals.tasks import local_tasks, task_manager
from tests.conftest import built_once
from tests.jobs.evals import releases

MAX_LENGTH = 64
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope='module')
def setup():
  """(HF GPT-2 dir, our run dir converted from it, the seven tasks' files in their release layouts; the same rows
  in the HF layouts beside it, in hf_layout/)."""
  def build(root):
    hf, run, data = root / 'hf', root / 'run', root / 'data'
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([text for _, text in embedded_documents()[::60]], vocab_size=300,
                            special_tokens=['<|endoftext|>'])
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=MAX_LENGTH, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(hf, safe_serialization=True)
    bpe.save_model(str(hf))
    (hf / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'GPT2Tokenizer', 'bos_token': '<|endoftext|>',
                                                          'eos_token': '<|endoftext|>', 'unk_token': '<|endoftext|>'}))
    assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 0
    releases.write_both(data, root / 'hf_layout')
  root = built_once('harness', build)
  return root / 'hf', root / 'run', root / 'data'


def harness_reference(hf, data, tasks, num_fewshot, configs, **model_kwargs):
  """The harness's HF backend on the same files (configs written by lm's own task mapping)."""
  import lm_eval
  from lm_eval.models.huggingface import HFLM
  local_tasks(task_manager(), tasks, data, configs)
  model = HFLM(pretrained=str(hf), batch_size=4, device='cpu', max_length=MAX_LENGTH, dtype='float32',
               **model_kwargs)
  return lm_eval.simple_evaluate(model=model, tasks=[str(configs / f'{t}.yaml') for t in tasks],
                                 num_fewshot=num_fewshot, task_manager=task_manager(), log_samples=True)


@pytest.mark.long(1)
@pytest.mark.parametrize('num_fewshot', [0, 3])
def test_lm_eval_equals_the_harness_hf_backend(setup, num_fewshot, tmp_path):
  hf, run_dir, data = setup
  tasks = list(releases.TASKS)
  out = tmp_path / 'out'
  results, _ = run(run_dir, Request(tasks=tuple(tasks), data_dir=data, num_fewshot=num_fewshot, batch_size=4),
                   out=out)
  reference = harness_reference(hf, data, tasks, num_fewshot, tmp_path / 'configs')
  ours = json.loads((out / 'results.json').read_text())
  for task in tasks:
    expected = reference['results'][task]
    got = ours['tasks'][task]
    assert got['shots'] == num_fewshot and got['n'] == len(reference['samples'][task])
    metrics = [k.split(',')[0] for k in expected if k.endswith(',none') and '_stderr' not in k]
    assert sorted(got['metrics']) == sorted(metrics)
    for metric in metrics:
      if metric == 'perplexity':  # exp of a mean log-likelihood: as close as the log-likelihoods
        assert got['metrics'][metric] == pytest.approx(expected[f'{metric},none'], rel=1e-3)
      else:
        assert got['metrics'][metric] == expected[f'{metric},none'], metric
    records = [json.loads(line) for line in (out / f'{task}.jsonl').read_text().splitlines()]
    samples = sorted(reference['samples'][task], key=lambda s: s['doc_id'])
    assert [r['doc_id'] for r in records] == [s['doc_id'] for s in samples]
    ours_samples = sorted(results['samples'][task], key=lambda s: s['doc_id'])
    assert [s['arguments'] for s in ours_samples] == [s['arguments'] for s in samples]  # the same prompts
    for record, sample in zip(records, samples):
      want = [float(r[0][0]) for r in sample['resps']]
      np.testing.assert_allclose(record['loglikelihood'], want, rtol=1e-4)
      assert record['greedy'] == [bool(r[0][1]) for r in sample['resps']]
      assert record['gold'] == sample['target']
    # Bhagia et al.'s task loss, from the backend's log-likelihoods: the gold continuation's nats per byte
    gold = [s['target'] if len(s['arguments']) > 1 else 0 for s in samples]
    if all(isinstance(g, int) for g in gold):
      want = np.mean([-float(s['resps'][g][0][0]) / len(s['arguments'][g][1].encode())
                      for s, g in zip(samples, gold)])
      assert got['task_loss'] == pytest.approx(want, rel=1e-4)
    else:  # a gold answer that is no choice index (winogrande's is the continuation)
      assert 'task_loss' not in got
  assert sorted(ours['data_files']) == sorted(str(p) for p in data.rglob('*') if p.is_file())  # each file read
  assert sorted(t for t in tasks if 'task_loss' not in ours['tasks'][t]) == ['winogrande']


# Open models through `lm convert --from-hf`: Gemma 2 (both soft-caps; an 8-token window, shorter than the
# requests, in layer 0, so its shared contexts are scored from a ring cache) on the devices' data axis; GPT-NeoX
# (Pythia: parallel residual, a quarter of each head rotating) laid over a data x fsdp x tensor mesh.
OPEN_MODELS = {
  'gemma2': (lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0, max_position_embeddings=MAX_LENGTH, bos_token_id=0, eos_token_id=0,
    pad_token_id=0)), {'attn_implementation': 'eager'}, ()),
  'gpt_neox': (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    rotary_pct=0.25, max_position_embeddings=MAX_LENGTH, bos_token_id=0, eos_token_id=0, pad_token_id=0)), {},
    ('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')),
}


@pytest.mark.long(0.5)
@pytest.mark.parametrize('family', list(OPEN_MODELS))
@pytest.mark.variants
def test_an_imported_open_model_equals_the_harness_hf_backend(setup, family, tmp_path):
  """`lm convert --from-hf`, then `lm eval`, against the harness's HF backend on the same weights and tokenizer."""
  gpt2, _, data = setup
  hf, run_dir, out = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'out'
  build, backend, mesh = OPEN_MODELS[family]
  transformers.set_seed(0)
  build().save_pretrained(hf)
  for name in ('vocab.json', 'merges.txt', 'tokenizer_config.json'):
    shutil.copy(gpt2 / name, hf / name)
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run_dir)]) == 0
  tasks = ('piqa', 'hellaswag', 'arc_easy')
  results, _ = run(run_dir, Request(tasks=tasks, data_dir=data, num_fewshot=0, batch_size=4), out=out,
                   overrides=mesh)
  reference = harness_reference(hf, data, tasks, 0, tmp_path / 'configs', **backend)
  for task in tasks:
    got = json.loads((out / 'results.json').read_text())['tasks'][task]['metrics']
    assert got == {k.split(',')[0]: v for k, v in reference['results'][task].items()
                   if k.endswith(',none') and '_stderr' not in k}, task
    samples = sorted(reference['samples'][task], key=lambda s: s['doc_id'])
    assert max(len(s['arguments'][0][0]) for s in samples) > 8  # contexts longer than Gemma 2's window
    records = [json.loads(line) for line in (out / f'{task}.jsonl').read_text().splitlines()]
    for record, sample in zip(records, samples):
      np.testing.assert_allclose(record['loglikelihood'], [float(r[0][0]) for r in sample['resps']], rtol=1e-4)


@pytest.mark.long(1)
def test_release_and_dataset_layouts_give_identical_results(setup, tmp_path):
  """Each task's original release files, converted by lm, score exactly as the same rows in the HF layout."""
  _, run_dir, data = setup
  tasks = tuple(releases.TASKS)
  results = [run(run_dir, Request(tasks=tasks, data_dir=d, num_fewshot=2, batch_size=4), out=tmp_path / d.name)[0]
             for d in (data, data.parent / 'hf_layout')]
  for task in tasks:
    a, b = (json.loads((tmp_path / d / 'results.json').read_text())['tasks'][task] for d in ('data', 'hf_layout'))
    assert a == b
    samples = [sorted(r['samples'][task], key=lambda s: s['doc_id']) for r in results]
    assert [s['arguments'] for s in samples[0]] == [s['arguments'] for s in samples[1]]
    assert [s['resps'] for s in samples[0]] == [s['resps'] for s in samples[1]]


@pytest.mark.parametrize('argv, message', [
  (['--tasks', 'hellaswagg'], "lm-eval-harness has no task 'hellaswagg'"),
  (['--tasks', 'piqa', '--data-dir', 'EMPTY'], 'has no folder piqa/'),
  (['--tasks', 'piqa', '--data-dir', 'BROKEN'], "valid.jsonl:2: no field 'sol2'"),
  (['--tasks', 'arc_easy', '--data-dir', 'NOTEST'], 'ARC-Easy-Test.jsonl not found'),
  (['--tasks', 'piqa', '--step', '7'], '--step 7: '),
  (['--tasks', 'piqa', '--max-length', '1000'], '--max-length 1000 must lie in'),
  (['--tasks', 'piqa', '--limit', '2', '--subset', '2'], '--limit and --subset both choose'),
  (['--tasks', 'piqa', '--data-dir', 'DATA', '--num-fewshot', '9'],
   '--num-fewshot 9: piqa draws its few-shot examples from 8 documents'),
])
def test_bad_input_is_one_line_and_writes_nothing(setup, argv, message, tmp_path, capsys):
  _, run_dir, data = setup
  (tmp_path / 'EMPTY').mkdir()
  broken = tmp_path / 'BROKEN' / 'piqa'
  broken.mkdir(parents=True)
  (broken / 'valid.jsonl').write_text('{"goal": "a", "sol1": "b", "sol2": "c"}\n{"goal": "a", "sol1": "b"}\n')
  (broken / 'valid-labels.lst').write_text('0\n1\n')
  notest = tmp_path / 'NOTEST' / 'arc' / 'ARC-V1-Feb2018-2' / 'ARC-Easy'
  notest.mkdir(parents=True)
  (notest / 'ARC-Easy-Train.jsonl').write_text('')
  argv = [str(tmp_path / a) if a in ('EMPTY', 'BROKEN', 'NOTEST') else str(data) if a == 'DATA' else a for a in argv]
  before = sorted(p.relative_to(run_dir) for p in run_dir.rglob('*'))
  assert cli.main(['eval', '--model', str(run_dir), *argv, '--out', str(tmp_path / 'out')]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / 'out').exists() and sorted(p.relative_to(run_dir) for p in run_dir.rglob('*')) == before


def test_a_run_without_a_checkpoint_or_without_the_extra_is_one_line(setup, tmp_path, capsys, monkeypatch):
  _, run_dir, _ = setup
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'config.yaml').write_text((run_dir / 'config.yaml').read_text())
  assert cli.main(['eval', '--model', str(empty), '--tasks', 'piqa']) == 2
  err = capsys.readouterr().err.strip()
  assert 'holds no checkpoint yet' in err and len(err.splitlines()) == 1, err
  assert sorted(p.name for p in empty.iterdir()) == ['config.yaml']
  import importlib.util
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'lm_eval' else find_spec(name, *a))
  assert cli.main(['eval', '--model', str(run_dir), '--tasks', 'piqa']) == 2
  err = capsys.readouterr().err.strip()
  assert "pip install -e '.[eval]'" in err and len(err.splitlines()) == 1, err


def test_bert_is_not_a_generative_model(tmp_path, capsys):
  run_dir = tmp_path / 'bert'
  assert cli.main(['train', '--config', 'bert_tiny', f'train.run_dir={run_dir}', 'train.steps=1',
                   'model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=16',
                   'train.global_batch=8', 'train.eval_batches=1']) == 0
  capsys.readouterr()
  assert cli.main(['eval', '--model', str(run_dir), '--tasks', 'piqa']) == 2
  assert 'not a generative model' in capsys.readouterr().err


@pytest.mark.long(1.5)
def test_one_device_equals_eight_devices_and_two_processes(setup, tmp_path):
  """The same scores on 1 device, on 8 simulated devices (data x fsdp) and on 2 processes of 4 devices each."""
  _, run_dir, data = setup
  args = ['eval', '--model', str(run_dir), '--tasks', 'piqa,lambada_openai,winogrande', '--data-dir', str(data),
          '--batch-size', '4', '--num-fewshot', '1']
  lm = [sys.executable, '-m', 'lm.cli']
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  one = subprocess.run([*lm, *args, '--out', str(tmp_path / 'one')], env=env, capture_output=True, text=True,
                       timeout=900, check=False)
  assert one.returncode == 0, one.stderr[-2000:]
  assert cli.main([*args, '--out', str(tmp_path / 'eight'), 'mesh.data=2', 'mesh.fsdp=4']) == 0
  two = subprocess.run([sys.executable, str(ROOT / 'launch' / 'local.py'), '--processes', '2',
                        '--devices-per-process', '4', '--', *lm, *args, '--out', str(tmp_path / 'two'),
                        'mesh.data=2', 'mesh.fsdp=4'], env=env, capture_output=True, text=True, timeout=900,
                       check=False)
  assert two.returncode == 0, two.stderr[-2000:]
  reference = json.loads((tmp_path / 'one' / 'results.json').read_text())
  for name in ('eight', 'two'):
    got = json.loads((tmp_path / name / 'results.json').read_text())
    for task in ('piqa', 'lambada_openai', 'winogrande'):
      for metric, value in reference['tasks'][task]['metrics'].items():
        assert got['tasks'][task]['metrics'][metric] == pytest.approx(value, rel=1e-5), (name, task, metric)
      lines = [[json.loads(line) for line in (tmp_path / d / f'{task}.jsonl').read_text().splitlines()]
               for d in ('one', name)]
      for a, b in zip(*lines):
        np.testing.assert_allclose(b['loglikelihood'], a['loglikelihood'], rtol=1e-5)


@pytest.mark.long(1)
def test_t5_equals_the_harness_seq2seq_backend(tmp_path):
  """T5 through the harness's seq2seq path: the context alone into the encoder (ending in EOS, as the HF tokenizer's
  special tokens add), the continuation as decoder targets; on piqa and boolq, 0- and 2-shot."""
  from tokenizers.processors import TemplateProcessing
  hf, run_dir, data = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'data'
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator([text for _, text in embedded_documents()[::60]], vocab_size=300,
                          special_tokens=['<pad>', '</s>', '<unk>'])
  bpe.post_processor = TemplateProcessing(single='$A </s>', special_tokens=[('</s>', bpe.token_to_id('</s>'))])
  transformers.set_seed(0)
  config = transformers.T5Config(vocab_size=320, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj='gated-gelu', tie_word_embeddings=False, decoder_start_token_id=0,
                                 pad_token_id=0, eos_token_id=1)
  transformers.T5ForConditionalGeneration(config).save_pretrained(hf, safe_serialization=True)
  bpe.save(str(hf / 'tokenizer.json'))
  (hf / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'PreTrainedTokenizerFast',
                                                        'eos_token': '</s>', 'pad_token': '<pad>',
                                                        'unk_token': '<unk>'}))
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run_dir)]) == 0
  releases.write_both(data, tmp_path / 'hf_layout')
  tasks = ['piqa', 'boolq']
  for shots in (0, 2):
    results, _ = run(run_dir, Request(tasks=tuple(tasks), data_dir=data, num_fewshot=shots, batch_size=4,
                                      max_length=MAX_LENGTH), out=tmp_path / f'out{shots}')
    reference = harness_reference(hf, data, tasks, shots, tmp_path / f'configs{shots}')
    for task in tasks:
      ours = sorted(results['samples'][task], key=lambda s: s['doc_id'])
      theirs = sorted(reference['samples'][task], key=lambda s: s['doc_id'])
      assert [s['arguments'] for s in ours] == [s['arguments'] for s in theirs]
      for a, b in zip(ours, theirs):
        np.testing.assert_allclose([r[0][0] for r in a['resps']], [r[0][0] for r in b['resps']], rtol=1e-4)
      assert results['results'][task]['acc,none'] == reference['results'][task]['acc,none']


GENERATIVE = """task: continue_text
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n", "."], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]
"""


@pytest.mark.long(1)
def test_generate_until_gives_the_hf_backends_strings(setup, tmp_path):
  """A generative task of the researcher's own (a task YAML): greedy continuations, cut at the stop strings and at
  max_gen_toks, equal the harness's HF backend's, for prompts short, unicode and longer than the model."""
  import lm_eval
  from lm_eval.models.huggingface import HFLM
  hf, run_dir, _ = setup
  texts = [text for _, text in embedded_documents()[:40:4]]
  rows = [{'prompt': text[:n], 'answer': text[n:n + 8]} for text, n in zip(texts, (3, 17, 40, 90, 400, 1000, 25,
                                                                                     60, 8, 200))]
  rows[1]['prompt'] = 'naïve café — ünïcödé ' + rows[1]['prompt']
  (tmp_path / 'test.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  task = tmp_path / 'continue_text.yaml'
  task.write_text(GENERATIVE.replace('DATA', str(tmp_path / 'test.jsonl')))
  ours, _ = run(run_dir, Request(tasks=(str(task),), batch_size=4), out=tmp_path / 'out')
  model = HFLM(pretrained=str(hf), batch_size=4, device='cpu', max_length=MAX_LENGTH, dtype='float32')
  reference = lm_eval.simple_evaluate(model=model, tasks=[str(task)], log_samples=True)
  by_doc = lambda results: [s['filtered_resps'] for s in sorted(results['samples']['continue_text'],
                                                               key=lambda s: s['doc_id'])]
  assert by_doc(ours) == by_doc(reference)
  assert sum(len(r[0]) for r in by_doc(ours)) > 20  # text was generated, not only stop strings
  assert ours['results']['continue_text'] == reference['results']['continue_text']
