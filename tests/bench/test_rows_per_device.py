"""bench/rows_per_device.py: each row count is the preset's step compiled with global_batch = rows x chips, under
each lever set; the most rows that fit by bisection."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lm.planning.compile import compile_report
from lm.config import load_config
from tests.conftest import needs_libtpu
from tests.planning.test_compile import TPU_TINY

ROOT = Path(__file__).resolve().parents[2]


def bench_module():
  spec = importlib.util.spec_from_file_location('rows_per_device', ROOT / 'bench/rows_per_device.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.long(0.3)
@needs_libtpu
def test_each_row_count_reports_the_compiled_memory_of_that_batch_under_each_lever(tmp_path):
  out = tmp_path / 'rows.json'
  done = subprocess.run([sys.executable, str(ROOT / 'bench/rows_per_device.py'), '--config', 'gpt_tiny',
                         '--topology', 'v5e-4', '--rows', '2', '--levers', 'none', 'offload', '--out', str(out),
                         *TPU_TINY, 'model.execution.remat=full'], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  levers = json.loads(out.read_text())['levers']
  for lever, extra in (('none', []), ('offload', ['model.execution.offload=[layer_input]'])):
    (row,) = levers[lever]['results']
    config = load_config('gpt_tiny', TPU_TINY + ['model.execution.remat=full', *extra, 'train.global_batch=8'])
    report = compile_report(config, 'v5e-4')
    assert row['rows'] == 2 and row['fits'] and row['memory_per_device'] == report['memory_per_device']
    assert row['host_memory_per_device'] == report['host_memory_per_device']
  assert levers['none']['results'][0]['host_memory_per_device']['total'] == 0
  assert levers['offload']['results'][0]['host_memory_per_device']['temp'] > 0


def test_the_most_rows_that_fit_is_found_by_bisection():
  """Against a step that fits up to 37 rows: the search from [20, 60) finds 37 in a handful of compiles, each of
  which it reports; a range whose low end does not fit (or whose high end does) finds none."""
  most_rows = bench_module().most_rows
  compiled = []

  def compile_at(rows):
    compiled.append(rows)
    return {'rows': rows, 'fits': rows <= 37}
  most, made = most_rows(compile_at, 20, 60)
  assert most == 37 and [r['rows'] for r in made] == compiled and len(compiled) <= 2 + 6
  assert most_rows(compile_at, 40, 60)[0] is None and most_rows(compile_at, 10, 30)[0] is None
