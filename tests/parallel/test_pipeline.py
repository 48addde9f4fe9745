"""`lm.parallel.pipeline.pipelined`: the layer stack over the `stage` mesh axis (GPipe; circular with repeats) equals
the layers applied in turn, loss and gradients (params and inputs), with the batch split over the other mesh axis
by XLA, a stage holding two layers (scanned, rematerialized) and each microbatch's side input (a mask) read where it
runs; bubbles filled with NaN change nothing; the compiled tick loops run the schedule table's ticks with one
stage-to-stage send each."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lm.parallel.pipeline import pipelined
from lm.parallel.schedules import table


LAYERS_PER_STAGE = 2


def layer(w, x, mask):
  return jnp.tanh(x @ w['w'] + w['b']) * mask[:, None]


def stage(w, x, mask):
  """A stage's layers [layers per stage, ...] in turn, each rematerialized."""
  step = jax.checkpoint(lambda x, w: (layer(w, x, mask), None))
  return jax.lax.scan(step, x, w)[0]


def sequential(params, xs, masks):
  repeats, stages = params['w'].shape[:2]
  for j in range(repeats):
    for s in range(stages):
      for k in range(LAYERS_PER_STAGE):
        xs = jax.vmap(layer, (None, 0, 0))(jax.tree.map(lambda a: a[j, s, k], params), xs, masks)
  return xs


def setup(stages, repeats, microbatches):
  mesh = Mesh(np.array(jax.devices()).reshape(stages, -1), ('stage', 'data'), axis_types=(AxisType.Auto,) * 2)
  k = jax.random.split(jax.random.key(0), 4)
  params = {'w': jax.random.normal(k[0], (repeats, stages, LAYERS_PER_STAGE, 16, 16)) / 4,
            'b': jax.random.normal(k[1], (repeats, stages, LAYERS_PER_STAGE, 16)) / 4}
  xs = jax.device_put(jax.random.normal(k[2], (microbatches, 8, 16)), NamedSharding(mesh, P(None, 'data')))
  masks = (jax.random.uniform(k[3], (microbatches, 8)) > 0.3).astype(jnp.float32)
  return mesh, params, xs, masks


def loss_and_grads(mesh, params, xs, masks, bubble=0.0):
  loss = lambda p, x: (pipelined(stage, p, x, mesh, masks, bubble=bubble) ** 2).mean()
  return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, xs)


@pytest.mark.parametrize('stages, repeats, microbatches', [(4, 1, 4), (4, 1, 8), (2, 1, 3), (4, 2, 4), (2, 3, 5)])
def test_pipelined_equals_the_layers_in_turn(stages, repeats, microbatches):
  mesh, params, xs, masks = setup(stages, repeats, microbatches)
  value, grads = loss_and_grads(mesh, params, xs, masks)
  want, want_grads = jax.value_and_grad(lambda p, x: (sequential(p, x, masks) ** 2).mean(), (0, 1))(params, xs)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  flat, got = jax.tree.leaves(want_grads), jax.tree.leaves(grads)
  scale = max(np.abs(g).max() for g in flat)
  for g, w in zip(got, flat):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
  nan_value, nan_grads = loss_and_grads(mesh, params, xs, masks, bubble=float('nan'))
  assert nan_value == value
  for g, n in zip(got, jax.tree.leaves(nan_grads)):
    np.testing.assert_array_equal(n, g)


def test_the_tick_loops_run_the_tables_ticks_with_one_send_each():
  mesh, params, xs, masks = setup(4, 2, 4)
  loss = lambda p, x: (pipelined(stage, p, x, mesh, masks) ** 2).mean()
  text = jax.jit(jax.grad(loss)).lower(params, xs).compile().as_text()
  ticks = table('circular', 4, 4, 2).forward_ticks
  assert ticks == 4 * 2 + 4 - 1
  trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)  # the tick loops, and the stage's layer loops
  assert trips.count(str(ticks)) == 2 and set(trips) == {str(ticks), str(LAYERS_PER_STAGE)}  # forward, backward
  assert text.count('collective-permute(') == 2


def test_circular_needs_as_many_microbatches_as_stages():
  mesh, params, xs, masks = setup(4, 2, 3)
  with pytest.raises(ValueError, match=r'the circular schedule needs at least as many microbatches as stages'):
    pipelined(stage, params, xs, mesh, masks)
