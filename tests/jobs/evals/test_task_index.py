"""The harness's task index kept on disk (lm.jobs.evals.tasks.task_manager): the manager built from the file is the
harness's own, entry for entry; a damaged file is rebuilt."""
import json

import pytest
from lm_eval.tasks import TaskManager

from lm.jobs.evals import tasks


def build(monkeypatch, cache) -> TaskManager:
  monkeypatch.setenv('LM_CACHE_DIR', str(cache))
  tasks.task_manager.cache_clear()
  try:
    return tasks.task_manager()
  finally:
    tasks.task_manager.cache_clear()


@pytest.mark.long(0.3)  # builds the harness's index (~10 s here, ~25 s under the suite's load)
def test_the_stored_index_gives_the_harness_own_manager(monkeypatch, tmp_path):
  monkeypatch.setenv('LM_CACHE_DIR', str(tmp_path))
  tasks.index_file().write_text('{"index": {"piqa": ')  # a write cut short
  built = build(monkeypatch, tmp_path)  # the harness's TaskManager(), its index then written
  assert json.loads(tasks.index_file().read_text())['index']['piqa']['kind'] == 'TASK'
  stored = build(monkeypatch, tmp_path)  # read back
  assert stored.task_index == built.task_index and len(built.task_index) > 10_000
  assert (stored.all_tasks, stored.all_groups, stored.all_subtasks, stored.all_tags) == (
    built.all_tasks, built.all_groups, built.all_subtasks, built.all_tags)
