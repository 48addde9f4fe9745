"""The one printer of reports and the benchmarks' JSON writer."""
import json

from lm.report import format_bytes, format_lines, write_json


def test_bytes_are_gib_from_128_mib_up_and_mib_below():
  assert format_bytes(2**27) == '0.125 GiB'
  assert format_bytes(2**27 - 2**20) == '127.00 MiB'
  assert format_bytes(3 * 2**30 + 2**29) == '3.500 GiB'


def test_lines_align_their_values_after_the_longest_name():
  assert format_lines([('a', '1'), ('longer', '2')]).split('\n') == ['a       1', 'longer  2']


def test_json_is_written_with_its_folder(tmp_path):
  out = write_json(tmp_path / 'new' / 'r.json', {'x': [1, 2.5]})
  assert json.loads(out.read_text()) == {'x': [1, 2.5]}
