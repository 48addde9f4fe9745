"""Whole loss curves (lm.jobs.scaling.curves) on the MultiPowerLaw repository's published curves: its published
parameters give its published held-out error, and lm's own fits of both forms on its three training schedules
predict the six others."""
from pathlib import Path

import numpy as np
import pytest

from lm.config import ConfigError
from lm.jobs.scaling.curves import (Curve, bootstrap_curves, fit_curves, holdout_each, paired, paired_steps, predict,
                                    relative_error, resolved_pick, search_pick)

DATA = Path(__file__).resolve().parents[2] / 'fixtures/multipowerlaw'
TRAIN = ('cosine_24000', 'constant_24000', 'wsdcon_9')  # the repository's src/config.py
HELD_OUT = ('constant_72000', 'cosine_72000', 'wsd_20000_24000', 'wsdld_20000_24000', 'wsdcon_3', 'wsdcon_18')
WARMUP, PEAK, END = 2160, 3e-4, 3e-5
# The repository's published 100M parameters (src/config.py PARAMS['100']) and its held-out error (README: PredE
# 0.00142; logs/100.log: 0.0014248385942192765).
PUBLISHED = dict(zip(('L0', 'A', 'alpha', 'B', 'C', 'beta', 'gamma'),
                     (2.6514477, 0.60115152, 0.45295811, 437.9464276, 2.13245612, 0.59785199, 0.65523644)))
PUBLISHED_ERROR = 0.0014248385942192765


def schedule(name: str) -> np.ndarray:
  """The repository's schedules (src/lr_schedules.py, as src/data_loader.py names them), written out here."""
  warmup = np.linspace(0, PEAK, WARMUP)
  kind, *numbers = name.split('_')
  if kind in ('cosine', 'constant'):
    total = int(numbers[0])
    step = np.arange(WARMUP, total)
    rest = (END + 0.5 * (PEAK - END) * (1 + np.cos(np.pi * (step - WARMUP) / (total - WARMUP))) if kind == 'cosine'
            else np.full(total - WARMUP, PEAK))
    return np.concatenate([warmup, rest])
  if kind == 'wsdcon':  # two stages: the peak to step 8000, then a lower constant
    return np.concatenate([warmup, np.full(8000 - WARMUP, PEAK), np.full(16000 - 8000, int(numbers[0]) * 1e-5)])
  total, decay = 24000, 20000
  step = np.arange(decay, total)
  t = (step - decay) / (total - decay)
  tail = PEAK ** (1 - t) * END ** t if kind == 'wsd' else PEAK * (1 - t) + END * t  # wsd: exponential; wsdld: linear
  return np.concatenate([warmup, np.full(decay - WARMUP, PEAK), tail])


def curves(size: int, names: tuple[str, ...]) -> list[Curve]:
  """The repository's curves: the loss at its index `step` follows updates 0..step (step + 1 of them); a
  24,000-step run's last point is dropped, as its loader drops it."""
  out = []
  for name in names:
    table = np.genfromtxt(DATA / f'csv_{size}/{name}.csv', delimiter=',', skip_header=1)
    steps, loss = table[:, 0].astype(int), table[:, 2]
    keep = steps < 24000 if steps.max() == 24000 else np.ones(len(steps), bool)
    out.append(Curve(name, schedule(name), steps[keep] + 1, loss[keep]))
  return out


def test_the_published_parameters_give_the_published_held_out_error():
  held_out = curves(100, HELD_OUT)
  errors = [relative_error('mpl', PUBLISHED, c)['mean'] for c in held_out]
  assert np.mean(errors) == pytest.approx(PUBLISHED_ERROR, abs=1e-4), errors
  # and the schedules are the repository's: its file's lr column is the rate of the update at that step
  for c, name in zip(held_out, HELD_OUT):
    table = np.genfromtxt(DATA / f'csv_100/{name}.csv', delimiter=',', skip_header=1)
    steps = table[:, 0].astype(int)
    inside = steps < len(c.rates)
    np.testing.assert_allclose(c.rates[steps[inside]], table[inside, 1], rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize('form', ['mpl', 'tissue'])
def test_a_fit_on_three_schedules_predicts_the_six_others(form):
  """Fitted by lm on the repository's three training schedules (100M), each form predicts every held-out schedule:
  mean relative error at most 0.3% over the six, every final loss within 1%."""
  fit = fit_curves(curves(100, TRAIN), form)
  held_out = [relative_error(form, fit['params'], c) for c in curves(100, HELD_OUT)]
  assert np.mean([e['mean'] for e in held_out]) <= 0.003, (fit['params'], held_out)
  for e in held_out:
    assert abs(e['final_predicted'] - e['final_loss']) / e['final_loss'] <= 0.01, e
  assert all(e['mean'] < 0.003 for e in fit['curves'].values())  # and it fits what it saw


def test_the_forms_agree_with_a_direct_sum():
  """predict against the formulas summed term by term in float64 on a short, irregular schedule."""
  rng = np.random.default_rng(0)
  rates = np.concatenate([np.linspace(0, 1e-3, 5), rng.uniform(2e-4, 1e-3, 40)])
  updates = np.array([3, 10, 27, 45])
  p = {'L0': 2.0, 'A': 0.5, 'alpha': 0.4, 'B': 300.0, 'C': 2.0, 'beta': 0.6, 'gamma': 0.6, 'lambda': 0.9}
  mpl, tissue = [], []
  for n in updates:
    s1 = rates[:n].sum()
    drop = sum((rates[k - 1] - rates[k]) * (1 - (1 + p['C'] * rates[k] ** -p['gamma'] * rates[k:n].sum()) ** -p['beta'])
               for k in range(1, n))
    m, s2 = 0.0, 0.0
    for i in range(1, n):
      m = p['lambda'] * m + rates[i - 1] - rates[i]
      s2 += m
    mpl.append(p['L0'] + p['A'] * s1 ** -p['alpha'] - p['B'] * drop)
    tissue.append(p['L0'] + p['A'] * s1 ** -p['alpha'] - p['C'] * s2)
  np.testing.assert_allclose(predict('mpl', p, rates, updates), mpl, rtol=1e-12)
  np.testing.assert_allclose(predict('tissue', p, rates, updates), tissue, rtol=1e-12)


def test_bootstrap_intervals_hold_the_truth_and_the_search_keeps_what_it_cannot_resolve():
  """Curves drawn from known momentum-form parameters with 1% noise: the bootstrap's 95% interval of a held-out
  schedule's final loss holds the true one; the search picks a schedule over the configured one only where it wins
  in 95% of the resamples."""
  truth = {'L0': 2.0, 'A': 1.5, 'alpha': 0.3, 'C': 2.0, 'lambda': 0.99}
  warmup = np.linspace(1e-4, 2e-3, 20)
  constant = np.concatenate([warmup, np.full(380, 2e-3)])
  cooldown = np.concatenate([warmup, np.full(280, 2e-3), np.linspace(2e-3, 0, 100)])
  rng = np.random.default_rng(0)
  drawn = []
  for name, rates in (('constant', constant), ('cooldown', cooldown)):
    updates = np.arange(1, len(rates) + 1)
    drawn.append(Curve(name, rates, updates, predict('tissue', truth, rates, updates) * np.exp(rng.normal(0, 0.01,
                                                                                                        len(rates)))))
  fit = fit_curves(drawn, 'tissue')
  samples = bootstrap_curves(drawn, fit, 20)
  longer = np.concatenate([warmup, np.full(500, 2e-3), np.linspace(2e-3, 0, 280)])
  end = np.array([len(longer)])
  final = [predict('tissue', s, longer, end)[0] for s in samples]
  assert np.percentile(final, 2.5) <= predict('tissue', truth, longer, end)[0] <= np.percentile(final, 97.5)
  assert np.std([s['L0'] for s in samples]) > 0  # the refits differ
  assert search_pick(np.array([2.0, 1.9]), np.array([[2.0, 1.9]] * 19 + [[2.0, 2.1]])) == (1, 0.95)
  assert search_pick(np.array([2.0, 1.9]), np.array([[2.0, 1.9]] * 18 + [[2.0, 2.1]] * 2)) == (0, 0.9)
  assert search_pick(np.array([2.0, 1.9]), None) == (1, None)


SHARED_TRUTH = {'L0': 2.0, 'A': 1.5, 'alpha': 0.3, 'C': 2.0, 'lambda': 0.99}


def _shared_noise_curves():
  """Curves from SHARED_TRUTH times one noise per step (AR(1), lag-1 correlation 0.55, 5% a step) that every run
  shares: a stable run to 500 steps, cooldowns of 50 steps at 250 (short) and of 100 at 400 (long), with the
  noise."""
  rng = np.random.default_rng(1)
  noise = np.zeros(500)
  for t in range(1, 500):
    noise[t] = 0.55 * noise[t - 1] + np.sqrt(1 - 0.55 ** 2) * rng.normal(0, 0.05)
  warmup = np.linspace(1e-4, 2e-3, 20)
  stable = np.concatenate([warmup, np.full(480, 2e-3)])
  short, long = (np.concatenate([warmup, np.full(start - 20, 2e-3), np.linspace(2e-3, 2e-4, end - start)])
                 for start, end in ((250, 300), (400, 500)))
  rates = {'stable': stable, 'short': short, 'long': long}
  updates = {name: np.arange(1, len(r) + 1) for name, r in rates.items()}
  drawn = {name: Curve(name, r, updates[name], predict('tissue', SHARED_TRUTH, r, updates[name])
                       * np.exp(noise[:len(r)])) for name, r in rates.items()}
  return rates, drawn, noise


def test_pairing_with_the_stable_run_cancels_the_noise_its_batches_share():
  """Curves from known momentum-form parameters times one noise per step (a batch's own difficulty: 5% a step,
  correlated from step to step), shared by every run that reads the same batches: paired with the stable run, the
  true parameters give a cooldown's measured losses exactly, and parameters fitted on the stable run and a short
  cooldown predict a longer one's last 5 steps within a quarter of those steps' noise."""
  truth = SHARED_TRUTH
  rates, drawn, noise = _shared_noise_curves()
  stable, short, long = rates['stable'], rates['short'], rates['long']
  updates = paired_steps(drawn['stable'], 'val_loss', 500, 500)
  np.testing.assert_array_equal(updates, np.arange(1, 501))
  np.testing.assert_allclose(paired('tissue', truth, long, updates, drawn['stable']), drawn['long'].loss, rtol=1e-12)
  fit = fit_curves([Curve('stable', stable[:400], np.arange(1, 401), drawn['stable'].loss[:400]), drawn['short']],
                   'tissue')
  last = np.arange(496, 501)
  measured = drawn['long'].loss[-5:].mean()
  five_step = np.convolve(noise, np.ones(5) / 5, 'valid').std()
  matched = abs(paired('tissue', fit['params'], long, last, drawn['stable']).mean() / measured - 1)
  assert matched < five_step / 4, (matched, five_step)
  with pytest.raises(ConfigError, match='--paired short logged no loss at step 500, the config.s last; continue it'):
    paired_steps(drawn['short'], 'loss', 500, 11)


def test_a_fit_paired_with_the_stable_run_recovers_what_a_decay_gains():
  """The same curves (one shared noise per step, 5%, correlated): fitted on the stable run and the short cooldown
  on its ratio to the stable run's loss (`fit --paired`), the law's gain of the long cooldown over the stable run
  comes within 0.5% of the true parameters', and the paired prediction of its last 5 steps within 0.5%; fitted on
  the cooldown's own loss, the same prediction misses by several times that."""
  truth = SHARED_TRUTH
  rates, drawn, _ = _shared_noise_curves()
  stable, short, long = rates['stable'], rates['short'], rates['long']
  base, last = drawn['stable'], np.arange(496, 501)
  measured = drawn['long'].loss[-5:].mean()
  gain = lambda params: predict('tissue', params, long, last).mean() / predict('tissue', params, stable, last).mean()
  errors = {}
  for name, cooldown in (('alone', drawn['short']), ('paired', drawn['short'].on_batches_of(base))):
    fit = fit_curves([base, cooldown], 'tissue')
    errors[name] = abs(paired('tissue', fit['params'], long, last, base).mean() / measured - 1)
    if name == 'paired':
      assert gain(fit['params']) == pytest.approx(gain(truth), rel=5e-3)
      assert fit['curves']['short']['final_predicted'] == pytest.approx(
        paired('tissue', fit['params'], short, np.array([300]), base)[0], rel=1e-12)
  assert errors['paired'] < 5e-3 and errors['alone'] > 4 * errors['paired'], errors


def test_each_run_left_out_is_predicted_by_the_others_and_a_search_keeps_what_that_cannot_resolve():
  """`holdout_each` on the stable run and two cooldowns paired with it: each cooldown (not the base) left out, its
  final loss as a fit on the other two predicts it (paired: the stable run's loss times the law's ratio), and the
  search keeps a pick only where its predicted gain exceeds the largest such miss."""
  rates, drawn, _ = _shared_noise_curves()
  base = drawn['stable']
  curves = [base, drawn['short'].on_batches_of(base), drawn['long'].on_batches_of(base)]
  held = holdout_each(curves, 'tissue')
  assert [h['run'] for h in held] == ['short', 'long']
  for h, i in zip(held, (1, 2)):
    others = fit_curves([c for j, c in enumerate(curves) if j != i], 'tissue')['params']
    end = curves[i].updates[-1:]
    assert h['predicted'] == pytest.approx(paired('tissue', others, rates[h['run']], end, base)[0], rel=1e-12)
    assert h['measured'] == drawn[h['run']].loss[-1] and h['error'] == h['predicted'] / h['measured'] - 1
  finals = np.array([2.0, 1.9, 1.95])
  assert resolved_pick(finals, 1, 0.04) == 1 and resolved_pick(finals, 1, 0.06) == 0
  assert resolved_pick(finals, 1, None) == 1 and resolved_pick(finals, 0, 0.0) == 0
  with pytest.raises(ConfigError, match='--holdout each leaves one run out in turn'):
    holdout_each([base], 'tissue')

