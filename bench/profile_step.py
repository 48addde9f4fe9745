"""Where the train step's time goes on the CPU: a jax.profiler trace of a few steps, each XLA kernel's time
grouped by what it computes (forward / backward per layer part, the tiled output layer and loss, the
optimizer), the matmuls' FLOPs and rate against XLA's own rate on a large matmul in the same process, and
the step a perfect schedule of those matmuls at that rate would take. Prints a table, writes JSON.

  python bench/profile_step.py --config gpt_bench [key=value ...] [--steps 10] [--out FILE]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

# The trace is of the CPU step; libtpu's profiler plugin, when installed, fails to start on a host without TPUs.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from lm.assembly.accounting import flops_per_sequence  # noqa: E402
from lm.config import load_config  # noqa: E402
from lm.jobs.pretraining import Pretraining  # noqa: E402
from lm.report import format_lines, write_json  # noqa: E402

_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%(\S+) = (\S+?)\[([\d,]*)\]\S* (\S+?)\((.*)$')


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(',') if d]


def parse_hlo(text: str) -> dict[str, dict]:
  """Per instruction of the compiled module: its op_name metadata and the FLOPs of the dots it computes in a
  step (a fusion's: those of the computation it calls; 2 x output elements x contracted size; in a loop's body,
  times the loop's trip count)."""
  computations, current, shapes, op_names = collections.defaultdict(list), None, {}, {}
  loops = []  # (computation holding the loop, its body, trip count): a body's kernels run that many times a step
  for line in text.splitlines():
    header = re.match(r'^(?:ENTRY )?%(\S+) .*\{$', line)
    if header:
      current = header[1]
      continue
    loop = re.search(r' while\(.*body=%([\w.\-]+).*"known_trip_count":\{"n":"(\d+)"', line)
    if loop:
      loops.append((current, loop[1], int(loop[2])))
    named = re.match(r'^\s*(?:ROOT )?%(\S+) = .*?(?:op_name="([^"]*)")?', line)
    if named and current and ' = ' in line:
      op_names[named[1]] = re.search(r'op_name="([^"]*)"', line)[1] if 'op_name="' in line else ''
    m = _INSTRUCTION.match(line)
    if m and current:
      shapes[m[1]] = _dims(m[3])
      computations[current].append(m)

  def dot_flops(m: re.Match) -> float:
    lhs = re.match(r'%(\S+?)[,)]', m[5])[1]
    contracted = _dims(re.search(r'lhs_contracting_dims=\{([\d,]*)\}', m[5])[1])
    size = 1
    for d in _dims(m[3]):
      size *= d
    for c in contracted:
      size *= shapes[lhs][c]
    return 2.0 * size

  def flops(computation: str) -> float:
    total = 0.0
    for m in computations.get(computation, []):
      if m[4] == 'dot':
        total += dot_flops(m)
      for called in re.findall(r'(?:calls|body|to_apply)=%([\w.\-]+)', m[5]):
        total += flops(called)
    return total

  runs = collections.defaultdict(lambda: 1)
  for _ in loops:  # enough passes for loops nested in loops
    for parent, body, trips in loops:
      runs[body] = runs[parent] * trips
  out = {name: {'op_name': op_name, 'flops': 0.0} for name, op_name in op_names.items()}
  for computation, instructions in computations.items():
    for m in instructions:
      called = re.findall(r'calls=%([\w.\-]+)', m[5])
      once = dot_flops(m) if m[4] == 'dot' else sum(flops(c) for c in called)
      out[m[1]]['flops'] = once * runs[computation]
  return out


def part_of(op_name: str) -> str:
  """What an XLA kernel computes, from the named scopes in its op_name: 'optimizer', 'output layer + loss',
  or phase and model part ('forward mlp', 'backward attention', 'forward final_norm', ...)."""
  for scope, part in (('optimizer', 'optimizer'), ('output_loss', 'output layer + loss (tiled)')):
    if re.search(rf'(^|[/(]){scope}([/)]|$)', op_name):  # a scope, or a custom VJP's `jvp(scope)`
      return part
  if not op_name:
    return 'unattributed (layout copies)'
  phase = 'backward' if 'transpose(jvp' in op_name else 'forward'
  module = re.search(r'layers(?:_\d+)?/([a-z]+)', op_name) or \
    re.search(r'jvp\(\w+\)\)?/(?:(?:en|de)coder/)?(\w+)/', op_name)
  return f'{phase} {module[1]}' if module else 'other'


def gemm_rate(size: int = 2048, repeats: int = 10) -> float:
  """FLOP/s of XLA's [size, size] x [size, size] float32 matmul on this host (median of `repeats`)."""
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(jnp.matmul)
  matmul(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2.0 * size ** 3 / statistics.median(times)


def kernel_times(trace_dir: str, steps: int) -> dict[str, float]:
  """Wall seconds per step of each XLA kernel in the trace: the union of its events on XLA:CPU's threads (a
  kernel that splits its work over both cores counts the time once)."""
  [path] = Path(trace_dir).rglob('*.xplane.pb')
  spans = collections.defaultdict(list)
  for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
    for line in plane.lines:
      if not line.name.startswith('tf_XLAEigen'):  # XLA:CPU's worker threads: one event per kernel run
        continue
      for event in line.events:
        if not event.name.startswith(('ThunkExecutor', 'SlinkyThreadPool', 'end: ')):
          spans[event.name].append((event.start_ns, event.end_ns))
  times = {}
  for name, intervals in spans.items():
    covered, reach = 0.0, float('-inf')
    for start, end in sorted(intervals):
      covered += max(0.0, end - max(start, reach))
      reach = max(reach, end)
    times[name] = covered * 1e-9 / steps
  return times


def profile(config_name: str, overrides: list[str], steps: int, devices: list[jax.Device] | None = None) -> dict:
  config = load_config(config_name, overrides)
  trainer = Pretraining(config, devices)
  state, batch = trainer.init_state(), next(trainer.train_batches)
  instructions = parse_hlo(trainer.train_step.lower(state, batch).compile().as_text())
  for _ in range(2):
    state, metrics = trainer.train_step(state, batch)
  jax.block_until_ready(metrics)
  wall = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    wall.append(time.perf_counter() - start)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(3):
      state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    jax.profiler.stop_trace()
    times = kernel_times(trace_dir, 3)

  parts = collections.defaultdict(lambda: {'seconds': 0.0, 'kernels': 0, 'matmul_flops': 0.0, 'matmul_seconds': 0.0})
  for name, seconds in times.items():
    info = instructions.get(name, {'op_name': '', 'flops': 0.0})
    part = parts[part_of(info['op_name'])]
    part['seconds'] += seconds
    part['kernels'] += 1
    if info['flops']:
      part['matmul_flops'] += info['flops']
      part['matmul_seconds'] += seconds
  step = statistics.median(wall)
  tokens = config.train.global_batch * config.data.seq_len
  model_flops = flops_per_sequence(trainer.assembly.abstract_params, config.model, config.data.seq_len, 'full') \
    * config.train.global_batch
  reference = gemm_rate()
  matmul_flops = sum(p['matmul_flops'] for p in parts.values())
  return {
    'config': config_name, 'overrides': overrides, 'step_seconds': step, 'tokens_per_sec': tokens / step,
    'kernel_seconds': sum(times.values()), 'parts': dict(parts), 'matmul_flops': matmul_flops,
    'model_flops': model_flops, 'reference_gemm_flops_per_sec': reference,
    # A step that ran only its matmuls, every one at the large-matmul rate, on all cores.
    'matmul_bound_tokens_per_sec': tokens / (matmul_flops / reference),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='gpt_bench')
  parser.add_argument('--steps', type=int, default=10, help='timed steps (the profile traces 3 more)')
  parser.add_argument('--out', default=None, help='JSON path (default bench/results/profile_step_<config>.json)')
  parser.add_argument('overrides', nargs='*')
  args = parser.parse_args()
  result = profile(args.config, args.overrides, args.steps)

  step, kernels = result['step_seconds'], result['kernel_seconds']
  lines = [('step (median wall)', f'{step * 1e3:.0f} ms, {result["tokens_per_sec"]:,.0f} tokens/s'),
           ('kernel time (summed over kernels)', f'{kernels * 1e3:.0f} ms: {kernels / step:.2f}x the step '
            '(above 1: kernels ran side by side)'),
           ('model FLOPs (matmuls, accounting)', f'{result["model_flops"] / 1e9:.1f} GFLOP per step, '
            f'{result["model_flops"] / step / 1e9:.0f} GFLOP/s'),
           ('matmul FLOPs (compiled HLO)', f'{result["matmul_flops"] / 1e9:.1f} GFLOP per step'),
           ('XLA 2048^3 float32 matmul', f'{result["reference_gemm_flops_per_sec"] / 1e9:.0f} GFLOP/s'),
           ('matmuls alone at that rate', f'{result["matmul_flops"] / result["reference_gemm_flops_per_sec"] * 1e3:.0f}'
            f' ms per step, {result["matmul_bound_tokens_per_sec"]:,.0f} tokens/s')]
  print(format_lines(lines))
  print('\n| part | ms per step (kernel wall time) | share | kernels | matmul GFLOP | matmul GFLOP/s |')
  print('|---|---|---|---|---|---|')
  for name, part in sorted(result['parts'].items(), key=lambda kv: -kv[1]['seconds']):
    rate = f'{part["matmul_flops"] / part["matmul_seconds"] / 1e9:.0f}' if part['matmul_seconds'] else '-'
    print(f'| {name} | {part["seconds"] * 1e3:.1f} | {part["seconds"] / kernels:.0%} | {part["kernels"]} | '
          f'{part["matmul_flops"] / 1e9:.2f} | {rate} |')
  out = args.out or Path(__file__).parent / 'results' / f'profile_step_{args.config}.json'
  print(f'wrote {write_json(out, result)}')


if __name__ == '__main__':
  main()
