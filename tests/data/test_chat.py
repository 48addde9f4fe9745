"""Chat data (lm/data/chat.py): rendered and masked as transformers' apply_chat_template does, bad records one
line each."""
import json

import numpy as np
import pytest
import tokenizers
import transformers

from lm.config import ConfigError
from lm.data.chat import encode_chat, load_template, read_chats
from lm.data.sources import embedded_documents
from lm.data.tokenizers import HFTokenizer
from tests.conftest import built_once


# ChatML with its assistant turns marked for transformers' return_assistant_tokens_mask, and the same unmarked.
MARKED = (
  "{% for message in messages %}"
  "{% if message['role'] == 'assistant' %}"
  "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
  "{{ '\n' }}"
  "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
UNMARKED = MARKED.replace('{% generation %}', '').replace('{% endgeneration %}', '')
CHATS = [
  [{'role': 'system', 'content': 'You reverse words.'}, {'role': 'user', 'content': 'reverse: quick'},
   {'role': 'assistant', 'content': 'kciuq'}],
  [{'role': 'user', 'content': 'Say the brown fox, twice.'}, {'role': 'assistant', 'content': 'the brown fox'},
   {'role': 'user', 'content': 'Twice, I said.'}, {'role': 'assistant', 'content': 'the brown fox the brown fox'}],
]


def save_chat_tokenizer(directory):
  """An HF byte-level BPE with ChatML's tokens, saved by transformers with the marked template."""
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator([text for _, text in embedded_documents()[::80]], vocab_size=400,
                          special_tokens=['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token='<|im_end|>',
                                              bos_token='<|endoftext|>', pad_token='<|endoftext|>')
  fast.chat_template = MARKED
  fast.save_pretrained(directory)


@pytest.fixture(scope='session')
def chat_tokenizer():
  return built_once('chat_tokenizer', save_chat_tokenizer)


def test_weighted_tokens_equal_transformers_assistant_mask(chat_tokenizer, tmp_path):
  """The ids and weights equal apply_chat_template(..., return_assistant_tokens_mask=True) token for token; a
  template without the markers finds the same assistant tokens from its turns' prefixes."""
  reference = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
  ours = HFTokenizer(chat_tokenizer)
  marked = load_template(chat_tokenizer)
  assert marked.marked and marked.source == MARKED
  (tmp_path / 'plain.jinja').write_text(UNMARKED)
  unmarked = load_template(chat_tokenizer, tmp_path / 'plain.jinja')
  assert not unmarked.marked
  for chat in CHATS:
    expected = reference.apply_chat_template(chat, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    for template in (marked, unmarked):
      ids, weights = encode_chat(ours, template, chat)
      assert ids.tolist() == expected['input_ids']
      assert weights.tolist() == expected['assistant_masks']
    ids, weights = encode_chat(ours, marked, chat, train_on='all')
    assert ids.tolist() == expected['input_ids'] and weights.tolist() == [1.0] * len(ids)
    # the weighted tokens decode to the assistant turns and their end markers
    text = reference.decode(np.asarray(expected['input_ids'])[np.asarray(expected['assistant_masks'], bool)])
    assert text == ''.join(m['content'] + '<|im_end|>' for m in chat if m['role'] == 'assistant')


@pytest.mark.parametrize('lines, needle', [
  (['{"messages": [{"role": "user", "content": "hi"}]}'], 'f.jsonl:1: a chat with no assistant turn'),
  (['{"prompt": "a", "completion": "b"}', '{"messages": [{"role": "robot", "content": "x"}]}'],
   "f.jsonl:2: unknown role 'robot'; choose one of: system, user, assistant, tool"),
  (['{"text": "plain"}'], 'f.jsonl:1: a record needs messages, or prompt and completion (it has text)'),
  (['not json'], 'f.jsonl:1: not JSON'),
  (['{"messages": [{"role": "user", "content": 3}]}'], 'f.jsonl:1: each message needs a role and a string content'),
  ([''], 'holds no records; write one JSON chat per line'),
])
def test_bad_chat_records_are_one_line(tmp_path, lines, needle):
  (tmp_path / 'f.jsonl').write_text('\n'.join(lines) + '\n')
  with pytest.raises(ConfigError) as info:
    read_chats(str(tmp_path / '*.jsonl'))
  assert needle in str(info.value) and '\n' not in str(info.value)


def test_records_of_both_shapes_read_in_order(tmp_path):
  (tmp_path / 'a.jsonl').write_text(json.dumps({'messages': CHATS[1]}) + '\n')
  (tmp_path / 'b.jsonl').write_text(json.dumps({'system': 's', 'prompt': 'p', 'completion': 'c'}) + '\n')
  assert read_chats(str(tmp_path / '*.jsonl')) == [
    CHATS[1], [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'p'},
               {'role': 'assistant', 'content': 'c'}]]
  with pytest.raises(ConfigError, match='matches no file'):
    read_chats(str(tmp_path / 'none*.jsonl'))


def test_a_template_that_cannot_be_split_into_turns_is_one_line(chat_tokenizer, tmp_path):
  """A template that renders a chat's last turn unlike its others (so a prefix is not the whole's start)."""
  (tmp_path / 't.jinja').write_text("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}"
                                    "{% endfor %}")
  template = load_template(chat_tokenizer, tmp_path / 't.jinja')
  with pytest.raises(ConfigError, match='mark them with {% generation %}'):
    encode_chat(HFTokenizer(chat_tokenizer), template, CHATS[1])
  with pytest.raises(ConfigError, match='has no chat template'):
    load_template(tmp_path)
