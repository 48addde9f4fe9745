"""Run outputs through etils.epath: a gs:// run dir keeps its URI, and metrics and events reach it."""
import sys

import pytest
from etils import epath
from etils.epath import testing as epath_testing

from lm.config import load_config
from lm.train.logging import MetricsLogger, read_metrics


def test_a_gs_run_dir_keeps_its_uri_and_receives_metrics_and_events(tmp_path):
  config = load_config('gpt_tiny', ['train.run_dir=gs://bucket/runs/{name}'])
  assert str(config.run_dir) == 'gs://bucket/runs/gpt_tiny'  # not pathlib's gs:/bucket/...
  local = lambda path: str(path).replace('gs://bucket', str(tmp_path))
  redirect = lambda fn, path, *args, **kwargs: fn(local(path), *args, **kwargs)
  copy = lambda fn, src, dst, *args, **kwargs: fn(local(src), local(dst), *args, **kwargs)
  with epath_testing.mock_epath(open=redirect, exists=redirect, isdir=redirect, listdir=redirect, makedirs=redirect,
                                mkdir=redirect, stat=redirect, glob=redirect, copy=copy):
    logger = MetricsLogger(config.run_dir, total_steps=4, start_step=0, progress=False)
    for step in (1, 2):
      logger.log({'step': step, 'loss': 1.0 / step})
    logger.close()
    assert read_metrics(config.run_dir) == [{'step': 1, 'loss': 1.0}, {'step': 2, 'loss': 0.5}]
    resumed = MetricsLogger(config.run_dir, total_steps=4, start_step=1, progress=False)  # step 2 is redone
    resumed.close()
    assert read_metrics(config.run_dir) == [{'step': 1, 'loss': 1.0}]
  events = list((tmp_path / 'runs' / 'gpt_tiny' / 'tensorboard').iterdir())
  assert events and events[0].name.startswith('events.out.tfevents')
  assert epath.Path(str(tmp_path)).exists()


@pytest.mark.parametrize('columns, bar', [(0, False), (20, False), (120, True)])
def test_step_lines_print_unless_a_bar_fits(columns, bar, tmp_path, monkeypatch, capsys):
  """On a terminal that reports no (or too few) columns there is no bar, and the step lines print."""
  import os
  import shutil
  monkeypatch.setattr(sys.stdout, 'isatty', lambda: True, raising=False)
  monkeypatch.setattr(shutil, 'get_terminal_size', lambda fallback=None: os.terminal_size((columns, 24)))
  logger = MetricsLogger(tmp_path, total_steps=2, start_step=0, progress=True)
  logger.log({'step': 1, 'loss': 2.5, 'tokens_per_sec': 100.0})
  logger.close()
  assert (logger.bar is not None) == bar
  assert ('step 1 | loss 2.5' in capsys.readouterr().out) == (not bar)


def test_events_hold_the_scalars_and_logging_starts_without_torch(tmp_path):
  """A fresh process: importing the logger does not import torch (2 s of every run's start), and the event
  file it writes holds each metric at its step (read back record by record with tensorboardX's protos)."""
  import struct
  import subprocess
  import sys
  code = ('import sys; from etils import epath; from lm.train.logging import MetricsLogger; '
          'assert "torch" not in sys.modules, "torch imported"; '
          f'log = MetricsLogger(epath.Path({str(tmp_path)!r}), 2, 0, False); '
          'log.log({"step": 1, "loss": 2.5}); log.log({"step": 2, "loss": 1.25}); log.close()')
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300,
                        env={**__import__('os').environ, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 0, done.stderr[-2000:]
  from tensorboardX.proto import event_pb2
  data = next((tmp_path / 'tensorboard').glob('events.out.tfevents.*')).read_bytes()
  scalars, offset = [], 0
  while offset < len(data):  # TFRecord: length, its CRC, the record, its CRC
    (length,) = struct.unpack('<Q', data[offset:offset + 8])
    event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
    scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    offset += 12 + length + 4
  assert scalars == [(1, 'loss', 2.5), (2, 'loss', 1.25)]
