"""bench/rows_per_device.py: each row count is the preset's step compiled with global_batch = rows x chips."""
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


@pytest.mark.long(0.2)
@needs_libtpu
def test_each_row_count_reports_the_compiled_memory_of_that_batch(tmp_path):
  out = tmp_path / 'rows.json'
  done = subprocess.run([sys.executable, str(ROOT / 'bench/rows_per_device.py'), '--config', 'gpt_tiny',
                         '--topology', 'v5e-4', '--rows', '2', '--out', str(out), *TPU_TINY],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  (row,) = json.loads(out.read_text())['results']
  report = compile_report(load_config('gpt_tiny', TPU_TINY + ['train.global_batch=8']), 'v5e-4')
  assert row['rows'] == 2 and row['fits'] and row['memory_per_device'] == report['memory_per_device']
