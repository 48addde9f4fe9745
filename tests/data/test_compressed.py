"""Compressed JSON lines (`data.source=jsonl` on `.jsonl.gz`, `.json.gz`, `.jsonl.zst`): files written by gzip and
zstandard read back as the documents written, in order, and train on the batches of the same plain `.jsonl`; each
file is decompressed once; a damaged stream or a bad line is one line naming the file (and line)."""
import gzip
import re
import json
from functools import partial

import jax
import numpy as np
import pytest
import zstandard

from lm.config import ConfigError, load_config
from lm.data.pipeline import training_batches
from lm.data.sources import embedded_documents, files_source, open_documents
from lm.models import make_objective
from lm.parallel.mesh import make_mesh

TINY = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=32', 'model.max_len=32',
        'train.global_batch=8', 'data.streams=4', 'data.val_fraction=0']


def dolma_lines(docs):
  """Dolma's layout: `id`, `text`, `source`, `metadata`."""
  return b''.join(json.dumps({'id': str(i), 'text': d, 'source': 'stdlib', 'metadata': {'n': i}}).encode() + b'\n'
                  for i, d in enumerate(docs))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """(folder, documents): 200 documents as plain JSONL and compressed three ways, each in two frames (members)."""
  root = tmp_path_factory.mktemp('compressed')
  docs = [text[:1200] for _, text in embedded_documents()[1::4][:200]]
  halves = dolma_lines(docs[:120]), dolma_lines(docs[120:])
  (root / 'plain.jsonl').write_bytes(b''.join(halves))
  (root / 'a.jsonl.gz').write_bytes(b''.join(gzip.compress(h) for h in halves))
  (root / 'b.json.gz').write_bytes(gzip.compress(b''.join(halves)))
  (root / 'c.jsonl.zst').write_bytes(b''.join(zstandard.ZstdCompressor(level=3).compress(h) for h in halves))
  return root, docs


def documents(path, *overrides):
  return open_documents(load_config('gpt_tiny', TINY + ['data.source=jsonl', f'data.paths=[{path}]',
                                                        *overrides]).data, 'train')


@pytest.mark.parametrize('name', ['a.jsonl.gz', 'b.json.gz', 'c.jsonl.zst'])
def test_each_form_reads_back_the_documents_in_order(corpus, name):
  root, docs = corpus
  found = documents(root / name)
  assert [found[i] for i in range(len(found))] == docs


def batches(path):
  config = load_config('gpt_tiny', TINY + ['data.source=jsonl', f'data.paths=[{path}]'])
  _, found = training_batches(config, make_mesh(config.mesh, jax.devices()[:1]), partial(make_objective, config))
  return [{k: np.asarray(v) for k, v in next(found).items()} for _ in range(3)]


def test_training_batches_equal_the_plain_files(corpus):
  root, _ = corpus
  want = batches(root / 'plain.jsonl')
  for name in ('a.jsonl.gz', 'c.jsonl.zst'):
    for got, expected in zip(batches(root / name), want, strict=True):
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_a_file_is_decompressed_once_and_again_when_it_changes(corpus, tmp_path, monkeypatch):
  root, docs = corpus
  monkeypatch.setenv('LM_CACHE_DIR', str(tmp_path / 'cache'))
  (tmp_path / 'd.jsonl.zst').write_bytes((root / 'c.jsonl.zst').read_bytes())
  documents(tmp_path / 'd.jsonl.zst')
  [copy] = (tmp_path / 'cache/decompressed').iterdir()
  assert copy.read_bytes() == (root / 'plain.jsonl').read_bytes()
  written = copy.stat().st_mtime_ns
  assert documents(tmp_path / 'd.jsonl.zst')[3] == docs[3] and copy.stat().st_mtime_ns == written
  (tmp_path / 'd.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(dolma_lines(['changed'])))
  assert documents(tmp_path / 'd.jsonl.zst')[0] == 'changed'
  assert len(list((tmp_path / 'cache/decompressed').iterdir())) == 2


@pytest.mark.parametrize('name, kind', [('a.jsonl.gz', 'gzip'), ('c.jsonl.zst', 'zstd')])
def test_a_truncated_stream_is_one_line_and_leaves_nothing(corpus, tmp_path, monkeypatch, name, kind):
  root, _ = corpus
  monkeypatch.setenv('LM_CACHE_DIR', str(tmp_path / 'cache'))
  data = (root / name).read_bytes()
  (tmp_path / name).write_bytes(data[:len(data) - 20])
  with pytest.raises(ConfigError, match=rf'{name}: a damaged or truncated {kind} stream \(.+\); download it again'):
    documents(tmp_path / name)
  assert list((tmp_path / 'cache/decompressed').iterdir()) == []


def test_an_empty_file_among_others_is_named_and_the_run_writes_nothing(corpus, tmp_path, monkeypatch, capsys):
  """A file with no lines (a failed download; empty, or a compressed stream of nothing) stops the run in one line
  naming it, exit 2, before anything is written."""
  from lm import cli
  root, _ = corpus
  monkeypatch.setenv('LM_CACHE_DIR', str(tmp_path / 'cache'))
  for name, data in (('e.jsonl', b''), ('e.jsonl.gz', gzip.compress(b'\n')),
                     ('e.jsonl.zst', zstandard.ZstdCompressor().compress(b''))):
    (tmp_path / name).write_bytes(data)
    capsys.readouterr()
    assert cli.main(['train', '--config', 'gpt_tiny', *TINY, 'data.source=jsonl',
                     f'data.paths=[{root}/plain.jsonl,{tmp_path / name}]', f'train.run_dir={tmp_path}/run']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and f'{tmp_path / name} holds no lines; remove it or narrow the glob' in err, err
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('line, message', [
  (b'{"text": "one", ', r'line 3 is not JSON \(.*\); fix or drop the line'),
  (b'{"text": "\xff\xfe"}', r'line 3 is not UTF-8; fix or drop the line'),
  (b'{"body": "x"}', r"line 3 has no 'text' field \(it has: body\); set data.text_key"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, message):
  (tmp_path / 'bad.jsonl.gz').write_bytes(gzip.compress(b'{"text": "a"}\n\n' + line + b'\n{"text": "b"}\n'))
  found = documents(tmp_path / 'bad.jsonl.gz')
  assert found[0] == 'a' and found[2] == 'b'
  with pytest.raises(ConfigError, match=rf'bad.jsonl.gz {message}'):
    found[1]


def test_skipped_bad_lines_are_counted_and_never_trained_on(tmp_path, capfd):
  """data.skip_bad_records=true: a line that is not JSON, not UTF-8 or has no text field is logged with a count
  and left out of the batches; every good line is read."""
  good = [f'good document number {i} ' * 3 for i in range(40)]
  bad = [b'{"text": "BAD BAD', b'{"text": "\xff BAD"}', b'{"body": "BAD"}']
  lines = [json.dumps({'text': g}).encode() for g in good]
  for i, line in enumerate(bad):
    lines.insert(10 * i + 5, line)
  (tmp_path / 'mixed.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(b'\n'.join(lines) + b'\n'))
  config = load_config('gpt_tiny', TINY + ['data.source=jsonl', f'data.paths=[{tmp_path}/mixed.jsonl.zst]',
                                           'data.skip_bad_records=true', 'train.global_batch=4', 'data.streams=1'])
  tokenizer, found = training_batches(config, make_mesh(config.mesh, jax.devices()[:1]),
                                      partial(make_objective, config))
  text = ''.join(tokenizer.decode([int(t) for t in row if t < 256]) for _ in range(40)
                 for row in np.asarray(next(found)['inputs']))
  assert 'BAD' not in text
  assert all(f'number {i} ' in text for i in range(len(good)))  # rows cut documents: a whole repeat of each survives
  out = capfd.readouterr().out
  assert set(re.findall(r'mixed.jsonl.zst line (\d+): it ', out)) == {'6', '16', '26'}  # each epoch skips them again
  counts = [int(n) for n in re.findall(r'\((\d+) bad records skipped by this reader\)', out)]
  assert counts == list(range(1, len(counts) + 1)) and len(counts) == out.count('data: skipped ') >= 3
  assert re.search(r'mixed.jsonl.zst line 16: it is not UTF-8 \(', out)


def test_local_files_are_read_by_their_endings():
  """`lm data build --from` and `lm tokenizer train --from` pick the source so."""
  assert files_source(['dolma/*.json.gz', 'dclm/*.jsonl.zst', 'a.jsonl']) == 'jsonl'
  assert files_source(['fineweb/*.parquet']) == 'parquet'
  assert files_source(['corpus/**/*.txt']) == files_source(['a.jsonl', 'b.parquet']) == 'text'
