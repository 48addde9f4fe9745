"""Test setup: 8 simulated CPU devices (before JAX starts) and a small GPT config factory."""
import importlib.util
import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

# 8 CPU devices for mesh tests. Tests run tiny models whose compile time dominates their run time: backend
# optimisation level 0 compiles ~3x faster, and XLA's older loop emitters at that level compile the small scanned
# models 30-45% faster (startup/sitecustomize.py: every Python process of the suite imports it, this one below, the
# others through PYTHONPATH).
# Tests run on the CPU even where libtpu is installed (AOT tests build TPU topologies explicitly);
# other processes may hold libtpu's lock, which AOT compiles do not need.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=8',
                                    '--xla_backend_optimization_level=0']).strip()
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'startup')
os.environ['PYTHONPATH'] = os.pathsep.join(p for p in [STARTUP, os.environ.get('PYTHONPATH')] if p)

# One persistent compilation cache for the whole run, shared by the xdist workers and every `lm` process a test
# starts (they inherit the environment): many tests compile the same few programs. Its size limit turns on
# jax's file lock, so concurrent workers never read a half-written entry; it also makes each write list and read
# every entry (to evict), so only compiles of a second or more are kept: kept from 0 s, the thousands of small
# programs tests/models and tests/ops compile made those tests 40% slower (124 s against 85 s).
OWN_CACHE = 'JAX_COMPILATION_CACHE_DIR' not in os.environ  # made here (by the controller): removed at the end
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(tempfile.gettempdir(), f'lm-tests-xla-{os.getpid()}'))
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(4 << 30))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '1')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
# The figures of the suite's TPU compiles, kept by their program (lm.planning.kept): a compile whose program, compiler
# and flags did not change is read back, not paid again (a new entry is committed with the change that made it).
os.environ.setdefault('LM_COMPILE_REPORTS', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'compiled'))
# Single-threaded BLAS (NumPy, SciPy) in the workers and their processes: the suite keeps more workers than cores
# busy, and OpenBLAS's idle threads spinning cost the scaling-law fits a third more CPU (54 s against 35 s).
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
# lm's own cache (the harness's task index, lm.jobs.evals.tasks) likewise: built by the first process that needs it.
OWN_LM_CACHE = 'LM_CACHE_DIR' not in os.environ
os.environ.setdefault('LM_CACHE_DIR', os.path.join(tempfile.gettempdir(), f'lm-tests-cache-{os.getpid()}'))
# What `built_once` fixtures build (trained runs, corpora), once for the whole run, likewise.
OWN_SHARED = 'LM_TEST_SHARED_DIR' not in os.environ
os.environ.setdefault('LM_TEST_SHARED_DIR', os.path.join(tempfile.gettempdir(), f'lm-tests-shared-{os.getpid()}'))

import pytest  # noqa: E402

from lm.config import Config, load_config  # noqa: E402

sys.path.insert(0, STARTUP)
import sitecustomize  # noqa: E402  (installs itself; in xdist's workers it already has, at start-up)

sys.path.remove(STARTUP)

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu is not installed')


def built_once(name: str, build: Callable[[Path], object]) -> Path:
  """The directory `name` that `build(directory)` fills, built by the first worker of the run to ask and reused by
  the others (they wait on a file lock). A module-scoped fixture is rebuilt by every worker that runs one of its
  tests, and again whenever a worker's next test is from another module (the suite deals tests out one at a
  time): a fixture that trains or converts a model pays for that many times. The tests must only read it."""
  root = Path(os.environ['LM_TEST_SHARED_DIR'])
  root.mkdir(parents=True, exist_ok=True)
  directory, done = root / name, root / f'{name}.done'
  with open(root / f'{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)  # a build that failed part way
      directory.mkdir()
      build(directory)
      done.touch()
  return directory


def computed_once(name: str, compute: Callable[[], dict]) -> dict:
  """`built_once` for a result: `compute()`'s nested dicts of arrays, computed by one worker, kept as an .npz."""
  import numpy as np
  from flax.traverse_util import flatten_dict, unflatten_dict
  save = lambda directory: np.savez(directory / 'result.npz', **flatten_dict(compute(), sep='/'))
  with np.load(built_once(name, save) / 'result.npz') as result:
    return unflatten_dict({key: result[key] for key in result.files}, sep='/')


def one_device_env(**extra: str) -> dict[str, str]:
  """This environment for an `lm` process of its own with the host's one CPU device, compiling as the suite does;
  `extra` variables on top."""
  flags = os.environ['XLA_FLAGS'].replace('--xla_force_host_platform_device_count=8', '')
  return {**os.environ, 'XLA_FLAGS': flags.strip(), **extra}


@pytest.fixture
def one_core():
  """Every thread of this process on one core for the test (the core by the xdist worker's number, so two
  workers' pinned tests do not share one): the TPU compiler's threads, spread over the cores the suite keeps busy,
  cost mixtral_8x7b's two compiles 466 CPU-s against 393 on one core, alone."""
  tasks = lambda: [int(task) for task in os.listdir('/proc/self/task')]
  cores = sorted(os.sched_getaffinity(0))
  worker = int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0')[2:])

  def pin(allowed):
    for task in tasks():
      try:
        os.sched_setaffinity(task, allowed)
      except ProcessLookupError:  # a thread that ended meanwhile
        pass
  pin({cores[worker % len(cores)]})
  yield
  pin(set(cores))


SMALL = [
  'model.d_model=64', 'model.num_layers=2', 'model.num_heads=8', 'model.d_ff=256', 'model.max_len=64',
  'data.seq_len=32', 'train.global_batch=16', 'train.steps=20', 'train.eval_batches=1', 'train.log_every=1',
  'train.eval_every=1000', 'optim.warmup_steps=2', 'optim.learning_rate=3e-3', 'train.progress=false',
  'mesh.data=1', 'model.execution.scan_layers=true',
]


@pytest.fixture(autouse=True)
def fusion_emitters(request: pytest.FixtureRequest):
  """A test marked `fusion_emitters` compiles as XLA does by default (its programs compiled afresh: jax's
  in-memory caches would hand back this worker's earlier executables of the same programs)."""
  if request.node.get_closest_marker('fusion_emitters') is None:
    yield
    return
  import jax
  jax.clear_caches()
  sitecustomize.enabled = False
  try:
    yield
  finally:
    sitecustomize.enabled = True
    jax.clear_caches()


@pytest.fixture
def small_config(tmp_path):
  """A 2-layer, width-64 GPT on 32-token rows; extra `key=value` overrides win."""
  def make(*overrides: str) -> Config:
    return load_config('gpt_tiny', SMALL + [f'train.run_dir={tmp_path}/run'] + list(overrides))
  return make


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
  """One worker more than cores (`--maxprocesses` still caps it): many tests spend minutes waiting on processes
  they start (lm runs, SLURM daemons, TPU compiles in a subprocess), and with a worker per core those minutes
  left a core idle (the whole suite used 1.44 of 2 cores)."""
  if os.environ.get('PYTEST_XDIST_AUTO_NUM_WORKERS'):
    return None  # xdist's own hook reads it
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
  return cores + 1


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """A parametrized test marked `variants` keeps its first case in the fast tier; its other cases (the same check
  on other families, shapes or settings) are `long`. Then long tests first, longest first
  (`@pytest.mark.long(minutes)`; a stable sort): xdist hands tests out in this order, and a long test started last
  would leave the other workers idle at the end. It hands them one at a time to whichever worker is free
  (`--dist=load --maxschedchunk=1`, pyproject.toml): with its default chunks a quarter of the suite is dealt out
  up front, and with `--dist=worksteal` the first worker is dealt every long test (a contiguous third), so both
  left long tests running alone at the end."""
  seen = set()
  for item in items:
    if item.get_closest_marker('variants') and not item.get_closest_marker('long'):
      function = (item.path, item.originalname)
      if function in seen:
        item.add_marker(pytest.mark.long(0))
      seen.add(function)

  def minutes(item: pytest.Item) -> float:
    mark = item.get_closest_marker('long')
    return mark.args[0] if mark else 0.0
  items.sort(key=minutes, reverse=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
  """With LM_TEST_CPU_LOG=FILE, each test's CPU seconds (its worker's threads and the processes it waited for)
  appended to FILE as JSON lines: the suite is CPU-bound on 2 cores, and wall times under load hide where it goes."""
  log = os.environ.get('LM_TEST_CPU_LOG')
  before = os.times()
  yield
  if log:
    after = os.times()
    cpu = sum(after[i] - before[i] for i in range(4))  # user, system, waited-for children's user and system
    with open(log, 'a') as f:
      f.write(json.dumps({'test': item.nodeid, 'cpu_s': round(cpu, 2)}) + '\n')


def pytest_sessionfinish(session: pytest.Session) -> None:
  if OWN_CACHE and not hasattr(session.config, 'workerinput'):  # the controller, after every worker is done
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
  if OWN_LM_CACHE and not hasattr(session.config, 'workerinput'):
    shutil.rmtree(os.environ['LM_CACHE_DIR'], ignore_errors=True)
  if OWN_SHARED and not hasattr(session.config, 'workerinput'):
    shutil.rmtree(os.environ['LM_TEST_SHARED_DIR'], ignore_errors=True)
