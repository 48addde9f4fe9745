"""Tokenizers: bytes, SentencePiece (lm tokenizer train), HF BPE and WordPiece built offline; special ids in use."""
import numpy as np
import pytest
import tokenizers

from lm import cli
from lm.config import ConfigError, load_config
from lm.models import make_objective
from lm.data.sources import embedded_documents
from lm.data.tokenizers import ByteTokenizer, get_tokenizer

SAMPLE = [text for _, text in embedded_documents()[::40]]  # ~50 documents: prose and code


def test_byte_tokenizer_round_trip():
  tok = ByteTokenizer()
  text = 'naïve café — 日本語 ok\n'
  ids = tok.encode(text)
  assert ids.min() >= tok.offset and ids.max() < tok.vocab_size == 260
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == text


@pytest.fixture(scope='module')
def sentencepiece_model(tmp_path_factory):
  out = tmp_path_factory.mktemp('sp') / 'sp'
  assert cli.main(['tokenizer', 'train', '--config', 'gpt_tiny', '--vocab-size', '1200', '--sentinels', '100',
                   '--max-lines', '5000', '--out', str(out)]) == 0
  return f'sentencepiece:{out}.model'


@pytest.fixture(scope='module')
def bpe_dir(tmp_path_factory):
  """GPT-2 style: byte-level BPE with <|endoftext|>, saved as vocab.json + merges.txt."""
  directory = tmp_path_factory.mktemp('bpe')
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(SAMPLE, vocab_size=1500, special_tokens=['<|endoftext|>'])
  bpe.save_model(str(directory))
  bpe.save(str(directory / 'tokenizer.json'))
  (directory / 'special_tokens_map.json').write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}')
  return directory


@pytest.fixture(scope='module')
def wordpiece_dir(tmp_path_factory):
  """BERT style: uncased WordPiece vocab.txt with [PAD] [UNK] [CLS] [SEP] [MASK]."""
  directory = tmp_path_factory.mktemp('wordpiece')
  wordpiece = tokenizers.BertWordPieceTokenizer(lowercase=True)
  wordpiece.train_from_iterator(SAMPLE, vocab_size=3000, limit_alphabet=2000)
  wordpiece.save_model(str(directory))
  return directory


@pytest.mark.long(0.2)
def test_sentencepiece_round_trips_the_corpus_and_names_its_specials(sentencepiece_model):
  tok = get_tokenizer(sentencepiece_model)
  for text in SAMPLE:
    assert tok.decode(tok.encode(text)) == text
  piece = tok.processor.piece_to_id
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.mask_id) == (0, 1, 3, piece('[MASK]'))
  np.testing.assert_array_equal(tok.sentinel_ids(3), [piece(f'<extra_id_{i}>') for i in range(3)])
  assert set(tok.sentinel_ids(100).tolist()) <= set(tok.special_ids.tolist())


def test_byte_level_bpe_round_trips_the_corpus(bpe_dir):
  for spec in (f'hf:{bpe_dir}', f'hf:{bpe_dir}/tokenizer.json'):
    tok = get_tokenizer(spec)
    end = tok.tokenizer.token_to_id('<|endoftext|>')
    assert tok.bos_id == tok.eos_id == tok.pad_id == end and tok.mask_id is None
    for text in SAMPLE:
      assert tok.decode(tok.encode(text)) == text


def test_wordpiece_round_trips_up_to_its_normalisation(wordpiece_dir):
  """Uncased WordPiece lowercases and splits punctuation: text comes back equal up to case and spacing."""
  tok = get_tokenizer(f'hf:{wordpiece_dir}')
  ids = tok.tokenizer.token_to_id
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (ids('[PAD]'), ids('[CLS]'), ids('[SEP]'), ids('[MASK]'))
  squash = lambda s: ''.join(s.lower().split())
  for text in SAMPLE:
    encoded = tok.encode(text)
    assert ids('[UNK]') not in encoded.tolist()
    assert squash(tok.decode(encoded)) == squash(text)


def test_objectives_use_the_tokenizers_special_ids(sentencepiece_model, wordpiece_dir, bpe_dir):
  """Masked LM masks with [MASK] and never picks [CLS]/[SEP]/[PAD]; NSP frames with [CLS]/[SEP]; span
  corruption uses the tokenizer's own <extra_id_N>; causal LM documents open with BOS."""
  wordpiece = get_tokenizer(f'hf:{wordpiece_dir}')
  bert = load_config('bert_tiny', [f'data.tokenizer=hf:{wordpiece_dir}', 'model.vocab_size=3000', 'model.nsp=true'])
  nsp = make_objective(bert, wordpiece)
  assert (nsp.cls_id, nsp.sep_id, nsp.masked_lm.mask_id) == (wordpiece.bos_id, wordpiece.eos_id, wordpiece.mask_id)
  assert {wordpiece.pad_id, wordpiece.bos_id, wordpiece.eos_id} <= set(nsp.masked_lm.special.tolist())
  assert not set(nsp.masked_lm.special.tolist()) & set(nsp.masked_lm.regular.tolist())

  sp = get_tokenizer(sentencepiece_model)
  t5 = make_objective(load_config('t5_tiny', [f'data.tokenizer={sentencepiece_model}', 'model.vocab_size=1280']), sp)
  np.testing.assert_array_equal(t5.sentinels, sp.sentinel_ids(len(t5.sentinels)))
  assert (t5.eos_id, t5.pad_id) == (sp.eos_id, sp.pad_id)

  bpe = get_tokenizer(f'hf:{bpe_dir}')
  with pytest.raises(ConfigError, match='masked LM needs a mask token'):
    make_objective(load_config('bert_tiny', [f'data.tokenizer=hf:{bpe_dir}', 'model.vocab_size=1536']), bpe)


@pytest.mark.parametrize('spec, message', [
  ('hf:/no/such/dir', 'data.tokenizer=hf:/no/such/dir: /no/such/dir does not exist'),
  ('sentencepiece:/no/such.model', 'does not exist; train one with lm tokenizer train'),
  ('wordpiece:x', "data.tokenizer='wordpiece:x' is not a tokenizer; write one of: byte, sentencepiece:PATH, hf:PATH"),
])
def test_bad_tokenizer_specs_are_one_line_errors(spec, message, capsys):
  assert cli.main(['train', '--config', 'gpt_tiny', f'data.tokenizer={spec}', 'mesh.data=-1']) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1


@pytest.mark.long(0.2)
def test_a_vocabulary_smaller_than_the_tokenizer_is_one_line(sentencepiece_model, capsys):
  assert cli.main(['train', '--config', 'gpt_tiny', f'data.tokenizer={sentencepiece_model}']) == 2
  err = capsys.readouterr().err
  assert 'model.vocab_size=264 is smaller than the' in err and '1200 ids; raise model.vocab_size' in err


def test_tokenizer_training_reports_progress_while_it_reads(tmp_path, monkeypatch):
  from lm.data import tokenizer_training
  monkeypatch.setattr(tokenizer_training, 'REPORT_EVERY', 100)
  documents = ['\n\n'.join(f'line {i} of document {d}' for i in range(60)) for d in range(5)]  # 300 lines
  messages = []
  tokenizer_training.train_sentencepiece(documents, tmp_path / 'sp', vocab_size=283, report=messages.append)
  assert messages == ['read 100 lines', 'read 200 lines', 'read 300 lines', 'read 300 lines; learning the pieces']
