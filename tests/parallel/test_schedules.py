"""Pipeline tick tables (`lm.parallel.schedules`): every table runs each forward and backward exactly once, after
what it depends on; GPipe's and the circular bubble are the published (p-1)/(r m+p-1); 1F1B keeps GPipe's bubble
while holding 2 (p - s) - 1 microbatches at stage s whatever m (GPipe holds m r)."""
import itertools

import pytest

from lm.parallel.schedules import SCHEDULES, table

CASES = [('gpipe', p, m, 1) for p, m in [(1, 3), (2, 2), (2, 8), (4, 4), (4, 16), (8, 8)]] + \
        [('circular', p, m, r) for p, m, r in [(2, 2, 3), (4, 4, 2), (4, 8, 2), (4, 16, 8)]] + \
        [('1f1b', p, m, 1) for p, m in [(1, 3), (2, 1), (2, 8), (4, 3), (4, 8), (4, 32), (8, 16)]]


def runs(t):
  """{(kind, stage, microbatch, repeat): tick}, checking that nothing runs twice."""
  seen = {}
  for tick, stages in enumerate(t.ticks):
    assert len(stages) == t.stages
    for stage, slots in enumerate(stages):
      assert [x.kind for x in slots] in (['F'], ['B'], ['F', 'B'], [])  # at most one of each, F first
      for x in slots:
        key = (x.kind, stage, x.microbatch, x.repeat)
        assert key not in seen, key
        seen[key] = tick
  return seen


@pytest.mark.parametrize('schedule, p, m, r', CASES)
def test_each_pass_runs_once_after_what_it_needs(schedule, p, m, r):
  t = table(schedule, p, m, r)
  ran = runs(t)
  want = {(k, s, i, j) for k, s, i, j in itertools.product('FB', range(p), range(m), range(r))}
  assert set(ran) == want
  for _, s, i, j in want:
    f, b = ran['F', s, i, j], ran['B', s, i, j]
    if s > 0:  # the previous stage's output arrives by the next tick
      assert f > ran['F', s - 1, i, j]
    elif j > 0:  # a circular repeat re-enters from the last stage
      assert f > ran['F', p - 1, i, j - 1]
    if s < p - 1:
      assert b > ran['B', s + 1, i, j]
    elif j < r - 1:
      assert b > ran['B', 0, i, j + 1]
    else:  # the loss: in the last forward's own tick at the earliest
      assert b >= f
    assert b >= f


@pytest.mark.parametrize('schedule, p, m, r', CASES)
def test_the_bubble_is_the_published_one(schedule, p, m, r):
  t = table(schedule, p, m, r)
  for backward in (1.0, 2.0):
    assert t.bubble(1.0, backward) == pytest.approx((p - 1) / (r * m + p - 1))


def test_1f1b_holds_a_bound_in_p_and_gpipe_holds_every_microbatch():
  for p in (2, 4, 8):
    for m in (2 * p, 8 * p):
      assert table('1f1b', p, m).in_flight() == [2 * (p - s) - 1 for s in range(p)]
      assert table('gpipe', p, m).in_flight() == [m] * p
  assert table('circular', 4, 8, 2).in_flight() == [16] * 4


@pytest.mark.parametrize('p, m', [(p, m) for p in range(1, 9) for m in (1, 2, 3, p, 2 * p + 1, 4 * p)])
def test_each_1f1b_input_arrives_the_tick_before_it_is_used(p, m):
  """So the tick loop (lm.parallel.one_f_one_b) needs one receive buffer each way, no inbox; the last stage's
  backward takes the gradient of its own forward of that tick."""
  when = {(x.kind, s, x.microbatch): t for t, tick in enumerate(table('1f1b', p, m).ticks)
          for s, slots in enumerate(tick) for x in slots}
  for (kind, s, i), t in when.items():
    if kind == 'F' and s > 0:
      assert when['F', s - 1, i] == t - 1
    if kind == 'B':
      assert when['B', s + 1, i] == t - 1 if s < p - 1 else when['F', s, i] == t


@pytest.mark.parametrize('schedule, p, m, r', CASES)
def test_ticks_and_sends(schedule, p, m, r):
  t = table(schedule, p, m, r)
  assert len(t.ticks) == (m + 2 * (p - 1) if schedule == '1f1b' else 2 * (r * m + p - 1))
  # every forward hands its output on but the last stage's last repeat's; every backward but the first stage's first
  assert t.sends() == 2 * (r * m * p - m)


@pytest.mark.parametrize('args, message', [
  (('zb', 4, 8), "schedule 'zb': choose among " + ', '.join(SCHEDULES)),
  (('circular', 4, 2, 2), 'the circular schedule needs at least as many microbatches as stages'),
  (('gpipe', 4, 8, 2), 'gpipe passes the stages once'),
  (('1f1b', 0, 8), '0 stages, 8 microbatches and 1 repeats must each be at least 1')])
def test_bad_tables_are_one_line(args, message):
  with pytest.raises(ValueError, match=message):
    table(*args)
