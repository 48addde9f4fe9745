"""The fast tier (`pytest -m "not long"`) still touches every module of lm/: a test file holding at least one test
not marked `long` imports it by name, or imports a module of the same subpackage (lm.jobs.glue, lm.ops.attention, ...)
that imports it: `lm.models` builds each family's model, `lm.train.loop` stops at a SIGTERM through
`lm.train.preemption`; a family record's converter counts as imported by `lm.models`."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LM = TESTS.parent / 'lm'


def lm_modules() -> set[str]:
  names = set()
  for path in LM.rglob('*.py'):
    parts = path.relative_to(LM.parent).with_suffix('').parts
    names.add('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
  return names


def marked_long(node: ast.expr) -> bool:
  """`pytest.mark.long(...)` itself, or a list holding it (a `pytestmark`); not a parametrize with some long cases."""
  if isinstance(node, (ast.List, ast.Tuple)):
    return any(map(marked_long, node.elts))
  return ast.unparse(node.func if isinstance(node, ast.Call) else node) == 'pytest.mark.long'


def has_fast_test(tree: ast.Module) -> bool:
  """A test function (top level or in a class) without the `long` mark, in a file whose `pytestmark` lacks it."""
  if any(isinstance(n, ast.Assign) and any(getattr(t, 'id', '') == 'pytestmark' for t in n.targets)
         and marked_long(n.value) for n in tree.body):
    return False
  functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
  for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and not any(map(marked_long, n.decorator_list))):
    functions += [n for n in cls.body if isinstance(n, ast.FunctionDef)]
  return any(f.name.startswith('test') and not any(map(marked_long, f.decorator_list)) for f in functions)


def imported(tree: ast.Module, modules: set[str]) -> set[str]:
  """lm modules a file names in its imports (`from lm.a import b` names lm.a, and lm.a.b when b is a module; the
  packages above them run too) or as a string (a family record names its converter module, imported on use)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      names.add(node.value)
    elif isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names |= {node.module} | {f'{node.module}.{alias.name}' for alias in node.names}
  parents = {'.'.join(name.split('.')[:i]) for name in names for i in range(1, name.count('.') + 1)}
  return (names | parents) & modules


def module_path(name: str) -> Path:
  path = LM.parent.joinpath(*name.split('.'))
  return path / '__init__.py' if path.is_dir() else path.with_suffix('.py')


def subpackage(name: str) -> str:
  return '.'.join(name.split('.')[:2])


def with_their_subpackages_imports(touched: set[str], modules: set[str]) -> set[str]:
  """`touched` and, transitively, what each imports from its own subpackage (none for modules at lm's top) or
  names as a string (a plug-in such as a family's converter)."""
  todo, seen = list(touched), set(touched)
  while todo:
    name = todo.pop()
    if name.count('.') < 1 or not module_path(name).is_file() or module_path(name).parent == LM:
      continue
    tree = ast.parse(module_path(name).read_text())
    by_name = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    for other in imported(tree, modules) - seen:
      if subpackage(other) == subpackage(name) or other in by_name:
        seen.add(other)
        todo.append(other)
  return seen


def test_every_module_of_lm_has_a_fast_test():
  modules, touched = lm_modules(), set()
  for path in TESTS.rglob('test_*.py'):
    tree = ast.parse(path.read_text())
    if has_fast_test(tree):
      touched |= imported(tree, modules)
  reached = with_their_subpackages_imports(touched, modules)
  if 'lm.models' in reached:  # a family record names its converter (the Llama layout's by the family's name)
    reached = with_their_subpackages_imports(reached | converters(), modules)
  assert sorted(modules - reached) == []


def converters() -> set[str]:
  """The converter modules the family records name, imported on use."""
  from lm.models import FAMILIES
  return {f.hf_converter for f in FAMILIES.values() if f.hf_converter}


def test_a_long_test_does_not_count():
  tree = ast.parse('import pytest\nfrom lm.config import load_config\n\n'
                   '@pytest.mark.long(1)\ndef test_slow():\n  pass\n')
  assert not has_fast_test(tree) and imported(tree, lm_modules()) == {'lm.config'}
  assert has_fast_test(ast.parse('def test_quick():\n  pass\n'))
