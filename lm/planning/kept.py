"""Compile figures kept by their program: a TPU compile of a step that did not change is not paid again.

What `lm compile` reads from a compile (memory and cost analysis, the compiler's refusal, what is live at the peak)
is a function of the lowered program, the devices it is compiled for, the compiler and its options. With
LM_COMPILE_REPORTS=DIR each compile's figures are written to DIR under a key over all of these, and a later compile
of the same program reads them back instead of compiling. The key hashes the program's text (with its op names
when the breakdown reads them, without source files and lines; its Pallas kernels without the checkout's and the
environment's paths), the devices' kind and ids in mesh order, the
options, jax's, jaxlib's and libtpu's versions, the compiler settings in jax's config and the compiler flags in the
environment (XLA_FLAGS, LIBTPU_INIT_ARGS, as the compiler reads them). The suite keeps its TPU compiles' figures in tests/compiled/.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import jax

ENV = 'LM_COMPILE_REPORTS'
# jax's settings that reach the compiler as its options rather than through the lowered program
_COMPILER_SETTINGS = re.compile(r'effort|optimization_level|fitting_level|remat_pass')
# a source location in the program's debug text: `"/path/file.py":12:3`, `... to :14:9`; the paths differ by checkout
_SOURCE = re.compile(r'"[^"]*":\d+:\d+( to (\d+)?:\d+)?')
# the debug text's location aliases (`#loc12 = loc(...)`), numbered in order of first use, and their uses
_ALIAS = re.compile(r'^(#loc\d*) = (loc\(.*\))$', re.M)
_USE = re.compile(r'#loc\d*\b')
# a Pallas kernel's serialized Mosaic module (base64, quoted `\22...\22` in a custom call's config in the program's
# text), which holds its source files' paths
_KERNEL = re.compile(r'\\22([A-Za-z0-9+/]{100,}={0,2})\\22')


def directory() -> Path | None:
  """Where compile figures are kept ($LM_COMPILE_REPORTS), or None: every compile is paid."""
  value = os.environ.get(ENV)
  return Path(value) if value else None


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return 'absent'


def key_parts(lowered: jax.stages.Lowered, devices: Iterable[Any], options: dict[str, Any]) -> dict[str, Any]:
  """Everything a compile's figures depend on (the module's docstring lists them), the program as its sha256."""
  text = _SOURCE.sub('', lowered.as_text(debug_info=bool(options.get('breakdown'))))
  text = _KERNEL.sub(lambda kernel: _without_paths(kernel.group(1)), _inlined(text))
  settings = {k: str(v) for k, v in sorted(jax.config.values.items()) if _COMPILER_SETTINGS.search(k)}
  return {'program': hashlib.sha256(text.encode()).hexdigest(), 'options': options, 'settings': settings,
          'devices': [(d.device_kind, d.id) for d in devices],
          'versions': [jax.__version__, _version('jaxlib'), _version('libtpu'), _version('libtpu-nightly')],
          'flags': [_flags(os.environ.get('XLA_FLAGS', '')), _flags(os.environ.get('LIBTPU_INIT_ARGS', ''))]}


def _flags(value: str) -> str:
  """Compiler flags as the compiler reads them: each flag's last value, by name, without the host platform's device
  count (the CPU client's, which processes append to XLA_FLAGS as they simulate devices)."""
  flags = dict(item.partition('=')[::2] for item in value.split())
  flags.pop('--xla_force_host_platform_device_count', None)
  return ' '.join(f'{name}={v}' if v else name for name, v in sorted(flags.items()))


def digest(parts: dict[str, Any]) -> str:
  """The key of a compile's figures: sha256 over `key_parts`."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _inlined(text: str) -> str:
  """The debug text with each location alias replaced by the location it names: the aliases' numbers follow which
  source locations were distinct, which differs by checkout once their paths are taken out."""
  aliases, resolved = dict(_ALIAS.findall(text)), {}

  def resolve(name: str) -> str:
    if name not in resolved:
      resolved[name] = _USE.sub(lambda use: resolve(use.group(0)), aliases.get(name, name))
    return resolved[name]
  return _USE.sub(lambda use: resolve(use.group(0)), _ALIAS.sub('', text))


def _without_paths(encoded: str) -> str:
  """A serialized kernel's sha256 with the checkout's and the environment's paths taken out of it: the same kernel
  from another clone or virtualenv keys alike (its source lines still count)."""
  try:
    body = base64.b64decode(encoded, validate=True)
  except ValueError:
    return encoded
  roots = {str(Path(__file__).resolve().parents[2]), sys.prefix, str(Path(sys.prefix).resolve())}
  for root in sorted(roots, key=len, reverse=True):  # the environment may lie inside the checkout (.venv)
    body = body.replace(root.encode(), b'<root>')
  return hashlib.sha256(body).hexdigest()


def _path(key: str, label: str) -> Path:
  return directory() / f'{label}-{key[:20]}.json'


def read(key: str, label: str) -> tuple[dict[str, Any], str] | None:
  """(the figures kept for `key`, their file), or None when none are."""
  path = _path(key, label)
  if not path.is_file():
    return None
  kept = json.loads(path.read_text())
  if kept.get('key') != key:
    return None
  os.utime(path)  # read now: entries no run reads any more keep their old times
  return kept['figures'], str(path)


def write(key: str, label: str, figures: dict[str, Any], parts: dict[str, Any]) -> None:
  """Keeps `figures` for `key` (with its parts, which show why two compiles keyed apart), written whole to a
  temporary name, then renamed: concurrent readers never see half."""
  path = _path(key, label)
  path.parent.mkdir(parents=True, exist_ok=True)
  part = path.with_suffix(f'.{os.getpid()}.part')
  part.write_text(json.dumps({'key': key, 'label': label, 'figures': figures, 'parts': parts}, indent=1,
                             sort_keys=True) + '\n')
  part.replace(path)
