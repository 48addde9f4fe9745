"""Parquet sources (`data.source=parquet`, `NAME=parquet:GLOB[:COLUMN]`): files written by pyarrow read back as the
documents written, in order; the validation split hashes each row's name as JSONL's hashes each line's; training
batches equal those of the same documents as JSONL; bad files are one line naming the file."""
import json
from functools import partial

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.config import ConfigError, held_out_sets, load_config
from lm.data.pipeline import held_out_batches, training_batches
from lm.data.sources import embedded_documents, held_out_documents, is_validation, mixture_documents, open_documents
from lm.models import make_objective
from lm.parallel.mesh import make_mesh

TINY = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=8', 'data.streams=4']


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """(folder, documents): 300 documents of the embedded corpus in three Parquet files of row groups of 17 rows,
  FineWeb's layout (`text` beside `id` and `url`), and the same documents as one JSONL file."""
  root = tmp_path_factory.mktemp('parquet')
  docs = [text[:1500] for _, text in embedded_documents()[::2][:300]]
  assert len(docs) == 300
  for f, part in enumerate((docs[:100], docs[100:250], docs[250:])):
    table = pa.table({'id': list(range(len(part))), 'text': part, 'url': [f'https://x/{i}' for i in range(len(part))]})
    pq.write_table(table, root / f'part-{f}.parquet', row_group_size=17)
  (root / 'docs.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  return root, docs


def data(root, *overrides):
  return load_config('gpt_tiny', TINY + ['data.source=parquet', f'data.paths=[{root}/*.parquet]', *overrides]).data


def test_rows_read_back_as_written_in_order_and_in_any_order(corpus):
  root, docs = corpus
  documents = open_documents(data(root, 'data.val_fraction=0'), 'train')
  assert len(documents) == len(docs) and [documents[i] for i in range(len(docs))] == docs
  order = np.random.default_rng(0).permutation(len(docs))  # across row groups and files: the kept groups turn over
  assert [documents[int(i)] for i in order] == [docs[i] for i in order]


def test_the_validation_split_hashes_each_rows_name_like_jsonl_lines(corpus):
  root, docs = corpus
  names = [(f'{root}/part-{f}.parquet', i) for f, n in enumerate((100, 150, 50)) for i in range(n)]
  held = [is_validation(f'{path}:{i}', 0.1) for path, i in names]
  train, val = (open_documents(data(root, 'data.val_fraction=0.1'), split) for split in ('train', 'validation'))
  assert [val[i] for i in range(len(val))] == [d for d, h in zip(docs, held) if h]
  assert [train[i] for i in range(len(train))] == [d for d, h in zip(docs, held) if not h]
  assert 10 < len(val) < 50


def batches(config, count=3):
  mesh = make_mesh(config.mesh, jax.devices()[:1])
  _, found = training_batches(config, mesh, partial(make_objective, config))
  return found, [{k: np.asarray(v) for k, v in next(found).items()} for _ in range(count)]


def test_training_batches_equal_the_same_documents_as_jsonl_and_resume_from_the_state(corpus):
  root, _ = corpus
  config = lambda *o: load_config('gpt_tiny', TINY + ['data.val_fraction=0', *o])
  _, want = batches(config('data.source=jsonl', f'data.paths=[{root}/docs.jsonl]'))
  found, got = batches(config('data.source=parquet', f'data.paths=[{root}/*.parquet]'))
  for a, b in zip(got, want, strict=True):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  state, after = found.iterator.get_state(), [next(found) for _ in range(2)]
  again, _ = batches(config('data.source=parquet', f'data.paths=[{root}/*.parquet]'), 0)
  again.iterator.set_state(state)
  for want_batch in after:
    np.testing.assert_array_equal(np.asarray(next(again)['inputs']), np.asarray(want_batch['inputs']))


def test_named_sources_read_their_column(corpus, tmp_path):
  root, docs = corpus
  pq.write_table(pa.table({'body': ['first body', None, 'third body']}), tmp_path / 'bodies.parquet')
  d = data(root, f'data.evals=[bodies=parquet:{tmp_path}/bodies.parquet:body, web=parquet:{root}/part-2.parquet]',
           f'data.mixture=[web=parquet:{root}/*.parquet, bodies=parquet:{tmp_path}/*.parquet:body]',
           'data.weights=[web=0.5 bodies=0.5]', 'data.val_fraction=0')
  bodies, web = (held_out_documents(held, d) for held in held_out_sets(d))
  assert [bodies[i] for i in range(3)] == ['first body', '', 'third body']  # a null text is an empty document
  assert [web[i] for i in range(len(web))] == docs[250:]
  mixed = mixture_documents(d)
  assert [len(m) for m in mixed] == [300, 3] and mixed[1][2] == 'third body'
  config = load_config('gpt_tiny', TINY + ['train.eval_batches=1', f'data.evals=[web=parquet:{root}/part-2.parquet]'])
  assert set(held_out_batches(config, make_mesh(config.mesh, jax.devices()[:1]), partial(make_objective, config))) \
    == {'web'}


def test_data_source_takes_the_named_sources_spelling():
  """`data.source=parquet:GLOB:COLUMN` (and jsonl:, text:, hf:PATH:SPLIT) stands for its fields."""
  spelled = load_config('gpt_tiny', ['data.source=parquet:fineweb/*.parquet:body']).data
  assert (spelled.source, spelled.paths, spelled.text_key) == ('parquet', ('fineweb/*.parquet',), 'body')
  hf = load_config('gpt_tiny', ['data.source=hf:/data/ds:train2']).data
  assert (hf.source, hf.name, hf.train_split) == ('hf', '/data/ds', 'train2')
  with pytest.raises(ConfigError, match=r'data.source=jsonl:a.jsonl names its data, and data.paths is set too'):
    load_config('gpt_tiny', ['data.source=jsonl:a.jsonl', 'data.paths=[b.jsonl]'])
  with pytest.raises(ConfigError, match=r'data.source=tfds:c4/en:3.1.0: write text:GLOB, .* data.source=tfds '
                                        r'data.name=DATASET'):
    load_config('gpt_tiny', ['data.source=tfds:c4/en:3.1.0'])


def test_bad_files_are_one_line_naming_the_file(corpus, tmp_path):
  root, _ = corpus
  with pytest.raises(ConfigError, match=r"part-0.parquet has no column 'body' \(its columns: id, text, url\); "
                                        r"set data.text_key"):
    open_documents(data(root, 'data.text_key=body'), 'train')
  (tmp_path / 'broken.parquet').write_bytes((root / 'part-0.parquet').read_bytes()[:500])
  with pytest.raises(ConfigError, match=r'broken.parquet: not a readable Parquet file \(.*\); check the file'):
    open_documents(data(tmp_path), 'train')
  (tmp_path / 'broken.parquet').unlink()
  pq.write_table(pa.table({'text': pa.array([], pa.string())}), tmp_path / 'empty.parquet')
  with pytest.raises(ConfigError, match=r'empty.parquet holds no rows; remove it or narrow the glob'):
    open_documents(data(tmp_path), 'train')
  with pytest.raises(ConfigError, match=r'data.source=parquet needs data.paths .* data.paths=\[corpus/\*.parquet\]'):
    load_config('gpt_tiny', ['data.source=parquet'])
  # Above 0.9999 every row's hash (mod 10,000) is held out, whatever the file's path: no training rows, always.
  with pytest.raises(ConfigError, match=r'data.val_fraction=0.99999 leaves 0 training'):
    open_documents(data(root, 'data.val_fraction=0.99999'), 'train')
