"""lm.planning.kept: what a compile's key leaves out, so two checkouts of one program key alike."""
import base64
import sys
from pathlib import Path

from lm.planning.kept import _flags, _inlined, _KERNEL, _without_paths

# One program's debug text from two checkouts: the source paths, taken out, leave the aliases numbered differently.
HERE = '''#loc1 = loc("x")
#loc2 = loc(callsite(#loc1 at #loc3))
#loc3 = loc("f"(loc()))
  %0 = stablehlo.add %a, %b loc(#loc2)
'''
THERE = '''#loc1 = loc("y")
#loc2 = loc("x")
#loc5 = loc("f"(loc()))
#loc7 = loc(callsite(#loc2 at #loc5))
  %0 = stablehlo.add %a, %b loc(#loc7)
'''


def test_location_aliases_are_inlined_whatever_their_numbers():
  assert _inlined(HERE).strip() == _inlined(THERE).strip() == \
      '%0 = stablehlo.add %a, %b loc(loc(callsite(loc("x") at loc("f"(loc())))))'
  assert _inlined(HERE.replace('"x"', '"z"', 1)) != _inlined(THERE)  # another op name keys apart


def test_a_kernels_paths_to_the_checkout_and_the_environment_leave_its_key():
  """A serialized kernel naming this checkout's and this environment's files keys as the one another clone (its
  paths put in) serializes; its own source, or a path outside both, still counts."""
  root, env = str(Path(__file__).resolve().parents[2]), sys.prefix
  kernel = lambda *paths: base64.b64encode(b'mosaic' * 20 + b'\0'.join(p.encode() for p in paths)).decode()
  mine = kernel(f'{root}/lm/ops/attention/flash.py', f'{env}/lib/jax/pallas.py')
  assert _KERNEL.fullmatch(f'\\22{mine}\\22')  # quoted as in a custom call's config
  assert _without_paths(mine) == _without_paths(kernel('<root>/lm/ops/attention/flash.py', '<root>/lib/jax/pallas.py'))
  assert _without_paths(mine) != _without_paths(kernel(f'{root}/lm/ops/attention/other.py', f'{env}/lib/jax/pallas.py'))
  assert _without_paths(mine) != _without_paths(kernel('/elsewhere/lm/ops/attention/flash.py', '<root>/lib/jax/pallas.py'))


def test_compiler_flags_key_as_the_compiler_reads_them():
  """A flag repeated with its value, or the host platform's device count a process appended, keys alike; another
  value, or the last of two, keys apart."""
  suite = '--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0'
  assert _flags(f'{suite} {suite}') == _flags(f'{suite} {suite} --xla_force_host_platform_device_count=8') == \
      _flags('--xla_backend_optimization_level=0')
  assert _flags('--a=1 --a=2') == _flags('--a=2') != _flags('--a=1')
