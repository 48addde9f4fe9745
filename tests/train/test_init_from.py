"""`train.init_from`: start a run from our run dirs or HF directories, heads fresh, mismatches named."""
import jax
import numpy as np
import pytest

from lm import cli
from lm.config import ConfigError, load_config
from lm.train.init_from import initial_state
from lm.train.logging import read_metrics
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL, built_once


def val_losses(run_dir):
  return [r['val_loss'] for r in read_metrics(run_dir) if 'val_loss' in r]


@pytest.fixture(scope='module')
def trained():
  """A scanned-layer GPT trained 40 steps, exported to HF and imported back as an (unrolled) run dir."""
  def build(root):
    config = load_config('gpt_tiny', SMALL + ['train.steps=40', 'train.eval_every=40', 'train.eval_batches=2',
                                              f'train.run_dir={root}/source'])
    Pretraining(config, jax.devices()[:1]).run()
    assert cli.main(['convert', '--to-hf', str(root / 'hf'), '--from', str(root / 'source')]) == 0
    assert cli.main(['convert', '--from-hf', str(root / 'hf'), '--to', str(root / 'imported')]) == 0
  return built_once('init_from', build)


@pytest.mark.parametrize('source', ['imported', 'hf', 'source'])
@pytest.mark.variants
def test_a_new_run_starts_where_the_source_ended(trained, source, tmp_path):
  """Step-0 validation loss equals the source run's final one, through HF and back and across layer layouts."""
  config = load_config('gpt_tiny', SMALL + ['train.steps=1', 'train.eval_batches=2', f'train.run_dir={tmp_path}',
                                            f'train.init_from={trained / source}'])
  Pretraining(config, jax.devices()[:1]).run()
  want, got = val_losses(trained / 'source')[-1], val_losses(tmp_path)[0]
  assert val_losses(trained / 'source')[0] - want > 1.0  # the source did learn
  assert abs(got - want) <= 1e-5 * want, (got, want)


@pytest.mark.long(0.2)
def test_config_yaml_of_an_imported_run_trains_from_its_weights(trained, tmp_path, capsys):
  argv = ['train', '--config', str(trained / 'imported' / 'config.yaml'), 'train.steps=1', 'train.eval_batches=2',
          'data.seq_len=32', 'train.global_batch=16', 'train.progress=false']
  assert cli.main(argv + [f'train.run_dir={tmp_path}']) == 0
  assert 'initialised from' in capsys.readouterr().out
  assert abs(val_losses(tmp_path)[0] - val_losses(trained / 'source')[-1]) <= 1e-5 * val_losses(tmp_path)[0]
  assert cli.main(argv) == 2  # training in the imported directory itself would overwrite its params
  assert 'holds an imported model' in capsys.readouterr().err


@pytest.mark.long(0.2)
def test_generate_samples_from_an_imported_run(trained, capsys):
  assert cli.main(['generate', '--run', str(trained / 'imported'), '--prompt', 'def ', '--max-new-tokens', '8']) == 0
  out = capsys.readouterr().out
  assert out.startswith("--- 'def '\n") and len(out.splitlines()) >= 2


def test_a_mismatched_model_is_one_line_naming_the_parameter_and_both_shapes(trained, tmp_path, capsys):
  argv = ['train', '--config', 'gpt_tiny', *SMALL, 'mesh.data=-1', 'model.d_ff=128',
          f'train.init_from={trained / "source"}', f'train.run_dir={tmp_path}']
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'Traceback' not in err
  assert 'parameter decoder/layers/mlp/wi/bias has shape (2, 256) there but (2, 128) in this model' in err
  with pytest.raises(ConfigError, match=r'has no parameter lm_head/kernel \(64, 264\), which this gpt model needs'):
    Pretraining(load_config('gpt_tiny', SMALL + ['model.tie_embeddings=false', f'train.init_from={trained / "source"}',
                                             f'train.run_dir={tmp_path}/b']), jax.devices()[:1]).run()


@pytest.mark.long(0.5)
def test_heads_the_source_lacks_start_fresh_and_are_listed(tmp_path, capsys):
  """A BERT pretrained without NSP, fine-tuned with it: pooler and NSP head are new, the rest is loaded."""
  base = SMALL + ['model.max_len=32', 'train.eval_batches=1']
  plain = load_config('bert_tiny', base + ['train.steps=2', f'train.run_dir={tmp_path}/plain'])
  source = Pretraining(plain, jax.devices()[:1])
  source.run()
  capsys.readouterr()
  config = load_config('bert_tiny', base + ['train.steps=2', 'model.nsp=true', 'model.type_vocab_size=2',
                                            f'train.init_from={tmp_path}/plain', f'train.run_dir={tmp_path}/nsp'])
  trainer = Pretraining(config, jax.devices()[:1])
  records = trainer.run()
  out = capsys.readouterr().out
  assert 'new: nsp_head/bias, nsp_head/kernel, pooler/bias, pooler/kernel' in out
  assert all(np.isfinite(r['nsp_loss']) for r in records if 'nsp_loss' in r)
  before = source.final_state.params['encoder']['layers']['mlp']['wi']['kernel']
  state = initial_state(Pretraining(config, jax.devices()[:1]).assembly, f'{tmp_path}/plain').state
  np.testing.assert_array_equal(np.asarray(state.params['encoder']['layers']['mlp']['wi']['kernel']),
                                np.asarray(before))
  assert int(state.step) == 0 and all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state)
                                      if np.ndim(x) > 0)

  back = load_config('bert_tiny', base + ['train.steps=1', f'train.init_from={tmp_path}/nsp',
                                          f'train.run_dir={tmp_path}/back'])
  Pretraining(back, jax.devices()[:1]).run()
  assert 'not used: nsp_head/bias, nsp_head/kernel, pooler/bias, pooler/kernel' in capsys.readouterr().out
