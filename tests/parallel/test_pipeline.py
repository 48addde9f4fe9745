"""`lm.parallel.pipeline.pipelined`: the layer stack over the `stage` mesh axis (GPipe; circular with repeats) equals
the layers applied in turn, loss and gradients (params and inputs), with the batch split over the other mesh axis
by XLA; bubbles filled with NaN change nothing; the compiled tick loops run the schedule table's ticks with one
stage-to-stage send each."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lm.parallel.pipeline import pipelined
from lm.parallel.schedules import table


def layer(w, x):
  return jnp.tanh(x @ w['w'] + w['b'])


def sequential(params, xs):
  repeats, stages = params['w'].shape[:2]
  for j in range(repeats):
    for s in range(stages):
      xs = layer(jax.tree.map(lambda a: a[j, s], params), xs)
  return xs


def setup(stages, repeats, microbatches):
  mesh = Mesh(np.array(jax.devices()).reshape(stages, -1), ('stage', 'data'), axis_types=(AxisType.Auto,) * 2)
  k = jax.random.split(jax.random.key(0), 3)
  params = {'w': jax.random.normal(k[0], (repeats, stages, 16, 16)) / 4,
            'b': jax.random.normal(k[1], (repeats, stages, 16)) / 4}
  xs = jax.device_put(jax.random.normal(k[2], (microbatches, 8, 16)), NamedSharding(mesh, P(None, 'data')))
  return mesh, params, xs


def loss_and_grads(mesh, params, xs, bubble=0.0):
  loss = lambda p, x: (pipelined(layer, p, x, mesh, bubble=bubble) ** 2).mean()
  return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, xs)


@pytest.mark.parametrize('stages, repeats, microbatches', [(4, 1, 4), (4, 1, 8), (2, 1, 3), (4, 2, 4), (2, 3, 5)])
def test_pipelined_equals_the_layers_in_turn(stages, repeats, microbatches):
  mesh, params, xs = setup(stages, repeats, microbatches)
  value, grads = loss_and_grads(mesh, params, xs)
  want, want_grads = jax.value_and_grad(lambda p, x: (sequential(p, x) ** 2).mean(), (0, 1))(params, xs)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  flat, got = jax.tree.leaves(want_grads), jax.tree.leaves(grads)
  scale = max(np.abs(g).max() for g in flat)
  for g, w in zip(got, flat):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
  nan_value, nan_grads = loss_and_grads(mesh, params, xs, bubble=float('nan'))
  assert nan_value == value
  for g, n in zip(got, jax.tree.leaves(nan_grads)):
    np.testing.assert_array_equal(n, g)


def test_the_tick_loops_run_the_tables_ticks_with_one_send_each():
  mesh, params, xs = setup(4, 2, 4)
  loss = lambda p, x: (pipelined(layer, p, x, mesh) ** 2).mean()
  text = jax.jit(jax.grad(loss)).lower(params, xs).compile().as_text()
  ticks = table('circular', 4, 4, 2).forward_ticks
  assert ticks == 4 * 2 + 4 - 1
  assert re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text) == [str(ticks)] * 2  # forward, backward
  assert text.count('collective-permute(') == 2


def test_circular_needs_as_many_microbatches_as_stages():
  mesh, params, xs = setup(4, 2, 3)
  with pytest.raises(ValueError, match=r'the circular schedule needs at least as many microbatches as stages'):
    pipelined(layer, params, xs, mesh)
