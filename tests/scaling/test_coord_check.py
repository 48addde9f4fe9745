"""lm scaling coord-check: the check can fail. On gpt_tiny at widths 64..1024 (heads fixed, head dims 16..256)
after 3 AdamW steps at 3x its learning rate, μP keeps every group's mean |x| flat in width (log-log slope within
+-0.1) while the standard parametrization's logits grow with it (slope above 0.3)."""
import json

import numpy as np
import pytest

from lm import cli

ARGS = ['scaling', 'coord-check', '--config', 'gpt_tiny', '--widths', '64,128,256,512,1024', '--lr', '3e-3',
        '--steps', '3', '--seeds', '3', 'train.global_batch=4', 'data.seq_len=64']


@pytest.mark.long(2.5)
def test_mup_is_flat_in_width_and_standard_is_not(tmp_path, capsys):
  slopes = {}
  for parametrization in ('mup', 'standard'):
    out = tmp_path / parametrization
    assert cli.main(ARGS + ['--parametrization', parametrization, '--out', str(out)]) == 0
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
  assert 'logits' in capsys.readouterr().out  # the slope table


def test_coord_check_needs_two_widths(capsys):
  assert cli.main(['scaling', 'coord-check', '--widths', '64', '--out', '/tmp/unused-coord-check']) == 2
  assert 'needs two or more positive --widths' in capsys.readouterr().err
