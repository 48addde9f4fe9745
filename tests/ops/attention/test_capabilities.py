"""The capability table is what dispatch and config validation both obey: for every implementation (and the ring
each choice runs on a split sequence) and every feature a config can ask, the config check accepts exactly where the
table says so, and a call to `attention` refuses in the same words the config check does."""
import itertools

import jax
import jax.numpy as jnp
import pytest

from lm.config import ConfigError, load_config
from lm.models import check_config
from lm.ops.attention import attention
from lm.ops.attention.capabilities import FEATURES, RING, TABLE, missing, pick_impl, refusal
from lm.config import MeshConfig
from lm.parallel.mesh import make_mesh
from lm.parallel.rules import sharding_context

# A config field that asks each feature, and the same ask of one `attention` call.
ASKS = {'window': (['model.sliding_window=4'], {'window': 4}),
        'softcap': (['model.attn_logit_softcap=30'], {'softcap': 30.0}),
        'dropout': (['model.attention_dropout=0.1'], {'dropout_rate': 0.1, 'dropout_rng': jax.random.key(0)}),
        'bias': (None, {'bias': jnp.zeros((1, 2, 8, 8))}),
        'sinks': (['model.attention_sinks=true'], {'sinks': jnp.zeros((2,))})}
KERNELS = [name for name in TABLE if name not in RING.values()]


def config(impl: str, sequence: int, *overrides: str):
  return load_config('llama_tiny', ['model.num_layers=2', 'model.d_model=32', 'model.num_heads=2',
                                    'model.num_kv_heads=1', 'model.d_ff=64', 'model.max_len=32', 'data.seq_len=32',
                                    'mesh.data=1', f'mesh.sequence={sequence}',
                                    f'model.execution.attention_impl={impl}', *overrides])


@pytest.mark.parametrize('choice, sequence', [(k, 1) for k in KERNELS] + [(c, 2) for c in RING])
@pytest.mark.parametrize('feature', [f for f in ASKS if ASKS[f][0]])
def test_config_validation_accepts_exactly_what_the_table_says(choice, sequence, feature):
  """Loading runs the check (the models register it); `check_config` is the same check on a config built in code."""
  name = RING[choice] if sequence > 1 else choice
  if getattr(TABLE[name], feature):
    cfg = config(choice, sequence, *ASKS[feature][0])
    assert check_config(cfg) is cfg
  else:
    with pytest.raises(ConfigError) as refused:
      config(choice, sequence, *ASKS[feature][0])
    assert str(refused.value) == refusal(name, [feature])


@pytest.mark.parametrize('name, feature', [(k, f) for k, f in itertools.product(KERNELS, ASKS)
                                           if not getattr(TABLE[k], f)])
def test_dispatch_refuses_in_the_same_words(name, feature):
  q = jnp.ones((1, 8, 2, 4))
  with pytest.raises(ValueError) as refused:
    attention(q, q, q, causal=True, impl=name, **ASKS[feature][1])
  assert str(refused.value) == refusal(name, [feature])


def test_the_ring_refuses_what_its_blocks_lack_in_the_same_words():
  mesh = make_mesh(MeshConfig(data=1, sequence=2), jax.devices()[:2])
  q = jnp.ones((1, 8, 2, 4))
  with sharding_context(mesh):
    with pytest.raises(ValueError) as refused:
      jax.jit(lambda q: attention(q, q, q, causal=True, impl='flash', window=4))(q)
  assert str(refused.value) == refusal('ring_flash', ['window'])


def test_auto_picks_the_platform_kernel_only_where_it_serves_the_call():
  assert pick_impl('tpu', set()) == 'flash' and pick_impl('tpu', {'window', 'bias'}) == 'flash'
  assert pick_impl('tpu', {'dropout'}) == 'xla' and pick_impl('gpu', {'window'}) == 'xla'
  assert pick_impl('gpu', {'bias'}) == 'cudnn' and pick_impl('cpu', set()) == 'xla'
  assert missing('xla', set(FEATURES)) == []  # the fallback serves everything


def test_the_documented_table_is_the_table():
  """docs/parallelism.md's capability table says what TABLE says."""
  from pathlib import Path
  page = (Path(__file__).resolve().parents[3] / 'docs/parallelism.md').read_text().splitlines()
  start = page.index('| | grouped KV in place | window | soft-cap | bias | dropout | mask | cross | sinks | platforms |')
  rows = [line.split('|')[1:-1] for line in page[start + 2:start + 2 + len(TABLE)]]
  names = [*KERNELS, 'ring', 'ring_flash']
  for name, row in zip(names, rows, strict=True):
    flags = [cell.strip() == 'yes' for cell in row[1:9]]
    row_table = TABLE[name]
    assert flags == [row_table.grouped_kv, *(getattr(row_table, f) for f in FEATURES)], name
    assert ('cpu interpreted' in row[9] or 'cpu,' in row[9]) == ('cpu' in row_table.platforms), name
