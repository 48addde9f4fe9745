"""BERT (`BertForMaskedLM`) <-> our `bert` family.

HF linear weights are [out, in]; BERT is post-LN with a LayerNorm on the summed embeddings, and
its MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings, bias) is our
`mlm_dense`, `mlm_norm`, `token_embed` and `mlm_bias`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lm.config import ConfigError, ExecutionConfig, ModelConfig
from lm.storage.convert.hf_config import check_exportable, hf_activation, hf_sizes, our_activation, unsupported
from lm.storage.convert.tensors import Checkpoint, Tensor, dense, norm

ARCHITECTURE = 'BertForMaskedLM'
DEFAULTS = {'vocab_size': 30522, 'hidden_size': 768, 'num_hidden_layers': 12, 'num_attention_heads': 12,
            'intermediate_size': 3072, 'hidden_act': 'gelu', 'hidden_dropout_prob': 0.1,
            'attention_probs_dropout_prob': 0.1, 'max_position_embeddings': 512, 'type_vocab_size': 2,
            'initializer_range': 0.02, 'layer_norm_eps': 1e-12}
WORDS = 'bert.embeddings.word_embeddings.weight'
# a GLUE fine-tune's head as BertForSequenceClassification names it (a PEFT adapter's modules_to_save)
SEQUENCE_HEAD = [*dense('bert.pooler.dense', 'pooler', 'linear'), *dense('classifier', 'classifier', 'linear')]


def load(hf: dict, ckpt: Checkpoint) -> tuple[ModelConfig, list[Tensor]]:
  unsupported(ARCHITECTURE, hf, position_embedding_type='absolute', is_decoder=False, add_cross_attention=False)
  h = {**DEFAULTS, **hf}
  words, bias = ckpt.get(WORDS), ckpt.get('cls.predictions.bias')
  tied = None if words is None else ckpt.same_as('cls.predictions.decoder.weight', words)
  if tied is False or (tied is None and hf.get('tie_word_embeddings') is False):
    raise ConfigError(f'{ckpt.path}: the MLM decoder (cls.predictions.decoder.weight) is not tied to the word '
                      f'embeddings; our BERT always ties them, so this checkpoint cannot be converted')
  if bias is not None and ckpt.same_as('cls.predictions.decoder.bias', bias) is False:
    raise ConfigError(f'{ckpt.path}: cls.predictions.decoder.bias differs from cls.predictions.bias; '
                      f'our BERT has one MLM output bias')
  cfg = ModelConfig(
    vocab_size=h['vocab_size'], d_model=h['hidden_size'], num_layers=h['num_hidden_layers'],
    num_heads=h['num_attention_heads'], d_ff=h['intermediate_size'], max_len=h['max_position_embeddings'],
    position='learned', type_vocab_size=h['type_vocab_size'], norm='layernorm',
    norm_eps=h['layer_norm_eps'], norm_position='post',
    activation=our_activation(h['hidden_act'], 'hidden_act', ARCHITECTURE), use_bias=True, tie_embeddings=True,
    dropout=h['hidden_dropout_prob'], attention_dropout=h['attention_probs_dropout_prob'],
    init_std=h['initializer_range'], execution=ExecutionConfig(scan_layers=False))
  return cfg, rules(cfg)


def save(cfg: ModelConfig, flat: dict[str, np.ndarray], base: dict) -> tuple[dict, list[Tensor]]:
  check_exportable(cfg, ARCHITECTURE, position='learned', norm='layernorm', norm_position='post', use_bias=True,
                   tie_embeddings=True, scale_attention=True, nsp=False,
                   resolved_head_dim=cfg.d_model // cfg.num_heads, resolved_kv_heads=cfg.num_heads)
  if cfg.type_vocab_size <= 0:
    raise ConfigError(f'cannot export model.type_vocab_size={cfg.type_vocab_size} as {ARCHITECTURE}; '
                      f'it always has token-type embeddings (type_vocab_size >= 1)')
  hf: dict[str, Any] = {
    **base, 'architectures': [ARCHITECTURE], 'model_type': 'bert', **hf_sizes(cfg),
    'type_vocab_size': cfg.type_vocab_size, 'layer_norm_eps': cfg.norm_eps,
    'hidden_act': hf_activation(cfg.activation, base.get('hidden_act'), ARCHITECTURE),
    'hidden_dropout_prob': cfg.dropout, 'attention_probs_dropout_prob': cfg.attention_dropout,
    'initializer_range': cfg.init_std, 'tie_word_embeddings': True}
  return hf, rules(cfg)


def rules(cfg: ModelConfig) -> list[Tensor]:
  e = 'bert.embeddings.'
  out = [Tensor(WORDS, ('token_embed/embedding',)),
         Tensor(f'{e}position_embeddings.weight', ('position_embed/embedding',)),
         *norm(f'{e}LayerNorm', 'embed_norm')]
  if cfg.type_vocab_size:
    out.append(Tensor(f'{e}token_type_embeddings.weight', ('type_embed/embedding',)))
  for i in range(cfg.num_layers):
    h, o = f'bert.encoder.layer.{i}.', f'encoder/layers_{i}/'
    for name in ('query', 'key', 'value'):
      out += dense(f'{h}attention.self.{name}', f'{o}attention/{name}', 'linear')
    out += [*dense(f'{h}attention.output.dense', f'{o}attention/out', 'linear', n_in=2),
            *norm(f'{h}attention.output.LayerNorm', f'{o}attention_norm'),
            *dense(f'{h}intermediate.dense', f'{o}mlp/wi', 'linear'),
            *dense(f'{h}output.dense', f'{o}mlp/wo', 'linear'),
            *norm(f'{h}output.LayerNorm', f'{o}mlp_norm')]
  return out + [*dense('cls.predictions.transform.dense', 'mlm_dense', 'linear'),
                *norm('cls.predictions.transform.LayerNorm', 'mlm_norm'),
                Tensor('cls.predictions.bias', ('mlm_bias',))]
