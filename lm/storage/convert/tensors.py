"""Moving weights between Hugging Face tensors and our param tree, one layout rule per HF tensor.

A `Tensor` names one HF tensor and the param(s) it holds; its layout says how the two are laid
out, so the same rule reads (`read_params`) and writes (`write_tensors`) a checkpoint exactly.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from lm.config import ConfigError, ModelConfig
from lm.models import abstract_params
from lm.storage.convert.quantized import read_raw

Shape = tuple[int, ...]

# same:       identical shape (embeddings, norms, output biases)
# flat:       HF 1-D, ours any shape (q/k/v biases [heads, head_dim])
# linear:     torch.nn.Linear [out, in]; ours [*in, *out] with `n_in` input dims
# conv1d:     GPT-2 Conv1D [in, out]; ours [*in, *out]
# transposed: HF [a, b], ours [b, a] (T5 relative bias [buckets, heads] vs [heads, buckets])
# heads:      GPT-NeoX's fused query_key_value, HF [heads * parts * head_dim(, in)] (each head's query, key and value
#             in turn), ours [(in,) heads, head_dim] per part
# interleaved: same shapes as ours, the params' last axes interleaved instead of concatenated (GPT-OSS's gate_up_proj:
#             gate in the even columns, up in the odd)
LAYOUTS = ('same', 'flat', 'linear', 'conv1d', 'transposed', 'heads', 'interleaved')


@dataclass(frozen=True)
class Tensor:
  """HF tensor `name` holding params `params` ('a/b/kernel' paths) concatenated on its last axis; with `index`,
  it holds entry `index` of the params' leading axis (one expert of a routed layer's stacked kernels)."""
  name: str
  params: tuple[str, ...]
  layout: str = 'same'
  n_in: int = 1  # input dims of our kernel (2 for attention out: [heads, head_dim, embed])
  index: int | None = None

  def hf_shape(self, shapes: dict[str, Shape]) -> Shape:
    shapes = shapes if self.index is None else {p: shapes[p][1:] for p in self.params}
    if self.layout == 'heads':
      *ins, heads, head_dim = shapes[self.params[0]]
      return (heads * len(self.params) * head_dim, *ins)
    parts = [_hf_part_shape(self.layout, shapes[p], self.n_in) for p in self.params]
    return parts[0][:-1] + (sum(s[-1] for s in parts),)


def _hf_part_shape(layout: str, shape: Shape, n_in: int) -> Shape:
  ins, outs = math.prod(shape[:n_in]), math.prod(shape[n_in:])
  return {'same': shape, 'interleaved': shape, 'flat': (math.prod(shape),), 'linear': (outs, ins),
          'conv1d': (ins, outs), 'transposed': shape[::-1]}[layout]


def _to_ours(layout: str, a: np.ndarray, shape: Shape) -> np.ndarray:
  if layout == 'linear':
    a = a.T
  elif layout == 'transposed':
    return np.ascontiguousarray(a.T, np.float32)
  return np.ascontiguousarray(a.reshape(shape), np.float32)


def _to_hf(layout: str, p: np.ndarray, n_in: int) -> np.ndarray:
  shape = _hf_part_shape(layout, p.shape, n_in)
  if layout == 'linear':
    return p.reshape(shape[::-1]).T
  if layout == 'transposed':
    return p.T
  return p.reshape(shape)


class Checkpoint:
  """A `model.safetensors`, or the shards a `model.safetensors.index.json` names, opened lazily; tensors come out
  as NumPy, checked by name and shape. `path` names the file or the index in messages."""

  def __init__(self, path: Path, architecture: str, shards: dict[str, Path] | None = None):
    """`shards`: tensor name -> its file (a sharded checkpoint's weight map); None: every tensor in `path`."""
    self.path, self.architecture = path, architecture
    files = {path: None} if shards is None else {file: None for file in shards.values()}
    for file in files:
      try:
        files[file] = safe_open(str(file), framework='numpy')
      except (SafetensorError, OSError) as e:
        raise ConfigError(f'{file} is not a readable safetensors file ({e}); re-save the model with '
                          f'save_pretrained(dir, safe_serialization=True)') from None
    self._where = {name: files[path] for name in files[path].keys()} if shards is None else \
      {name: files[file] for name, file in shards.items()}
    missing = [name for name, file in self._where.items() if name not in file.keys()]
    if missing:
      raise ConfigError(f'{path} places {missing[0]!r} in a shard that lacks it; the index and its shards do not '
                        f'belong together')
    self.names = set(self._where)
    self._paths = {name: path for name in self.names} if shards is None else dict(shards)
    self.used: set[str] = set()
    self._derived: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {}
    self._rewritten: dict[str, Callable[[np.ndarray], np.ndarray]] = {}

  def derive(self, name: str, source: str, part: Callable[[np.ndarray], np.ndarray]) -> None:
    """Make tensor `name` readable as `part` of tensor `source` (another layout of the same weights: the fused
    experts transformers 5 keeps in memory); a name the file holds itself is read as it is."""
    if name not in self.names and source in self.names:
      self._derived[name] = source, part
      self.names.add(name)

  def rewrite(self, name: str, part: Callable[[np.ndarray], np.ndarray]) -> None:
    """Read tensor `name` of the file through `part` (a quantized weight, dequantized)."""
    self._rewritten[name] = part

  def get(self, name: str) -> np.ndarray | None:
    if name not in self.names:
      return None
    if name in self._derived:
      source, part = self._derived[name]
      return part(self.get(source))
    self.used.add(name)
    try:
      a = self._where[name].get_tensor(name)
    except (AttributeError, TypeError):  # a dtype safetensors' NumPy reader lacks (float8)
      a = read_raw(self._paths[name], name)
    return self._rewritten[name](a) if name in self._rewritten else a

  def require(self, name: str, shape: Shape) -> np.ndarray:
    a = self.get(name)
    if a is None:
      raise ConfigError(f'{self.path} has no tensor {name!r} (shape {shape}), which a {self.architecture} with '
                        f'this config.json needs; the checkpoint and config.json do not belong together')
    if a.shape != shape:
      raise ConfigError(f'tensor {name!r} in {self.path} has shape {a.shape} but config.json implies {shape}; '
                        f'the checkpoint and config.json do not belong together')
    return a

  def same_as(self, name: str, reference: np.ndarray) -> bool | None:
    """Whether optional tensor `name` equals `reference`; None when the file lacks it."""
    a = self.get(name)
    return None if a is None else a.shape == reference.shape and bool(np.array_equal(a, reference))

  def warn_unused(self) -> None:
    unused = sorted(set(self._where) - self.used)
    if unused:
      warnings.warn(f'{self.path}: ignored {len(unused)} tensor(s) a {self.architecture} does not use: '
                    f'{", ".join(unused[:8])}{" ..." if len(unused) > 8 else ""}', stacklevel=3)


def param_shapes(model: nn.Module) -> dict[str, Shape]:
  """'a/b/kernel' -> shape of every param the model creates."""
  params = abstract_params(model)
  return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(params, sep='/').items()}


def read_params(ckpt: Checkpoint, rules: list[Tensor], shapes: dict[str, Shape]) -> dict[str, Any]:
  """The nested float32 param tree the rules fill from `ckpt`, which must cover every param."""
  flat: dict[str, np.ndarray] = {}
  for rule in rules:
    a = ckpt.require(rule.name, rule.hf_shape(shapes))
    if rule.index is not None:  # one expert's slice of a stacked param
      (path,) = rule.params
      flat.setdefault(path, np.zeros(shapes[path], np.float32))[rule.index] = _to_ours(rule.layout, a,
                                                                                      shapes[path][1:])
      continue
    if rule.layout == 'heads':
      flat.update(zip(rule.params, _heads_to_ours(a, [shapes[p] for p in rule.params])))
      continue
    if rule.layout == 'interleaved':
      flat.update({p: np.ascontiguousarray(a[..., i::len(rule.params)], np.float32) for i, p in enumerate(rule.params)})
      continue
    widths = [_hf_part_shape(rule.layout, shapes[p], rule.n_in)[-1] for p in rule.params]
    for path, piece in zip(rule.params, np.split(a, np.cumsum(widths)[:-1], axis=-1)):
      flat[path] = _to_ours(rule.layout, piece, shapes[path])
  missing = sorted(set(shapes) - set(flat))
  if missing:
    raise RuntimeError(f'conversion rules leave params unset: {missing}')
  return traverse_util.unflatten_dict(flat, sep='/')


def write_tensors(rules: list[Tensor], flat: dict[str, np.ndarray], dtype: Any) -> dict[str, np.ndarray]:
  """HF name -> contiguous array in `dtype` for each rule, from our flat ('a/b/kernel') params."""
  out = {}
  for rule in rules:
    if rule.index is not None:
      a = _to_hf(rule.layout, flat[rule.params[0]][rule.index], rule.n_in)
    elif rule.layout == 'heads':
      a = _heads_to_hf([flat[p] for p in rule.params])
    elif rule.layout == 'interleaved':
      a = np.stack([flat[p] for p in rule.params], axis=-1).reshape(*flat[rule.params[0]].shape[:-1], -1)
    else:
      parts = [_to_hf(rule.layout, flat[p], rule.n_in) for p in rule.params]
      a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    out[rule.name] = np.ascontiguousarray(a.astype(dtype))
  return out


def _heads_to_ours(a: np.ndarray, shapes: list[Shape]) -> list[np.ndarray]:
  """HF [heads * parts * head_dim, *in] -> one float32 array [*in, heads, head_dim] per part."""
  *ins, heads, head_dim = shapes[0]
  grouped = a.reshape(heads, len(shapes), head_dim, *ins)
  order = (*range(2, 2 + len(ins)), 0, 1)  # [heads, head_dim, *in] -> [*in, heads, head_dim]
  return [np.ascontiguousarray(grouped[:, i].transpose(order), np.float32) for i in range(len(shapes))]


def _heads_to_hf(parts: list[np.ndarray]) -> np.ndarray:
  """One array [*in, heads, head_dim] per part -> HF [heads * parts * head_dim, *in]."""
  ins = parts[0].ndim - 2
  order = (ins, ins + 1, *range(ins))  # [*in, heads, head_dim] -> [heads, head_dim, *in]
  stacked = np.stack([p.transpose(order) for p in parts], axis=1)
  return stacked.reshape(-1, *stacked.shape[3:])


def dense(hf: str, ours: str, layout: str, n_in: int = 1, bias: bool = True) -> list[Tensor]:
  """Rules of a linear layer: HF '{hf}.weight' / '.bias' <-> our '{ours}/kernel' / '/bias'."""
  rules = [Tensor(f'{hf}.weight', (f'{ours}/kernel',), layout, n_in)]
  return rules + [Tensor(f'{hf}.bias', (f'{ours}/bias',), 'flat')] if bias else rules


def norm(hf: str, ours: str, bias: bool = True) -> list[Tensor]:
  """Rules of a LayerNorm (bias) or RMSNorm: HF '{hf}.weight' is our '{ours}/scale'."""
  rules = [Tensor(f'{hf}.weight', (f'{ours}/scale',))]
  return rules + [Tensor(f'{hf}.bias', (f'{ours}/bias',))] if bias else rules



@dataclass(frozen=True)
class FusedQkvDecoder:
  """The HF names of a biased pre-norm decoder whose query, key and value are one projection (GPT-2's `c_attn`,
  GPT-NeoX's `query_key_value`), and the layouts of its kernels."""
  layers: str  # a layer's prefix before its index
  layer: tuple[str, str, str, str, str, str]  # attention norm, fused qkv, attention output, MLP norm, MLP in, MLP out
  final_norm: str
  output: str  # the untied output layer's weight
  layout: str  # every kernel's but the fused one's
  qkv_layouts: tuple[str, str]  # the fused weight's and bias's

  def rules(self, cfg: ModelConfig, prefix: str, embeddings: list[Tensor]) -> list[Tensor]:
    out = list(embeddings)
    attention_norm, qkv, attention_out, mlp_norm, mlp_in, mlp_out = self.layer
    for i in range(cfg.num_layers):
      h, o = f'{prefix}{self.layers}{i}.', f'decoder/layers_{i}/'
      parts = tuple(f'{o}attention/{n}' for n in ('query', 'key', 'value'))
      out += [*norm(f'{h}{attention_norm}', f'{o}attention_norm'),
              Tensor(f'{h}{qkv}.weight', tuple(f'{p}/kernel' for p in parts), self.qkv_layouts[0]),
              Tensor(f'{h}{qkv}.bias', tuple(f'{p}/bias' for p in parts), self.qkv_layouts[1]),
              *dense(f'{h}{attention_out}', f'{o}attention/out', self.layout, n_in=2),
              *norm(f'{h}{mlp_norm}', f'{o}mlp_norm'),
              *dense(f'{h}{mlp_in}', f'{o}mlp/wi', self.layout),
              *dense(f'{h}{mlp_out}', f'{o}mlp/wo', self.layout)]
    out += norm(f'{prefix}{self.final_norm}', 'decoder/final_norm')
    if not cfg.tie_embeddings:
      out.append(Tensor(self.output, ('lm_head/kernel',), 'linear'))
    return out
