"""`lm data tokenize` and `data.source=tokenized:DIR`: shards hold each document's ids and bytes per token as the
tokenizer gives them; training from them gives the batches tokenizing on the fly gives; a stopped run resumes to
the shards of an uninterrupted one, with any number of workers; a mismatched tokenizer, a damaged or missing
shard, another corpus in the folder: one line each."""
import gzip
import json
from functools import partial

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from lm import cli
from lm.config import ConfigError, load_config
from lm.data import tokenize as tokenize_module
from lm.data.pipeline import training_batches
from lm.data.shards import MANIFEST, decode_record
from lm.data.sources import embedded_documents, open_documents
from lm.data.tokenizers import get_tokenizer
from lm.models import make_objective
from lm.parallel.mesh import make_mesh

TINY = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=8', 'data.streams=4', 'data.val_fraction=0']


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """(folder, documents, tokenizer spec): 150 documents, the first 100 as gzip JSON lines and the rest as Parquet
  (with non-ASCII text), the same as one plain JSONL file, and a byte-level BPE of 400 pieces trained on them."""
  root = tmp_path_factory.mktemp('tokenize')
  docs = [text[:900] for _, text in embedded_documents()[3::5][:150]]
  docs[7] = 'naïve café 東京 🙂 ' * 20
  (root / 'a.jsonl.gz').write_bytes(gzip.compress(''.join(json.dumps({'text': d}) + '\n' for d in docs[:100]).encode()))
  pq.write_table(pa.table({'text': docs[100:]}), root / 'b.parquet', row_group_size=16)
  (root / 'all.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator(docs, vocab_size=400, special_tokens=['<pad>', '<s>', '</s>', '<mask>'])
  bpe.save(str(root / 'bpe.json'))
  return root, docs, f'hf:{root / "bpe.json"}'


def tokenize(root, out, spec, *extra):
  assert cli.main(['data', 'tokenize', f'jsonl:{root}/a.jsonl.gz', f'parquet:{root}/b.parquet', '--tokenizer', spec,
                   '--out', str(out), '--shard-documents', '40', '--no-progress', *extra]) == 0
  return json.loads((out / MANIFEST).read_text())


def records(out, manifest):
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  source = ArrayRecordDataSource([str(out / s['file']) for s in manifest['shards']])
  return [decode_record(source[i]) for i in range(len(source))]


def test_shards_hold_each_documents_ids_and_bytes(corpus, tmp_path):
  root, docs, spec = corpus
  manifest = tokenize(root, tmp_path / 'shards', spec)
  tokenizer = get_tokenizer(spec)
  assert manifest['documents'] == 150 and [s['documents'] for s in manifest['shards']] == [40, 40, 40, 30]
  assert [s['documents'] for s in manifest['sources']] == [100, 50]
  found = records(tmp_path / 'shards', manifest)
  for doc, (ids, nbytes) in zip(docs, found, strict=True):
    want_ids, want_bytes = tokenizer.encode_with_bytes(doc)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(nbytes, want_bytes)
    assert nbytes.sum() == len(doc.encode('utf-8'))  # bits per byte divide by the text's own bytes
  assert sum(s['tokens'] for s in manifest['shards']) == sum(len(ids) for ids, _ in found)


def test_training_from_shards_equals_tokenizing_on_the_fly(corpus, tmp_path):
  root, _, spec = corpus
  tokenize(root, tmp_path / 'shards', spec)
  found = []
  for source in ([f'data.source=jsonl:{root}/all.jsonl'], [f'data.source=tokenized:{tmp_path / "shards"}']):
    config = load_config('gpt_tiny', TINY + source + [f'data.tokenizer={spec}', 'model.vocab_size=512'])
    _, batches = training_batches(config, make_mesh(config.mesh, jax.devices()[:1]), partial(make_objective, config))
    found.append([{k: np.asarray(v) for k, v in next(batches).items()} for _ in range(4)])
  for got, want in zip(*found, strict=True):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_a_stopped_run_resumes_to_an_uninterrupted_runs_shards_with_any_workers(corpus, tmp_path, monkeypatch):
  root, _, spec = corpus
  straight = tokenize(root, tmp_path / 'straight', spec)
  write, calls = tokenize_module._write_shard, []

  def stop_after_two(job):
    if len(calls) == 2:
      raise KeyboardInterrupt  # stopped while the third shard is being written
    calls.append(job)
    return write(job)
  monkeypatch.setattr(tokenize_module, '_write_shard', stop_after_two)
  with pytest.raises(KeyboardInterrupt):
    tokenize(root, tmp_path / 'resumed', spec)
  stopped = json.loads((tmp_path / 'resumed' / MANIFEST).read_text())
  assert [s is not None for s in stopped['shards']] == [True, True, False, False]
  with pytest.raises(ConfigError, match=r'2 of the 4 shards in .* are not written yet; run the same lm data tokenize'):
    open_documents(load_config('gpt_tiny', [f'data.source=tokenized:{tmp_path / "resumed"}',
                                            f'data.tokenizer={spec}', 'model.vocab_size=512']).data, 'train')
  monkeypatch.setattr(tokenize_module, '_write_shard', write)
  resumed = tokenize(root, tmp_path / 'resumed', spec, '--workers', '2')
  assert resumed == straight  # the same shards: documents, tokens and file sizes
  for a, b in zip(records(tmp_path / 'resumed', resumed), records(tmp_path / 'straight', straight), strict=True):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_bad_input_is_one_line_and_changes_nothing(corpus, tmp_path, capsys):
  root, _, spec = corpus
  out = tmp_path / 'shards'
  tokenize(root, out, spec)
  before = (out / MANIFEST).read_text()
  for argv, message in ((['--tokenizer', 'byte', '--out', str(out)], 'holds shards of other sources, settings or '
                         'another tokenizer; choose another --out or remove it (nothing was changed)'),
                        (['csv:x', '--tokenizer', 'byte', '--out', str(tmp_path / 'x')], "'csv:x': write a source as "
                         'text:GLOB, jsonl:GLOB')):
    capsys.readouterr()
    assert cli.main(['data', 'tokenize', f'jsonl:{root}/a.jsonl.gz', *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count('\n') == 1
  assert (out / MANIFEST).read_text() == before and not (tmp_path / 'x').exists()
  read = lambda *o: open_documents(load_config('gpt_tiny', [f'data.source=tokenized:{out}', *o]).data, 'train')
  with pytest.raises(ConfigError, match=rf'data.name={out} was tokenized with {spec}, and the run\'s '
                                        r'data.tokenizer=byte encodes otherwise; set data.tokenizer='):
    read()
  shard = out / json.loads(before)['shards'][1]['file']
  shard.write_bytes(shard.read_bytes()[:1000])
  with pytest.raises(ConfigError, match=rf'shard {shard} is missing or damaged'):
    read(f'data.tokenizer={spec}', 'model.vocab_size=512')
  with pytest.raises(ConfigError, match=rf'no {MANIFEST} in {tmp_path}; write the shards with lm data tokenize'):
    open_documents(load_config('gpt_tiny', [f'data.source=tokenized:{tmp_path}']).data, 'train')


@pytest.mark.parametrize('source', ['parquet', 'jsonl.gz', 'tokenized'])
def test_the_global_batch_is_the_same_on_two_processes(corpus, tmp_path, source):
  """Each simulated process reads only its streams' records of the new forms; stacked, they equal one process's."""
  from lm.data.pipeline import batch_dataset
  root, _, spec = corpus
  if source == 'tokenized':
    tokenize(root, tmp_path / 'shards', spec)
  data = {'parquet': f'parquet:{root}/b.parquet', 'jsonl.gz': f'jsonl:{root}/a.jsonl.gz',
          'tokenized': f'tokenized:{tmp_path / "shards"}'}[source]
  config = load_config('bert_tiny', ['data.seq_len=32', 'model.max_len=32', f'data.source={data}',
                                     f'data.tokenizer={spec}', 'model.vocab_size=512', 'data.val_fraction=0'])
  docs, tokenizer = open_documents(config.data, 'train'), get_tokenizer(spec)
  objective = make_objective(config, tokenizer)

  def batches(processes):
    parts = [batch_dataset(docs, tokenizer, objective, shuffle_seed=5, key_seed=5, global_batch=8,
                           process_index=p, process_count=processes) for p in range(processes)]
    return [{k: np.concatenate([b[k] for b in rows]) for k in rows[0]}
            for rows in zip(*[[next(it) for _ in range(3)] for it in map(iter, parts)])]
  for got, want in zip(batches(2), batches(1), strict=True):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
