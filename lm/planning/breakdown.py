"""`lm compile --memory-breakdown`: what is live at the compiled step's peak, by the named scope that made it.

The compiler (TPU's, and CPU's alike) dumps, beside its buffer assignment, the live range of every buffer and a
"stack trace breakdown for peak usage": each buffer live at the peak of the step's memory, under the path of the
argument it holds (`state/params/...`, `state.opt_state...`) or the op that wrote it (`jit(step)/.../decoder/
layers_3/mlp/...`, the model's and the step's named scopes). This module compiles the lowered step with that dump,
reads the breakdown back, and sums it by part (`PARTS`: the first pattern a path matches) and by path, the layers'
copies of one path counted together (`layers_*`).
"""
from __future__ import annotations

import contextlib
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import jax

from lm.report import format_bytes, format_lines

# (part, pattern on a buffer's path): the first that matches names its part.
# MaxText's step (bench/maxtext_breakdown.py) names its state `state/model/...` and `state['optimizer']...`.
PARTS = (
  ('params', r'^state/params|^state\.params|^state/model/'),
  ('optimizer state', r'^state[./]opt_state|^state\[.optimizer.\]'),
  ('other state', r'^state\b'),
  ('batch', r'^batch\b'),
  # the layer scan's stacked outputs, what full remat keeps: the loop's result (CPU, MaxText), or on TPU where the
  # forward loop's body writes them (a backward pass's stacking is the weights' gradients)
  ('saved layer inputs', r'^[^{]*/while\{\d+\}$|^(?!.*transpose\().*/while/.*dynamic_update_index_in_dim\)/'
                         r'dynamic_update_slice$'),
  ('all-to-all', r'all.to.all'),
  ('routing', r'router|routing|top_k|sort'),
  ('experts', r'expert|gmm|/moe\b|MoeBlock|ffn_act'),
  ('attention', r'/attention\b|flash|splash'),
  ('mlp', r'/mlp\b'),
  ('loss and output layer', r'loss|unembed|lm_head|logits'),
  ('optimizer update', r'/optimizer\b'),
  ('async copies', r'^copy-start|^copy-done'),
)
_LINE = re.compile(r'^(?P<indent>[\s│├└─]*)(?P<name>\S.*?) \((?P<share>[\d.]+)%, total: (?P<total>[\d ]+) bytes, '
                   r'current: (?P<current>[\d ]+) bytes')
_HEAD = 'Stack trace breakdown for peak usage:'


def dump_options(directory: str) -> dict[str, Any]:
  """Compiler options that dump the step's program, its buffer assignment and live ranges to `directory`."""
  return {'xla_dump_to': directory, 'xla_dump_hlo_as_text': True, 'xla_dump_hlo_module_re': 'jit_step'}


def read_peak(text: str) -> tuple[int, list[tuple[str, int]]]:
  """(peak bytes, [(path, bytes)] of every buffer live at the peak) from a live-range dump."""
  start = text.find(_HEAD)
  if start < 0:
    raise ValueError(f'no "{_HEAD}" section in the live-range dump')
  lines = text[start:].splitlines()
  peak = int(lines[0][len(_HEAD):].replace('bytes', '').replace(' ', ''))
  stack: list[tuple[int, str]] = []  # (indent, name) of the open nodes above the current line
  entries = []
  for line in lines[1:]:
    match = _LINE.match(line)
    if match is None:
      break
    depth = len(match['indent'])
    while stack and stack[-1][0] >= depth:
      stack.pop()
    stack.append((depth, match['name']))
    current = int(match['current'].replace(' ', ''))
    if current:
      entries.append(('/'.join(name for _, name in stack[1:]), current))  # below the module's root
  return peak, entries


def printed_memory(output: str) -> dict[str, int] | None:
  """The total a device needs (arguments + outputs - aliased + temporaries + code, as lm counts) and the temporaries,
  from the `CompiledMemoryStats(...)` a process printed (MaxText's train_compile); None when it printed none."""
  stats = re.search(r'CompiledMemoryStats\((.*?)\)', output)
  if stats is None:
    return None
  f = {k: int(v) for k, v in re.findall(r'(\w+)=(\d+)', stats.group(1))}
  total = (f['argument_size_in_bytes'] + f['output_size_in_bytes'] - f['alias_size_in_bytes']
           + f['temp_size_in_bytes'] + f['generated_code_size_in_bytes'])
  return {'total': total, 'temp': f['temp_size_in_bytes']}


def part_of(path: str) -> str:
  return next((part for part, pattern in PARTS if re.search(pattern, path)), 'other')


def _short(path: str) -> str:
  """A path with the step's prefix and the transforms' wrappers dropped (the backward pass marked), and the layer
  index of a stack's copies made `*`."""
  backward = 'transpose(' in path
  kept = [s for s in path.split('/') if not re.match(r'^(jit\(step\)|jvp\(.*\)|transpose\(.*\)|.*\._decode)$', s)]
  return ('backward: ' if backward else '') + re.sub(r'layers_\d+', 'layers_*', '/'.join(kept))


def summarize(peak: int, entries: list[tuple[str, int]], top: int = 15) -> dict[str, Any]:
  """The peak's bytes by part, and the `top` largest paths (a stack's layers together, with their count)."""
  parts: dict[str, int] = defaultdict(int)
  paths: dict[str, list[int]] = defaultdict(lambda: [0, 0])
  for path, size in entries:
    parts[part_of(path)] += size
    group = paths[_short(path)]
    group[0] += size
    group[1] += 1
  largest = sorted(paths.items(), key=lambda item: -item[1][0])[:top]
  return {'peak': peak, 'parts': dict(sorted(((k, v) for k, v in parts.items() if v), key=lambda item: -item[1])),
          'largest': [{'path': path, 'bytes': size, 'buffers': count} for path, (size, count) in largest]}


@contextlib.contextmanager
def _compiled_afresh() -> Iterator[None]:
  """JAX's persistent cache off: a hit would bring the executable back without compiling it, so without the dump
  (its key leaves the dump options out). The cache is set up again, as configured, at the next compile."""
  from jax.experimental.compilation_cache import compilation_cache
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', enabled)
    compilation_cache.reset_cache()


def compile_with_breakdown(lowered: jax.stages.Lowered, top: int = 15
                           ) -> tuple[jax.stages.Compiled, dict[str, Any]]:
  """`lowered` compiled with the dump, and the summary of what is live at its peak."""
  with tempfile.TemporaryDirectory(prefix='lm_breakdown_') as directory, _compiled_afresh():
    compiled = lowered.compile(compiler_options=dump_options(directory))
    dumps = sorted(Path(directory).glob('*jit_step*live-range.txt'))
    if not dumps:
      raise ValueError(f'the compiler wrote no live-range dump for the step in {directory}')
    return compiled, summarize(*read_peak(dumps[-1].read_text()), top)


def format_breakdown(summary: dict[str, Any]) -> str:
  """The parts, then the largest paths, each with its share of the peak."""
  peak = summary['peak']
  share = lambda size: f'{format_bytes(size):>10}  {size / peak:4.0%}'
  lines = [('live at the peak', format_bytes(peak))]
  lines += [(f'  {part}', share(size)) for part, size in summary['parts'].items()]
  lines += [('largest', '')]
  lines += [(f'  {row["path"]}' + (f' (x{row["buffers"]})' if row['buffers'] > 1 else ''), share(row['bytes']))
            for row in summary['largest']]
  return format_lines(lines)
