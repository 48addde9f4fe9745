"""Release files are found with or without the top folders of the release's tree (a user unpacking Winogrande's
`dev.jsonl` straight into `DATA/winogrande/`), and convert to the same rows as in the release's own layout."""
import shutil

import pytest

from lm.jobs.evals.releases import RELEASES, convert_release, release_files, task_folder
from tests.jobs.evals import releases


def flattened(original, target, keep_last=1):
  """A copy of `original` with each task folder's files moved up to all but their last `keep_last - 1` folders."""
  for path in original.rglob('*'):
    if path.is_file():
      task = path.relative_to(original).parts[0]
      inner = path.relative_to(original / task).parts[-keep_last:]
      (target / task / '/'.join(inner)).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(path, target / task / '/'.join(inner))


@pytest.mark.parametrize('keep_last', [1, 2])  # every folder left out; the top (dated, versioned) one left out
def test_release_files_are_found_without_their_top_folders(keep_last, tmp_path):
  releases.write_both(tmp_path / 'release', tmp_path / 'hf')
  flattened(tmp_path / 'release', tmp_path / 'flat', keep_last)
  assert (tmp_path / 'flat' / 'winogrande' / 'dev.jsonl').is_file() or keep_last == 2
  for task in RELEASES:
    ours = release_files(task_folder(tmp_path / 'release', task), task)
    flat = release_files(task_folder(tmp_path / 'flat', task), task)
    assert sorted(flat) == sorted(ours) == sorted(RELEASES[task][1]), task
    convert_release(task, ours, tmp_path / 'a' / task)
    convert_release(task, flat, tmp_path / 'b' / task)
    for split in ours:
      assert (tmp_path / 'b' / task / f'{split}.jsonl').read_text() == \
        (tmp_path / 'a' / task / f'{split}.jsonl').read_text(), (task, split)
