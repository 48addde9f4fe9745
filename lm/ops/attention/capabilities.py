"""What each attention implementation can do, in one table: dispatch (`lm.ops.attention.attention`, `pick_impl`)
and config validation (`check_attention`, which every loaded config runs: `lm.models.check_config`) both read it, and both refuse a call
or a config it cannot serve in the same words."""
from __future__ import annotations

from dataclasses import dataclass

from lm.config import Config, ConfigError, ModelConfig


@dataclass(frozen=True)
class Capability:
  grouped_kv: bool  # reads grouped key/value heads in place (else they are repeated up to the query heads)
  window: bool  # a causal sliding window of keys
  softcap: bool  # attention-logit soft-capping
  bias: bool  # an additive bias (T5's relative positions)
  dropout: bool  # attention dropout
  mask: bool  # an arbitrary mask
  cross: bool  # keys of another sequence (kv segment ids)
  sinks: bool  # a learned sink logit per head in the softmax's denominator (GPT-OSS)
  platforms: tuple[str, ...]  # where it compiles; 'cpu' for a Pallas kernel means interpreted


ALL_PLATFORMS = ('cpu', 'gpu', 'tpu')
TABLE: dict[str, Capability] = {
  'xla': Capability(False, True, True, True, True, True, True, True, ALL_PLATFORMS),
  'flash': Capability(True, True, True, True, False, False, True, True, ('tpu', 'cpu')),  # ours (Pallas)
  'tpu_flash': Capability(False, False, False, True, False, False, True, False, ('tpu', 'cpu')),
  'tpu_splash': Capability(False, False, False, False, False, False, True, False, ('tpu', 'cpu')),
  'cudnn': Capability(False, False, False, True, False, False, True, False, ('gpu',)),
  # a sequence split over the mesh (mesh.sequence > 1): ring attention, self-attention only, its blocks by ...
  'ring': Capability(False, True, True, True, False, False, False, True, ALL_PLATFORMS),  # ... the XLA path
  'ring_flash': Capability(False, False, False, True, False, False, False, True, ('tpu', 'cpu')),  # ... our kernel
}
RING = {'auto': 'ring', 'xla': 'ring', 'flash': 'ring_flash'}  # the ring each choice runs on a split sequence
AUTO = {'tpu': ('flash',), 'gpu': ('cudnn',)}  # what `auto` prefers on each platform where it can serve; then xla
FEATURES = {'window': 'model.sliding_window', 'softcap': 'model.attn_logit_softcap',
            'bias': 'bias (model.position=relative)', 'dropout': 'model.attention_dropout',
            'mask': 'arbitrary masks', 'cross': 'cross-attention', 'sinks': 'attention sinks (model.attention_sinks)'}
NAMES = {'ring': 'ring attention with XLA blocks (mesh.sequence > 1)',
         'ring_flash': 'ring attention with flash blocks (mesh.sequence > 1)'}


def missing(name: str, needs: frozenset[str] | set[str]) -> list[str]:
  """The features of `needs` (keys of FEATURES) implementation `name` lacks, in FEATURES' order."""
  return [f for f in FEATURES if f in needs and not getattr(TABLE[name], f)]


def refusal(name: str, lacks: list[str]) -> str:
  """The one wording of a refusal: what lacks what, and the choices that have it."""
  what = ' or '.join(FEATURES[f] for f in lacks)
  ring = name in RING.values()
  rows = {choice: RING[choice] for choice in RING} if ring else {choice: choice for choice in TABLE if choice not in
                                                                  RING.values()}
  choices = [choice for choice, row in rows.items() if not missing(row, set(lacks))]
  if not ring and 'xla' in choices:  # auto falls back to the XLA path
    choices.append('auto')
  fix = f'use model.execution.attention_impl={", ".join(choices[:-1])} or {choices[-1]}' if len(choices) > 1 else \
    f'drop {what}'
  return f'{NAMES.get(name, f"model.execution.attention_impl={name}")} has no {what}; {fix}' + \
    (', or set mesh.sequence=1' if ring else '')


def pick_impl(platform: str, needs: frozenset[str] | set[str]) -> str:
  """`auto`: the platform's preferred kernel where it can serve the call (our flash kernel on TPU, cuDNN on GPU),
  else the XLA path."""
  return next((name for name in AUTO.get(platform, ()) if not missing(name, needs)), 'xla')


def config_needs(m: ModelConfig) -> frozenset[str]:
  """The features a model's attention calls ask for, from its config."""
  return frozenset(f for f, on in (('window', m.sliding_window), ('softcap', m.attn_logit_softcap),
                                   ('bias', m.position == 'relative'), ('dropout', m.attention_dropout > 0),
                                   ('sinks', m.attention_sinks)) if on)


def check_attention(config: Config) -> None:
  """The config's attention implementation (on a split sequence: its ring) serves every feature the model asks."""
  m, n = config.model, config.mesh.sequence
  name = m.execution.attention_impl
  if n != 1:
    if name not in RING:
      raise ConfigError(f'mesh.sequence={n} runs ring attention, whose blocks use the XLA path or our flash kernel: '
                        f'set model.execution.attention_impl=auto, xla or flash (not {name}), or mesh.sequence=1')
    name = RING[name]
  elif name == 'auto':
    return  # resolved per call, to an implementation that serves it
  lacks = missing(name, config_needs(m))
  if lacks:
    raise ConfigError(refusal(name, lacks))
