"""The learning rate and batch for a budget (lm.jobs.scaling.hparams): power laws of the near-optimal rate and batch
recovered from a synthetic bowl whose optimum follows DeepSeek LLM's laws, through `lm scaling fit --law hparams`."""
import json

import numpy as np
import pytest

from lm import cli
from lm.jobs.scaling.hparams import deepseek, porian, step_law


def bowl(tmp_path, noise=0.002, seed=0):
  """Final losses of runs on a grid of rates and batches (factors of sqrt 2 around the optimum) at four compute
  budgets: L*(C) (1 + 0.01 log(eta/eta*)^2 + 0.01 log(B/B*)^2), eta* and B* DeepSeek LLM's, with relative noise."""
  rng = np.random.default_rng(seed)
  lines = ['run,step,params,tokens,flops,loss,learning_rate,batch_tokens']
  for c in (1e17, 1e18, 1e19, 1e20):
    n = np.sqrt(c / 6 / 20)
    lr_opt, batch_opt = deepseek(c)
    for i in range(-4, 5):
      for j in range(-4, 5):
        lr, batch = lr_opt * 2 ** (i / 2), batch_opt * 2 ** (j / 2)
        loss = (2 + 50 * c ** -0.1) * (1 + 0.01 * np.log(lr / lr_opt) ** 2 + 0.01 * np.log(batch / batch_opt) ** 2)
        loss *= 1 + noise * rng.standard_normal()
        values = (n, c / 6 / n, c, loss, lr, batch)
        lines.append(f'C{c:g}_{i}_{j},100,' + ','.join(repr(float(v)) for v in values))
  path = tmp_path / 'points.csv'
  path.write_text('\n'.join(lines) + '\n')
  return path


def test_the_laws_of_a_bowl_are_recovered(tmp_path, capsys):
  """With 0.2% noise: exponents within 0.02, and the laws' optimum within 10% of the truth at every budget and at a
  target 10x beyond them, inside its bootstrap interval. (The coefficients themselves are the laws at C = 1, 17
  decades below the data: across noise seeds they move by about 15%, so they are not what a prediction rests on.)"""
  assert cli.main(['scaling', 'fit', str(bowl(tmp_path)), '--law', 'hparams', '--target', '1e21', '--bootstrap',
                   '200', '--out', str(tmp_path / 'fit.json')]) == 0
  fit = json.loads((tmp_path / 'fit.json').read_text())
  law = fit['params']
  assert law['lr_C'] == pytest.approx(-0.1250, abs=0.02) and law['batch_C'] == pytest.approx(0.3271, abs=0.02), law
  for c in (1e17, 1e18, 1e19, 1e20, 1e21):
    fitted = (law['lr_coef'] * c ** law['lr_C'], law['batch_coef'] * c ** law['batch_C'])
    assert fitted == pytest.approx(deepseek(c), rel=0.1), (c, fitted, deepseek(c))
  target = fit['targets'][0]
  low, high = target['learning_rate_ci']
  assert low < deepseek(1e21)[0] < high and target['deepseek'] == list(deepseek(1e21))
  assert 'DeepSeek LLM' in capsys.readouterr().out


def test_the_published_rules_and_bad_grids():
  """The built-in rules are the papers' formulas (DeepSeek LLM eq. 1; Step Law's fit; Porian et al.'s, printed at
  108M params: 0.0047 and 160 sequences of 2,048 tokens, the rate down 2x and the batch up 4x at 8x the params)."""
  assert deepseek(1e20) == pytest.approx((0.3118 * 1e20 ** -0.125, 0.2920 * 1e20 ** 0.3271), rel=1e-12)
  assert step_law(1e9, 1e11) == pytest.approx((1.79 * 1e9 ** -0.713 * 1e11 ** 0.307, 0.58 * 1e11 ** 0.571), rel=1e-12)
  assert porian(108e6) == pytest.approx((0.0047, 160 * 2048), rel=1e-12)
  assert porian(8 * 108e6) == pytest.approx((0.0047 / 2, 4 * 160 * 2048), rel=1e-12)


def test_one_batch_size_or_one_budget_is_one_line(tmp_path, capsys):
  path = bowl(tmp_path)
  rows = path.read_text().splitlines()
  one_batch = [rows[0]] + [','.join(r.split(',')[:-1] + ['65536']) for r in rows[1:]]
  path.write_text('\n'.join(one_batch) + '\n')
  assert cli.main(['scaling', 'fit', str(path), '--law', 'hparams', '--target', '1e21']) == 2
  err = capsys.readouterr().err
  assert 'every run has batch size' in err and 'lm scaling sweep --batch-grid' in err, err
  path.write_text('\n'.join(rows[:82]) + '\n')  # the first budget alone
  assert cli.main(['scaling', 'fit', str(path), '--law', 'hparams', '--target', '1e21']) == 2
  assert 'needs 2 or more budgets; the runs make 1' in capsys.readouterr().err
