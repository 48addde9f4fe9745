"""Today's open architectures train: a tiny Gemma 2 (sandwich (1 + w) norms, soft-capped attention and output
logits, a window in every other layer), a tiny Gemma 3 (five windowed layers rotating at their own base wavelength
to a global one, (1 + w) query/key norms), a tiny Qwen3 (query/key norms), a tiny Pythia (GPT-NeoX: parallel
residual, a quarter of each head rotating) and a tiny OLMo 2 (branch outputs normalised, query/key norms over all
heads), a tiny GPT-OSS (sinks, biases, routed experts with the clamped SwiGLU) and a tiny DeepSeek-V3 (latent
attention, a dense layer then routed experts under a sigmoid router with groups, a shared expert and the selection
bias) learn the embedded corpus for 50
steps, on one device and on a data (GPT-OSS: expert) x fsdp x tensor mesh, which gives the same losses; Gemma 2 also with its sequence split over the mesh (ring attention
with the window and soft-capping)."""
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.jobs.pretraining import Pretraining
from tests.conftest import SMALL

PRESETS = {'gemma2_tiny': ['model.sliding_window=8'],  # shorter than the 32-token rows
           'gemma3_tiny': ['model.sliding_window=8', 'model.global_every=2'],  # two layers: one windowed, one global
           'qwen3_tiny': [], 'pythia_tiny': [], 'olmo2_tiny': [],
           'gpt_oss_tiny': ['model.sliding_window=8'],  # two layers: one windowed, one global
           'deepseek_v3_tiny': []}  # two layers: one dense, one routed; an MTP module (its loss equal too)
MESHES = {'gemma2_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'),
                          ('mesh.data=2', 'mesh.sequence=2', 'mesh.tensor=2')],
          'gemma3_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')],
          'qwen3_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')],
          'pythia_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')],
          # the query/key norm spans the heads, which the tensor axis splits
          'olmo2_tiny': [('mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')],
          'gpt_oss_tiny': [('mesh.expert=2', 'mesh.fsdp=2', 'mesh.tensor=2')],
          # latent attention's narrower values through ring attention too (padded to the query/key width)
          'deepseek_v3_tiny': [('mesh.expert=2', 'mesh.fsdp=2', 'mesh.tensor=2'),
                               ('mesh.data=2', 'mesh.sequence=2', 'mesh.tensor=2')]}


def losses(preset: str, devices: list, run_dir, *mesh: str) -> np.ndarray:
  """[steps, the loss and each MTP depth's]."""
  config = load_config(preset, SMALL + PRESETS[preset] + ['train.steps=50', f'train.run_dir={run_dir}', *mesh])
  trainer = Pretraining(config, devices)
  state, out = trainer.init_state(), []
  names = ['loss'] + [f'mtp/loss_{k}' for k in range(1, config.model.mtp.depth + 1)]
  for _ in range(50):
    state, metrics = trainer.train_step(state, next(trainer.train_batches))
    out.append([float(metrics[name]) for name in names])
  return np.array(out)


@pytest.mark.long(0.5)
@pytest.mark.parametrize('preset', list(PRESETS))
def test_fifty_steps_learn_and_a_mesh_equals_one_device(preset, tmp_path):
  one = losses(preset, jax.devices()[:1], tmp_path / 'one')
  print(preset, one[::10].round(4).tolist(), one[-1])
  assert np.all(np.mean(one[-5:], axis=0) < one[0] - 1.0)  # from ~ln(264) = 5.6 towards the corpus's byte statistics
  for i, mesh in enumerate(MESHES[preset]):
    np.testing.assert_allclose(losses(preset, jax.devices(), tmp_path / f'mesh{i}', *mesh), one, rtol=2e-4,
                               err_msg=str(mesh))


@pytest.mark.long(0.5)
def test_an_imported_gemma2_generates_trains_and_fine_tunes(tmp_path, capsys):
  """Downstream of `lm convert --from-hf`: `lm generate` (soft-capped logits, windowed cache), a run initialised
  from it, and `lm finetune`'s last-token classifier."""
  import torch
  import transformers

  from lm import cli
  from lm.train.logging import read_metrics
  from tests.jobs.glue import synthetic
  torch.manual_seed(0)
  hf = transformers.Gemma2Config(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                 sliding_window=8, max_position_embeddings=64)
  transformers.Gemma2ForCausalLM(hf).save_pretrained(tmp_path / 'hf')
  run = tmp_path / 'run'
  assert cli.main(['convert', '--from-hf', str(tmp_path / 'hf'), '--to', str(run)]) == 0
  assert 'converted' in capsys.readouterr().out
  assert cli.main(['generate', '--run', str(run), '--prompt', 'def ', '--max-new-tokens', '12']) == 0
  assert capsys.readouterr().out.startswith("--- 'def '\n")
  quick = ['data.seq_len=32', 'train.global_batch=8', 'train.eval_batches=1', 'train.progress=false']
  assert cli.main(['train', '--config', str(run / 'config.yaml'), 'train.steps=2', 'train.eval_every=1',
                   f'train.run_dir={tmp_path / "trained"}', *quick]) == 0
  assert 'initialised from' in capsys.readouterr().out
  losses = [r['val_loss'] for r in read_metrics(tmp_path / 'trained') if 'val_loss' in r]
  assert len(losses) == 3 and all(np.isfinite(losses))
  synthetic.write_rte(tmp_path / 'glue', train=64, dev=16, test=4)
  assert cli.main(['finetune', '--task', 'rte', '--data-dir', str(tmp_path / 'glue'), '--init', str(run),
                   f'train.run_dir={tmp_path / "ft"}', 'train.steps=2', 'train.eval_every=2', *quick]) == 0
  assert (tmp_path / 'ft' / 'rte' / 'eval_results.json').is_file()
