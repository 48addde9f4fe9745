"""`lm finetune --task sft`: a tiny Llama learns a chat task; packed chats never attend across each other."""
import json

import jax

import numpy as np
import pytest
import transformers

from lm import cli
from lm.jobs.chat.sft import ChatOptions
from lm.jobs.chat.sweep import RESULT
from lm.storage.run_dir import CHAT_TEMPLATE
from tests.data.test_chat import MARKED
from tests.jobs.chat.conftest import echo_chats

@pytest.mark.long(1)
def test_sft_learns_to_echo_a_word(echo_sft, tmp_path):
  """Exact-answer accuracy on held-out chats rises from its start (a random model) to nearly all; the run keeps
  the template it rendered with."""
  records = [json.loads(line) for line in (echo_sft / 'run' / 'metrics.jsonl').read_text().splitlines()]
  start, end = (next(r for r in records if r['step'] == s and 'eval/loss' in r) for s in (0, 120))
  assert start['eval/exact_match'] <= 0.1 and end['eval/exact_match'] >= 0.9, (start, end)
  assert end['eval/loss'] < 0.1 * start['eval/loss']
  assert (echo_sft / 'run' / CHAT_TEMPLATE).read_text() == MARKED

  # Exported, the model chats in transformers: its template and tokenizer travel with it.
  assert cli.main(['convert', '--to-hf', str(tmp_path / 'hf'), '--from', str(echo_sft / 'run')]) == 0
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'hf')
  chats = [json.loads(line)['messages'] for line in (echo_sft / 'eval.jsonl').read_text().splitlines()]
  for chat in chats[:4]:
    prompt = tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True, return_tensors='pt',
                                           return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, prompt['input_ids'].shape[1]:], skip_special_tokens=True) == chat[-1]['content']


def test_sft_refuses_bad_input_in_one_line(tiny_llama, tmp_path, capsys):
  (tmp_path / 'bad.jsonl').write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
  argv = ['finetune', '--task', 'sft', '--init', str(tiny_llama)]
  assert cli.main([*argv, '--data', str(tmp_path / 'bad.jsonl')]) == 2
  assert 'bad.jsonl:1: a chat with no assistant turn' in capsys.readouterr().err
  assert cli.main(argv) == 2
  assert '--task sft needs --data GLOB' in capsys.readouterr().err
  assert cli.main(['finetune', '--task', 'mrpc', '--init', str(tiny_llama), '--data', 'x.jsonl']) == 2
  assert '--data go with --task sft or dpo' in capsys.readouterr().err


@pytest.mark.parametrize('model', ['tiny_llama', 'tiny_gpt2'])
@pytest.mark.variants
def test_packed_chats_never_attend_across_each_other(model, request):
  """Three chats packed into one row: each one's per-token log-probabilities equal those of the chat alone in a
  row of its own (1e-5), so no chat sees another (rotary or learned positions restart at each); the weights are
  the assistant masks."""
  hf_dir = request.getfixturevalue(model)
  from lm.assembly import assemble
  from lm.data.chat import encode_chat, load_template, pack_chats
  from lm.data.tokenizers import HFTokenizer
  from lm.jobs.chat.sft import sft_config
  from lm.train.init_from import initial_state
  options = ChatOptions(data='', init=str(hf_dir), overrides=('data.seq_len=96', 'model.execution.dtype=float32',
                                                                  'train.global_batch=8'))
  assembly = assemble(sft_config(options, 1))
  params = initial_state(assembly, str(hf_dir)).state.params
  tokenizer, template = HFTokenizer(hf_dir), load_template(hf_dir)
  chats = [encode_chat(tokenizer, template, [{'role': 'user', 'content': f'echo {w}'},
                                             {'role': 'assistant', 'content': w}]) for w in ('quick', 'fox', 'lazy')]
  packed, cut = pack_chats(chats, 96, tokenizer.pad_id)
  alone = [pack_chats([chat], 96, tokenizer.pad_id)[0] for chat in chats]
  assert cut == 0 and len(packed['inputs']) == 1 and packed['segment_ids'].max() == 3

  def log_probs(rows):
    logits = assembly.family.apply(assembly.model, params, rows, deterministic=True, rngs={})['logits'].logits()
    picked = jax.nn.log_softmax(logits.astype(np.float32))
    return np.take_along_axis(np.asarray(picked), rows['targets'][..., None], -1)[..., 0]
  together = log_probs(packed)[0]
  at = 0
  for chat, row in zip(chats, alone):
    n = len(chat[0]) - 1
    np.testing.assert_allclose(together[at:at + n], log_probs(row)[0, :n], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(packed['weights'][0, at:at + n], chat[1][1:])
    at += n


@pytest.mark.long(0.3)
def test_a_sweep_over_learning_rates_compares_held_out_loss(tiny_llama, tmp_path, capsys):
  """Two learning rates, each a run dir of the sweep; the best point is the lower held-out loss; a rerun skips the
  finished points."""
  echo_chats(tmp_path / 'train.jsonl', 32, 0)
  argv = ['finetune', '--task', 'sft', '--init', str(tiny_llama), '--data', str(tmp_path / 'train.jsonl'),
          '--eval-fraction', '0.25', '--eval-generate', '0', '--sweep', 'optim.learning_rate=1e-5,3e-3',
          'data.seq_len=32', 'train.global_batch=8', 'train.steps=8', f'train.run_dir={tmp_path}/runs']
  assert cli.main(argv) == 0
  report = json.loads((tmp_path / 'runs' / 'sweep' / 'sweep_results.json').read_text())
  losses = {label: point['eval/loss'] for label, point in report['points'].items()}
  assert sorted(losses) == ['learning_rate=1e-5', 'learning_rate=3e-3']
  assert report['best_point'] == min(losses, key=losses.get) == 'learning_rate=3e-3'
  assert all((tmp_path / 'runs' / 'sweep' / label / RESULT).is_file() for label in losses)
  capsys.readouterr()
  assert cli.main(argv) == 0
  assert capsys.readouterr().out.count('done, skipped') == 2


def test_a_sweep_needs_held_out_chats(tiny_llama, tmp_path, capsys):
  echo_chats(tmp_path / 'train.jsonl', 8, 0)
  assert cli.main(['finetune', '--task', 'sft', '--init', str(tiny_llama), '--data', str(tmp_path / 'train.jsonl'),
                   '--sweep', 'optim.learning_rate=1e-5,3e-3']) == 2
  assert '--sweep compares held-out results: pass --eval-data GLOB or --eval-fraction F' in capsys.readouterr().err


@pytest.mark.long(0.3)
def test_sft_distils_the_echo_model_into_a_gpt2_of_the_same_tokenizer_files_elsewhere(echo_sft, tiny_gpt2, tiny_llama,
                                                                                       tmp_path):
  """With the teacher alone (weight 1) a random GPT-2 learns the trained Llama's answers: held-out loss falls by half
  in 30 steps; the two tokenizers are one tokenizer in two directories. A teacher of another tokenizer is one line."""
  import dataclasses
  from lm.config import ConfigError
  from lm.storage.source import ModelSource
  from lm.train.distill import check_teacher
  assert cli.main(['finetune', '--task', 'sft', '--init', str(tiny_gpt2), '--data', str(echo_sft / 'train.jsonl'),
                   '--eval-data', str(echo_sft / 'eval.jsonl'), 'data.seq_len=64', 'optim.learning_rate=3e-3',
                   'train.steps=30', 'train.eval_every=30', f'train.distill.teacher={echo_sft / "run"}',
                   'train.distill.weight=1', f'train.run_dir={tmp_path}/run']) == 0
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  start, end = (next(r for r in records if r['step'] == s and 'eval/loss' in r) for s in (0, 30))
  assert end['eval/loss'] < 0.5 * start['eval/loss'], (start, end)
  distilled = [r['distill_loss'] for r in records if 'distill_loss' in r]
  assert distilled[-1] < 0.5 * distilled[0]

  student = ModelSource(tiny_gpt2).config
  byte = dataclasses.replace(student, data=dataclasses.replace(student.data, tokenizer='byte'))
  with pytest.raises(ConfigError, match=r'reads tokens of the tokenizer byte and the student of hf:.*; distill from'):
    check_teacher(student, byte, 'train.distill.teacher=T')
