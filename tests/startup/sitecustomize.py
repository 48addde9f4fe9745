"""Run at start-up by every Python process of the suite (conftest.py puts this folder on PYTHONPATH, so xdist's
workers, `lm` processes and `python -c` children all import it): XLA's loop emitters instead of its MLIR fusion
emitters for every CPU compile at optimisation level 0, which compiles the small scanned models 30-45% faster
(the unrolled presets hardly at all: tests/README.md).

Every process has to compile alike: a run resumed in-process must equal the one a child process started, bit for
bit. XLA_FLAGS cannot carry the option, since libtpu (the AOT tests' TPU compiles) aborts on a CPU flag there: it
goes into each CPU compile's options instead, once jax's compiler module is imported (not before: most children
never import jax)."""
import importlib.abc
import importlib.util
import os
import sys

MODULE = 'jax._src.compiler'
OVERRIDE = ('xla_cpu_use_fusion_emitters', False)
# Off while a test marked `fusion_emitters` runs (conftest.py): a bit-for-bit claim between two different programs
# (a branched cooldown against the straight run) holds for XLA's default emitters, not for these.
enabled = True


def patch(compiler) -> None:
  """jax's compile options, with OVERRIDE (as `jit(compiler_options=...)` sets one) for a CPU compile."""
  if getattr(compiler, 'loop_emitters', False):
    return
  get_compile_options = compiler.get_compile_options

  def with_loop_emitters(*args, **kwargs):
    options = get_compile_options(*args, **kwargs)
    backend = kwargs.get('backend')
    if enabled and backend is not None and backend.platform == 'cpu':
      options.env_option_overrides = [*options.env_option_overrides, OVERRIDE]
    return options

  compiler.get_compile_options = with_loop_emitters
  compiler.loop_emitters = True


class PatchOnImport(importlib.abc.MetaPathFinder):
  """Patches jax's compiler module as it is first imported."""

  def find_spec(self, name, path, target=None):
    if name != MODULE:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    run = spec.loader.exec_module

    def run_and_patch(module):
      run(module)
      patch(module)

    spec.loader.exec_module = run_and_patch
    return spec


def install() -> None:
  """The loop emitters in this process, where it compiles at optimisation level 0 (elsewhere they compile slower)."""
  if '--xla_backend_optimization_level=0' not in os.environ.get('XLA_FLAGS', ''):
    return
  if MODULE in sys.modules:
    patch(sys.modules[MODULE])
  elif not any(isinstance(finder, PatchOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, PatchOnImport())


def log_at_exit() -> None:
  """With LM_TEST_PROC_LOG=FILE, this process's command line, CPU seconds (its own, not its children's, which log
  themselves) and the test that started it, appended to FILE as a JSON line when it exits: where the suite's
  CPU goes by process (xdist's workers, `lm` runs, TPU compiles)."""
  log = os.environ.get('LM_TEST_PROC_LOG')
  if not log:
    return
  import atexit
  import json

  def write():
    times = os.times()
    with open(log, 'a') as f:
      f.write(json.dumps({'argv': sys.argv, 'cpu_s': round(times[0] + times[1], 2),
                          'test': os.environ.get('PYTEST_CURRENT_TEST')}) + '\n')

  atexit.register(write)


install()
log_at_exit()
