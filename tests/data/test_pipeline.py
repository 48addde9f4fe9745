"""Batches: deterministic from the seed, resumable, split per process; the embedded corpus is real text."""
from functools import partial

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from lm.config import ConfigError, load_config
from lm.data.pipeline import (batch_dataset, local_row_range, records, stream_layout, training_batches,
                              validation_batches)
from lm.data.sources import TextList, embedded_documents, is_validation, split_documents
from lm.data.tokenizers import get_tokenizer
from lm.models import make_objective
from lm.parallel.mesh import make_mesh


def test_embedded_corpus_is_real_english_text():
  docs = embedded_documents()
  text = ''.join(t for _, t in docs)
  assert len(docs) > 100 and len(text) > 2_000_000
  printable = sum(c.isprintable() or c in '\n\t' for c in text[:1_000_000]) / 1_000_000
  assert printable > 0.99
  words = text.lower().split()
  for common in ('the', 'and', 'is', 'of', 'return'):
    assert words.count(common) > 1000
  assert any(name.startswith('pydoc/') for name, _ in docs), 'the language reference topics are included'


def test_validation_split_is_fixed_and_disjoint():
  docs = [(f'doc{i}', 'x') for i in range(2000)]
  train, val = split_documents(docs, 0.05)
  assert 60 < len(val) < 140 and not {n for n, _ in train} & {n for n, _ in val}
  assert [n for n, _ in val] == [n for n, _ in docs if is_validation(n, 0.05)]


def one_device_batches(config):
  """(tokenizer, training batches, validation batches) on one device."""
  mesh, objective_for = make_mesh(config.mesh, jax.devices()[:1]), partial(make_objective, config)
  return (*training_batches(config, mesh, objective_for), validation_batches(config, mesh, objective_for))


def test_same_seed_same_batches_other_seed_other_batches(small_config):
  _, a, val_a = one_device_batches(small_config())
  _, b, val_b = one_device_batches(small_config())
  _, c, val_c = one_device_batches(small_config('train.seed=1'))
  for _ in range(3):
    x, y, z = next(a), next(b), next(c)
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
    assert not np.array_equal(x['inputs'], z['inputs'])
  # Validation rows do not depend on the training seed, and every evaluation sees the same ones.
  first = [np.asarray(batch['inputs']) for batch in val_a.first(2)]
  np.testing.assert_array_equal(first[0], next(val_c.first(1))['inputs'])
  np.testing.assert_array_equal(first[1], [np.asarray(batch['inputs']) for batch in val_a.first(2)][1])


def test_iterator_state_resumes_the_stream(small_config):
  _, a, _ = one_device_batches(small_config())
  for _ in range(5):
    next(a)
  state = a.iterator.get_state()
  expected = [next(a) for _ in range(3)]
  _, b, _ = one_device_batches(small_config())
  b.iterator.set_state(state)
  for want in expected:
    got = next(b)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def texts(n):
  return TextList([f'document {i}' for i in range(n)])


def test_epochs_cover_every_record_once_in_a_new_order():
  n = 101
  stream = records(texts(n), shuffle_seed=3, stream=0, streams=1)
  epoch = lambda e: [stream[i][1] for i in range(e * n, (e + 1) * n)]
  first, second = epoch(0), epoch(1)
  assert sorted(first) == sorted(second) == sorted(texts(n).texts)
  assert first != second
  assert [stream[i][0] for i in range(5)] == list(range(5)), 'records carry their sequence position'


@pytest.mark.parametrize('processes', [2, 3])
def test_process_shards_are_disjoint_and_cover_every_record_once_per_epoch(processes):
  """Each host runs only its streams, which read every S-th shuffled record: its share of the record index."""
  n, batch = 100, 12
  seen = []
  for p in range(processes):
    mine, total = stream_layout(batch, 16, p, processes)
    assert total == 12 and len(mine) == total // processes
    texts_read = set()
    for stream in mine:
      shard = records(texts(n), shuffle_seed=7, stream=stream, streams=total)
      taken = [shard[k] for k in range(-(-(n - stream) // total))]  # this stream's positions < n: epoch 0
      assert all(position % total == stream for position, _ in taken)
      texts_read |= {text for _, text in taken}
    seen.append(texts_read)
  assert sum(len(s) for s in seen) == n and set().union(*seen) == set(texts(n).texts)


def test_the_global_batch_is_the_same_for_any_number_of_processes():
  """The rows each simulated process builds, stacked in process order, equal the one-process batch."""
  docs = TextList([text for _, text in embedded_documents()[:300]])
  objective = make_objective(load_config('bert_tiny', ['data.seq_len=32', 'model.max_len=32']), get_tokenizer('byte'))

  def batches(processes):
    parts = [batch_dataset(docs, get_tokenizer('byte'), objective, shuffle_seed=5, key_seed=5, global_batch=8,
                           process_index=p, process_count=processes) for p in range(processes)]
    return [{k: np.concatenate([b[k] for b in rows]) for k in rows[0]}
            for rows in zip(*[[next(it) for _ in range(3)] for it in map(iter, parts)])]
  one = batches(1)
  for processes in (2, 4):
    for got, want in zip(batches(processes), one):
      for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_global_batch_is_sharded_over_data_axes(small_config):
  config = small_config('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')
  _, train = training_batches(config, make_mesh(config.mesh), partial(make_objective, config))
  batch = next(train)
  assert batch['inputs'].shape == (16, 32)
  assert batch['inputs'].sharding.spec[0] == ('data', 'fsdp')  # the size-1 slice and tensor axes split nothing
  shard_rows = {s.data.shape[0] for s in batch['inputs'].addressable_shards}
  assert shard_rows == {4}


def test_each_process_builds_only_its_rows():
  mesh = jax.make_mesh((4, 2), ('data', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = NamedSharding(mesh, PartitionSpec('data'))
  # In one process every device is addressable: the whole batch is local.
  assert local_row_range(sharding, 16) == (0, 16)


def simulated_processes(devices, per_process=2):
  """Processes as a multi-host job has them: process p owns devices p*n ... p*n+n-1."""
  return [devices[p:p + per_process] for p in range(0, len(devices), per_process)]


@pytest.mark.parametrize('shape, axes, spec, rows', [
  ((4, 2), ('data', 'tensor'), 'data', [(0, 4), (4, 8), (8, 12), (12, 16)]),  # a process: one data index
  ((2, 4), ('data', 'fsdp'), ('data', 'fsdp'), [(0, 4), (4, 8), (8, 12), (12, 16)]),  # two of data x fsdp
  ((2, 4), ('data', 'tensor'), 'data', [(0, 8), (0, 8), (8, 16), (8, 16)]),  # processes sharing a data index
])
def test_processes_hold_contiguous_blocks_of_rows(shape, axes, spec, rows):
  devices = np.array(jax.devices()).reshape(shape)
  sharding = NamedSharding(jax.sharding.Mesh(devices, axes), PartitionSpec(spec))
  got = [local_row_range(sharding, 16, process) for process in simulated_processes(jax.devices())]
  assert got == rows
  covered = sorted({i for lo, hi in got for i in range(lo, hi)})
  assert covered == list(range(16))


def test_a_process_holding_rows_apart_is_refused():
  """Devices ordered so that process 0 (devices 0 and 1) holds data indices 0 and 2: its rows are not one block."""
  d = jax.devices()
  mesh = jax.sharding.Mesh(np.array([[d[0], d[4]], [d[2], d[6]], [d[1], d[5]], [d[3], d[7]]]), ('data', 'tensor'))
  with pytest.raises(ValueError, match='non-contiguous part of the batch; order the mesh'):
    local_row_range(NamedSharding(mesh, PartitionSpec('data')), 16, simulated_processes(d)[0])


def test_vocab_smaller_than_tokenizer_is_refused(small_config):
  with pytest.raises(ConfigError, match='model.vocab_size=200 is smaller than the byte tokenizer'):
    one_device_batches(small_config('model.vocab_size=200'))


def test_a_vocabulary_without_room_for_the_sentinels_is_refused():
  config = load_config('t5_tiny', ['model.vocab_size=264'])  # 260 byte ids + 4: no room for T5's 100 sentinels
  with pytest.raises(ConfigError, match=r"needs T5's 100 sentinel ids above the tokenizer's 260 .*raise "
                                        r'model.vocab_size to at least 360'):
    make_objective(config, get_tokenizer('byte'))


@pytest.mark.long(0.2)
def test_one_small_text_file_trains_with_validation_held_out_from_its_tail(tmp_path):
  """Too few files to split by file: the last pieces are held out, disjoint from the training pieces."""
  from lm import cli
  from lm.data.sources import chunk_bounds, open_documents
  from lm.train.logging import read_metrics
  text = ''.join(f'line {i}: the quick brown fox jumps over the lazy dog\n' for i in range(400))  # ~20 KB
  (tmp_path / 'one.txt').write_text(text)
  overrides = ['data.source=text', f'data.paths=[{tmp_path}/one.txt]', 'data.max_chars=1024']
  config = load_config('gpt_tiny', overrides + ['data.val_fraction=0.1'])
  train, val = open_documents(config.data, 'train'), open_documents(config.data, 'validation')
  assert len(val) == 2 and len(train) + len(val) == len(chunk_bounds(text.encode(), 1024))  # round(0.1 x 22)
  assert ''.join(train[i] for i in range(len(train))) + ''.join(val[i] for i in range(len(val))) == text
  tiny = ['model.num_layers=1', 'model.d_model=32', 'model.num_heads=2', 'data.seq_len=32', 'train.global_batch=8',
          'train.steps=2', 'train.eval_every=2', 'train.progress=false', 'train.eval_batches=1']
  assert cli.main(['train', '--config', 'gpt_tiny', *overrides, *tiny, f'train.run_dir={tmp_path}/a']) == 0
  assert [r['step'] for r in read_metrics(tmp_path / 'a') if 'val_loss' in r] == [0, 2]
  assert cli.main(['train', '--config', 'gpt_tiny', *overrides, *tiny, 'train.eval_batches=0', 'data.val_fraction=0',
                   f'train.run_dir={tmp_path}/b']) == 0
  records = read_metrics(tmp_path / 'b')
  assert not [r for r in records if 'val_loss' in r] and max(r['step'] for r in records) == 2


@pytest.mark.parametrize('sources, consumed', [(1, 0), (1, 3), (3, 0), (3, 1), (3, 4)])
def test_a_state_saved_as_json_resumes_the_stream_exactly(sources, consumed):
  """Checkpoints keep the iterator's state as JSON, which turns grain's (-1, -1) "no remainder" slices into lists:
  restored, the rows go on exactly as they would have, a mixture's sources not yet read included (short rows, so
  documents end inside and between rows)."""
  import json
  from lm.data.mixture import Mixture
  docs = [TextList([f'source {j} document {i} ' * (3 + i % 5) for i in range(50)]) for j in range(sources)]
  mixture = Mixture([f's{j}' for j in range(sources)], [(0, [1.0] * sources)]) if sources > 1 else None
  objective = make_objective(load_config('gpt_tiny', ['data.seq_len=16', 'model.max_len=16']), get_tokenizer('byte'))
  make = lambda: iter(batch_dataset(docs if mixture else docs[0], get_tokenizer('byte'), objective, shuffle_seed=1,
                                    key_seed=1, global_batch=2, streams=2, mixture=mixture))
  a = make()
  for _ in range(consumed):
    next(a)
  state = json.loads(json.dumps(a.get_state()))
  want = [next(a) for _ in range(8)]
  b = make()
  b.set_state(state)
  for expected in want:
    got = next(b)
    for key in expected:
      np.testing.assert_array_equal(got[key], expected[key])
