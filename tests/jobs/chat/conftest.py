"""The chat jobs' shared models: a tiny random Llama beside a ChatML tokenizer (tests/data/test_chat.py)."""
import pytest
import transformers

from tests.data.test_chat import chat_tokenizer  # noqa: F401  (a fixture these use)


@pytest.fixture(scope='session')
def tiny_llama(chat_tokenizer, tmp_path_factory):  # noqa: F811
  """A random 2-layer Llama saved by transformers beside the chat tokenizer (its template included)."""
  directory = tmp_path_factory.mktemp('tiny_llama')
  tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
  transformers.set_seed(0)
  config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=128, tie_word_embeddings=False,
                                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
  transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
  tokenizer.save_pretrained(directory)
  return directory
