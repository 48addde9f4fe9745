"""Attention memory: compiled temp bytes and FLOPs of causal forward+backward, `xla` against `flash`.

  python bench/attention_memory.py [--targets tpu cpu] [--lengths 1024 2048 ...] [--out FILE]

Batch 1, 8 heads, head dim 64, bfloat16 inputs, `attention(..., causal=True, impl=...)` as the models
call it. With libtpu installed (the `tpu` extra) the step is also compiled ahead of time for one
TPU v5e chip, so the numbers are the TPU compiler's (the kernel through Mosaic); for `cpu` the kernel
is lowered in Pallas interpret mode. Nothing runs: only `memory_analysis()` and `cost_analysis()` of
the compiled executables are read.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm.ops.attention import attention
from lm.parallel.chips import topology_devices
from lm.parallel.mesh import MESH_AXES
from lm.parallel.rules import sharding_context

HEADS, HEAD_DIM = 8, 64
TARGETS = {'tpu': 'one TPU v5e chip (HBM temp; XLA may keep small temps on chip)', 'cpu': 'this CPU host'}


def compile_step(impl: str, length: int, target: str) -> Any:
  """Compiles causal attention and its VJP (dq, dk, dv from an output cotangent) for one device of the target.

  The step is traced under a one-device mesh of the target, as the trainer does, so the kernel is
  lowered for the mesh's platform (Mosaic for TPU) rather than for this host.
  """
  if target == 'tpu':
    devices = topology_devices('v5e:2x2')[:1]  # libtpu's compile-only devices, started quietly off a TPU VM
  else:
    devices = jax.devices('cpu')[:1]
  mesh = Mesh(np.array(devices).reshape((1,) * len(MESH_AXES)), MESH_AXES)
  x = jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))

  def forward_backward(q, k, v, d_out):
    with sharding_context(mesh):
      _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True, impl=impl, block_q=512, block_k=512), q, k, v)
    return vjp(d_out)
  return jax.jit(forward_backward).lower(x, x, x, x).compile()


def measure(impl: str, length: int, target: str) -> dict[str, Any]:
  compiled = compile_step(impl, length, target)
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {'target': target, 'impl': impl, 'length': length, 'temp_bytes': int(mem.temp_size_in_bytes),
          'argument_bytes': int(mem.argument_size_in_bytes), 'output_bytes': int(mem.output_size_in_bytes),
          'flops': float(cost.get('flops', 0.0))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  has_tpu = importlib.util.find_spec('libtpu') is not None
  parser.add_argument('--targets', choices=('tpu', 'cpu'), nargs='+', default=['tpu', 'cpu'] if has_tpu else ['cpu'])
  parser.add_argument('--lengths', type=int, nargs='+', default=[1024, 2048, 4096, 8192, 16384])
  parser.add_argument('--out', default='bench/results/attention_memory.json')
  args = parser.parse_args()
  if 'tpu' in args.targets and not has_tpu:
    parser.error('--targets tpu needs libtpu: pip install -e ".[tpu]"')

  rows = [measure(impl, n, t) for t in args.targets for n in args.lengths for impl in ('xla', 'flash')]
  by = {(r['target'], r['impl'], r['length']): r for r in rows}
  mib = lambda b: b / 2 ** 20
  for t in args.targets:
    print(f'\ncausal attention fwd+bwd, batch 1, {HEADS} heads, head dim {HEAD_DIM}, bf16, compiled for {TARGETS[t]}')
    header = f'{"length":>7} | {"xla temp MiB":>13} | {"flash temp MiB":>14} | {"flash/xla":>9} | ' \
             f'{"xla GFLOP":>10} | {"flash GFLOP":>11}'
    print(header)
    print('-' * len(header))
    for n in args.lengths:
      x, f = by[t, 'xla', n], by[t, 'flash', n]
      print(f'{n:>7} | {mib(x["temp_bytes"]):>13,.1f} | {mib(f["temp_bytes"]):>14,.2f} | '
            f'{f["temp_bytes"] / max(x["temp_bytes"], 1):>9.4f} | {x["flops"] / 1e9:>10,.1f} | '
            f'{f["flops"] / 1e9:>11,.1f}')
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({'heads': HEADS, 'head_dim': HEAD_DIM, 'batch': 1, 'dtype': 'bfloat16',
                             'rows': rows}, indent=2) + '\n')
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
