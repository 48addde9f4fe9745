"""`lm scaling sweep` end to end on the embedded corpus: plan, train, resume, collect, fit, plot."""
import csv
import json
import math

import pytest

from lm import cli
from lm.config import load_config
from lm.jobs.scaling.sweep import plan, stable_runs, tokens_trained
from lm.train.logging import read_metrics

BASE = ['data.seq_len=32', 'train.global_batch=8', 'train.eval_batches=1', 'train.log_every=5',
        'train.progress=false']
SIZES = '16x1,32x1,32x2'


def test_plan_fits_each_schedule_to_its_budget():
  base = load_config('gpt_tiny', BASE)
  points = plan(base, [(32, 2), (64, 2)], tokens=[2560, 7680], evals=2)
  assert {p.label for p in points} == {'d32_l2_t2.56e03', 'd32_l2_t7.68e03', 'd64_l2_t2.56e03',
                                       'd64_l2_t7.68e03'}
  for p in points:
    steps = round(float(p.label.split('_t')[1]) / (8 * 32))
    assert p.steps == steps and p.tokens == steps * 8 * 32
    assert {f'train.steps={steps}', f'optim.decay_steps={steps}', f'train.eval_every={-(-steps // 2)}',
            f'optim.warmup_steps={min(30, steps // 10)}', f'model.num_heads={p.width // 64 or 1}'} <= set(p.overrides)
  iso = plan(base, [(32, 2), (64, 2)], budgets=[1e10])
  for p in iso:  # D = C / 6N, rounded to whole batches
    assert abs(p.tokens - 1e10 / (6 * p.params)) <= 8 * 32 / 2


def test_an_lr_grid_runs_every_point_at_every_rate_and_mup_keeps_the_base_head_dim():
  base = load_config('gpt_tiny', BASE + ['model.parametrization=mup', 'model.mup.base_width=64'])
  points = plan(base, [(64, 2), (128, 2)], tokens=[2560, 7680], evals=2, schedule='wsd',
                learning_rates=[1e-3, 3e-3])
  assert len(points) == 8 and {p.label for p in points} >= {'d64_l2_t2.56e03_lr0.001', 'd128_l2_t7.68e03_lr0.003'}
  for p in points:
    assert f'optim.learning_rate={p.learning_rate:g}' in p.overrides and p.label.endswith(f'_lr{p.learning_rate:g}')
    assert 'model.mup.base_head_dim=64' in p.overrides  # the sizes keep gpt_tiny's head dim of 64
  stable = stable_runs(points)
  assert len(stable) == 4  # one per width and rate: cooldowns branch off their own rate's stable run
  for (width, _, _, lr, _), run in stable.items():
    assert run.label == f'd{width}_l2_lr{lr:g}_stable' and f'optim.learning_rate={lr:g}' in run.overrides


def test_a_batch_grid_runs_every_point_at_every_batch_on_its_own_steps():
  """`--batch-grid`: each point at each global batch, its steps the budget over that batch's tokens; a wsd size's
  cooldowns branch off the stable run of their own batch, and the tokens trained count each batch's steps."""
  base = load_config('gpt_tiny', BASE)  # rows of 32 tokens
  points = plan(base, [(64, 2)], tokens=[2560, 7680], evals=2, schedule='wsd', batches=[4, 16])
  assert sorted((p.label, p.steps, p.tokens) for p in points) == [
    ('d64_l2_t2.56e03_b16', 5, 2560), ('d64_l2_t2.56e03_b4', 20, 2560),
    ('d64_l2_t7.68e03_b16', 15, 7680), ('d64_l2_t7.68e03_b4', 60, 7680)]
  for p in points:
    assert f'train.global_batch={p.batch}' in p.overrides and load_config('gpt_tiny', [*BASE, *p.overrides]
                                                                          ).train.global_batch == p.batch
  stable = stable_runs(points)
  assert sorted(run.label for run in stable.values()) == ['d64_l2_b16_stable', 'd64_l2_b4_stable']
  assert all(f'train.global_batch={key[4]}' in run.overrides for key, run in stable.items())
  trained, alone = tokens_trained(points)
  assert alone == 2 * (2560 + 7680)
  assert trained == sum((s.steps * b * 32) for s, b in ((stable[k], k[4]) for k in stable)) + sum(
    (p.steps - p.branch_at) * p.batch * 32 for p in points)


def test_plot_lr_stars_each_widths_lowest_final_loss(tmp_path, capsys):
  rows = [('a', 64, 1e-3, 10, 3.0), ('a', 64, 1e-3, 20, 2.5), ('b', 64, 3e-3, 20, 2.4), ('c', 64, 1e-2, 20, 'nan'),
          ('d', 256, 1e-3, 20, 2.2), ('e', 256, 3e-3, 20, 2.3), ('e', 256, 3e-3, 10, 2.0)]
  points = tmp_path / 'points.csv'
  points.write_text('run,step,params,tokens,loss,width,learning_rate\n' + ''.join(
    f'{run},{step},1000,{step * 100},{loss},{width},{lr}\n' for run, width, lr, step, loss in rows))
  assert cli.main(['scaling', 'plot', str(points), '--lr', '--out', str(tmp_path / 'lr.png')]) == 0
  assert 'best learning rate by width: 64 0.003, 256 0.001' in capsys.readouterr().out  # final steps, NaN skipped
  assert (tmp_path / 'lr.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  one = tmp_path / 'one.csv'
  one.write_text('run,step,params,tokens,loss,width,learning_rate\na,1,1,1,2.0,64,0.001\n')
  assert cli.main(['scaling', 'plot', str(one), '--lr', '--out', str(tmp_path / 'x.png')]) == 2
  assert 'sweep with --lr-grid' in capsys.readouterr().err


def test_a_suites_figure_has_a_line_per_size_against_tokens_and_compute(tmp_path, capsys):
  from lm.jobs.scaling.points import size_label
  points = tmp_path / 'suite.csv'
  rows = [(run, params, step, 3.0 - step / 4000 - params / 1e9) for run, params in (('70m', 70_426_624),
                                                                                       ('1b', 1_011_781_632))
          for step in (1000, 2000, 4000)]
  points.write_text('run,step,params,tokens,flops,loss,piqa/acc,piqa/task_loss\n' + ''.join(
    f'{run},{step},{n},{step * 2097152},{6 * n * step * 2097152},{loss},{0.5 + step / 1e5},{loss}\n'
    for run, n, step, loss in rows))
  assert cli.main(['scaling', 'plot', str(points), '--suite', '--out', str(tmp_path / 'suite.png')]) == 0
  assert (tmp_path / 'suite.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert (size_label(70_426_624), size_label(1_011_781_632), size_label(11_846_072_320)) == ('70.4M', '1.01B', '11.8B')
  assert cli.main(['scaling', 'plot', str(points), '--suite', '--lr', '--out', str(tmp_path / 'x.png')]) == 2
  assert '--lr, --suite and --curves are separate figures' in capsys.readouterr().err


@pytest.mark.long(2)
def test_sweep_collect_fit_plot(tmp_path, capsys):
  """The ladder trains with a harness task in the loop; `collect --tasks` takes the recorded values, and evaluates
  the checkpoints of a run whose records are gone to the same values; `fit --law task` and the plot run on them."""
  from tests.jobs.evals import releases
  data = tmp_path / 'data'
  releases.write_both(data, tmp_path / 'hub')
  out = tmp_path / 'sweep'
  evals = ['train.harness.tasks=piqa', 'train.harness.limit=8', f'train.harness.data_dir={data}']
  argv = ['scaling', 'sweep', '--out', str(out), '--sizes', SIZES, '--tokens', '1280,2560', '--evals', '2', *BASE,
          *evals]
  assert cli.main(argv) == 0
  plan_ = json.loads((out / 'sweep.json').read_text())['points']
  assert len(plan_) == 6
  for point in plan_:
    records = [json.loads(line) for line in (out / point['label'] / 'metrics.jsonl').read_text().splitlines()]
    assert max(r['step'] for r in records) == point['steps']
    assert load_config(str(out / point['label'] / 'config.yaml')).train.steps == point['steps']
  capsys.readouterr()
  assert cli.main(argv) == 0  # a second invocation trains nothing
  log = capsys.readouterr().out
  assert log.count('done, skipped') == 6

  points = tmp_path / 'points.csv'
  assert cli.main(['scaling', 'collect', str(out), '--out', str(points)]) == 0
  with open(points, newline='') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 6 * 2 and {r['run'] for r in rows} == {str(out / p['label']) for p in plan_}
  fit = tmp_path / 'fit.json'
  assert cli.main(['scaling', 'fit', str(points), '--law', 'kaplan', '--out', str(fit)]) == 0
  assert cli.main(['scaling', 'plot', str(points), '--fit', str(fit), '--out', str(tmp_path / 'fig.png')]) == 0
  assert (tmp_path / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

  points = tmp_path / 'task_points.csv'
  collect = ['scaling', 'collect', str(out), '--tasks', 'piqa', '--tasks-data-dir', str(data), '--tasks-limit', '8']
  assert cli.main([*collect, '--out', str(points)]) == 0
  with open(points, newline='') as f:
    recorded = list(csv.DictReader(f))
  assert len(recorded) == 12 and all(float(r['piqa/acc']) >= 0 and float(r['piqa/task_loss']) > 0 for r in recorded)
  run = out / json.loads((out / 'sweep.json').read_text())['points'][0]['label']
  metrics = run / 'metrics.jsonl'
  lines = [{k: v for k, v in json.loads(line).items() if not k.startswith('eval/')}
           for line in metrics.read_text().splitlines()]
  metrics.write_text(''.join(json.dumps(r) + '\n' for r in lines))
  assert cli.main([*collect, '--out', str(tmp_path / 'evaluated.csv')]) == 0
  with open(tmp_path / 'evaluated.csv', newline='') as f:
    evaluated = list(csv.DictReader(f))
  for a, b in zip(recorded, evaluated):
    assert a['run'] == b['run'] and a['step'] == b['step']
    for column in ('piqa/acc', 'piqa/acc_norm', 'piqa/task_loss'):
      assert float(b[column]) == pytest.approx(float(a[column]), rel=1e-6), (a['run'], a['step'], column)
  fit = tmp_path / 'task_fit.json'
  assert cli.main(['scaling', 'fit', str(points), '--law', 'task', '--task', 'piqa', '--target', '1e6', '1e8',
                   '--out', str(fit)]) == 0
  assert math.isfinite(json.loads(fit.read_text())['predictions'][0]['accuracy'])
  assert cli.main(['scaling', 'plot', str(points), '--fit', str(fit), '--out', str(tmp_path / 'tasks.png')]) == 0
  assert (tmp_path / 'tasks.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.long(0.2)
def test_an_interrupted_point_resumes(tmp_path):
  """A point stopped before its last step is continued from its checkpoint, not restarted."""
  out = tmp_path / 'sweep'
  argv = ['scaling', 'sweep', '--out', str(out), '--sizes', '16x1', '--tokens', '2560', '--evals', '2', *BASE]
  assert cli.main(argv) == 0
  run = out / 'd16_l1_t2.56e03'
  [final] = [p for p in (run / 'checkpoints').iterdir() if p.name == '10']
  import shutil
  shutil.rmtree(final)  # as if killed between the mid-run and the final checkpoint
  assert cli.main(argv) == 0
  records = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
  assert sorted(p.name for p in (run / 'checkpoints').iterdir()) == ['10', '5']
  assert [r['step'] for r in records if 'val_loss' in r] == [0, 5, 10]


def test_an_expert_ladder_splits_experts_finer_at_the_same_active_params_and_budgets_on_them():
  """moe_tiny's recipe at two widths x layouts 4x1 and 4x1g2 (Krajewski's granularity: 8 experts of half the width,
  2 per token): total and active params equal across G and equal hand counts; IsoFLOP budgets give D = C / 6
  N_active; each layout's points branch off a stable run of their own."""
  base = load_config('moe_tiny', BASE)
  points = plan(base, [(64, 2), (128, 2)], budgets=[1e10], schedule='wsd', experts=[(4, 1, 1), (4, 1, 2)])
  assert len(points) == 4 and {p.label for p in points} >= {'C1e10_d64_l2_e4k1g1', 'C1e10_d128_l2_e4k1g2'}
  for p in points:
    d, (e, k, g) = p.width, p.experts
    f = 352 // g  # the dense width (moe_tiny's d_ff) split G ways
    assert {f'model.moe.num_experts={e * g}', f'model.moe.experts_per_token={k * g}',
            f'model.moe.expert_d_ff={f}'} <= set(p.overrides)
    attention = 4 * d * d  # query, key, value, output (a sized model has as many kv heads as heads)
    shared = 2 * (attention + 2 * d) + d + 2 * 264 * d  # two layers' attention and norms, final norm, untied tables
    router = 2 * d * e * g
    assert p.params == shared + router + 2 * e * g * 3 * d * f
    assert p.active == shared + router + 2 * k * g * 3 * d * f
    assert abs(p.tokens - 1e10 / (6 * p.active)) <= 8 * 32 / 2
  assert {s.label for s in stable_runs(points).values()} == {f'd{d}_l2_e4k1g{g}_stable' for d in (64, 128)
                                                              for g in (1, 2)}


@pytest.mark.parametrize('argv, message', [
  (['--sizes', '64by2'], 'is not WIDTHxDEPTH'),
  (['--experts', '8x9'], 'is not EXk[gG]'),
  (['--tokens', '1e5,-3'], 'is not a list of positive numbers'),
  (['--sizes', '16x1', '--tokens', '10'], 'shorter than one batch'),
])
def test_bad_sweeps_are_one_line(argv, message, tmp_path, capsys):
  assert cli.main(['scaling', 'sweep', '--out', str(tmp_path / 's'), '--dry-run', *argv, *BASE]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err, err



@pytest.mark.long(0.5)
def test_a_wsd_ladder_branches_each_budget_off_one_stable_run(tmp_path, capsys):
  """`--schedule wsd`: one constant-rate run to the largest budget's last step, each budget a cooldown branched off
  it at its decay start; every point's final val_loss is the independent WSD run's of its budget (to float32
  rounding). Its cooldowns' whole curves fit (`fit --law curve`), and `predict` on a cooldown's config gives the fit's
  own curve there (the schedule rebuilt from the config, against the rates the run logged); paired with the
  cooldown itself, its measured loss (`--paired`)."""
  base = [*BASE, 'optim.decay_fraction=0.4', 'train.log_every=1']  # 5 steps decay from step 3, 10 from step 6
  out = tmp_path / 'sweep'
  argv = ['scaling', 'sweep', '--out', str(out), '--sizes', '16x1', '--tokens', '1280,2560', '--evals', '2',
          '--schedule', 'wsd', *base]
  assert cli.main(argv) == 0
  assert 'tokens to train: 4,096 (107% of the 3,840 of independent runs)' in capsys.readouterr().out
  listing = json.loads((out / 'sweep.json').read_text())
  assert [(p['label'], p['steps'], p['branch_at']) for p in listing['points']] == [
    ('d16_l1_t1.28e03', 5, 3), ('d16_l1_t2.56e03', 10, 6)]
  assert [(s['label'], s['steps'], s['branches']) for s in listing['stable']] == [('d16_l1_stable', 10, [3, 6])]
  assert listing['tokens_trained'] == 16 * 256 and listing['tokens_as_independent_runs'] == 15 * 256
  assert {'3', '6', '10'} <= {p.name for p in (out / 'd16_l1_stable' / 'checkpoints').iterdir()}
  # evaluated at each budget's last step too (train.eval_at), where its cooldown's held-out loss pairs with it
  assert {5, 10} <= {r['step'] for r in read_metrics(out / 'd16_l1_stable') if 'val_loss' in r}

  final = lambda run: [r['val_loss'] for r in read_metrics(run) if 'val_loss' in r][-1]
  for point in listing['points']:
    alone = tmp_path / f'alone_{point["steps"]}'
    overrides = [o for o in point['overrides'] if o != 'train.resume=true']
    assert cli.main(['train', '--config', 'gpt_tiny', *base, *overrides, f'train.run_dir={alone}']) == 0
    # to float32 rounding: on an AVX-512 BF16 machine the branch's last held-out loss came out an ulp from the
    # independent run's, every training loss, rate and gradient norm equal
    assert final(out / point['label']) == pytest.approx(final(alone), rel=1e-6), point['label']
    assert max(r['step'] for r in read_metrics(out / point['label'])) == point['steps']

  capsys.readouterr()
  assert cli.main(argv) == 0  # nothing left to train: the stable run and both branches are skipped
  assert capsys.readouterr().out.count('done, skipped') == 3
  points = tmp_path / 'points.csv'
  assert cli.main(['scaling', 'collect', str(out), '--out', str(points)]) == 0
  with open(points, newline='') as f:
    assert {r['run'] for r in csv.DictReader(f)} == {str(out / p['label']) for p in listing['points']}

  cooldowns = [str(out / p['label']) for p in listing['points']]
  for form in ('tissue', 'mpl'):
    capsys.readouterr()
    assert cli.main(['scaling', 'fit', *cooldowns, '--law', 'curve', '--form', form, '--out',
                     str(tmp_path / f'{form}.json')]) == 0
    fit = json.loads((tmp_path / f'{form}.json').read_text())
    assert fit['law'] == 'curve' and fit['form'] == form and set(fit['curves']) == set(cooldowns)
    assert f'curve ({form}) on 2 runs' in capsys.readouterr().out
    assert cli.main(['scaling', 'predict', '--fit', str(tmp_path / f'{form}.json'), '--config',
                     f'{cooldowns[1]}/config.yaml']) == 0
    said = capsys.readouterr().out
    assert f'predicted final training loss (step 10, {form}): {fit["curves"][cooldowns[1]]["final_predicted"]:.4f}' \
      in said, said
  # on the held-out loss at the evaluations instead: measured after the step's update, so predict's step 10 is the
  # fit's point at the run's last evaluation
  held = tmp_path / 'held.json'
  assert cli.main(['scaling', 'fit', *cooldowns, '--law', 'curve', '--form', 'tissue', '--metric', 'val_loss',
                   '--bootstrap', '3', '--out', str(held)]) == 0
  fit = json.loads(held.read_text())
  said = capsys.readouterr().out
  assert fit['metric'] == 'val_loss' and 'curve (tissue) on 2 runs, their val_loss' in said
  assert len(fit['samples']) == 3 and '3 refits on resampled residuals' in said
  assert [fit['curves'][run]['final_loss'] for run in cooldowns] == [final(run) for run in cooldowns]
  assert cli.main(['scaling', 'predict', '--fit', str(held), '--config', f'{cooldowns[1]}/config.yaml']) == 0
  said = capsys.readouterr().out
  assert f'predicted final val_loss (step 10, tissue): {fit["curves"][cooldowns[1]]["final_predicted"]:.4f} [' in said
  assert cli.main(['scaling', 'predict', '--fit', str(held), '--config', f'{cooldowns[1]}/config.yaml', '--search',
                   'decay_fraction=0.2,0.4']) == 0
  said = capsys.readouterr().out  # each schedule's final loss with its interval over the resamples
  assert said.startswith('as configured') and said.count(' [') == 3 and 'best: ' in said, said
  assert cli.main(['scaling', 'fit', *cooldowns, '--law', 'curve', '--metric', 'val/code/loss']) == 2
  assert f'{cooldowns[0]} logged no val/code/loss; fit --metric loss (the training loss) or one of its held-out ' \
         f'losses: val_loss' in capsys.readouterr().err
  assert cli.main(['scaling', 'predict', '--fit', str(tmp_path / 'mpl.json'), '--config', f'{cooldowns[1]}/config.yaml',
                   '--search', 'decay_fraction=0.2,0.4', 'decay_shape=linear,sqrt']) == 0
  said = capsys.readouterr().out
  assert said.count('optim.decay_fraction=') == 5 and 'best: optim.decay_fraction=' in said, said
  config = f'{cooldowns[1]}/config.yaml'
  assert cli.main(['scaling', 'predict', '--fit', str(tmp_path / 'mpl.json'), '--config', config,
                   '--paired', cooldowns[1]]) == 0  # the law's ratio of a schedule to itself is 1
  measured = [r['loss'] for r in read_metrics(cooldowns[1]) if 'loss' in r][-1]
  assert f'paired with {cooldowns[1]}): {measured:.4f}' in capsys.readouterr().out
  stable = str(out / 'd16_l1_stable')
  assert cli.main(['scaling', 'predict', '--fit', str(tmp_path / 'mpl.json'), '--config', config,
                   '--paired', stable]) == 0
  assert f'(step 10, mpl, paired with {stable}): ' in capsys.readouterr().out
  assert cli.main(['scaling', 'predict', '--fit', str(held), '--config', f'{cooldowns[0]}/config.yaml',
                   '--paired', stable]) == 0
  assert f'predicted final val_loss (step 5, tissue, paired with {stable}): ' in capsys.readouterr().out
  for paired, extra, message in [(cooldowns[0], [], f'--paired {cooldowns[0]} logged no loss at step 10, the '
                                                    f'config\'s last; continue it to step 10'),
                                 (stable, ['train.seed=1'], f'--paired {stable} read other batches: its train.seed '
                                                            f'is 0, the config\'s 1')]:
    assert cli.main(['scaling', 'predict', '--fit', str(tmp_path / 'mpl.json'), '--config', config, '--paired',
                     paired, *extra]) == 2
    assert message in capsys.readouterr().err
  # fitted paired: the cooldown on its ratio to the stable run's loss, its final prediction predict --paired's
  paired_fit = tmp_path / 'paired.json'
  assert cli.main(['scaling', 'fit', stable, cooldowns[0], '--law', 'curve', '--form', 'tissue', '--paired', stable,
                   '--out', str(paired_fit)]) == 0
  fit = json.loads(paired_fit.read_text())
  assert fit['paired'] == stable
  capsys.readouterr()
  assert cli.main(['scaling', 'predict', '--fit', str(paired_fit), '--config', f'{cooldowns[0]}/config.yaml',
                   '--paired', stable]) == 0
  assert f'paired with {stable}): {fit["curves"][cooldowns[0]]["final_predicted"]:.4f}' in capsys.readouterr().out
  # each cooldown left out in turn; predict --search keeps the configured schedule unless a pick gains more than the
  # largest miss (here set to 100%, then 0%)
  assert cli.main(['scaling', 'fit', stable, *cooldowns, '--law', 'curve', '--form', 'tissue', '--paired', stable,
                   '--holdout', 'each', '--out', str(paired_fit)]) == 0
  fit = json.loads(paired_fit.read_text())
  assert [h['run'] for h in fit['holdout']] == cooldowns
  assert fit['holdout_error'] == max(abs(h['error']) for h in fit['holdout'])
  assert f'held out {cooldowns[1]}' in capsys.readouterr().out
  search = ['scaling', 'predict', '--fit', str(paired_fit), '--config', f'{cooldowns[1]}/config.yaml', '--search',
            'decay_fraction=0.2,0.8']
  for error, said in ((1.0, 'within the 100.00% the fit missed a run it left out by'),
                      (0.0, 'beyond the 0.00% the fit missed a run it left out by')):
    paired_fit.write_text(json.dumps({**fit, 'holdout_error': error}))
    assert cli.main(search) == 0
    out_text = capsys.readouterr().out
    assert said in out_text and out_text.count('  best') == 1, out_text
  reseeded = tmp_path / 'reseeded'  # a cooldown's record, as if trained from another seed
  reseeded.mkdir()
  (reseeded / 'config.yaml').write_text((out / listing['points'][0]['label'] / 'config.yaml').read_text().replace(
    '  seed: 0', '  seed: 1'))
  (reseeded / 'metrics.jsonl').write_text((out / listing['points'][0]['label'] / 'metrics.jsonl').read_text())
  for runs, paired, message in [([cooldowns[0]], stable, f'--paired {stable} is not among the fitted runs'),
                                ([stable, str(reseeded)], stable, f'{reseeded} read other batches than --paired '
                                                                  f'{stable}: its train.seed is 1, {stable}\'s 0')]:
    assert cli.main(['scaling', 'fit', *runs, '--law', 'curve', '--paired', paired]) == 2
    assert message in capsys.readouterr().err
  assert cli.main(['scaling', 'fit', str(points), '--paired', stable]) == 2
  assert '--paired applies to --law curve, not --law chinchilla' in capsys.readouterr().err
  for argv, message in [([str(points), '--holdout', 'each'], '--holdout each applies to --law curve'),
                        ([stable, '--law', 'curve', '--holdout', 'largest'], 'a curve fit holds out each run'),
                        ([stable, '--law', 'curve', '--holdout', 'each'], '--holdout each leaves one run out')]:
    assert cli.main(['scaling', 'fit', *argv]) == 2
    assert message in capsys.readouterr().err
  assert cli.main(['scaling', 'plot', *cooldowns, '--curves', '--fit', str(tmp_path / 'mpl.json'), '--out',
                   str(tmp_path / 'curves.png')]) == 0
  assert (tmp_path / 'curves.png').stat().st_size > 10_000

  other = tmp_path / 'wider'  # another size's run, as config.yaml and metrics.jsonl say
  other.mkdir()
  (other / 'config.yaml').write_text((out / listing['points'][1]['label'] / 'config.yaml').read_text().replace(
    'd_model: 16', 'd_model: 32'))
  (other / 'metrics.jsonl').write_text((out / listing['points'][1]['label'] / 'metrics.jsonl').read_text())
  no_rates = tmp_path / 'no_rates'
  no_rates.mkdir()
  (no_rates / 'config.yaml').write_text((other / 'config.yaml').read_text())
  (no_rates / 'metrics.jsonl').write_text(''.join(
    json.dumps({k: v for k, v in r.items() if k != 'learning_rate'}) + '\n' for r in read_metrics(other)))
  for runs, message in [([cooldowns[0], str(other)], 'is another model than'),
                        ([str(no_rates)], 'has losses without learning rates (step 1)')]:
    assert cli.main(['scaling', 'fit', *runs, '--law', 'curve']) == 2
    assert message in capsys.readouterr().err
  assert cli.main(['scaling', 'fit', cooldowns[0], cooldowns[1]]) == 2
  assert '--law chinchilla fits one points CSV, not 2 files' in capsys.readouterr().err
