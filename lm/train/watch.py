"""`train.watch_every=N`: the RMS of the params, gradients and updates of each layer group every N steps, computed
inside the jitted step and reduced to scalars on the devices (records `watch/<group>/<params|grads|updates>`).

A group is a block's branch (`decoder/layers_3/attention`, `.../mlp`, `.../cross_attention`; its norms together as
`.../norms`) or, outside the blocks, a module (`token_embed`, `lm_head`, `decoder/final_norm`). A scanned stack's
params hold every layer on their leading axis: each layer index is a group of its own, named as an unrolled
stack's would be.
"""
from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from lm.parallel.rules import path_names

_BLOCK = re.compile(r'layers(_\d+)?$')
KINDS = ('params', 'grads', 'updates')


def group_of(names: list[str]) -> str:
  """The group of the param at path `names` (a scanned stack's groups say `layers`, not the index)."""
  for i, name in enumerate(names[:-1]):
    if _BLOCK.match(name):
      branch = names[i + 1]
      return '/'.join(names[:i + 1] + ['norms' if branch.endswith('norm') else branch])
  return '/'.join(names[:-1])


def layer_group(group: str, index: int) -> str:
  """A scanned stack's group for layer `index`: `decoder/layers/mlp` -> `decoder/layers_<index>/mlp`."""
  head, _, tail = group.rpartition('/layers')
  return f'{head}/layers_{index}{tail}' if head else f'layers_{index}{tail}'


def watch_metrics(trees: dict[str, Any], axes: Any) -> dict[str, jax.Array]:
  """{'watch/<group>/<kind>': RMS} of each tree in `trees` (kind -> params-shaped tree); `axes` the params'
  logical axes, whose leading 'layers' marks a scanned stack."""
  specs = {tuple(path_names(path)): spec for path, spec in
           jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, PartitionSpec))}
  out = {}
  for kind, tree in trees.items():
    squares: dict[str, list] = collections.defaultdict(list)
    sizes: dict[str, int] = collections.defaultdict(int)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      names = path_names(path)
      group, x = group_of(names), leaf.astype(jnp.float32)
      spec = specs.get(tuple(names))
      if spec and spec[0] == 'layers':
        per_layer = jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))
        for i in range(x.shape[0]):
          squares[layer_group(group, i)].append(per_layer[i])
          sizes[layer_group(group, i)] += x[0].size
      else:
        squares[group].append(jnp.sum(jnp.square(x)))
        sizes[group] += x.size
    out.update({f'watch/{group}/{kind}': jnp.sqrt(sum(parts) / sizes[group]) for group, parts in squares.items()})
  return out
