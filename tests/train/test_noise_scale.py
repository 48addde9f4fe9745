"""`train.noise_scale`: the two-batch estimates of |G|^2 and tr(Sigma) against Gaussian gradients whose truth is
known, and the gradient noise scale logged by a run with microbatches."""
import numpy as np
import pytest

from lm import cli
from lm.config import ConfigError, load_config
from lm.train.logging import read_metrics
from lm.train.noise_scale import two_batch


def test_the_two_batch_estimates_are_unbiased_on_gaussian_gradients():
  """Per-example gradients G + noise of covariance Sigma (50 dimensions, diagonal): the means of the estimates over
  2,000 draws of a 32-row batch in 4 microbatches are within 2% of |G|^2 and tr(Sigma)."""
  rng = np.random.default_rng(0)
  d, rows, k = 50, 32, 4
  mean = rng.normal(0, 1, d)
  scales = rng.uniform(0.5, 3.0, d)
  estimates = []
  for _ in range(2000):
    examples = mean + scales * rng.standard_normal((rows, d))
    micro = examples.reshape(k, rows // k, d).mean(1)
    small_sq = (micro ** 2).sum(1).mean()
    big_sq = (examples.mean(0) ** 2).sum()
    estimates.append(two_batch(small_sq, big_sq, rows // k, rows))
  g2, trace = np.mean(estimates, 0)
  assert g2 == pytest.approx((mean ** 2).sum(), rel=0.02) and trace == pytest.approx((scales ** 2).sum(), rel=0.02)


def test_a_run_with_microbatches_logs_the_noise_scale(tmp_path, capsys):
  """gpt_tiny in 4 microbatches: gns/* at the watch steps, positive, B_simple in tokens that many times in rows;
  no raw norms in the records; with one microbatch, asking for it is one line."""
  run = tmp_path / 'run'
  assert cli.main(['train', '--config', 'gpt_tiny', 'model.d_model=64', 'model.num_layers=1', 'data.seq_len=32',
                   'train.global_batch=32', 'train.microbatches=4', 'train.noise_scale=true', 'train.watch_every=2',
                   'train.steps=4', 'train.log_every=1', 'train.eval_every=4', 'train.eval_batches=1',
                   'train.progress=false', f'train.run_dir={run}']) == 0
  records = [r for r in read_metrics(run) if 'loss' in r]
  logged = [r for r in records if 'gns/b_simple' in r]
  assert [r['step'] for r in logged] == [2, 4]
  for r in logged:
    assert r['gns/g2'] > 0 and r['gns/trace'] > 0
    assert r['gns/b_simple_tokens'] == pytest.approx(32 * r['gns/b_simple'])
  assert not any('gns/small_sq' in r or 'gns/big_sq' in r for r in records)
  with pytest.raises(ConfigError, match='train.noise_scale=true compares .* and train.microbatches=1; set'):
    load_config('gpt_tiny', ['train.noise_scale=true'])


@pytest.mark.long(0.3)
def test_the_noise_scale_at_a_checkpoint_is_within_20_percent_of_per_example_gradients(tmp_path):
  """gpt_tiny after 30 steps, its params held fixed: the step's two-batch estimates (64 rows in 4 microbatches),
  averaged over 16 batches, against tr(Sigma) and |G|^2 from the 1,024 rows' own gradients (vmapped). Rows cut from
  one document are not independent, which the per-row reference ignores: the two differ by about 10%."""
  import jax
  import jax.numpy as jnp
  from jax.flatten_util import ravel_pytree
  from lm.jobs.pretraining import Pretraining
  from lm.train.step import GNS_BIG, GNS_SMALL, PretrainingLoss
  from tests.conftest import SMALL
  config = load_config('gpt_tiny', SMALL + ['train.global_batch=64', 'train.microbatches=4', 'train.noise_scale=true',
                                            'train.steps=30', 'train.eval_batches=0', f'train.run_dir={tmp_path}'])
  job = Pretraining(config, jax.devices()[:1])
  job.run()
  state, batches = job.final_state, [next(job.train_batches) for _ in range(16)]
  estimates = []
  for batch in batches:
    _, metrics = job.train_step(jax.tree.map(jnp.copy, state), batch)  # the step donates its state: a copy
    estimates.append(two_batch(float(metrics[GNS_SMALL]), float(metrics[GNS_BIG]), 16, 64))
  g2, trace = np.mean(estimates, 0)
  loss = PretrainingLoss(job.assembly)

  def row_gradient(row):
    row = jax.tree.map(lambda x: x[None], row)
    grads = jax.grad(lambda params: loss(params, row, jax.random.key(0), loss.totals(row))[0])(state.params)
    return ravel_pytree(grads)[0]
  per_row = jax.jit(jax.vmap(row_gradient))
  rows = np.concatenate([np.asarray(per_row(batch), np.float64) for batch in batches])
  mean = rows.mean(0)
  trace_ref = ((rows - mean) ** 2).sum() / (len(rows) - 1)
  g2_ref = (mean ** 2).sum() - trace_ref / len(rows)
  assert trace / g2 == pytest.approx(trace_ref / g2_ref, rel=0.2)
  assert g2 == pytest.approx(g2_ref, rel=0.2) and trace == pytest.approx(trace_ref, rel=0.2)
