"""Bits per byte: each token's UTF-8 bytes from the tokenizer, validation read whole with its last batch padded,
and val_bpb equal to a float64 computation from per-token losses and the bytes the target tokens decode to."""
import io
import math

import jax
import numpy as np
import pytest
import sentencepiece as spm
import tokenizers

from lm.data.sources import embedded_documents
from lm.data.tokenizers import get_tokenizer
from lm.assembly import assemble
from lm.train.held_out import HeldOut

WORDS = 'the quick brown fox jumps over a lazy dog while seven wizards quietly hex big jumbo crates'.split()
SAMPLE = [text for _, text in embedded_documents()[::60]]  # prose and code, some of it beyond ASCII


def ascii_documents(count: int, seed: int) -> list[str]:
  """Single-spaced lower-case sentences: every tokenizer here keeps them as they are."""
  rng = np.random.default_rng(seed)
  return [' '.join(rng.choice(WORDS, size=int(rng.integers(5, 15)))) for _ in range(count)]


@pytest.fixture(scope='module')
def tokenizer_specs(tmp_path_factory):
  directory = tmp_path_factory.mktemp('tokenizers')
  corpus = SAMPLE + ascii_documents(50, 0)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, vocab_size=400,
                                 byte_fallback=True, minloglevel=2)
  (directory / 'sp.model').write_bytes(model.getvalue())
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(corpus, vocab_size=600, special_tokens=['<|endoftext|>'])
  bpe.save(str(directory / 'bpe.json'))
  return {'byte': 'byte', 'sentencepiece': f'sentencepiece:{directory}/sp.model', 'bpe': f'hf:{directory}/bpe.json'}


def hand_bytes(spec: str, previous: int, target: int) -> int:
  """The UTF-8 bytes target token `target` decodes to (after token `previous`), by each tokenizer's own rules."""
  tok = get_tokenizer(spec)
  if target in set(tok.special_ids.tolist()):
    return 0
  if spec == 'byte':
    return 1
  if spec.startswith('hf:'):
    return len(tok.decode([target]).encode('utf-8'))
  piece = tok.processor.id_to_piece(target)  # '▁' is a space, but the one SentencePiece adds at a text's start
  return len(piece.replace('\u2581', ' ').encode('utf-8')) - (previous == tok.bos_id and piece[0] == '\u2581')


@pytest.mark.parametrize('kind', ['byte', 'sentencepiece', 'bpe'])
def test_token_bytes_add_up_to_the_text(tokenizer_specs, kind):
  tok = get_tokenizer(tokenizer_specs[kind])
  for text in SAMPLE + ['', '  two  spaces, é and 日本 \n']:
    ids, nbytes = tok.encode_with_bytes(text)
    np.testing.assert_array_equal(ids, tok.encode(text))
    assert nbytes.sum() == len(text.encode('utf-8')) and nbytes.min(initial=0) >= 0
  for text in ascii_documents(20, 1):
    ids, nbytes = tok.encode_with_bytes(text)
    previous = np.concatenate([[tok.bos_id], ids[:-1]])
    np.testing.assert_array_equal(nbytes, [hand_bytes(tokenizer_specs[kind], p, t) for p, t in zip(previous, ids)])


@pytest.mark.long(0.2)
@pytest.mark.parametrize('kind', ['byte', 'sentencepiece', 'bpe'])
def test_val_bpb_of_a_set_smaller_than_one_batch_is_the_hand_computation(small_config, tokenizer_specs, tmp_path,
                                                                        kind):
  """A held-out set of three short files (far less than one batch of 16 rows) is read whole, and its loss and
  bpb equal float64 sums of per-target NLL over the bytes each target decodes to."""
  for i, text in enumerate(ascii_documents(3, 2)):
    (tmp_path / f'{i}.txt').write_text(text)
  spec = tokenizer_specs[kind]
  assembly = assemble(small_config(f'data.evals=[small=text:{tmp_path}/*.txt]', f'data.tokenizer={spec}',
                                   'model.vocab_size=640', 'train.eval_batches=-1'), jax.devices()[:1])
  held_out = HeldOut(assembly)  # no training stream, no trainer
  params = assembly.init_state().params
  got = held_out.evaluate(params, held_out.sets['small'], -1)

  nll = weight = nbytes = 0.0
  batches = list(held_out.sets['small'].first(2))
  assert np.asarray(batches[1]['weights']).sum() == 0, 'the set fits in one padded batch'
  batch = batches[0]
  logits = assembly.family.apply(assembly.model, params, batch, deterministic=True, rngs={})['logits']
  logits = np.asarray(logits.logits(), np.float64)
  log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
    - logits.max(-1, keepdims=True)
  inputs, targets, weights = (np.asarray(batch[k]) for k in ('inputs', 'targets', 'weights'))
  assert 0 < weights.sum() and (weights[-1] == 0).all(), 'the rows past the set are padding'
  for row in range(len(targets)):
    for j in np.flatnonzero(weights[row]):
      nll -= log_probs[row, j, targets[row, j]]
      weight += 1
      nbytes += hand_bytes(spec, inputs[row, j], targets[row, j])
  held_out = [path.read_text() for path in sorted(tmp_path.glob('*.txt'))]
  # A row's first token is an input only. It follows the row before in its stream (a stream's first row: BOS).
  row_starts = sum(hand_bytes(spec, targets[r - 1, -1] if r else -1, inputs[r, 0]) for r in range(len(inputs)))
  assert nbytes + row_starts == sum(len(text.encode()) for text in held_out), 'every byte of the set, once'
  assert got['loss'] == pytest.approx(nll / weight, rel=1e-5)
  assert got['bpb'] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-5)
  if kind == 'byte':  # one byte a token but EOS (no bytes)
    eos = (targets == get_tokenizer(spec).eos_id)[weights > 0].sum()
    assert got['bpb'] == pytest.approx(got['loss'] / math.log(2) * weight / (weight - eos), rel=1e-5)
