"""bench/compile_table.py, as the README runs it: each row is the preset's `lm compile` on the slice it names."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lm.config import preset_slice
from tests.conftest import needs_libtpu

ROOT = Path(__file__).resolve().parents[2]


@needs_libtpu
@pytest.mark.long(0.5)
def test_a_row_is_the_preset_compiled_for_its_slice_and_it_fits(tmp_path):
  """gpt_tiny's row (the table's quickest compile, ~13 s of TPU compiling against transformer_base's ~100 s): the
  table's mechanics. Whether each preset fits its slice is docs/results/scaling_table.json's (the check below) and, for
  the presets compiled in CI (FITS_IN_CI), tests/planning/test_compile.py's, through the same compile_report."""
  table, result = tmp_path / 'table.md', tmp_path / 'table.json'
  done = subprocess.run([sys.executable, str(ROOT / 'bench/compile_table.py'), '--only', 'gpt_tiny',
                         '--no-remat', '--out', str(table), '--json', str(result)],
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  written = json.loads(result.read_text())
  assert set(written['table']) == {'gpt_tiny'} and written['remat'] == {}
  report = written['table']['gpt_tiny']
  assert report['topology'] == preset_slice('gpt_tiny') and report['fits']
  memory = report['memory_per_device']
  assert memory['total'] <= report['hbm_per_device']
  mesh = report['mesh']
  assert mesh['slice'] * mesh['data'] * mesh['fsdp'] * mesh['tensor'] == report['chips']
  # The markdown row carries the report's figures.
  rows = [line for line in table.read_text().splitlines() if line.startswith('| gpt_tiny |')]
  assert len(rows) == 1
  cells = [cell.strip() for cell in rows[0].strip('|').split('|')]
  assert cells[3] == f'{report["topology"]} ({report["chips"]} chips)'
  assert cells[7].startswith(f'{memory["total"] / 2**30:,.2f} (') and cells[9] == 'yes'
  assert cells[12] == f'{report["tokens_per_sec"]:,.0f}'
  # --resume keeps the reports the JSON holds (the whole table takes over an hour here): nothing is compiled again.
  again = subprocess.run([sys.executable, str(ROOT / 'bench/compile_table.py'), '--only', 'gpt_tiny',
                          '--no-remat', '--out', str(tmp_path / 'again.md'), '--json', str(result), '--resume'],
                         capture_output=True, text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert re.search(rf'gpt_tiny +kept from {re.escape(str(result))}', again.stdout) and 'compiled in' not in again.stdout
  assert [line for line in (tmp_path / 'again.md').read_text().splitlines() if line.startswith('| gpt_tiny |')] == rows


def test_the_table_covers_every_preset():
  sys.path.insert(0, str(ROOT / 'bench'))
  try:
    import compile_table
  finally:
    sys.path.remove(str(ROOT / 'bench'))
  assert sorted(compile_table.PLAN) == sorted(p.stem for p in (ROOT / 'configs').glob('*.yaml'))


def test_the_docs_table_holds_every_preset_compiled_for_its_slice_and_each_fits():
  """docs/results/scaling_table.md is written from docs/results/scaling_table.json: a preset added or renamed since
  that run, or one
  that did not fit, fails here until the table is run again (`python bench/compile_table.py --resume`)."""
  sys.path.insert(0, str(ROOT / 'bench'))
  try:
    import compile_table
  finally:
    sys.path.remove(str(ROOT / 'bench'))
  reports = json.loads((ROOT / 'docs/results/scaling_table.json').read_text())['table']
  assert sorted(reports) == sorted(compile_table.PLAN)
  assert [name for name, r in reports.items() if not (r['fits'] and r['topology'] == preset_slice(name))] == []
  table = (ROOT / 'docs/results/scaling_table.md').read_text()
  assert all(f'\n| {name} | ' in table for name in reports)
