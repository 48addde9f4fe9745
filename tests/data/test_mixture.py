"""Weighted data mixtures: token shares, stages, exact resume, per-process shares, epochs and the tokens logged.

Three sources whose documents differ ~200x in length, each of one letter, so every packed row tells its source."""
import collections
import json

import grain
import pytest

from lm import cli
from lm.config import ConfigError, load_config
from lm.data.mixture import Mixture, _interleave_counts
from lm.data.pipeline import batch_dataset
from lm.data.sources import mixture_documents
from lm.data.tokenizers import get_tokenizer
from lm.models import make_objective
from lm.train.logging import read_metrics

BATCH = 16


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """a: 40 files of 10 characters; b: 6 files of 2,000; c: 30 JSONL lines of 300."""
  root = tmp_path_factory.mktemp('mixture')
  (root / 'a').mkdir()
  (root / 'b').mkdir()
  for i in range(40):
    (root / 'a' / f'{i}.txt').write_text('a' * 10)
  for i in range(6):
    (root / 'b' / f'{i}.txt').write_text('b' * 2000)
  (root / 'c.jsonl').write_text(''.join(json.dumps({'text': 'c' * 300}) + '\n' for _ in range(30)))
  return [f'data.mixture=[a=text:{root}/a/*.txt, b=text:{root}/b/*.txt, c=jsonl:{root}/c.jsonl]',
          'data.seq_len=32', f'train.global_batch={BATCH}']


def rows_of(corpus, weights, steps, process_index=0, process_count=1, state=None):
  """Each row's source letter, batch by batch, from the pipeline (rows of one process), and the iterator."""
  config = load_config('gpt_tiny', [*corpus, f'data.weights={weights}'])
  dataset = batch_dataset(mixture_documents(config.data), get_tokenizer('byte'), make_objective(config,
                          get_tokenizer('byte')), shuffle_seed=0, key_seed=0, global_batch=BATCH,
                          process_index=process_index, process_count=process_count,
                          mixture=Mixture.of(config.data))
  iterator = iter(dataset)
  if state is not None:
    iterator.set_state(state)
  batches = []
  for _ in range(steps):
    inputs = next(iterator)['inputs']
    letters = [set((row[row >= 4] - 4).tolist()) for row in inputs]
    assert all(len(s) == 1 for s in letters), 'a row holds one source'
    batches.append([chr(s.pop()) for s in letters])
  return batches, iterator


def shares(batches):
  counts = collections.Counter(letter for batch in batches for letter in batch)
  return {letter: counts[letter] / sum(counts.values()) for letter in 'abc'}


@pytest.mark.long(0.2)
@pytest.mark.parametrize('weights', ['[a=0.5 b=0.3 c=0.2]', '[a=0.05 b=0.15 c=0.8]'])
def test_each_sources_token_share_over_200_batches_is_its_weight(corpus, weights):
  """Rows are equal length, so row shares are token shares; document lengths do not matter."""
  batches, _ = rows_of(corpus, weights, 200)
  want = dict(zip('abc', (float(w.split('=')[1]) for w in weights.strip('[]').split())))
  for letter, share in shares(batches).items():
    assert abs(share - want[letter]) < 0.01, (letter, share, want[letter])
  # The tokens a run logs per source (closed form) are the rows counted here times the row length.
  mixture = Mixture.of(load_config('gpt_tiny', [*corpus, f'data.weights={weights}']).data)
  counted = collections.Counter(letter for batch in batches for letter in batch)
  assert mixture.tokens(200, 16, 1, 33) == {name: counted[name] * 33 for name in 'abc'}
  # Each batch holds each source by its weight (to a row or two), not one source at a time.
  for batch in batches:
    for letter, share in shares([batch]).items():
      assert abs(share - want[letter]) <= 2 / BATCH


def test_the_closed_form_counts_are_grains_interleave():
  for weights in [(0.5, 0.3, 0.2), (0.7, 0.3), (1, 1, 1), (0.01, 0.99), (3, 1, 0.25)]:
    order = grain.MapDataset.mix([grain.MapDataset.source([j]).repeat() for j in range(len(weights))], list(weights))
    sequence = [order[k] for k in range(3001)]
    for n in (0, 1, 7, 100, 999, 3001):
      counts = collections.Counter(sequence[:n])
      assert _interleave_counts(n, weights) == [counts[j] for j in range(len(weights))]


def test_a_stage_switches_the_weights_at_its_step_and_resume_is_exact_across_it(corpus):
  weights = '[a=0.5 b=0.5, 10 a=0.2 c=0.8]'
  straight, _ = rows_of(corpus, weights, 20)
  assert 'b' in straight[9] and not any('c' in batch for batch in straight[:10])
  assert not any('b' in batch for batch in straight[10:]), 'b has no weight from step 10'
  assert shares(straight[:10]) == {'a': 0.5, 'b': 0.5, 'c': 0} and shares(straight[10:]) == {'a': 0.2, 'b': 0,
                                                                                              'c': 0.8}
  _, stopped = rows_of(corpus, weights, 7)
  resumed, _ = rows_of(corpus, weights, 13, state=stopped.get_state())
  assert resumed == straight[7:]


def test_every_process_reads_its_share_and_the_batch_is_the_same(corpus):
  one, _ = rows_of(corpus, '[a=0.5 b=0.3 c=0.2, 5 a=0.1 b=0.1 c=0.8]', 8)
  halves = [rows_of(corpus, '[a=0.5 b=0.3 c=0.2, 5 a=0.1 b=0.1 c=0.8]', 8, p, 2)[0] for p in range(2)]
  assert [first + second for first, second in zip(*halves)] == one


def test_a_source_that_runs_out_says_so_once(corpus, capsys):
  """Every stream reads its share of each source's records; the first to reach the second epoch says so."""
  rows_of(corpus, '[a=0.5 b=0.3 c=0.2]', 60)  # every stream reads 2 or more records of each source
  out = capsys.readouterr().out
  records = [len(documents) for documents in mixture_documents(load_config('gpt_tiny', [*corpus,
                                                                                        'data.weights=[a=1]']).data)]
  for name, count in zip('abc', records):
    line = (f'data: data.mixture source {name} starts its second epoch, in a new order (its {count} records all '
            f'dealt out to the streams)')
    assert out.count(line) == 1, out


# Resumed under the tests' loop emitters its losses part from the straight run's by 1 ulp from step 5 (with or
# without the compilation cache; cause not yet found: tests/README.md); XLA's default emitters resume it exactly.
@pytest.mark.long(0.1)
@pytest.mark.fusion_emitters
def test_a_mixture_run_logs_each_sources_tokens_and_resumes_exactly(corpus, small_config, tmp_path):
  mix = [*corpus, 'data.weights=[a=0.5 b=0.3 c=0.2, 3 a=0.2 b=0 c=0.8]', 'train.log_every=1', 'mesh.data=-1']
  straight = small_config(*mix, 'train.steps=6', f'train.run_dir={tmp_path}/straight')
  assert cli.main(['train', '--config', str(write(straight, tmp_path / 's.yaml'))]) == 0
  first = small_config(*mix, 'train.steps=2', f'train.run_dir={tmp_path}/resumed', 'train.checkpoint.every=2')
  assert cli.main(['train', '--config', str(write(first, tmp_path / 'r.yaml'))]) == 0
  assert cli.main(['train', '--config', str(write(first, tmp_path / 'r.yaml')), '--resume', 'train.steps=6']) == 0
  a, b = read_metrics(tmp_path / 'straight'), read_metrics(tmp_path / 'resumed')
  losses = lambda records: {r['step']: r['loss'] for r in records if 'loss' in r}
  assert losses(a) == losses(b) and len(losses(a)) == 6
  tokens = {r['step']: r for r in a if 'data/a/tokens' in r}
  row = 33  # seq_len + 1 tokens a causal row
  assert tokens[2]['data/a/tokens'] == 16 * row and tokens[2]['data/b/tokens'] == 10 * row  # 2 steps of 16 rows
  assert tokens[6]['data/b/tokens'] == tokens[3]['data/b/tokens']  # no b from step 3
  assert tokens[6]['data/c/tokens'] - tokens[3]['data/c/tokens'] == pytest.approx(0.8 * 3 * 16 * row, abs=row)
  assert [r for r in b if 'data/a/tokens' in r][-1] == tokens[6]


def write(config, path):
  path.write_text(config.to_yaml())
  return path


@pytest.mark.parametrize('weights, needle', [
  ('[a=0.5 b=-0.5 c=1]', "'b=-0.5' is not NAME=WEIGHT with a weight >= 0"),
  ('[a=0 b=0 c=0]', 'gives every source weight 0; give some source a positive share'),
  ('[a=0.5 d=0.5]', "names 'd', no data.mixture source (a, b, c)"),
  ('[a=0.5 b=0.5, c=1]', 'the first stage starts at step 0 and each later one at a larger step'),
])
def test_bad_weights_are_one_line_and_write_nothing(corpus, tmp_path, capsys, weights, needle):
  run = tmp_path / 'run'
  assert cli.main(['train', '--config', 'gpt_tiny', *corpus, f'data.weights={weights}',
                   f'train.run_dir={run}']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err, err
  assert not run.exists()


def test_a_mixture_without_weights_is_refused(corpus):
  with pytest.raises(ConfigError, match='data.mixture and data.weights go together'):
    load_config('gpt_tiny', corpus)
