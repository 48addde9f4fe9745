"""Pipeline schedules as pure tick tables: which stage runs which microbatch's forward (F) or backward (B) pass, and
for which repeat (virtual stage), at each tick of one SPMD program.

p stages, m microbatches, r repeats (the layer stack passes the p stages r times: circular). In a tick every stage
runs at most one F and one B slot, in that order, and hands its outputs to its neighbour (a `ppermute`) for the next
tick; a slot with nothing to run is a bubble, masked. All stages run in step, so a tick costs an F where any stage
runs one, and a B likewise (`lax.cond` skips a slot no stage runs).

- `gpipe`: every forward, then every backward (the forward table reversed: autodiff of the tick loop); r = 1.
- `circular`: GPipe's order over r repeats, microbatch i's repeat j entering stage 0 at tick j m + i (m >= p).
- `1f1b`: each stage runs a microbatch's backward as soon as its gradient arrives and starts a forward only while it
  holds fewer than 2 (p - s) - 1 microbatches' activations (PipeDream-flush in lockstep: a hop takes a tick each way,
  so a microbatch's round trip from stage s is 2 (p - s) - 1 ticks): at most 2p - 1 in flight whatever m, against
  GPipe's m, at GPipe's bubble.

Each table says its ticks, bubble fraction, the activations each stage holds at most, and the stage-to-stage sends;
the tests check them against the published formulas (../PIPELINE-NOTES: GPipe (p-1)/(m+p-1), circular
(p-1)/(r m+p-1)).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

Kind = Literal['F', 'B']
SCHEDULES = ('gpipe', 'circular', '1f1b')


@dataclasses.dataclass(frozen=True)
class Slot:
  kind: Kind
  microbatch: int
  repeat: int = 0


@dataclasses.dataclass(frozen=True)
class Table:
  """`ticks[t][s]`: the slots stage s runs at tick t (F before B)."""
  schedule: str
  stages: int
  microbatches: int
  repeats: int
  ticks: tuple[tuple[tuple[Slot, ...], ...], ...]

  @property
  def forward_ticks(self) -> int:
    """Ticks in which some stage runs a forward: the forward tick loop's trip count (GPipe, circular)."""
    return sum(any(x.kind == 'F' for slots in tick for x in slots) for tick in self.ticks)

  def cost(self, forward: float = 1.0, backward: float = 2.0) -> float:
    """The step's time in units of one stage's forward of one microbatch (a backward costing `backward`)."""
    return sum(forward * any(x.kind == 'F' for slots in tick for x in slots) +
               backward * any(x.kind == 'B' for slots in tick for x in slots) for tick in self.ticks)

  def bubble(self, forward: float = 1.0, backward: float = 2.0) -> float:
    """The share of the step's time a stage idles."""
    busy = self.microbatches * self.repeats * (forward + backward)
    return 1 - busy / self.cost(forward, backward)

  def in_flight(self) -> list[int]:
    """Per stage, the most microbatches (times repeats) whose forward activations it holds for their backward."""
    most = []
    for s in range(self.stages):
      held, peak = 0, 0
      for tick in self.ticks:
        for slot in tick[s]:
          held += 1 if slot.kind == 'F' else -1
          peak = max(peak, held)
      most.append(peak)
    return most

  def sends(self) -> int:
    """Stage-to-stage transfers of one microbatch's activations or gradients over the step."""
    return sum(self.stage_sends())

  def stage_sends(self) -> list[int]:
    """Per stage, the transfers it sends over the step."""
    return [sum(1 for tick in self.ticks for x in tick[s] if not _last_hop(x, s, self.stages, self.repeats))
            for s in range(self.stages)]


def _last_hop(slot: Slot, stage: int, stages: int, repeats: int) -> bool:
  """A slot whose output stays on its stage: the last stage's final forward feeds the loss, the first stage's first
  backward the embedding."""
  if slot.kind == 'F':
    return stage == stages - 1 and slot.repeat == repeats - 1
  return stage == 0 and slot.repeat == 0


def table(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> Table:
  """The tick table of `schedule` (`SCHEDULES`); ValueError for a combination it cannot run."""
  if schedule not in SCHEDULES:
    raise ValueError(f'schedule {schedule!r}: choose among {", ".join(SCHEDULES)}')
  if stages < 1 or microbatches < 1 or repeats < 1:
    raise ValueError(f'{stages} stages, {microbatches} microbatches and {repeats} repeats must each be at least 1')
  if schedule == 'circular' and microbatches < stages:
    raise ValueError(f'the circular schedule needs at least as many microbatches as stages ({microbatches} < '
                     f'{stages}): a microbatch leaving the last stage re-enters the first')
  if schedule != 'circular' and repeats != 1:
    raise ValueError(f'{schedule} passes the stages once (repeats 1, not {repeats}); circular repeats them')
  if schedule == '1f1b':
    return _one_f_one_b(stages, microbatches)
  forward = _forward_ticks(stages, microbatches, repeats)
  backward = [tuple(tuple(Slot('B', x.microbatch, x.repeat) for x in slots) for slots in tick)
              for tick in reversed(forward)]
  return Table(schedule, stages, microbatches, repeats, tuple(forward + backward))


def _forward_ticks(stages: int, microbatches: int, repeats: int) -> list[tuple[tuple[Slot, ...], ...]]:
  """GPipe's and the circular forward: stage s runs work item t - s at tick t (item i: microbatch i mod m of repeat
  i // m), m r + p - 1 ticks."""
  work = microbatches * repeats
  return [tuple((Slot('F', (t - s) % microbatches, (t - s) // microbatches),) if 0 <= t - s < work else ()
                for s in range(stages)) for t in range(work + stages - 1)]


def _one_f_one_b(stages: int, microbatches: int) -> Table:
  """Simulates PipeDream-flush tick by tick: a stage runs the next forward whose input arrived in an earlier tick
  while it holds fewer than 2 (p - s) - 1 microbatches, then the next backward whose gradient arrived (the last stage's own
  forward of this tick included: the loss is computed in its forward slot)."""
  done_f = [[None] * microbatches for _ in range(stages)]  # the tick each forward ran
  done_b = [[None] * microbatches for _ in range(stages)]
  next_f, next_b = [0] * stages, [0] * stages
  ticks = []
  t = 0
  while min(next_b) < microbatches:
    tick = []
    for s in range(stages):
      slots = []
      i = next_f[s]
      if i < microbatches and next_f[s] - next_b[s] < 2 * (stages - s) - 1 and \
          (s == 0 or done_f[s - 1][i] is not None and done_f[s - 1][i] < t):
        slots.append(Slot('F', i))
        done_f[s][i], next_f[s] = t, i + 1
      j = next_b[s]
      arrived = j < microbatches and (done_f[s][j] if s == stages - 1 else done_b[s + 1][j])
      if arrived is not None and arrived is not False and (arrived <= t if s == stages - 1 else arrived < t):
        slots.append(Slot('B', j))
        done_b[s][j], next_b[s] = t, j + 1
      tick.append(tuple(slots))
    ticks.append(tuple(tick))
    t += 1
  return Table('1f1b', stages, microbatches, 1, tuple(ticks))
