"""Scaling-law fits recover the laws that generated their points (the simulations of Besiroglu et al.'s
reanalysis), the compute-optimal allocation agrees with a direct minimisation, and bad input is one line."""
import json

import numpy as np
import pytest
from scipy import optimize

from lm import cli
from lm.jobs.scaling import laws
from lm.jobs.scaling.points import Points, read_points

# Hoffmann et al.'s approach-3 constants, unrounded.
TRUE = {'E': 1.69337, 'A': 406.401, 'B': 410.723, 'alpha': 0.33917084, 'beta': 0.2849083}
A_TRUE = TRUE['beta'] / (TRUE['alpha'] + TRUE['beta'])


def law(n, d):
  return TRUE['E'] + TRUE['A'] / n ** TRUE['alpha'] + TRUE['B'] / d ** TRUE['beta']


def grid_points(sigma: float, seed: int) -> Points:
  """7 x 7 runs, N from 1e7 to 1e10 and D from 1e9 to 1e12, losses times exp(N(0, sigma^2))."""
  n, d = (x.ravel() for x in np.meshgrid(np.logspace(7, 10, 7), np.logspace(9, 12, 7)))
  loss = law(n, d) * np.exp(np.random.default_rng(seed).normal(0, sigma, n.shape))
  return Points(n, d, 6 * n * d, loss, tuple(map(str, range(len(n)))), np.zeros(len(n)))


def test_chinchilla_without_noise_returns_every_parameter():
  fit = laws.fit_chinchilla(grid_points(0.0, 0))
  for name, value in TRUE.items():
    assert fit['params'][name] == pytest.approx(value, rel=1e-6), name
  assert fit['a'] == pytest.approx(A_TRUE, rel=1e-6)


@pytest.mark.parametrize('seed', range(10))
@pytest.mark.variants
def test_chinchilla_with_noise_is_within_the_published_recovery(seed):
  fit = laws.fit_chinchilla(grid_points(0.005, seed))
  p = fit['params']
  assert abs(p['alpha'] - TRUE['alpha']) < 0.03 and abs(p['beta'] - TRUE['beta']) < 0.04
  assert abs(p['E'] - TRUE['E']) < 0.09 and abs(fit['a'] - A_TRUE) < 0.04


def test_compute_optimal_minimises_the_law_on_the_iso_compute_curve():
  """N_opt from the closed form equals a direct 1-D minimisation of L(N, C/6N) over log N."""
  for c in (1e19, 5.76e23):
    optimal = laws.compute_optimal(TRUE, c)
    direct = optimize.minimize_scalar(lambda x: law(np.exp(x), c / (6 * np.exp(x))), bounds=(0, 60),
                                      method='bounded', options={'xatol': 1e-10})
    assert optimal['params'] == pytest.approx(np.exp(direct.x), rel=1e-6)
    assert 6 * optimal['params'] * optimal['tokens'] == pytest.approx(c)
    assert optimal['loss'] == pytest.approx(direct.fun, rel=1e-12)


def test_bootstrap_intervals_bracket_the_fit():
  fit = laws.fit_chinchilla(grid_points(0.005, 1), bootstrap=40, budgets=[1e21])
  for key in ('E', 'alpha', 'beta', 'a', 'params_opt@1e+21'):
    lo, hi = fit['ci'][key]
    value = fit['optimal'][0]['params'] if key.startswith('params_opt') else fit.get(key, fit['params'].get(key))
    assert lo < value < hi, key
  assert fit['ci']['alpha'][0] < TRUE['alpha'] < fit['ci']['alpha'][1]


def kaplan_points(sigma: float, seed: int, alpha=0.076, n_c=8.8e13) -> Points:
  """Seven sizes, each with three runs: the longest reaches L(N) = (N_c/N)^alpha (times noise), shorter ones
  sit above it. Compute is 6ND."""
  rng = np.random.default_rng(seed)
  rows = []
  for n in np.logspace(6, 9, 7):
    for d, extra in ((2e8, 0.3), (1e9, 0.1), (5e9, 0.0)):
      rows.append((n, d, (n_c / n) ** alpha * np.exp(rng.normal(0, sigma)) + extra))
  n, d, loss = map(np.array, zip(*rows))
  return Points(n, d, 6 * n * d, loss, tuple(map(str, range(len(n)))), np.zeros(len(n)))


@pytest.mark.parametrize('seed', range(5))
def test_kaplan_recovers_alpha_n(seed):
  fit = laws.fit_kaplan(kaplan_points(0.005, seed))
  assert abs(fit['params']['alpha_N'] - 0.076) < 0.003


def test_kaplan_without_noise_and_the_frontier():
  points = kaplan_points(0.0, 0)
  fit = laws.fit_kaplan(points)
  assert fit['params']['alpha_N'] == pytest.approx(0.076, rel=1e-9)
  assert fit['params']['N_c'] == pytest.approx(8.8e13, rel=1e-6)
  # The frontier by its definition: no point of less or equal compute has lower loss.
  expected = sorted(i for i in range(len(points)) if not any(
    points.flops[j] <= points.flops[i] and points.loss[j] < points.loss[i] for j in range(len(points))))
  assert sorted(laws.frontier(points).tolist()) == expected
  assert [p['flops'] for p in fit['frontier']] == sorted(p['flops'] for p in fit['frontier'])


def isoflop_points(sigma: float, seed: int, sizes: int = 15) -> Points:
  """Five budgets 1e18..1e22, each with `sizes` models over 4x either side of the law's optimum, D = C/6N;
  the recorded compute up to 2% above 6ND, as an exact count adds attention."""
  rng = np.random.default_rng(seed)
  rows = []
  for c in np.logspace(18, 22, 5):
    centre = laws.compute_optimal(TRUE, c)['params']
    for n in centre * np.logspace(-np.log10(4), np.log10(4), sizes):
      d = c / (6 * n)
      rows.append((n, d, c * rng.uniform(1, 1.02), law(n, d) * np.exp(rng.normal(0, sigma))))
  n, d, c, loss = map(np.array, zip(*rows))
  return Points(n, d, c, loss, tuple(map(str, range(len(n)))), np.zeros(len(n)))


@pytest.mark.parametrize('seed', range(10))
def test_isoflop_exponent(seed):
  fit = laws.fit_isoflop(isoflop_points(0.005, seed))
  assert len(fit['budgets']) == 5 and all(b['points'] == 15 for b in fit['budgets'])
  assert abs(fit['a'] - A_TRUE) < 0.02
  assert fit['a'] + fit['b'] == pytest.approx(1.0, abs=0.03)  # D_opt = C/6N_opt, C within 2% of 6ND


def test_isoflop_bootstrap_intervals_cover_the_true_exponent():
  """Each budget's runs resampled (100 times): over 20 noisy simulations the 95% interval of a holds the true
  exponent in at least 17, every vertex has an interval around it, and a target's optimum has one too."""
  covered = 0
  for seed in range(20):
    fit = laws.fit_isoflop(isoflop_points(0.005, seed), budgets=[1e22], bootstrap=100, seed=seed)
    low, high = fit['ci']['a']
    covered += low <= A_TRUE <= high
    for budget in fit['budgets']:
      low, high = fit['ci'][f'params_opt@{budget["flops"]:.3g}']
      assert low <= budget['params_opt'] <= high
    assert fit['ci']['params@1e+22'][0] < fit['optimal'][0]['params'] < fit['ci']['params@1e+22'][1]
  assert covered >= 17, covered


def test_isoflop_without_noise_is_unbiased_in_the_exponent():
  """The parabola's vertex is off by a constant factor (the notes' +1.4% at 4x), which the exponent ignores."""
  fit = laws.fit_isoflop(isoflop_points(0.0, 0))
  assert abs(fit['a'] - A_TRUE) < 0.003
  for budget in fit['budgets']:
    true_n = laws.compute_optimal(TRUE, budget['flops'])['params']
    assert 1.0 < budget['params_opt'] / true_n < 1.06


def write_csv(path, header, rows):
  path.write_text('\n'.join([header] + [','.join(map(str, r)) for r in rows]) + '\n')
  return str(path)


def test_cli_fit_json_matches_the_library(tmp_path, capsys):
  points = grid_points(0.005, 3)
  csv_path = write_csv(tmp_path / 'p.csv', 'params,tokens,loss', zip(points.params, points.tokens, points.loss))
  assert cli.main(['scaling', 'fit', csv_path, '--json', '--budget', '1e21', '--out', str(tmp_path / 'fit.json')]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed == json.loads((tmp_path / 'fit.json').read_text())
  direct = laws.fit_chinchilla(points, budgets=[1e21])
  assert printed['params'] == pytest.approx(direct['params'], rel=1e-6)
  assert printed['optimal'][0]['tokens_per_param'] == pytest.approx(direct['optimal'][0]['tokens_per_param'], rel=1e-5)
  assert set(printed) >= {'law', 'params', 'a', 'b', 'optimal'}
  from lm.jobs.scaling.report import format_fit  # without --json: the same fit as lines
  assert cli.main(['scaling', 'fit', csv_path, '--budget', '1e21']) == 0
  assert capsys.readouterr().out == format_fit(printed) + '\n'


def test_holding_out_the_largest_size_reports_its_prediction_error(tmp_path, capsys):
  """`--holdout largest`: Chinchilla fitted to the six smaller sizes of the 7 x 7 grid predicts the largest's seven
  runs as the true law does (to 0.5% with 0.5% noise), and the same without noise to 1e-6; Kaplan names the size
  and its best run."""
  for sigma, tolerance in ((0.0, 1e-6), (0.005, 0.005)):
    points = grid_points(sigma, 3)
    csv_path = write_csv(tmp_path / 'p.csv', 'run,params,tokens,loss',
                         zip(points.run, points.params, points.tokens, points.loss))
    assert cli.main(['scaling', 'fit', csv_path, '--holdout', 'largest', '--out', str(tmp_path / 'fit.json')]) == 0
    held = json.loads((tmp_path / 'fit.json').read_text())['holdout']
    largest = points.params == points.params.max()
    assert held['params'] == points.params.max() and len(held['runs']) == 7
    np.testing.assert_allclose(held['predicted'], law(points.params[largest], points.tokens[largest]),
                               rtol=tolerance)
    assert 'held out N 1e+10' in capsys.readouterr().out
  assert cli.main(['scaling', 'fit', csv_path, '--law', 'kaplan', '--holdout', 'largest', '--json']) == 0
  held = json.loads(capsys.readouterr().out)['holdout']
  assert len(held['runs']) == 1 and held['measured'][0] == points.loss[largest].min()
  assert cli.main(['scaling', 'fit', csv_path, '--law', 'isoflop', '--holdout', 'largest']) == 2
  assert '--holdout largest applies to chinchilla, kaplan, data_constrained and loss2loss' in capsys.readouterr().err


@pytest.mark.parametrize('header, rows, argv, message', [
  ('params,loss', [(1e7, 3.0)] * 6, [], 'has no column tokens'),
  ('params,tokens,loss', [(1e7, 1e9, 3.0)] * 4, [], 'has 5 parameters but the points number 4'),
  ('params,tokens,loss', [(1e7, 1e9, 3.0)] * 5 + [(1e7, -1, 3.0)], [], 'row 7: tokens=\'-1\' is not a positive'),
  ('params,tokens,loss', [(1e7, 1e9, 3.0)] * 6, ['--law', 'kaplan'], 'at least two sizes'),
  ('params,tokens,loss', [(1e7, 1e9, 3.0)] * 6, ['--params', 'non_embedding'], 'no column non_embedding_params'),
])
def test_bad_points_are_one_line(header, rows, argv, message, tmp_path, capsys):
  csv_path = write_csv(tmp_path / 'p.csv', header, rows)
  assert cli.main(['scaling', 'fit', csv_path, *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err


def test_plot_draws_points_fit_and_isoflop_profiles(tmp_path, capsys):
  points = isoflop_points(0.005, 0, sizes=5)
  csv_path = write_csv(tmp_path / 'p.csv', 'run,params,tokens,flops,loss',
                       zip(points.run, points.params, points.tokens, points.flops, points.loss))
  assert cli.main(['scaling', 'fit', csv_path, '--law', 'isoflop', '--out', str(tmp_path / 'fit.json')]) == 0
  assert cli.main(['scaling', 'plot', csv_path, '--fit', str(tmp_path / 'fit.json'), '--out',
                   str(tmp_path / 'fig.png')]) == 0
  assert (tmp_path / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  from lm.jobs.scaling.plot import plot
  direct = plot(points, tmp_path / 'direct.png', json.loads((tmp_path / 'fit.json').read_text()))
  assert direct.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  (tmp_path / 'bad.json').write_text('{"not": "a fit"}')
  capsys.readouterr()
  assert cli.main(['scaling', 'plot', csv_path, '--fit', str(tmp_path / 'bad.json'), '--out',
                   str(tmp_path / 'fig2.png')]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'is not a fit' in err and not (tmp_path / 'fig2.png').exists()


def test_chinchilla_and_isoflop_fit_each_runs_final_evaluation(tmp_path):
  """Mid-run evaluations (under a schedule fitted to a longer budget) would bias approach 3: a CSV with
  curves fits as its final points alone; Kaplan keeps the curves for the frontier."""
  final = grid_points(0.0, 0)
  rows = [(f'r{i}', 100, n, d, loss) for i, (n, d, loss) in enumerate(zip(final.params, final.tokens, final.loss))]
  rows += [(f'r{i}', 50, n, d / 2, loss + 0.5) for i, (n, d, loss) in enumerate(zip(final.params, final.tokens,
                                                                                     final.loss))]
  path = write_csv(tmp_path / 'curves.csv', 'run,step,params,tokens,loss', rows)
  points = read_points(path)
  assert len(points) == 98 and len(points.final()) == 49
  fitted = laws.fit(points, 'chinchilla')
  for name, value in TRUE.items():
    assert fitted['params'][name] == pytest.approx(value, rel=1e-6), name
  assert laws.fit(points, 'kaplan')['points'] == 98


# The task law (Bhagia et al. 2024): task loss as Chinchilla's form, accuracy as a sigmoid of it.
TASK = {'E': 0.9, 'A': 200.0, 'B': 300.0, 'alpha': 0.3, 'beta': 0.28}
CURVE = {'a': 0.6, 'k': -3.0, 'L0': 2.2, 'b': 0.25}
TARGET = (7e9, 1.4e11)


def task_truth(n, d):
  loss = TASK['E'] + TASK['A'] / n ** TASK['alpha'] + TASK['B'] / d ** TASK['beta']
  return loss, CURVE['a'] / (1 + np.exp(-CURVE['k'] * (loss - CURVE['L0']))) + CURVE['b']


def ladder(sigma: float, seed: int) -> tuple[Points, np.ndarray]:
  """A ladder: 5 sizes (1e7-1e9) x 2 token budgets (20 and 80 tokens per param), each run evaluated at a quarter,
  half, three quarters and all of its tokens; task loss times exp(N(0, sigma^2)), accuracy plus N(0, sigma^2)."""
  rng = np.random.default_rng(seed)
  rows = [(n, ratio * n * f, f'{n:g}x{ratio}', step) for n in np.logspace(7, 9, 5) for ratio in (20, 80)
          for step, f in enumerate((0.25, 0.5, 0.75, 1.0), 1)]
  n, d = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
  loss, accuracy = task_truth(n, d)
  loss = loss * np.exp(rng.normal(0, sigma, n.shape))
  accuracy = accuracy + rng.normal(0, sigma, n.shape)
  return Points(n, d, 6 * n * d, loss, tuple(r[2] for r in rows), np.array([r[3] for r in rows])), accuracy


def test_the_task_law_without_noise_returns_every_parameter_and_the_target():
  points, accuracy = ladder(0.0, 0)
  fit = laws.fit_task(points, accuracy, [TARGET])
  for name, value in {**TASK, **CURVE}.items():
    assert fit['params'][name] == pytest.approx(value, rel=1e-4), name
  loss, acc = task_truth(*TARGET)
  assert fit['predictions'][0]['task_loss'] == pytest.approx(loss, rel=1e-6)
  assert fit['predictions'][0]['accuracy'] == pytest.approx(acc, rel=1e-5)


@pytest.mark.long(0.5)
@pytest.mark.parametrize('seed', range(3))
def test_the_task_law_with_noise_predicts_the_target_within_its_interval(seed):
  """Noise of 0.5% (task loss) and 0.005 (accuracy): the predicted accuracy of a model 7x the largest, on 140x
  the tokens, lies within 0.03 of the truth and inside the bootstrap's 95% interval; the exponents within 0.05."""
  points, accuracy = ladder(0.005, seed)
  fit = laws.fit_task(points, accuracy, [TARGET], bootstrap=40, seed=seed)
  _, acc = task_truth(*TARGET)
  predicted = fit['predictions'][0]['accuracy']
  low, high = fit['ci'][f'accuracy@{TARGET[0]:g},{TARGET[1]:g}']
  assert abs(predicted - acc) < 0.03 and low <= acc <= high, (predicted, acc, low, high)
  assert abs(fit['params']['alpha'] - TASK['alpha']) < 0.05 and abs(fit['params']['beta'] - TASK['beta']) < 0.05


def write_ladder(path, points, accuracy):
  rows = ['run,step,params,tokens,loss,piqa/task_loss,piqa/acc'] + [
    f'{r},{s:g},' + ','.join(repr(float(x)) for x in (n, d, 3.0, lo, a)) for r, s, n, d, lo, a in
    zip(points.run, points.step, points.params, points.tokens, points.loss, accuracy)]
  path.write_text('\n'.join(rows) + '\n')


def test_cli_task_law_matches_the_library_and_names_what_is_missing(tmp_path, capsys):
  points, accuracy = ladder(0.005, 0)
  csv = tmp_path / 'points.csv'
  write_ladder(csv, points, accuracy)
  assert cli.main(['scaling', 'fit', str(csv), '--law', 'task', '--task', 'piqa', '--target', '7e9', '1.4e11',
                   '--json']) == 0
  got = json.loads(capsys.readouterr().out)
  want = laws.fit_task(points, accuracy, [TARGET])
  assert got['task'] == 'piqa' and got['metric'] == 'acc'
  for name, value in want['params'].items():
    assert got['params'][name] == pytest.approx(value, rel=1e-9), name
  assert got['predictions'][0]['accuracy'] == pytest.approx(want['predictions'][0]['accuracy'], rel=1e-9)
  (tmp_path / 'fit.json').write_text(json.dumps(got))
  assert cli.main(['scaling', 'plot', str(csv), '--fit', str(tmp_path / 'fit.json'), '--out',
                   str(tmp_path / 'fig.png')]) == 0  # loss, accuracy against compute, accuracy against task loss
  assert (tmp_path / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  for argv, message in ((['--law', 'task'], 'name it with --task'),
                        (['--law', 'task', '--task', 'hellaswag'], 'no column hellaswag/task_loss'),
                        (['--law', 'task', '--task', 'piqa', '--metric', 'acc_norm'], 'no column piqa/acc_norm'),
                        (['--law', 'task', '--task', 'piqa', '--target', '7e9'], '--target takes pairs')):
    assert cli.main(['scaling', 'fit', str(csv), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, (argv, err)
