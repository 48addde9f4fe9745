"""`lm.parallel.one_f_one_b`: the 1F1B tick loop's loss and gradients (params, head, inputs) equal the layers applied
in turn with the loss summed over microbatches; NaN in the stages' buffers changes nothing; the compiled loop runs
the table's ticks with two stage-to-stage sends each; its temporaries stay flat as the microbatches grow from 2p to
8p while GPipe's grow with them."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lm.parallel.one_f_one_b import one_f_one_b
from lm.parallel.pipeline import pipelined
from lm.parallel.schedules import table

LAYERS_PER_STAGE, WIDTH, HIDDEN, ROWS = 3, 16, 128, 8


def block(w, x):
  return x + jnp.tanh(x @ w['up']) @ w['down']


def stage(w, x, side):
  """A stage's layers [layers per stage, ...] in turn."""
  return jax.lax.scan(lambda x, w: (block(w, x), None), x, w)[0] * side['scale']


def stage_with_own_loss(w, x, side):
  """A stage whose layers add a loss of their own (as routed layers' balance loss) and report stats."""
  y = stage(w, x, side)
  return y, (jnp.mean(y ** 2) / 10, {'mean': jnp.mean(y)})


def loss(head, y, side):
  """The microbatch's loss, and a sum reported beside it."""
  err = y @ head - side['target']
  return jnp.sum(err ** 2) / 100, {'abs_err': jnp.sum(jnp.abs(err))}


def setup(stages, microbatches):
  mesh = Mesh(np.array(jax.devices()).reshape(stages, -1), ('stage', 'data'), axis_types=(AxisType.Auto,) * 2)
  k = jax.random.split(jax.random.key(0), 5)
  params = {'up': jax.random.normal(k[0], (stages, LAYERS_PER_STAGE, WIDTH, HIDDEN)) / 4,
            'down': jax.random.normal(k[1], (stages, LAYERS_PER_STAGE, HIDDEN, WIDTH)) / 16}
  head = jax.random.normal(k[2], (WIDTH, 4))
  xs = jax.device_put(jax.random.normal(k[3], (microbatches, ROWS, WIDTH)), NamedSharding(mesh, P(None, 'data')))
  sides = {'target': jax.random.normal(k[4], (microbatches, ROWS, 4)),
           'scale': 1 + jnp.arange(microbatches, dtype=jnp.float32)[:, None, None] / 10}
  return mesh, params, head, xs, sides


def sequential(params, head, xs, sides, layer=stage):
  """The loss summed over microbatches, each through the stages in turn; with `stage_with_own_loss`, its losses added
  and its stats as [stages, m]."""
  total, sums, stats = 0.0, {'abs_err': 0.0}, []
  for i in range(xs.shape[0]):
    x, side = xs[i], jax.tree.map(lambda a: a[i], sides)
    for s in range(params['up'].shape[0]):
      x = layer(jax.tree.map(lambda a: a[s], params), x, side)
      if layer is stage_with_own_loss:
        x, (own, stat) = x
        total, stats = total + own, stats + [(s, i, stat['mean'])]
    value, sums_i = loss(head, x, side)
    total, sums = total + value, jax.tree.map(jnp.add, sums, sums_i)
  if not stats:
    return total, (sums, None)
  return total, (sums, jnp.stack([jnp.stack([mean for t, _, mean in stats if t == s])
                                  for s in range(params['up'].shape[0])]))


def value_and_grads(mesh, params, head, xs, sides, bubble=0.0, layer=stage):
  run = lambda p, h, x: one_f_one_b(layer, loss, p, h, x, mesh, sides, bubble=bubble)
  return jax.jit(jax.value_and_grad(run, (0, 1, 2), has_aux=True))(params, head, xs)


@pytest.mark.parametrize('stages, microbatches, layer', [(4, 8, stage), (4, 3, stage), (2, 5, stage), (1, 2, stage),
                                                         (4, 6, stage_with_own_loss)])
def test_one_f_one_b_equals_the_layers_in_turn(stages, microbatches, layer):
  mesh, params, head, xs, sides = setup(stages, microbatches)
  (value, (sums, stats)), grads = value_and_grads(mesh, params, head, xs, sides, layer=layer)
  (want, (want_sums, want_stats)), want_grads = jax.value_and_grad(
    lambda p, h, x: sequential(p, h, x, sides, layer), (0, 1, 2), has_aux=True)(params, head, xs)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  np.testing.assert_allclose(sums['abs_err'], want_sums['abs_err'], rtol=1e-6)
  if layer is stage_with_own_loss:
    np.testing.assert_allclose(stats['mean'], want_stats, rtol=1e-6)
  flat, got = jax.tree.leaves(want_grads), jax.tree.leaves(grads)
  scale = max(np.abs(g).max() for g in flat)
  for g, w in zip(got, flat):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
  (nan_value, (nan_sums, _)), nan_grads = value_and_grads(mesh, params, head, xs, sides, bubble=float('nan'),
                                                          layer=layer)
  assert nan_value == value and nan_sums == sums
  for g, n in zip(got, jax.tree.leaves(nan_grads)):
    np.testing.assert_array_equal(n, g)


def compiled(schedule, stages, microbatches):
  mesh, params, head, xs, sides = setup(stages, microbatches)
  if schedule == '1f1b':
    run = lambda p, h, x: one_f_one_b(stage, loss, p, h, x, mesh, sides)[0]
  else:
    run = lambda p, h, x: sum(loss(h, y, jax.tree.map(lambda a: a[i], sides))[0] for i, y in enumerate(
      pipelined(stage, jax.tree.map(lambda a: a[None], p), x, mesh, sides)))
  return jax.jit(jax.grad(run, (0, 1, 2))).lower(params, head, xs).compile()


def test_the_tick_loop_runs_the_tables_ticks_with_two_sends_each():
  text = compiled('1f1b', 4, 8).as_text()
  ticks = len(table('1f1b', 4, 8).ticks)
  assert ticks == 8 + 2 * 4 - 2
  loops = re.findall(r'while\(.*body=(%[\w.-]+).*"known_trip_count":\{"n":"(\d+)"\}', text)
  bodies = [body for body, trips in loops if int(trips) == ticks]
  assert len(bodies) == 1, loops
  body = re.search(rf'^{re.escape(bodies[0])} .*?^}}', text, re.M | re.S)[0]
  assert body.count('collective-permute(') == 2


def test_its_temporaries_stay_flat_as_microbatches_grow_and_gpipes_do_not():
  p = 2
  temp = lambda schedule, m: compiled(schedule, p, m).memory_analysis().temp_size_in_bytes
  one_f, gpipe = [temp('1f1b', m) for m in (2 * p, 8 * p)], [temp('gpipe', m) for m in (2 * p, 8 * p)]
  assert one_f[1] <= 1.1 * one_f[0], one_f
  assert gpipe[1] >= 2.5 * gpipe[0], gpipe
