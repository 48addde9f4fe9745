"""Quantized released weights (DeepSeek-V3's block-scaled FP8, GPT-OSS's MXFP4) dequantize to what transformers
computes, read from safetensors files written by torch."""
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from lm.config import ConfigError
from lm.storage.convert.hf import load_hf
from lm.storage.convert.quantized import dequantize_fp8, mxfp4_values, mxfp4_weight
from lm.storage.convert.tensors import Checkpoint


def test_block_scaled_fp8_reads_from_safetensors_and_equals_transformers(tmp_path):
  """300 x 200 (partial edge blocks on both axes) and a stacked [2, 130, 128] one, each block with its own scale."""
  rng = np.random.default_rng(0)
  tensors = {}
  for name, shape in {'w': (300, 200), 'experts': (2, 130, 128)}.items():
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    tensors[name] = torch.from_numpy(rng.normal(size=shape).astype(np.float32) * 100).to(torch.float8_e4m3fn)
    tensors[f'{name}_scale_inv'] = torch.from_numpy(rng.uniform(1e-3, 1e-1, size=blocks).astype(np.float32))
  save_file(tensors, str(tmp_path / 'model.safetensors'))
  ckpt = Checkpoint(tmp_path / 'model.safetensors', 'DeepseekV3ForCausalLM')
  for name in ('w', 'experts'):
    weight, scale = ckpt.get(name), ckpt.get(f'{name}_scale_inv')
    assert weight.dtype.name == 'float8_e4m3fn'
    ours = dequantize_fp8(weight, scale)
    theirs = _dequantize_fp8_weight(tensors[name], tensors[f'{name}_scale_inv'], [128, 128], torch.float32)
    np.testing.assert_array_equal(ours, theirs.numpy())
  with pytest.raises(ConfigError, match=r'needs block scales of shape \(3, 2\) for blocks of 128 x 128, not \(2, 2\)'):
    dequantize_fp8(ckpt.get('w'), np.ones((2, 2), np.float32))


def test_mxfp4_blocks_and_scales_equal_transformers():
  """Every code in both nibbles, scales above and below 2^0, experts [3] x rows [5] x groups [4] of 16 bytes."""
  rng = np.random.default_rng(1)
  blocks = rng.integers(0, 256, size=(3, 5, 4, 16), dtype=np.uint8)
  scales = rng.integers(117, 137, size=(3, 5, 4), dtype=np.uint8)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
  np.testing.assert_array_equal(mxfp4_weight(blocks, scales), theirs.numpy())
  values = mxfp4_values(blocks[:1, :1, :1], np.full((1, 1, 1), 127, np.uint8)).ravel()
  byte = blocks[0, 0, 0, 0]
  assert values[0] == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6][byte & 15]  # low nibble first
  with pytest.raises(ConfigError, match=r'MXFP4 blocks \(3, 5, 4, 16\) and scales \(3, 5\) do not match'):
    mxfp4_values(blocks, scales[..., 0])


def test_a_quantization_format_no_converter_handles_is_named(tmp_path):
  """A GPTQ Llama (or any format its converter does not dequantize) is refused in one line before any tensor is
  read."""
  import json
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, max_position_embeddings=32)
  transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
  hf = json.loads((tmp_path / 'config.json').read_text())
  (tmp_path / 'config.json').write_text(json.dumps({**hf, 'quantization_config': {'quant_method': 'gptq', 'bits': 4}}))
  with pytest.raises(ConfigError, match=r"quant_method 'gptq' is not handled when converting LlamaForCausalLM "
                                        r'\(handled: none\); load an unquantized checkpoint, or dequantize'):
    load_hf(tmp_path)


def test_an_mxfp4_gpt_oss_imports_as_transformers_dequantizes_it_and_exports_unquantized(tmp_path):
  """A random GPT-OSS whose experts are rewritten as MXFP4 blocks and scales (as the released checkpoints hold
  them; expert widths of whole 32-value groups): lm's import gives the expert weights transformers' own
  dequantizing load gives (`Mxfp4Config(dequantize=True)`), exactly, and the same logits; the export is unquantized."""
  import json
  import transformers
  from safetensors.numpy import load_file
  from lm.storage.convert.hf import save_hf
  from tests.storage.convert.test_hf import CONFIGS, compare
  torch.manual_seed(0)
  config = CONFIGS['gpt_oss']()
  config.intermediate_size = 32
  transformers.GptOssForCausalLM(config).save_pretrained(tmp_path / 'plain')
  tensors = load_file(str(tmp_path / 'plain' / 'model.safetensors'))
  rng = np.random.default_rng(2)
  for name in [n for n in tensors if n.endswith(('gate_up_proj', 'down_proj'))]:
    experts, inputs, out = tensors.pop(name).shape  # [E, in, out] -> blocks [E, out, in / 32, 16], scales
    groups = inputs // 32
    tensors[f'{name}_blocks'] = rng.integers(0, 256, size=(experts, out, groups, 16), dtype=np.uint8)
    tensors[f'{name}_scales'] = rng.integers(120, 128, size=(experts, out, groups), dtype=np.uint8)
  quantized = tmp_path / 'mxfp4'
  quantized.mkdir()
  save_file({k: torch.from_numpy(v) for k, v in tensors.items()}, str(quantized / 'model.safetensors'))
  hf = json.loads((tmp_path / 'plain' / 'config.json').read_text())
  (quantized / 'config.json').write_text(json.dumps({**hf, 'quantization_config': {
    'quant_method': 'mxfp4', 'modules_to_not_convert': ['model.layers.*.self_attn', 'model.layers.*.mlp.router',
                                                        'model.embed_tokens', 'lm_head']}}))
  theirs = transformers.GptOssForCausalLM.from_pretrained(
    quantized, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
  model, params = load_hf(quantized)
  for i in range(config.num_hidden_layers):
    experts, ours = theirs.model.layers[i].mlp.experts, params['decoder'][f'layers_{i}']['mlp']
    gate_up = experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(ours['wi_0'], gate_up[..., ::2])
    np.testing.assert_array_equal(ours['wi_1'], gate_up[..., 1::2])
    np.testing.assert_array_equal(ours['wo'], experts.down_proj.detach().numpy())
  assert compare(theirs, model, params, 'gpt_oss') < 1e-4
  save_hf(model, params, tmp_path / 'out')
  written = load_file(str(tmp_path / 'out' / 'model.safetensors'))
  assert 'model.layers.0.mlp.experts.gate_up_proj' in written and not any(n.endswith('_blocks') for n in written)
  assert 'quantization_config' not in json.loads((tmp_path / 'out' / 'config.json').read_text())


def test_an_fp8_deepseek_v3_imports_as_transformers_dequantizes_it_and_exports_unquantized(tmp_path):
  """A random DeepSeek-V3 whose projections are rewritten as FP8 with a float32 scale per 128 x 128 block (as the
  released checkpoint holds them; the projections here are smaller than a block, the dense MLP's down projection
  [32, 48] included): lm's import gives the weights transformers' own dequantizing load gives
  (`FineGrainedFP8Config(dequantize=True)`), exactly, and the same logits; the export is unquantized."""
  import json
  import transformers
  from safetensors.numpy import load_file
  from lm.storage.convert.hf import save_hf
  from tests.storage.convert.test_hf import CONFIGS, compare
  torch.manual_seed(0)
  transformers.DeepseekV3ForCausalLM(CONFIGS['deepseek_v3']()).save_pretrained(tmp_path / 'plain')
  tensors = {k: torch.from_numpy(v) for k, v in load_file(str(tmp_path / 'plain' / 'model.safetensors')).items()}
  rng = np.random.default_rng(3)
  quantized = [n for n in tensors if n.endswith('proj.weight') or n.endswith('kv_a_proj_with_mqa.weight')]
  for name in quantized:
    w = tensors[name]
    scale = torch.from_numpy(rng.uniform(1e-3, 1e-2, size=(-(-w.shape[0] // 128), -(-w.shape[1] // 128))))
    tensors[name] = (w / scale.float()).to(torch.float8_e4m3fn)
    tensors[f'{name}_scale_inv'] = scale.float()
  out = tmp_path / 'fp8'
  out.mkdir()
  save_file(tensors, str(out / 'model.safetensors'))
  hf = json.loads((tmp_path / 'plain' / 'config.json').read_text())
  (out / 'config.json').write_text(json.dumps({**hf, 'quantization_config': {
    'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic', 'weight_block_size': [128, 128]}}))
  theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(
    out, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
  model, params = load_hf(out)
  attention, ours = theirs.model.layers[0].self_attn, params['decoder']['layers_0']['attention']
  np.testing.assert_array_equal(ours['kv_up']['kernel'].reshape(16, -1), attention.kv_b_proj.weight.detach().numpy().T)
  np.testing.assert_array_equal(ours['query_down']['kernel'], attention.q_a_proj.weight.detach().numpy().T)
  assert compare(theirs, model, params, 'deepseek_v3') < 1e-4
  save_hf(model, params, tmp_path / 'out')
  written = load_file(str(tmp_path / 'out' / 'model.safetensors'))
  assert not any(n.endswith('_scale_inv') for n in written) and written['lm_head.weight'].dtype == np.float32
  assert 'quantization_config' not in json.loads((tmp_path / 'out' / 'config.json').read_text())
