"""Chat fine-tunes stopped by SIGTERM resume to the straight run; one device equals a data x fsdp mesh."""
import json

import jax
import numpy as np
import pytest

from lm.config import ConfigError
from lm.jobs.chat.dpo import DPOSettings, finetune_dpo
from lm.jobs.chat.sft import ChatOptions, finetune_sft
from lm.train.timing import is_timing
from tests.jobs.chat.test_dpo import preference_pairs
from tests.jobs.chat.conftest import echo_chats
from tests.jobs.glue.test_resume import stop_at

COMMON = ('data.seq_len=32', 'train.global_batch=8', 'train.steps=6', 'train.checkpoint.every=3', 'train.log_every=1',
          'optim.learning_rate=1e-3', 'train.progress=false')


def records(run_dir):
  return [{k: v for k, v in json.loads(line).items() if not is_timing(k)}
          for line in (run_dir / 'metrics.jsonl').read_text().splitlines()]


@pytest.mark.parametrize('task', ['sft', 'dpo'])
@pytest.mark.long(0.5)
def test_sigterm_and_resume_and_one_device_equal_the_straight_run(task, tiny_llama, tmp_path, monkeypatch, capsys):
  """SIGTERM at step 4 (a checkpoint is due at 3 and 6): resumed, every step's record equals the uninterrupted
  run's on a data=2 x fsdp=2 mesh; on one device every loss equals it to 1e-5."""
  data = tmp_path / 'data.jsonl'
  (echo_chats if task == 'sft' else preference_pairs)(data, 48, 0)

  def run(name, devices, *extra, beta=0.5):
    options = ChatOptions(data=str(data), init=str(tiny_llama),
                          overrides=(*COMMON, f'train.run_dir={tmp_path / name}', *extra))
    if task == 'sft':
      return finetune_sft(options, devices)
    return finetune_dpo(options, DPOSettings(beta=beta), devices)
  mesh = ('mesh.data=2', 'mesh.fsdp=2')
  run('straight', jax.devices()[:4], *mesh)
  stop_at(monkeypatch, 4)
  assert run('stopped', jax.devices()[:4], *mesh) is None
  assert 'stopped by SIGTERM after step 4; checkpoint saved' in capsys.readouterr().out
  monkeypatch.undo()
  run('stopped', jax.devices()[:4], *mesh, 'train.resume=true')
  assert f'resumed from {tmp_path}/stopped/checkpoints/4' in capsys.readouterr().out
  assert records(tmp_path / 'stopped') == records(tmp_path / 'straight')
  run('one', jax.devices()[:1], 'mesh.data=1', 'mesh.fsdp=1')
  losses = lambda name: [r['loss'] for r in records(tmp_path / name) if 'loss' in r]
  assert len(losses('one')) == 6
  np.testing.assert_allclose(losses('one'), losses('straight'), rtol=1e-5)
  if task == 'dpo':  # the settings a run was trained with are kept, and a resume must keep them
    with pytest.raises(ConfigError, match=f'{tmp_path}/stopped was trained with another dpo.json; resume it with'):
      run('stopped', jax.devices()[:4], *mesh, 'train.resume=true', beta=0.1)
