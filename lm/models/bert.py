"""BERT (Devlin et al. 2019): post-LN encoder, learned positions and token types, MLM/NSP/pooler heads."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import Config, ConfigError, ModelConfig
from lm.data.objectives import MaskedLM, NextSentencePairs, regular_ids
from lm.models.family import Encoder, Head, check_vocabulary
from lm.models.layers import ACTIVATIONS, DTYPES, DenseGeneral, Embed, LearnedPositions, LayerNorm
from lm.models.parametrization import Init, readout_input
from lm.models.task_heads import Classifier
from lm.models.transformer import Stack, default_positions
from lm.ops.unembed import Unembedding
from lm.parallel.rules import constrain


class BERT(nn.Module):
  """Bidirectional encoder. `__call__` gives masked-LM logits; `encode`, `pooled`, `nsp_logits` and
  `classify` (when `model.num_labels` > 0) give the other heads. `segment_ids` 0 marks padding."""
  cfg: ModelConfig

  def setup(self) -> None:
    cfg = self.cfg
    dtype, param_dtype = DTYPES[cfg.execution.dtype], DTYPES[cfg.param_dtype]
    common = dict(dtype=dtype, param_dtype=param_dtype)
    inits = Init(cfg)
    head = lambda features, axes, **kw: DenseGeneral(features, axes, use_bias=True,
                                                     kernel_init=inits('head', axes), **common, **kw)
    self.token_embed = Embed(cfg.vocab_size, cfg.d_model, inits=inits, scale=cfg.embedding_scale, **common)
    self.position_embed = LearnedPositions(cfg.max_len, cfg.d_model, inits=inits, **common)
    if cfg.type_vocab_size:
      self.type_embed = Embed(cfg.type_vocab_size, cfg.d_model, inits=inits, axes=(None, 'embed'), **common)
    self.embed_norm = LayerNorm(cfg.norm_eps, **common)
    self.embed_dropout = nn.Dropout(cfg.dropout)
    self.encoder = Stack(cfg, causal=False, num_layers=cfg.num_layers)
    self.mlm_dense = head(cfg.d_model, ('embed', 'mlp'))
    self.mlm_norm = LayerNorm(cfg.norm_eps, **common)
    self.mlm_bias = self.param('mlm_bias', nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
                               (cfg.vocab_size,), param_dtype)
    self.pooler = head(cfg.d_model, ('embed', 'mlp'))
    if cfg.nsp:
      self.nsp_head = head(2, ('mlp', None))
    if cfg.num_labels:
      self.classifier = head(cfg.num_labels, ('mlp', None))

  def encode(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
             token_types: jax.Array | None = None, deterministic: bool = True) -> jax.Array:
    x = self.token_embed(tokens) + self.position_embed(default_positions(tokens) if positions is None else positions)
    if self.cfg.type_vocab_size:
      x = x + self.type_embed(jnp.zeros_like(tokens) if token_types is None else token_types)
    x = self.embed_dropout(self.embed_norm(x), deterministic=deterministic)
    x = constrain(x, ('batch', 'length', 'embed'))
    return self.encoder(x, segment_ids, deterministic=deterministic)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               token_types: jax.Array | None = None, deterministic: bool = True, unembed: bool = True
               ) -> jax.Array | Unembedding:
    """Masked-LM logits [batch, length, vocab]: dense + GELU + LayerNorm, then the tied decoder plus a bias
    (`unembed=False`: that output layer unapplied, for the tiled token loss)."""
    x = self.encode(tokens, segment_ids, positions, token_types, deterministic)
    if self.is_initializing():  # create the heads' params along with the rest
      if self.cfg.nsp:
        self.nsp_logits(x)
      if self.cfg.num_labels:
        self.classifier(self.pooled(x))
    head = self.mlm_head(x)
    return head.logits() if unembed else head

  def mlm_head(self, encoded: jax.Array) -> Unembedding:
    h = readout_input(self.mlm_norm(ACTIVATIONS[self.cfg.activation](self.mlm_dense(encoded))), self.cfg)
    return self.token_embed.unembed(h, bias=self.mlm_bias, chunk=self.cfg.execution.loss_chunk)

  def pretrain(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               token_types: jax.Array | None = None, deterministic: bool = True
               ) -> tuple[Unembedding, jax.Array]:
    """(the MLM output layer unapplied, NSP logits [batch, 2]) for next-sentence-prediction pretraining."""
    x = self.encode(tokens, segment_ids, positions, token_types, deterministic)
    return self.mlm_head(x), self.nsp_logits(x)

  def pooled(self, encoded: jax.Array) -> jax.Array:
    """tanh(dense(first token)): the [CLS] summary the NSP and classification heads read."""
    return jnp.tanh(self.pooler(encoded[:, 0]))

  def nsp_logits(self, encoded: jax.Array) -> jax.Array:
    return self.nsp_head(self.pooled(encoded))

  def classify(self, tokens: jax.Array, segment_ids: jax.Array | None = None, token_types: jax.Array | None = None,
               deterministic: bool = True) -> jax.Array:
    """[batch, num_labels] scores of the sequence (a regression value when num_labels is 1): pooled [CLS],
    dropout, linear, as in BERT's run_classifier.py."""
    encoded = self.encode(tokens, segment_ids, token_types=token_types, deterministic=deterministic)
    return self.classifier(self.embed_dropout(self.pooled(encoded), deterministic=deterministic))


NSP = Head('nsp', labels='nsp_labels', params=('pooler', 'nsp_head'), enabled=lambda cfg: cfg.nsp)


class BERTFamily(Encoder):
  name = 'bert'
  readout_norm = ('mlm_norm',)
  module = BERT
  hf_converter = 'lm.storage.convert.bert'
  heads = (NSP,)
  task_head = Classifier(params=('pooler', 'classifier'), token_types=True)

  def apply(self, model, params, batch, *, deterministic, rngs):
    kwargs = dict(segment_ids=batch.get('segment_ids'), positions=batch.get('positions'),
                  token_types=batch.get('token_types'), deterministic=deterministic, rngs=rngs)
    if model.cfg.nsp:
      head, nsp_logits = model.apply({'params': params}, batch['inputs'], **kwargs, method=BERT.pretrain)
      return {'logits': head, NSP.name: nsp_logits}
    return {'logits': model.apply({'params': params}, batch['inputs'], **kwargs, unembed=False)}

  def objective(self, config, tokenizer):
    check_vocabulary(config, tokenizer)
    if tokenizer.mask_id is None:
      raise ConfigError(f'masked LM needs a mask token, which data.tokenizer={config.data.tokenizer} lacks; '
                        f'use a vocabulary with [MASK] (lm tokenizer train adds one)')
    masked_lm = MaskedLM(config.data.seq_len, special=tokenizer.special_ids, mask_id=tokenizer.mask_id,
                         regular=regular_ids(tokenizer.vocab_size, tokenizer.special_ids))
    if config.model.nsp:
      return NextSentencePairs(masked_lm, cls_id=tokenizer.bos_id, sep_id=tokenizer.eos_id)
    return masked_lm

  def validate(self, config: Config) -> None:
    if config.model.nsp and config.model.type_vocab_size < 2:
      raise ConfigError('model.nsp=true pretrains on sentence pairs, which need token types A and B: '
                        'set model.type_vocab_size=2')


FAMILY = BERTFamily()
