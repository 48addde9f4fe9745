"""Hugging Face datasets on disk (`data.source=hf`, `NAME=hf:PATH[:SPLIT]`): what `datasets` saved (a Dataset, a
DatasetDict) or a folder of data files reads back as the rows written, in order; a single Dataset holds out
data.val_fraction by each row's name; batches equal the same documents as JSONL; bad folders are one line."""
import json
from functools import partial

import datasets
import jax
import numpy as np
import pytest

from lm.config import ConfigError, held_out_sets, load_config
from lm.data.pipeline import training_batches
from lm.data.sources import embedded_documents, held_out_documents, is_validation, mixture_documents, open_documents
from lm.models import make_objective
from lm.parallel.mesh import make_mesh

TINY = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=8', 'data.streams=4']


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """(folder, documents): 240 documents saved three ways: a Dataset, a DatasetDict (train 200, validation 40) and
  a folder of JSON-lines data files named by split; and as plain JSONL."""
  root = tmp_path_factory.mktemp('hf')
  docs = [text[:1000] for _, text in embedded_documents()[2::3][:240]]
  assert len(docs) == 240
  rows = {'text': docs, 'id': list(range(240))}
  datasets.Dataset.from_dict(rows).save_to_disk(root / 'one')
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': docs[:200]}),
                        'validation': datasets.Dataset.from_dict({'text': docs[200:]})}).save_to_disk(root / 'dict')
  (root / 'files').mkdir()
  for split, part in (('train', docs[:200]), ('validation', docs[200:])):
    (root / f'files/{split}.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in part))
  (root / 'docs.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  return root, docs


def data(*overrides):
  return load_config('gpt_tiny', TINY + ['data.source=hf', *overrides]).data


def read(documents):
  return [documents[i] for i in range(len(documents))]


def test_a_saved_dataset_splits_by_each_rows_name(saved):
  root, docs = saved
  path = str(root / 'one')
  held = [is_validation(f'{path}:{i}', 0.1) for i in range(len(docs))]
  config = data(f'data.name={path}', 'data.val_fraction=0.1')
  assert read(open_documents(config, 'validation')) == [d for d, h in zip(docs, held) if h]
  assert read(open_documents(config, 'train')) == [d for d, h in zip(docs, held) if not h]


@pytest.mark.parametrize('folder', ['dict', 'files'])
def test_a_saved_dataset_dict_and_a_folder_of_data_files_give_their_splits(saved, folder):
  root, docs = saved
  config = data(f'data.name={root / folder}')
  assert read(open_documents(config, 'train')) == docs[:200]
  assert read(open_documents(config, 'validation')) == docs[200:]


def test_training_batches_equal_the_same_documents_as_jsonl(saved):
  root, _ = saved
  config = lambda *o: load_config('gpt_tiny', TINY + ['data.val_fraction=0', *o])
  found = []
  for source in (['data.source=jsonl', f'data.paths=[{root}/docs.jsonl]'],
                 ['data.source=hf', f'data.name={root}/one']):
    c = config(*source)
    _, batches = training_batches(c, make_mesh(c.mesh, jax.devices()[:1]), partial(make_objective, c))
    found.append([{k: np.asarray(v) for k, v in next(batches).items()} for _ in range(3)])
  for got, want in zip(*found, strict=True):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_named_sources_take_their_split(saved):
  root, docs = saved
  d = data(f'data.name={root}/dict', f'data.evals=[dev=hf:{root}/dict, all=hf:{root}/one, tr=hf:{root}/files:train]',
           f'data.mixture=[a=hf:{root}/dict, b=hf:{root}/dict:validation]', 'data.weights=[a=1 b=1]')
  dev, whole, train = (held_out_documents(held, d) for held in held_out_sets(d))
  assert read(dev) == docs[200:] and read(whole) == docs and read(train) == docs[:200]
  assert [read(m) for m in mixture_documents(d)] == [docs[:200], docs[200:]]


def test_bad_datasets_are_one_line(saved, tmp_path):
  root, _ = saved
  with pytest.raises(ConfigError, match=rf'data.name={tmp_path}/none: no folder {tmp_path}/none; save a dataset'):
    open_documents(data(f'data.name={tmp_path}/none'), 'train')
  with pytest.raises(ConfigError, match=r"no column 'body' \(its columns: text, id\); set data.text_key"):
    open_documents(data(f'data.name={root}/one', 'data.text_key=body'), 'train')
  with pytest.raises(ConfigError, match=r"dict has no split 'dev' \(its splits: train, validation\); name one"):
    open_documents(data(f'data.name={root}/dict', 'data.val_split=dev'), 'validation')
  with pytest.raises(ConfigError, match=r"data.evals set x: .*one is one dataset without splits, so there is no split"):
    d = data(f'data.name={root}/dict', f'data.evals=[x=hf:{root}/one:test]')
    held_out_documents(held_out_sets(d)[0], d)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ConfigError, match=r'empty holds neither a saved dataset nor data files load_dataset reads'):
    open_documents(data(f'data.name={tmp_path}/empty'), 'train')
  with pytest.raises(ConfigError, match=r"data.source=hf needs data.name, the dataset's folder"):
    load_config('gpt_tiny', ['data.source=hf'])
