"""`train.profile=START:COUNT`: a jax.profiler trace of steps START..START+COUNT-1 in RUN/profile/.

The loop names each step in the trace (a `StepTraceAnnotation`), which is what TensorBoard's profile plugin and
XProf read as steps. The trace starts once step START-1's results are in and stops once the last traced step's
are, so it holds exactly those steps' work; it also writes a Perfetto trace (perfetto_trace.json.gz,
ui.perfetto.dev) beside the XPlane file.
"""
from __future__ import annotations

from pathlib import Path

import jax

from lm.config import profile_steps
from lm.distributed import is_main_process
from lm.train.callbacks import After, Callback


class Profile(Callback):
  """Traces the steps `spec` ('START:COUNT') names into `directory`, on process 0 (`all_hosts`: every process)."""

  def __init__(self, spec: str, directory: str | Path, all_hosts: bool = False):
    self.first, count = profile_steps(spec)
    self.last = self.first + count - 1
    self.directory, self.enabled = str(directory), all_hosts or is_main_process()
    self.tracing = False

  def start(self, step, state, history):
    if self.enabled and self.first <= step + 1 <= self.last:  # a resumed run's first step compiles: not traced
      print(f'train.profile: step {step + 1} is this process\'s first (it compiles the program); steps '
            f'{self.first}-{self.last} are not traced', flush=True)
      self.enabled = False
    return []

  def due(self, step, final, stopping):
    return self.enabled and (step == self.first - 1 or (self.tracing and (step == self.last or final or stopping)))

  def __call__(self, after: After):
    if not self.tracing:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.tracing = True
      return []
    jax.block_until_ready(after.state)
    jax.profiler.stop_trace()
    self.tracing, self.enabled = False, False
    print(f'profile of steps {self.first}-{after.step} in {self.directory} (tensorboard --logdir '
          f'{self.directory}, or xprof; {Path(self.directory)}/plugins/profile/*/perfetto_trace.json.gz in '
          f'ui.perfetto.dev)', flush=True)
    return []
