"""The local checkpoint tier in one process: a local step is resumed only onto the mesh that wrote it, and a local
directory belongs to one run. (Two processes, kill -9 and a replaced host: tests/launch/test_local.py.)"""
import shutil

import jax
import numpy as np
import pytest

from lm.config import ConfigError
from lm.jobs.pretraining import Pretraining
from lm.train.logging import read_metrics


def losses(run_dir):
  return {r['step']: r['loss'] for r in read_metrics(run_dir) if 'loss' in r}


@pytest.mark.long(0.5)
def test_a_local_step_restores_only_onto_the_mesh_that_wrote_it(small_config, tmp_path, capsys):
  """Local every 3, persistent every 4, 7 steps, the persistent step 7 then lost: resumed under other mesh settings
  the run takes the persistent step 4 (each process would read back shards it never wrote), with one line; under
  the settings that wrote it, the local step 6. Both continue the straight run. Another run is refused the directory."""
  common = ['train.steps=7', 'train.checkpoint.every=4', 'optim.decay_steps=7', 'train.local_checkpoint_every=3',
            f'train.local_checkpoint_dir={tmp_path}/local', f'train.run_dir={tmp_path}/run']
  run = lambda fsdp, *extra: Pretraining(small_config(*common, f'mesh.fsdp={fsdp}', *extra), jax.devices()[:fsdp]).run()
  run(2)
  straight = losses(tmp_path / 'run')
  shutil.rmtree(tmp_path / 'run' / 'checkpoints' / '7')
  capsys.readouterr()
  run(1, 'train.resume=true')
  out, err = capsys.readouterr()
  assert f'resumed from {tmp_path}/run/checkpoints/4\n' in out
  assert f'local checkpoint {tmp_path}/local/process_0/6 does not restore (it was written under other mesh' in err
  shutil.rmtree(tmp_path / 'run' / 'checkpoints' / '7')
  run(1, 'train.resume=true')  # the local step 6 this time is the one the fsdp=1 run wrote
  assert f'resumed from {tmp_path}/local/process_0/6\n' in capsys.readouterr().out
  resumed = losses(tmp_path / 'run')
  assert sorted(resumed) == sorted(straight)
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)], [straight[s] for s in sorted(straight)],
                             rtol=1e-5)
  with pytest.raises(ConfigError, match=f'train.local_checkpoint_dir={tmp_path}/local holds the local checkpoints '
                                        f'of {tmp_path}/run; give each run its own local directory'):
    run(2, f'train.run_dir={tmp_path}/other')
