"""Faults: kill -9 and resume, damaged checkpoints, non-finite losses, another mesh on restore, x64."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from lm import cli
from lm.storage.checkpoint import Checkpointer
from lm.parallel.mesh import one_device_mesh
from lm.storage.source import ModelSource
from lm.train.logging import read_metrics
from lm.jobs.pretraining import Pretraining
from lm.train.loop import restore_or_start
from lm.data.sources import embedded_documents
from lm.data.tokenize import tokenize_corpus
from lm.train.timing import is_timing
from tests.conftest import SMALL, one_device_env

def without_timing(records):
  return [{k: v for k, v in r.items() if not is_timing(k)} for r in records]  # wall-clock figures differ


def kill_past(command: list[str], run, step: int, env: dict[str, str]) -> None:
  """Runs `command` (an `lm train` writing `run`) and kills it (-9) once its metrics reach `step`."""
  proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  while not any(r.get('step', 0) >= step for r in read_metrics(run)):
    assert proc.poll() is None and time.monotonic() < deadline, 'the run ended before it could be killed'
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()


def corpora(root) -> list[str]:
  """Overrides training from a mixture of the corpus forms a resume has to seek in: Parquet row groups, zstd JSON
  lines (decompressed once into lm's cache) and shards tokenized ahead."""
  docs = [text[:2000] for _, text in embedded_documents()[::4]]
  pq.write_table(pa.table({'id': list(range(len(docs[0::3]))), 'text': docs[0::3]}), root / 'web.parquet',
                 row_group_size=32)
  lines = ''.join(json.dumps({'text': d}) + '\n' for d in docs[1::3]).encode()
  (root / 'dolma.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(lines))
  (root / 'books.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs[2::3]))
  tokenize_corpus([f'jsonl:{root}/books.jsonl'], 'byte', root / 'shards', shard_documents=20, progress=False)
  return [f'data.mixture=[web=parquet:{root}/web.parquet,dolma=jsonl:{root}/dolma.jsonl.zst,'
          f'books=tokenized:{root}/shards]', 'data.weights=[web=0.4 dolma=0.3 books=0.3]']


@pytest.mark.long(1)
def test_kill_9_at_three_seeded_moments_then_resume_gives_the_straight_metrics(tmp_path):
  """Trained from Parquet, zstd JSON lines and tokenized shards at once: the data pipeline resumes at the exact
  record of each (a source no row has been read from yet included)."""
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.steps=30',
           'train.eval_every=10', 'train.checkpoint.every=4', 'optim.decay_steps=30', *corpora(tmp_path)]
  # One host CPU device compiling as the suite does, the venv not on PATH; the suite's compilation cache
  # (conftest.py) spares the restarts the first run's compiling.
  env = {'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin', 'LM_CACHE_DIR': os.environ['LM_CACHE_DIR'],
         **{k: v for k, v in one_device_env().items()
            if k in ('XLA_FLAGS', 'PYTHONPATH') or k.startswith(('JAX_COMPILATION_CACHE', 'JAX_PERSISTENT_CACHE'))}}
  straight = subprocess.run(train + [f'train.run_dir={tmp_path}/straight'], env=env, capture_output=True, timeout=600)
  assert straight.returncode == 0, straight.stderr[-2000:]
  assert straight.stderr == b'', straight.stderr[-2000:]  # a run that goes well prints nothing on stderr
  kills = sorted(np.random.default_rng(2024).choice(np.arange(3, 28), size=3, replace=False).tolist())
  run = tmp_path / 'killed'
  for i, at in enumerate(kills):
    kill_past(train + [f'train.run_dir={run}'] + (['--resume'] if i else []), run, at, env)
  resumed = subprocess.run(train + [f'train.run_dir={run}', '--resume'], env=env, capture_output=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert without_timing(read_metrics(run)) == without_timing(read_metrics(tmp_path / 'straight'))


def damage(step_dir):
  """Truncates every array file of a checkpoint, as a full disk or a bad copy would."""
  files = [f for f in step_dir.rglob('*') if f.is_file() and f.stat().st_size > 200 and '/d/' in str(f)]
  assert files, 'no array data files found'
  for f in files:
    f.write_bytes(f.read_bytes()[:100])


@pytest.mark.long(0.5)
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path):
  # Run and resumed as a user runs them, each in a process of its own (one device, this XLA): whatever Python,
  # orbax and TensorStore print reaches its stderr (under pytest, Python's reports of ignored exceptions would not).
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.steps=15',
           'train.checkpoint.every=5', 'optim.decay_steps=15', 'train.checkpoint.keep=3', f'train.run_dir={tmp_path}']
  env = one_device_env()
  first = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0 and first.stderr == '', first.stderr[-3000:]
  straight = without_timing(read_metrics(tmp_path))
  checkpoints = tmp_path / 'checkpoints'
  damage(checkpoints / '15')
  (checkpoints / '10' / 'optimizer').rename(tmp_path / 'gone')  # and a missing item one step earlier
  resumed = subprocess.run(train + ['--resume'], env=env, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  err = resumed.stderr.splitlines()
  assert len(err) == 3, resumed.stderr[:3000]  # one line per checkpoint set aside, one for the one resumed
  assert err[0].startswith(f'checkpoint {checkpoints}/15 does not restore (')
  assert err[0].endswith(f'kept as {checkpoints}/15.unrestorable; trying the one before')
  assert err[1] == (f'checkpoint {checkpoints}/10 does not restore (its optimizer state is missing); kept as '
                    f'{checkpoints}/10.unrestorable; trying the one before')
  assert err[2] == f'resuming from {checkpoints}/5'
  assert (checkpoints / '15.unrestorable').is_dir() and (checkpoints / '10.unrestorable').is_dir(), 'kept'
  assert without_timing(read_metrics(tmp_path)) == straight  # resumed from step 5, redone exactly


@pytest.mark.long(0.2)
def test_nan_stops_with_one_line_and_no_later_checkpoint(small_config, tmp_path, capsys):
  argv = ['train', '--config', 'gpt_tiny', *SMALL, 'mesh.data=-1', 'optim.learning_rate=1e4', 'optim.warmup_steps=0',
          'optim.grad_clip=0', 'train.steps=40', 'train.checkpoint.every=2', f'train.run_dir={tmp_path}']
  assert cli.main(argv) == 1
  err = capsys.readouterr().err
  assert err.startswith('lm: error: step ') and err.count('\n') == 1 and ('is nan' in err or 'is inf' in err)
  bad = int(err.split('step ')[1].split(':')[0])
  metrics = read_metrics(tmp_path)
  first = next(r for r in metrics if r.get('nonfinite'))
  assert first['step'] == bad and all(not r.get('nonfinite') for r in metrics if r['step'] < bad)
  saved = Checkpointer(tmp_path / 'checkpoints', create=False)
  assert max(saved.all_steps()) < bad
  params = ModelSource(tmp_path).params(one_device_mesh())
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


@pytest.mark.long(0.2)
def test_skip_drops_non_finite_updates_and_counts_them(small_config):
  config = small_config('optim.learning_rate=1e4', 'optim.warmup_steps=0', 'optim.grad_clip=0', 'train.steps=20',
                        'train.on_nonfinite=skip')
  trainer = Pretraining(config, jax.devices()[:1])
  records = trainer.run()
  steps = [r for r in records if 'loss' in r]
  assert len(steps) == 20 and steps[-1]['skipped_steps'] == sum(r['nonfinite'] for r in steps) > 0
  assert int(trainer.final_state.skipped) == steps[-1]['skipped_steps']
  # each step logs the rate its update used: the schedule at the count of updates applied before it
  applied = 0
  for record in steps:
    assert record['learning_rate'] == pytest.approx(float(trainer.assembly.schedule(applied)), rel=1e-6)
    applied += not record['nonfinite']
  assert applied < 20 and trainer.assembly.schedule(applied) != trainer.assembly.schedule(20)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(trainer.final_state.params))


@pytest.mark.long(0.2)
def test_restore_onto_other_meshes_and_device_counts(small_config, tmp_path):
  """Saved on 8 devices (fsdp=8); restored on 4 (data=2 x tensor=2), then on 1: identical params."""
  first = small_config('train.steps=2', 'mesh.data=1', 'mesh.fsdp=8')
  trainer = Pretraining(first, jax.devices())
  trainer.run()
  want = jax.device_get(trainer.final_state.params)
  for devices, mesh in ((jax.devices()[:4], ['mesh.data=2', 'mesh.tensor=2']), (jax.devices()[:1], ['mesh.data=1'])):
    again = Pretraining(small_config('train.steps=2', 'train.resume=true', *mesh), devices)
    state = restore_or_start(Checkpointer(first.run_dir / 'checkpoints'), again.assembly, again.train_batches.iterator,
                             again.init_state)
    assert state.params['decoder']['layers']['mlp']['wi']['kernel'].sharding.mesh.devices.size == len(devices)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), want)


@pytest.mark.long(0.2)
def test_flash_attention_with_x64_enabled():
  code = '''
import jax, jax.numpy as jnp, numpy as np
from lm.ops.attention import attention
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=(1, 200, 2, 16)), jnp.float32) for _ in range(3))
loss = lambda impl: lambda q, k, v: jnp.sum(attention(q, k, v, causal=True, impl=impl) ** 2)
flash, xla = (jax.grad(loss(i), argnums=(0, 1, 2))(q, k, v) for i in ('flash', 'xla'))
print(max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(flash, xla)))
'''
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                       env={'JAX_PLATFORMS': 'cpu', 'JAX_ENABLE_X64': '1', 'PATH': '/usr/bin:/bin'})
  assert out.returncode == 0, out.stderr[-2000:]
  assert float(out.stdout.split()[-1]) < 1e-5


@pytest.mark.long(0.5)
def test_a_full_disk_ends_the_run_in_one_line_and_the_last_checkpoint_resumes(tmp_path):
  """The run directory on a 4 MiB filesystem (a tmpfs in a mount namespace of the run's own): two ~1.5 MiB
  checkpoints fit, the third does not. One line says which checkpoint failed, why, the last complete one and what
  to do; nothing else reaches stderr; the partial files are gone and the last checkpoint resumes."""
  if subprocess.run(['unshare', '-rm', 'true'], capture_output=True).returncode != 0:
    pytest.skip('a small filesystem needs a mount namespace (unshare -rm)')
  small, kept = tmp_path / 'small', tmp_path / 'kept'
  small.mkdir()
  train = [sys.executable, '-m', 'lm.cli', 'train', '--config', 'gpt_tiny', *SMALL, 'train.steps=10',
           'train.checkpoint.every=2', 'train.checkpoint.keep=2', f'train.run_dir={small}/run']
  script = f'mount -t tmpfs -o size=4m tmpfs {small} && {shlex.join(train)}; rc=$?; cp -a {small}/run {kept}; exit $rc'
  done = subprocess.run(['unshare', '-rm', 'sh', '-c', script], env=one_device_env(), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 1, done.stderr[-3000:]
  err = done.stderr.splitlines()
  assert len(err) == 1, done.stderr[:3000]
  found = re.fullmatch(rf'lm: error: checkpoint (\d+) was not written: no space left on the device holding '
                       rf'{small}/run/checkpoints; the last complete checkpoint is {small}/run/checkpoints/(\d+); '
                       rf'free space \(or lower train.checkpoint.keep\), then continue with --resume', err[0])
  assert found, err[0]
  failed, last = int(found[1]), int(found[2])
  assert failed == last + 2 and last >= 2
  assert sorted(p.name for p in (kept / 'checkpoints').iterdir()) == [str(s) for s in (last - 2, last) if s > 0]
  resumed = subprocess.run([*train[:-1], f'train.run_dir={kept}', '--resume'], env=one_device_env(),
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'resumed from {kept}/checkpoints/{last}' in resumed.stdout
  assert read_metrics(kept)[-1]['step'] == 10
