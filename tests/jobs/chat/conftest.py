"""The chat jobs' shared models, built once per run: a tiny random Llama beside a ChatML tokenizer
(tests/data/test_chat.py), and that Llama fine-tuned to echo a word (the SFT run the DPO test starts from)."""
import json

import numpy as np
import pytest
import transformers

from lm import cli
from tests.conftest import built_once
from tests.data.test_chat import chat_tokenizer  # noqa: F401  (a fixture these use)

WORDS = ['quick', 'brown', 'fox', 'jumps', 'over', 'lazy', 'dog', 'river', 'stone', 'cloud', 'green', 'table',
         'light', 'paper', 'music', 'water', 'house', 'night', 'bread', 'plant']


def echo_chats(path, count, seed):
  """'echo W' answered W, for words of WORDS."""
  rng = np.random.default_rng(seed)
  with open(path, 'w') as f:
    for word in rng.choice(WORDS, count):
      f.write(json.dumps({'messages': [{'role': 'user', 'content': f'echo {word}'},
                                       {'role': 'assistant', 'content': str(word)}]}) + '\n')


@pytest.fixture(scope='session')
def tiny_llama(chat_tokenizer):  # noqa: F811
  """A random 2-layer Llama saved by transformers beside the chat tokenizer (its template included)."""
  def build(directory):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    transformers.set_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
  return built_once('chat_tiny_llama', build)


@pytest.fixture(scope='session')
def tiny_gpt2(chat_tokenizer):  # noqa: F811
  """A random 2-layer GPT-2 beside the chat tokenizer."""
  def build(directory):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
  return built_once('chat_tiny_gpt2', build)


@pytest.fixture(scope='session')
def echo_sft(tiny_llama):
  """`lm finetune --task sft` of the tiny Llama on 320 echo chats (120 steps), 16 held out: DIR/run."""
  def build(directory):
    echo_chats(directory / 'train.jsonl', 320, 0)
    echo_chats(directory / 'eval.jsonl', 16, 1)
    assert cli.main(['finetune', '--task', 'sft', '--init', str(tiny_llama), '--data', str(directory / 'train.jsonl'),
                     '--eval-data', str(directory / 'eval.jsonl'), 'data.seq_len=64', 'optim.learning_rate=3e-3',
                     'train.steps=120', 'train.eval_every=120', f'train.run_dir={directory}/run']) == 0
  return built_once('chat_echo_sft', build)
