"""Run directories: `lm convert` both ways, and `lm.storage.source` opening our runs and HF directories onto a mesh."""
import json

import grain
import jax
import numpy as np
import pytest
import tokenizers
import transformers

from lm import cli
from lm.assembly import assemble
from lm.storage.checkpoint import Checkpointer
from lm.config import ConfigError, load_config
from lm.storage.convert.hf import load_hf
from lm.data.sources import embedded_documents
from lm.data.tokenizers import get_tokenizer
from lm.jobs.generate import encode_prompt
from lm.parallel.mesh import make_mesh
from lm.parallel.mesh import one_device_mesh
from lm.storage.convert.runs import import_hf
from lm.storage.source import ModelSource
from tests.storage.convert.test_hf import assert_same_tensors, save_hf_model


def test_convert_round_trip_through_a_run_dir(tmp_path, capsys):
  hf, run, out = tmp_path / 'hf', tmp_path / 'run', tmp_path / 'out'
  save_hf_model('bert', hf)
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 0
  model, params = load_hf(hf)
  config = load_config(str(run / 'config.yaml'))
  assert config.model == model.cfg and config.train.run_dir == str(run) and config.data.seq_len == 32
  assert config.train.init_from == str(run.absolute())  # training from its config.yaml starts from these weights
  assert sorted(p.name for p in (run / 'checkpoints').iterdir()) == ['0']  # the layout a training run has
  source = ModelSource(run)
  cfg, loaded = source.config.model, source.params(one_device_mesh())
  assert cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, loaded, params)

  assert cli.main(['convert', '--to-hf', str(out), '--from', str(run)]) == 0
  assert_same_tensors(hf, out)
  with pytest.raises(ConfigError, match='already holds a run'):  # an import never writes over a run
    import_hf(hf, run)
  assert json.loads((out / 'config.json').read_text()) == json.loads((hf / 'config.json').read_text())

  capsys.readouterr()
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 2
  assert cli.main(['convert', '--from-hf', str(hf)]) == 2
  err = capsys.readouterr().err.splitlines()
  assert 'already holds a run' in err[0] and 'needs --to RUN_DIR' in err[1]


HF_CLASSES = {'gpt2': transformers.GPT2LMHeadModel, 'bert': transformers.BertForMaskedLM,
              't5': transformers.T5ForConditionalGeneration, 'llama': transformers.LlamaForCausalLM}


@pytest.mark.parametrize('preset, extra', [
  ('gpt_tiny', []), ('bert_tiny', ['model.max_len=32']), ('t5_tiny', ['model.d_ff=128']),
  ('llama_tiny', ['model.num_kv_heads=4']),
])
@pytest.mark.variants
def test_a_training_checkpoint_exports_to_transformers(preset, extra, tmp_path):
  """A scanned-layer checkpoint written by lm's train loop, every family, loads in transformers with the same
  logits on a padded batch."""
  from tests.conftest import SMALL
  from tests.storage.convert.test_hf import compare
  config = load_config(preset, SMALL + extra + [f'train.run_dir={tmp_path}/run'])
  assert config.model.execution.scan_layers
  assembly = assemble(config, jax.devices()[:1])
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: (0.2 * rng.normal(size=a.shape)).astype(a.dtype), assembly.abstract_state)
  checkpoints = Checkpointer(config.run_dir / 'checkpoints', keep=1, async_save=False)
  checkpoints.save(7, state, iter(grain.MapDataset.range(3).to_iter_dataset()), config.to_dict())
  checkpoints.close()
  (config.run_dir / 'config.yaml').write_text(config.to_yaml())
  assert cli.main(['convert', '--to-hf', str(tmp_path / 'hf'), '--from', str(config.run_dir)]) == 0

  hf_config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  byte = get_tokenizer('byte')  # the run's tokenizer: its ids, not transformers' GPT-2 default of 50256
  assert (hf_config['bos_token_id'], hf_config['eos_token_id'], hf_config['pad_token_id']) == \
    (byte.bos_id, byte.eos_id, byte.pad_id)
  kind = hf_config['model_type']
  hf_model = HF_CLASSES[kind].from_pretrained(tmp_path / 'hf').eval()
  assert (hf_model.config.bos_token_id, hf_model.config.eos_token_id) == (byte.bos_id, byte.eos_id)
  assert compare(hf_model, assembly.model, state.params, kind) < 1e-4


@pytest.mark.parametrize('source', ['hf', 'run'])
def test_params_load_straight_onto_the_mesh_shards(source, tmp_path):
  """FSDP over 8 devices: each device holds an eighth of a kernel, from either kind of directory."""
  save_hf_model('llama', tmp_path / 'hf')
  path = tmp_path / 'hf'
  if source == 'run':
    assert cli.main(['convert', '--from-hf', str(path), '--to', str(tmp_path / 'run')]) == 0
    path = tmp_path / 'run'
  config = load_config('llama_tiny', ['mesh.data=1', 'mesh.fsdp=8'])
  mesh = make_mesh(config.mesh)
  source = ModelSource(path)
  cfg, params = source.config.model, source.params(mesh)
  kernel = params['decoder']['layers_0']['mlp']['wi_0']['kernel']  # [embed 32, mlp 64]
  assert cfg.num_kv_heads == 2 and kernel.shape == (32, 64)
  assert {s.data.shape for s in kernel.addressable_shards} == {(4, 64)} and len(kernel.addressable_shards) == 8
  want = load_hf(tmp_path / 'hf')[1]['decoder']['layers_0']['mlp']['wi_0']['kernel']
  np.testing.assert_array_equal(np.asarray(kernel), want)


def test_neither_kind_of_directory_is_named(tmp_path):
  with pytest.raises(ConfigError, match='neither a run directory .*, a Hugging Face model directory .* nor a PEFT'):
    ModelSource(tmp_path)
  (tmp_path / 'config.yaml').write_text(load_config('gpt_tiny').to_yaml())
  with pytest.raises(ConfigError, match='holds no checkpoint yet'):
    ModelSource(tmp_path)


def _bpe(directory, vocab_size, specials):
  bpe = tokenizers.ByteLevelBPETokenizer()
  bpe.train_from_iterator([text for _, text in embedded_documents()[::60]], vocab_size=vocab_size,
                          special_tokens=specials)
  return bpe


@pytest.mark.parametrize('kind', ['gpt2', 't5'])
@pytest.mark.variants
def test_imported_models_bring_their_tokenizer_to_generation(kind, tmp_path, capsys):
  """GPT-2 with vocab.json + merges.txt, T5 with a tokenizer.json holding <extra_id_N>: the run keeps the files
  and `lm generate` encodes and decodes with them."""
  hf, run = tmp_path / 'hf', tmp_path / 'run'
  if kind == 'gpt2':
    bpe = _bpe(hf, 300, ['<|endoftext|>'])
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=4,
                                                                 n_positions=64))
    model.save_pretrained(hf, safe_serialization=True)
    bpe.save_model(str(hf))
  else:
    bpe = _bpe(hf, 300, ['<pad>', '</s>', '<unk>'] + [f'<extra_id_{i}>' for i in range(100)])
    config = transformers.T5Config(vocab_size=416, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   feed_forward_proj='gated-gelu', tie_word_embeddings=False)
    transformers.T5ForConditionalGeneration(config).save_pretrained(hf, safe_serialization=True)
    bpe.save(str(hf / 'tokenizer.json'))
    (hf / 'special_tokens_map.json').write_text(json.dumps({'eos_token': '</s>', 'pad_token': '<pad>',
                                                            'unk_token': '<unk>'}))
  assert cli.main(['convert', '--from-hf', str(hf), '--to', str(run)]) == 0
  config = load_config(str(run / 'config.yaml'))
  assert config.data.tokenizer == f'hf:{run}/tokenizer' and (run / 'tokenizer').is_dir()
  tok = get_tokenizer(config.data.tokenizer)
  prompt = 'def area(r):<extra_id_0> 3.14' if kind == 't5' else 'def area(r):'
  ids = encode_prompt(config, tok, prompt)
  if kind == 'gpt2':
    assert ids == [bpe.token_to_id('<|endoftext|>')] + bpe.encode('def area(r):').ids
  else:  # the tokenizer's own sentinel, then EOS
    assert bpe.token_to_id('<extra_id_0>') in ids and ids[-1] == bpe.token_to_id('</s>')
  capsys.readouterr()
  assert cli.main(['generate', '--run', str(run), '--prompt', prompt, '--max-new-tokens', '6']) == 0
  assert capsys.readouterr().out.startswith(f'--- {prompt!r}\n')
