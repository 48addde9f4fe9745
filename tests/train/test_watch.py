"""`train.watch_every`: per-layer-group RMS of params, gradients and updates, computed in the step, equal a NumPy
computation from the same step's tensors; logged at their steps only; absent from the program when off."""
import collections
import re

import jax
import numpy as np
import pytest

from lm.parallel.rules import sharding_context
from lm.jobs.pretraining import Pretraining
from lm.train.step import PretrainingLoss, lay_out_sequences


def numpy_groups(tree, scanned: bool) -> dict[str, float]:
  """RMS per group, by hand: a block's branch (its norms together) or the module outside the blocks; a scanned
  stack's leading axis split into layers."""
  squares, sizes = collections.defaultdict(float), collections.defaultdict(int)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [k.key for k in path]
    x = np.asarray(leaf, np.float64)
    block = next((i for i, n in enumerate(names) if re.fullmatch(r'layers(_\d+)?', n)), None)
    if block is None:
      pieces = [('/'.join(names[:-1]), x)]
    else:
      branch = 'norms' if names[block + 1].endswith('norm') else names[block + 1]
      prefix = '/'.join(names[:block])
      pieces = [(f'{prefix}/layers_{i}/{branch}', x[i]) for i in range(x.shape[0])] if scanned else \
          [(f'{prefix}/{names[block]}/{branch}', x)]
    for group, part in pieces:
      squares[group] += float(np.sum(part ** 2))
      sizes[group] += part.size
  return {group: np.sqrt(squares[group] / sizes[group]) for group in squares}


@pytest.mark.parametrize('scan', [True, pytest.param(False, marks=pytest.mark.long(0.2))], ids=['scanned', 'unrolled'])
def test_watched_norms_equal_numpy_from_the_steps_tensors(small_config, scan):
  trainer = Pretraining(small_config('train.watch_every=2', f'model.execution.scan_layers={str(scan).lower()}'),
                        jax.devices()[:1])
  state = trainer.init_state()
  state, first = trainer.train_step(state, next(trainer.train_batches))
  assert not any(k.startswith('watch/') and float(v) for k, v in first.items())  # step 1: not a watched step
  batch = next(trainer.train_batches)
  before = jax.device_get(state.params)
  # the gradient at the params step 2 starts from, on its batch and dropout key, by a jax.grad of its own
  loss, mesh = PretrainingLoss(trainer.assembly), trainer.assembly.mesh
  with sharding_context(mesh):
    laid_out = lay_out_sequences(batch, mesh, trainer.config.data.seq_len)
    rng = jax.random.fold_in(jax.random.key(trainer.config.train.seed), state.step)
    grads = jax.device_get(jax.jit(jax.grad(lambda p: loss(p, laid_out, rng, loss.totals(laid_out))[0]))(state.params))
  state, second = trainer.train_step(state, batch)
  after = jax.device_get(state.params)
  updates = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), after, before)
  for kind, tree in (('params', after), ('grads', grads), ('updates', updates)):
    want = numpy_groups(tree, scan)
    got = {k.split('/', 1)[1].rsplit('/', 1)[0]: float(v) for k, v in second.items()
           if k.startswith('watch/') and k.endswith(f'/{kind}')}
    assert sorted(got) == sorted(want)
    for group in want:
      assert got[group] == pytest.approx(want[group], rel=1e-4 if kind != 'updates' else 1e-3), (kind, group)
  layers = trainer.config.model.num_layers
  assert {g for g in want if '/layers_' in g} == {f'decoder/layers_{i}/{b}' for i in range(layers)
                                                   for b in ('attention', 'mlp', 'norms')}
  # the groups' gradients make up the global gradient norm the step logs
  total = sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads))
  assert float(second['grad_norm']) == pytest.approx(np.sqrt(total), rel=1e-4)


@pytest.mark.long(0.2)
def test_watch_logs_at_its_steps_and_is_absent_from_the_program_when_off(small_config):
  on = Pretraining(small_config('train.watch_every=2', 'train.steps=5'), jax.devices()[:1])
  records = [r for r in on.run() if 'loss' in r]
  watched = [r['step'] for r in records if any(k.startswith('watch/') for k in r)]
  assert watched == [2, 4]
  assert {'watch/token_embed/params', 'watch/decoder/layers_0/attention/grads',
          'watch/decoder/final_norm/updates'} <= set(records[1])

  off = Pretraining(small_config('train.steps=5'), jax.devices()[:1])
  state, batch = off.init_state(), next(off.train_batches)
  program = off.train_step.lower(state, batch).as_text()
  assert 'watch' not in program and 'watch' in on.train_step.lower(on.init_state(), batch).as_text()
