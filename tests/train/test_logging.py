"""Run outputs through etils.epath: a gs:// run dir keeps its URI, and metrics and events reach it."""
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
