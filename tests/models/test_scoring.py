"""The scoring seam (`Scoring.rows` + `Family.score`, jitted by `make_score_step`): per example, a
continuation's summed log-probability, token count and greediness, against float64 NumPy from the model's own
logits on each pair alone (no padding, no batch)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.assembly import assemble
from lm.config import ConfigError, load_config
from lm.data.pipeline import global_rows
from lm.models.family import scoring_of
from lm.train.step import make_score_step

SMALL = ['model.d_model=64', 'model.num_layers=2', 'model.num_heads=4', 'model.d_ff=128',
         'model.execution.dtype=float32', 'train.global_batch=8']
MESHES = {'1 device': (1, ['mesh.data=1']), 'data x fsdp': (8, ['mesh.data=2', 'mesh.fsdp=4'])}
LENGTH = 16
# Gemma 2 with a 4-token window (shorter than contexts and continuations): layer 0 windowed (its cache a ring of 4
# slots), layer 1 global, both soft-capped
VARIANTS = {'gemma2_window': ('gemma2_tiny', ['model.sliding_window=4', 'model.attention_scale_dim=16'])}


def log_softmax64(logits) -> np.ndarray:
  x = np.asarray(logits, np.float64)
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@functools.cache
def jitted_apply(model):
  return jax.jit(lambda p, *xs: model.apply({'params': p}, *xs))


def causal_row(tokens) -> jnp.ndarray:
  """`tokens` as one row, right-padded to a fixed width (one compile): causal positions never see what follows."""
  return jnp.asarray([list(tokens) + [0] * (2 * LENGTH - len(tokens))], jnp.int32)


def reference_logits(assembly, params, context, continuation) -> np.ndarray:
  """The model's logits for the continuation's tokens, [len(continuation), vocab], from this pair alone."""
  apply, n = jitted_apply(assembly.model), len(continuation)
  if assembly.family.decoding.shares_context:
    return np.asarray(apply(params, causal_row(list(context) + list(continuation)[:-1])))[0, len(context) - 1:][:n]
  encoded = jnp.asarray([list(context)], jnp.int32)  # unpadded: the encoder attends both ways
  return np.asarray(apply(params, encoded, causal_row([0] + list(continuation)[:-1])))[0, :n]


def config(preset, mesh, scan=False):
  preset, overrides = VARIANTS.get(preset, (preset, []))
  return load_config(preset, SMALL + overrides + MESHES[mesh][1] + [f'model.execution.scan_layers={str(scan).lower()}'])


@functools.cache
def reference(preset, scan=False):
  """(pairs, each pair's float64 log-probabilities of every position of its continuation) on one device; the
  last pair's continuation is the model's greedy one (3 tokens)."""
  assembly = assemble(config(preset, '1 device', scan), jax.devices()[:1])
  params = assembly.init_state().params
  rng = np.random.default_rng(0)
  words = lambda n: rng.integers(3, 250, n).tolist()
  pairs = [(words(5), words(1)), (words(3), words(7)), (words(9), words(2)), (words(1), words(4)),
           (words(12), words(3)), (words(2), words(1)), (words(6), words(6))]
  context, greedy = words(4), []
  for _ in range(3):
    greedy.append(int(np.argmax(reference_logits(assembly, params, context, greedy + [0])[-1])))
  pairs.append((context, greedy))
  return pairs, [log_softmax64(reference_logits(assembly, params, *pair)) for pair in pairs]


@pytest.mark.parametrize('mesh', MESHES)
@pytest.mark.parametrize('preset', ['gpt_tiny', *(pytest.param(p, marks=pytest.mark.long(0.2))
                                                for p in ('llama_tiny', 't5_tiny'))])  # the fast tier: GPT
@pytest.mark.variants
def test_scores_equal_a_float64_reference_from_the_models_own_logits(preset, mesh):
  """Rows of several lengths padded to one, in one batch split over the mesh (the same seed's params)."""
  pairs, log_probs = reference(preset)
  assembly = assemble(config(preset, mesh), jax.devices()[:MESHES[mesh][0]])
  rows = assembly.family.scoring.rows(pairs, LENGTH, pad_id=0)
  got = jax.device_get(make_score_step(assembly)(assembly.init_state().params, global_rows(assembly.mesh, rows)))
  for i, ((_, continuation), lp) in enumerate(zip(pairs, log_probs)):
    assert got['logprob'][i] == pytest.approx(lp[np.arange(len(continuation)), continuation].sum(), rel=1e-5), i
    assert got['tokens'][i] == len(continuation)
    assert bool(got['greedy'][i]) == all(np.argmax(lp, axis=-1) == continuation), i
  assert bool(got['greedy'][-1]) and not got['greedy'][1]  # both outcomes occur


@pytest.mark.parametrize('mesh', ['1 device', pytest.param('data x fsdp', marks=pytest.mark.long(0.2))])
@pytest.mark.parametrize('preset, scan', [
  ('gpt_tiny', False), pytest.param('gemma2_window', False, marks=pytest.mark.long(0.2)),
  *(pytest.param(p, scan, marks=pytest.mark.long(0.2)) for p, scan in (('llama_tiny', True), ('t5_tiny', False)))])
def test_shared_contexts_score_as_each_pair_alone(preset, scan, mesh):
  """Each context computed once (decoders: a KV cache prefilled, its rows taken for each continuation, scanned
  layers putting the cache's batch on axis 1; T5: the encoding, its rows taken likewise): the same float64
  reference, with contexts of one token, continuations of one and of many, and unused rows."""
  pairs, log_probs = reference(preset, scan)
  assembly = assemble(config(preset, mesh, scan), jax.devices()[:MESHES[mesh][0]])
  family = assembly.family
  # Two continuations per context: the pair's own and the last pair's (scored after this context too).
  contexts = [context for context, _ in pairs]
  continuations = [c for _, own in pairs for c in (own, pairs[-1][1])]
  owners = [i for i in range(len(pairs)) for _ in range(2)]
  rows = family.scoring.shared_rows(contexts + [[0]] * 8, continuations + [[0]] * 8, owners + [0] * 8,
                                    context_length=LENGTH, continuation_length=8, pad_id=0)
  step, params = make_score_step(assembly, family.scoring.score_shared), assembly.init_state().params
  got = jax.device_get(step(params, global_rows(assembly.mesh, rows)))
  for i, ((context, continuation), lp) in enumerate(zip(pairs, log_probs)):
    assert got['logprob'][2 * i] == pytest.approx(lp[np.arange(len(continuation)), continuation].sum(), rel=1e-5), i
    assert got['tokens'][2 * i] == len(continuation)
    assert bool(got['greedy'][2 * i]) == all(np.argmax(lp, axis=-1) == continuation), i
    other = log_softmax64(reference_logits(assembly, params, context, pairs[-1][1]))
    assert got['logprob'][2 * i + 1] == pytest.approx(other[np.arange(3), pairs[-1][1]].sum(), rel=1e-5), i


def test_a_context_longer_than_the_row_is_cut_from_the_left():
  assembly = assemble(config('gpt_tiny', '1 device'), jax.devices()[:1])
  params = assembly.init_state().params
  context, continuation = list(range(10, 40)), [7, 8]
  rows = assembly.family.scoring.rows([(context, continuation)], LENGTH, pad_id=0)
  kept = (context + continuation)[-(LENGTH + 1):]
  assert rows['inputs'][0].tolist() == kept[:-1] and rows['targets'][0].tolist() == kept[1:]
  got = jax.device_get(make_score_step(assembly)(params, global_rows(assembly.mesh, rows)))
  log_probs = log_softmax64(reference_logits(assembly, params, kept[:-2], continuation))
  assert got['logprob'][0] == pytest.approx(log_probs[[0, 1], continuation].sum(), rel=1e-5)


def test_an_encoder_gives_no_continuation_scores():
  assembly = assemble(load_config('bert_tiny', ['mesh.data=1']), jax.devices()[:1])
  with pytest.raises(ConfigError, match='not a generative model'):
    scoring_of(assembly.family)
