"""The transformer_base/big presets are Vaswani et al.'s encoder-decoder: their forward pass equals PyTorch's
nn.TransformerEncoder/DecoderLayer (post-LN, ReLU) with the paper's embeddings (scaled by sqrt(d_model),
sinusoidal positions added, the table shared with the output layer, section 3.4)."""
import jax
import numpy as np
import pytest

from lm.config import load_config
from lm.models import build_model, init_params

torch = pytest.importorskip('torch')
TINY = ['model.vocab_size=384', 'data.tokenizer=byte', 'model.d_model=32', 'model.num_heads=4', 'model.d_ff=64',
        'model.num_layers=2', 'model.num_decoder_layers=2', 'model.execution.scan_layers=false', 'model.max_len=32',
        'data.seq_len=32', 'model.execution.dtype=float32', 'model.execution.attention_impl=xla']


def timing_signal(length, d):
  """Tensor2tensor's sinusoids (the paper's code): sines then cosines, timescales 1 to 1e4."""
  inv = np.exp(-np.log(1e4) * np.arange(d // 2) / (d // 2 - 1))
  angles = np.arange(length)[:, None] * inv
  return np.concatenate([np.sin(angles), np.cos(angles)], -1)


def load_attention(torch_attention, ours):
  t = lambda x: torch.tensor(np.asarray(x, np.float64))
  flat_in = lambda name: np.asarray(ours[name]['kernel']).reshape(ours[name]['kernel'].shape[0], -1).T
  torch_attention.in_proj_weight.data = t(np.concatenate([flat_in(n) for n in ('query', 'key', 'value')]))
  torch_attention.in_proj_bias.data = t(np.concatenate([np.ravel(ours[n]['bias']) for n in ('query', 'key', 'value')]))
  out = np.asarray(ours['out']['kernel'])
  torch_attention.out_proj.weight.data = t(out.reshape(-1, out.shape[-1]).T)
  torch_attention.out_proj.bias.data = t(ours['out']['bias'])


def load_layer(layer, ours, norms):
  t = lambda x: torch.tensor(np.asarray(x, np.float64))
  load_attention(layer.self_attn, ours['attention'])
  if hasattr(layer, 'multihead_attn'):
    load_attention(layer.multihead_attn, ours['cross_attention'])
  layer.linear1.weight.data, layer.linear1.bias.data = t(ours['mlp']['wi']['kernel']).T, t(ours['mlp']['wi']['bias'])
  layer.linear2.weight.data, layer.linear2.bias.data = t(ours['mlp']['wo']['kernel']).T, t(ours['mlp']['wo']['bias'])
  for norm, name in zip(norms, ('attention_norm', 'cross_attention_norm', 'mlp_norm') if len(norms) == 3 else
                        ('attention_norm', 'mlp_norm')):
    norm.weight.data, norm.bias.data = t(ours[name]['scale']), t(ours[name]['bias'])


@pytest.mark.parametrize('preset', ['transformer_base', 'transformer_big'])
@pytest.mark.variants
def test_forward_equals_pytorch_transformer(preset):
  config = load_config(preset, TINY)
  cfg = config.model
  model = build_model(cfg)
  params = jax.tree.map(np.asarray, __import__('flax').linen.unbox(init_params(model, jax.random.key(0), 16)))
  rng = np.random.default_rng(0)
  inputs, targets = rng.integers(0, cfg.vocab_size, (2, 20)), rng.integers(0, cfg.vocab_size, (2, 13))
  got = np.asarray(model.apply({'params': params}, inputs, targets), np.float64)

  kw = dict(d_model=cfg.d_model, nhead=cfg.num_heads, dim_feedforward=cfg.d_ff, dropout=0.0, activation='relu',
            layer_norm_eps=cfg.norm_eps, batch_first=True, norm_first=False, dtype=torch.float64)
  table = params['token_embed']['embedding'].astype(np.float64)

  def embed(ids):
    return torch.tensor(table[ids] * np.sqrt(cfg.d_model) + timing_signal(ids.shape[1], cfg.d_model))
  x = embed(inputs)
  for i in range(cfg.num_layers):
    layer = torch.nn.TransformerEncoderLayer(**kw)
    load_layer(layer, params['encoder'][f'layers_{i}'], (layer.norm1, layer.norm2))
    x = layer(x)
  y = embed(targets)
  causal = torch.nn.Transformer.generate_square_subsequent_mask(targets.shape[1], dtype=torch.float64)
  for i in range(cfg.num_decoder_layers):
    layer = torch.nn.TransformerDecoderLayer(**kw)
    load_layer(layer, params['decoder'][f'layers_{i}'], (layer.norm1, layer.norm2, layer.norm3))
    y = layer(y, x, tgt_mask=causal)
  want = y.detach().numpy() @ table.T  # the output layer is the embedding table
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
