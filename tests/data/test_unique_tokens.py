"""`data.unique_tokens`: training on a source's first documents up to a token count, repeated in epochs."""
from functools import partial

import jax
import numpy as np
import pytest

from lm.config import ConfigError, load_config
from lm.data.pipeline import capped, training_batches
from lm.data.sources import TextList
from lm.data.tokenizers import get_tokenizer
from lm.models import make_objective
from lm.parallel.mesh import make_mesh

TINY = ['data.seq_len=64', 'train.global_batch=8', 'data.streams=2']
WORDS = ['alpha beta gamma ', 'delta epsilon ', 'zeta eta theta iota ', 'kappa lambda mu ']


def corpus(tmp_path, count=400):
  """JSON lines of numbered sentences: every document's text names its index."""
  import json
  path = tmp_path / 'docs.jsonl'
  path.write_text(''.join(json.dumps({'text': f'<doc {i}> ' + WORDS[i % 4] * (1 + i % 5)}) + '\n'
                          for i in range(count)))
  return path


def test_the_cap_is_the_shortest_prefix_holding_the_tokens():
  docs = TextList(['a' * 10, 'b' * 20, 'c' * 30, 'd' * 40])
  byte = get_tokenizer('byte')
  found, total = capped(docs, byte, 32)  # 11 + 21 = 32 with each EOS
  assert (len(found), total) == (2, 32) and [found[i] for i in range(2)] == ['a' * 10, 'b' * 20]
  assert len(capped(docs, byte, 33)[0]) == 3 and len(capped(docs, byte, 10 ** 6)[0]) == 4
  with pytest.raises(IndexError):
    found[2]


def test_training_reads_only_the_capped_documents_and_says_when_they_come_round(tmp_path, capsys):
  """Every row's text comes from the first documents the cap keeps (by their index markers), all of them are
  read, the second epoch is said once; a cap below one sequence, or beside a mixture, is one line."""
  path = corpus(tmp_path)
  config = load_config('gpt_tiny', TINY + ['data.source=jsonl', f'data.paths=[{path}]', 'data.unique_tokens=2000',
                                           'data.val_fraction=0'])
  tokenizer, batches = training_batches(config, make_mesh(config.mesh, jax.devices()[:1]),
                                        partial(make_objective, config))
  out = capsys.readouterr().out
  kept = int(out.split('the first ')[1].split(' documents')[0])
  assert 20 < kept < 400 and 'repeated in epochs' in out, out
  seen = set()
  for _ in range(60):
    rows = np.asarray(next(batches)['inputs'])
    text = bytes(int(t) - 4 for t in rows.ravel() if int(t) >= 4).decode('utf-8', 'replace')
    seen |= {int(marker.split('>')[0]) for marker in text.split('<doc ')[1:] if marker.split('>')[0].isdigit()}
  assert seen == set(range(kept)), sorted(set(range(kept)) ^ seen)
  assert capsys.readouterr().out.count('starts its second epoch') == 1
  with pytest.raises(ConfigError, match='data.unique_tokens=32 is less than one sequence'):
    load_config('gpt_tiny', TINY + ['data.unique_tokens=32'])
