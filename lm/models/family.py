"""What generic code knows of a model family: one record per family, registered in `lm.models.FAMILIES`.

A record says how to build and initialise the module, how a batch maps onto its call, which objective pretrains
it, which extra heads it trains (with their losses and metrics), its forward FLOPs, how `lm.jobs.generate` decodes
it (`Decoding`) and `lm eval` scores it (`Scoring`), and which Hugging Face converter reads and writes it. Step,
loss, data pipeline, accounting, generation, conversion and config validation ask the record and never the
family's name. The three shapes of model share their record code here (`DecoderOnly`, `Encoder`,
`EncoderDecoder`); a family's own record sits in its model file.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.config import Config, ConfigError, ModelConfig
from lm.mesh_axes import axis_size
from lm.data.objectives import CausalLM, Objective
from lm.models.decode import DECODER_ONLY, ENCODER_DECODER, Decoding
from lm.models.moe import aux_losses, expert_counts
from lm.models.mtp import ahead_keys
from lm.models.scoring import CAUSAL, SEQ2SEQ, Scoring
from lm.models.task_heads import Classifier, TaskHead, TextToText
from lm.ops.scores import continuation_scores

if TYPE_CHECKING:
  from lm.data.tokenizers import Tokenizer

Batch = dict[str, jax.Array]
# `Family.apply`'s outputs beside the logits
AUX_LOSS, AUX_TERMS, EXPERT_COUNTS = 'aux_loss', 'aux_terms', 'expert_counts'
AHEAD = 'ahead'  # the MTP depths' output layers (`model.mtp`), in order


@dataclass(frozen=True)
class Head:
  """A per-sequence output trained beside the token loss by softmax cross-entropy (BERT's NSP).

  The model's outputs carry its logits [batch, classes] under `name`; the batch carries its labels
  under `labels`. Metrics: '{name}_loss' and '{name}_accuracy' per sequence.
  """
  name: str
  labels: str
  params: tuple[str, ...]  # top-level param modules it owns: initialised fresh when a source lacks them
  enabled: Callable[[ModelConfig], bool]


@dataclass(frozen=True)
class KernelSizes:
  """Weights of the dense kernels by the tokens they see (`lm.assembly.accounting.kernel_sizes`)."""
  encoder: int  # under the top-level 'encoder' module (the stacks of T5 and BERT)
  other: int  # every other per-token kernel: decoder stacks, output and MLM layers
  cross_kv: int  # cross-attention key/value projections: they see encoder tokens
  per_sequence: int  # heads that read one position per row
  output: int  # a tied output layer, whose weights are the embedding table

  @property
  def per_token(self) -> int:
    """Everything a single-stack model runs on each token."""
    return self.encoder + self.other + self.cross_kv + self.output


class Family:
  """The record base: subclasses set the class attributes (or an instance its name and converter, as the Llama
  layout's do) and override what differs."""
  name: str
  module: ClassVar[type[nn.Module]]
  hf_converter: str | None = None  # module with ARCHITECTURE (the transformers class), load, save
  decoding: ClassVar[Decoding | None] = None  # how `lm.jobs.generate` samples from it; None: it cannot
  scoring: ClassVar[Scoring | None] = None  # how `lm eval` scores continuations with it; None: it cannot
  heads: ClassVar[tuple[Head, ...]] = ()
  task_head: ClassVar[TaskHead | None] = None  # how it fine-tunes on sequence tasks (GLUE); None: it cannot
  # The norm whose output alone feeds a tied output layer (μP's 1/m readout multiplier folds into it on export);
  # None: no such norm
  readout_norm: ClassVar[tuple[str, ...] | None] = None
  routed_mlp: ClassVar[bool] = False  # whether its blocks build routed experts (model.moe)
  # whether its module hands a pipelined stack its output layer, so that the last stage takes the loss (1F1B)
  loss_in_last_stage: ClassVar[bool] = False
  predicts_ahead: ClassVar[bool] = False  # whether `model.mtp` may add modules after its stack (causal decoders)
  peft_task: ClassVar[str | None] = None  # PEFT's task_type for its adapters (`lm convert --to-peft`)

  def build(self, cfg: ModelConfig) -> nn.Module:
    return self.module(cfg)

  def init_inputs(self, length: int) -> tuple[jax.Array, ...]:
    """Dummy positional inputs of `length` tokens that make `init` create every parameter."""
    return (jnp.zeros((1, length), jnp.int32),)

  def init(self, model: nn.Module, rng: jax.Array, length: int) -> Any:
    """Boxed (logically partitioned) params."""
    return model.init({'params': rng, 'dropout': rng}, *self.init_inputs(length))['params']

  def apply(self, model: nn.Module, params: Any, batch: Batch, *, deterministic: bool,
            rngs: dict[str, jax.Array]) -> dict[str, Any]:
    """Outputs for a batch: 'logits', the output layer unapplied (an `Unembedding`: the token loss applies it,
    whole or in tiles), scored against batch['targets'] with batch['weights'], the logits of each active
    head under its name, and for a model with auxiliary losses (routed experts) their weighted sum per row
    (`AUX_LOSS`) and each term by its metric name (`AUX_TERMS`); with aux-loss-free balancing each routed layer's
    token counts per expert (`EXPERT_COUNTS`: `lm.models.moe.expert_counts`)."""
    raise NotImplementedError

  def objective(self, config: Config, tokenizer: Tokenizer) -> Objective:
    raise NotImplementedError

  def score(self, model: nn.Module, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """Per example of a `Scoring.rows` batch: the continuation's summed log-probability ('logprob'), its token
    count ('tokens') and whether greedy decoding would produce it ('greedy')."""
    head = self.apply(model, params, batch, deterministic=True, rngs={})['logits']
    return continuation_scores(head.logits(), batch['targets'], batch['weights'])

  def forward_flops(self, k: KernelSizes, cfg: ModelConfig, seq_len: int,
                    pairs: Callable[[int], float]) -> float:
    """Forward matmul FLOPs of one row of `seq_len` tokens; `pairs(n)` counts a causal n x n square."""
    raise NotImplementedError

  def validate(self, config: Config) -> None:
    """Checks beyond the generic ones in `lm.config.validate`; raise ConfigError naming the fix."""

  def active_heads(self, cfg: ModelConfig) -> tuple[Head, ...]:
    return tuple(h for h in self.heads if h.enabled(cfg))

  def num_blocks(self, cfg: ModelConfig) -> int:
    """Transformer blocks in the model (every stack's)."""
    return cfg.num_layers

  def per_sequence_params(self) -> frozenset[str]:
    """Top-level param modules of the heads (pretraining and fine-tuning): they read one position per row,
    and start fresh when a source checkpoint lacks them."""
    task = self.task_head.params if self.task_head else ()
    return frozenset(p for h in self.heads for p in h.params) | frozenset(task)

  def converter(self) -> ModuleType:
    if self.hf_converter is None:
      raise ConfigError(f'the {self.name} family has no Hugging Face converter')
    return importlib.import_module(self.hf_converter)


def check_vocabulary(config: Config, tokenizer: Tokenizer) -> None:
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ConfigError(f'model.vocab_size={config.model.vocab_size} is smaller than the {config.data.tokenizer} '
                      f'tokenizer\'s {tokenizer.vocab_size} ids; raise model.vocab_size')


def scoring_of(family: Family) -> Scoring:
  """The family's scoring, or one line saying it has none."""
  if family.scoring is None:
    raise ConfigError(f'the {family.name} family is not a generative model: it gives no log-likelihood of a '
                      f'continuation; score with a decoder-only or encoder-decoder model')
  return family.scoring


def _attention_flops(cfg: ModelConfig, pairs: float) -> float:
  """Scores and the weighted sum of values: 2 * 2 * query heads * head_dim per query-key pair."""
  return 4 * cfg.num_heads * cfg.resolved_head_dim * pairs


class DecoderOnly(Family):
  """Causal LMs (GPT, Llama): `module(tokens, segment_ids, positions, deterministic, decode)` gives logits;
  `module.classify` a classifier's scores from the last real token."""
  decoding = DECODER_ONLY
  scoring = CAUSAL
  task_head = Classifier(params=('score',))
  readout_norm = ('decoder', 'final_norm')
  loss_in_last_stage = True
  predicts_ahead = True
  peft_task = 'CAUSAL_LM'

  def init(self, model, rng, length):
    """A classifier's params (`model.num_labels`) are made by `classify`: `score`, no output layer."""
    method = 'classify' if model.cfg.num_labels else None
    return model.init({'params': rng, 'dropout': rng}, *self.init_inputs(length), method=method)['params']

  def apply(self, model, params, batch, *, deterministic, rngs):
    """A batch with `model.mtp`'s shifted features (`lm.models.mtp.look_ahead`, which the train step adds) also
    gives each depth's output layer (`AHEAD`)."""
    depths = range(1, model.cfg.mtp.depth + 1)
    ahead = [batch[ahead_keys(k)[0]] for k in depths if ahead_keys(k)[0] in batch]
    call = functools.partial(model.apply, {'params': params}, batch['inputs'], segment_ids=batch.get('segment_ids'),
                             positions=batch.get('positions'), deterministic=deterministic, rngs=rngs, unembed=False,
                             ahead=ahead)
    if not model.cfg.moe.num_experts:
      return _with_ahead(call())
    out, sown = call(mutable=['intermediates'])
    outputs = _with_ahead(out)
    aux, terms = aux_losses(sown['intermediates'], model.cfg.moe)
    outputs.update({AUX_LOSS: aux, AUX_TERMS: terms})
    if model.cfg.moe.bias_rate:
      outputs[EXPERT_COUNTS] = expert_counts(sown['intermediates'])
    return outputs

  def objective(self, config, tokenizer):
    check_vocabulary(config, tokenizer)
    return CausalLM(config.data.seq_len)

  def forward_flops(self, k, cfg, seq_len, pairs):
    """MTP's depths (`model.mtp`) run a block each, and the output layer again."""
    depth = cfg.mtp.depth
    return (2 * ((k.per_token + depth * cfg.vocab_size * cfg.d_model) * seq_len + k.per_sequence)
            + _attention_flops(cfg, (cfg.num_layers + depth) * pairs(seq_len)))


class Encoder(Family):
  """Bidirectional encoders (BERT): every query sees every key of its segment."""

  def forward_flops(self, k, cfg, seq_len, pairs):
    return 2 * (k.per_token * seq_len + k.per_sequence) + \
        _attention_flops(cfg, cfg.num_layers * seq_len * seq_len)


class EncoderDecoder(Family):
  """Encoder-decoders (T5): `module(inputs, decoder_inputs, segment_ids, decoder_segment_ids, deterministic)`,
  with `encode` and `decode` methods for cached generation; fine-tuned text to text."""
  decoding = ENCODER_DECODER
  scoring = SEQ2SEQ
  task_head = TextToText()
  peft_task = 'SEQ_2_SEQ_LM'

  def num_blocks(self, cfg):
    return cfg.num_layers + cfg.resolved_decoder_layers

  def validate(self, config):
    if config.mesh.sequence > 1:  # ring attention is self-attention; cross-attention would gather the encoder
      raise ConfigError(f'{self.name} does not split its sequences over a mesh axis (its decoder cross-attends to '
                        f'encoder tokens of another length): set mesh.sequence=1 and shard with data, fsdp, tensor')
    if axis_size(config.mesh, 'stage') > 1:
      raise ConfigError(f'{self.name} does not pipeline its two stacks over mesh.stage: set mesh.stage=1 and shard '
                        f'with data, fsdp, tensor')

  def init_inputs(self, length):
    tokens = jnp.zeros((1, length), jnp.int32)
    return tokens, tokens

  def apply(self, model, params, batch, *, deterministic, rngs):
    return {'logits': model.apply({'params': params}, batch['inputs'], batch['decoder_inputs'],
                                  segment_ids=batch.get('segment_ids'),
                                  decoder_segment_ids=batch.get('decoder_segment_ids'),
                                  deterministic=deterministic, rngs=rngs, unembed=False)}

  def target_length(self, seq_len: int) -> int:
    """Decoder tokens of a row whose encoder sees `seq_len` tokens."""
    raise NotImplementedError

  def forward_flops(self, k, cfg, seq_len, pairs):
    enc, dec = seq_len, self.target_length(seq_len)
    dense = (k.encoder + k.cross_kv) * enc + (k.other + k.output) * dec
    attention = cfg.num_layers * enc * enc + cfg.resolved_decoder_layers * (pairs(dec) + dec * enc)
    return 2 * (dense + k.per_sequence) + _attention_flops(cfg, attention)


def _with_ahead(out: Any) -> dict[str, Any]:
  """A causal decoder's output layer, and each MTP depth's when it gave them ((main, [depths]))."""
  return {'logits': out[0], AHEAD: out[1]} if isinstance(out, tuple) else {'logits': out}
