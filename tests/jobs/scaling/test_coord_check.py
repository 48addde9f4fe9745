"""lm scaling coord-check: the check can fail. On gpt_tiny at widths 64..512 (heads fixed, head dims 16..128)
after 3 AdamW steps at 3x its learning rate, μP keeps every group's mean |x| flat in width (log-log slope within
+-0.1) while the standard parametrization's logits grow with it (slope above 0.3). The README's commands go on to
width 1024 (its table); 512 keeps the margins (largest μP slope 0.06, standard's logits 0.65) at 60% of the CPU."""
import json
import subprocess
import sys

import numpy as np
import pytest

from lm import cli
from lm.config import ConfigError, load_config
from lm.jobs.scaling.coord_check import width_config
from tests.conftest import one_device_env

ARGS = ['scaling', 'coord-check', '--config', 'gpt_tiny', '--widths', '64,128,256,512', '--lr', '3e-3',
        '--steps', '3', '--seeds', '3', 'train.global_batch=4', 'data.seq_len=64']


@pytest.mark.long(1.5)
def test_mup_is_flat_in_width_and_standard_is_not(tmp_path):
  # a process of its own on one device, compiling as the suite does (its 8 compiles outweigh its 96 small steps:
  # 91 CPU-s per parametrization against 125 at XLA's full optimisation)
  slopes, tables = {}, ''
  for parametrization in ('mup', 'standard'):
    out = tmp_path / parametrization
    done = subprocess.run([sys.executable, '-m', 'lm.cli', *ARGS, '--parametrization', parametrization,
                           '--out', str(out)], check=False, env=one_device_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    tables += done.stdout
    assert (out / 'coord_check.png').stat().st_size > 10_000
    result = json.loads((out / 'coord_check.json').read_text())
    # the slopes are least-squares fits of the recorded means
    logits = np.array(result['mean_abs']['logits'])
    np.testing.assert_allclose(result['slopes']['logits'][3],
                               np.polyfit(np.log(result['widths']), np.log(logits[3]), 1)[0], rtol=1e-9)
    slopes[parametrization] = {group: values[3] for group, values in result['slopes'].items()}
  print(slopes)
  assert set(slopes['mup']) == {'embedding', 'attention', 'mlp', 'logits'}
  assert all(abs(s) <= 0.1 for s in slopes['mup'].values()), slopes['mup']
  assert slopes['standard']['logits'] > 0.3, slopes['standard']
  assert tables.count('logits ') == 2  # the slope tables


def test_coord_check_needs_two_widths(capsys):
  assert cli.main(['scaling', 'coord-check', '--widths', '64', '--out', '/tmp/unused-coord-check']) == 2
  assert 'needs two or more positive --widths' in capsys.readouterr().err


def test_each_width_keeps_the_heads_and_trains_plain_adamw_steps():
  base = load_config('gpt_tiny', ['model.d_ff=512', 'optim.lr_multipliers=[embed=2]'])
  mup = width_config(base, 1024, 'mup', 1e-2)
  assert (mup.model.d_model, mup.model.num_heads, mup.model.d_ff, mup.model.resolved_head_dim) == (1024, 4, 2048, 256)
  assert (mup.model.parametrization, mup.model.mup.base_width, mup.model.execution.scan_layers) == ('mup', 256, False)
  o = mup.optim
  assert (o.name, o.learning_rate, o.warmup_steps, o.schedule, o.grad_clip, o.weight_decay, o.lr_multipliers) == \
    ('adamw', 1e-2, 0, 'constant', 0.0, 0.0, ())
  assert width_config(base, 64, 'standard', 1e-2).model.parametrization == 'standard'
  assert width_config(load_config('moe_tiny'), 512, 'mup', 1e-2).model.moe.expert_d_ff == 4 * 176  # experts grow too
  with pytest.raises(ConfigError, match='does not divide model.d_model=66'):
    width_config(base, 66, 'mup', 1e-2)
