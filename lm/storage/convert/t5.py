"""T5 (`T5ForConditionalGeneration`, v1.0 and v1.1) <-> our `t5` family.

HF linear weights are [out, in]; only block 0 of each stack holds the relative-position bias
([buckets, heads]). The output layer comes in three layouts:
- tied and rescaled by d_model^-0.5 (v1.0; transformers 5 `scale_decoder_outputs: true`): our tied output;
- tied without the rescale (v1.1 written by transformers 5, `scale_decoder_outputs: false`): our
  untied `lm_head` holding a copy of `shared.weight`, which `save` drops again while they are equal;
- a separate `lm_head.weight`, no rescale (v1.1 written by transformers 4, `tie_word_embeddings: false`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, ModelConfig
from lm.storage.convert.hf_config import GATED, HF_ACTIVATIONS, check_exportable, hf_activation, our_activation
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'T5ForConditionalGeneration'
DEFAULTS = {'vocab_size': 32128, 'd_model': 512, 'd_kv': 64, 'd_ff': 2048, 'num_layers': 6,
            'num_decoder_layers': None, 'num_heads': 8, 'relative_attention_num_buckets': 32,
            'relative_attention_max_distance': 128, 'dropout_rate': 0.1, 'layer_norm_epsilon': 1e-6,
            'initializer_factor': 1.0, 'feed_forward_proj': 'relu'}
EMBED_ALIASES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')  # older files repeat shared.weight


def scales_output(hf: dict) -> bool:
  """Whether transformers 5 rescales the decoder output by d_model^-0.5 (T5Config.__post_init__)."""
  return hf.get('scale_decoder_outputs', hf.get('tie_word_embeddings') is not False)


def activation(feed_forward_proj: str) -> str:
  """Our activation for HF `feed_forward_proj` ('relu', 'gated-gelu', 'gated-silu', ...)."""
  parts = feed_forward_proj.split('-')
  gated = len(parts) == 2 and parts[0] == 'gated'
  if len(parts) > 2 or (len(parts) == 2 and not gated):
    raise ConfigError(f'config.json feed_forward_proj={feed_forward_proj!r} is not of the form ACT or gated-ACT')
  act = 'gelu_new' if feed_forward_proj == 'gated-gelu' else parts[-1]  # HF's backwards-compatible alias
  ours = our_activation(act, 'feed_forward_proj', ARCHITECTURE)
  return GATED[ours] if gated else ours


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  h = {**DEFAULTS, **hf}
  shared = ckpt.get('shared.weight')
  separate = False
  if shared is not None:
    for alias in EMBED_ALIASES:
      if ckpt.same_as(alias, shared) is False:
        raise ConfigError(f'{ckpt.path}: {alias} differs from shared.weight; our T5 has one embedding table')
    separate = ckpt.same_as('lm_head.weight', shared) is False
  scale = scales_output(hf)
  if scale and separate:
    raise ConfigError(f'{ckpt.path}: a separate lm_head.weight with the d_model^-0.5 output rescale '
                      f'(scale_decoder_outputs) is not supported; our T5 rescales only a tied output')
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['d_model'], num_layers=h['num_layers'],
    num_decoder_layers=h['num_decoder_layers'] or h['num_layers'], num_heads=h['num_heads'], head_dim=h['d_kv'],
    d_ff=h['d_ff'], position='relative', relative_buckets=h['relative_attention_num_buckets'],
    relative_max_distance=h['relative_attention_max_distance'], norm='rmsnorm', norm_eps=h['layer_norm_epsilon'],
    norm_position='pre', activation=activation(h['feed_forward_proj']), use_bias=False, scale_attention=False,
    init='fan_in',
    tie_embeddings=scale, dropout=h['dropout_rate'], attention_dropout=h['dropout_rate'],
    init_std=h['initializer_factor'], execution=ExecutionConfig(scan_layers=False))
  out = rules(cfg)
  if not scale:
    out.append(Tensor('lm_head.weight' if separate else 'shared.weight', ('lm_head/kernel',), 'linear'))
  return cfg, out


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='relative', norm='rmsnorm', norm_position='pre', use_bias=False,
                   scale_attention=False, resolved_kv_heads=cfg.num_heads)
  separate = not cfg.tie_embeddings and not np.array_equal(flat['lm_head/kernel'].T, flat['token_embed/embedding'])
  ffp = feed_forward_proj(cfg.activation, base.get('feed_forward_proj'))
  act = ffp.split('-')[-1]
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 't5', 'is_encoder_decoder': True,
    'vocab_size': cfg.vocab_size, 'd_model': cfg.d_model, 'num_layers': cfg.num_layers,
    'num_decoder_layers': cfg.resolved_decoder_layers, 'num_heads': cfg.num_heads,
    'd_kv': cfg.resolved_head_dim, 'd_ff': cfg.resolved_d_ff,
    'relative_attention_num_buckets': cfg.relative_buckets,
    'relative_attention_max_distance': cfg.relative_max_distance, 'layer_norm_epsilon': cfg.norm_eps,
    'feed_forward_proj': ffp, 'dense_act_fn': 'gelu_new' if ffp == 'gated-gelu' else act,
    'is_gated_act': ffp.startswith('gated-'), 'dropout_rate': cfg.dropout, 'initializer_factor': cfg.init_std}
  hf.setdefault('tie_word_embeddings', not separate)
  if scales_output(hf) != cfg.tie_embeddings:
    hf['scale_decoder_outputs'] = cfg.tie_embeddings
  out = rules(cfg)
  if separate:
    out.append(Tensor('lm_head.weight', ('lm_head/kernel',), 'linear'))
  return hf, out


def feed_forward_proj(ours: str, base_name: Any) -> str:
  """HF `feed_forward_proj` for our activation, keeping the base config's spelling when it means the same."""
  try:
    if isinstance(base_name, str) and activation(base_name) == ours:
      return base_name
  except ConfigError:
    pass
  plain = {v: k for k, v in GATED.items()}.get(ours)
  if plain is None:
    return hf_activation(ours, None, ARCHITECTURE)
  return {'gelu_tanh': 'gated-gelu', 'gelu': 'gated-gelu_python'}.get(plain, f'gated-{HF_ACTIVATIONS[plain]}')


def rules(cfg: ModelConfig) -> list[Tensor]:
  """Every tensor but the output layer, whose source depends on the checkpoint layout."""
  mlp = ('wi_0', 'wi_1', 'wo') if cfg.activation in GATED.values() else ('wi', 'wo')
  out = [Tensor('shared.weight', ('token_embed/embedding',))]
  for stack, num_layers in (('encoder', cfg.num_layers), ('decoder', cfg.resolved_decoder_layers)):
    out.append(Tensor(f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
                      (f'{stack}/relpos/rel_embedding',), 'transposed'))
    branches = [('SelfAttention', 'attention')] + ([('EncDecAttention', 'cross_attention')] if stack == 'decoder'
                                                    else [])
    for i in range(num_layers):
      b, o = f'{stack}.block.{i}.layer.', f'{stack}/layers_{i}/'
      for j, (theirs, ours) in enumerate(branches):
        for x, name in zip('qkv', ('query', 'key', 'value')):
          out += dense(f'{b}{j}.{theirs}.{x}', f'{o}{ours}/{name}', 'linear', bias=False)
        out += [*dense(f'{b}{j}.{theirs}.o', f'{o}{ours}/out', 'linear', n_in=2, bias=False),
                *norm(f'{b}{j}.layer_norm', f'{o}{ours}_norm', bias=False)]
      j = len(branches)
      for w in mlp:
        out += dense(f'{b}{j}.DenseReluDense.{w}', f'{o}mlp/{w}', 'linear', bias=False)
      out += norm(f'{b}{j}.layer_norm', f'{o}mlp_norm', bias=False)
    out += norm(f'{stack}.final_layer_norm', f'{stack}/final_norm', bias=False)
  return out
