"""The import layers: config at the bottom, data beside models (never importing them), GLUE and scaling on top;
no cycle anywhere in lm/, and no import (lazy, or for type hints, included) against the layer order."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

LM = Path(__file__).resolve().parents[1] / 'lm'


def imported_modules(path: Path) -> set[str]:
  """Every module a file imports, at any depth (lazy imports inside functions count too)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.add(node.module)
  return names


def offenders(files, forbidden: tuple[str, ...]) -> list[str]:
  return [f'{path.relative_to(LM.parent)} imports {name}' for path in files for name in sorted(imported_modules(path))
          if name.startswith(forbidden)]


def test_data_never_imports_models_or_anything_above():
  assert not offenders((LM / 'data').rglob('*.py'), ('lm.models', 'lm.train', 'lm.assembly', 'lm.jobs.glue'))


def test_models_and_ops_never_import_training_assembly_or_checkpoints():
  files = [*(LM / 'models').rglob('*.py'), *(LM / 'ops').rglob('*.py'), *(LM / 'parallel').rglob('*.py')]
  assert not offenders(files, ('lm.train', 'lm.assembly', 'lm.storage', 'lm.jobs.pretraining'))


def test_config_imports_nothing_of_lm_but_the_mesh_axes_leaf():
  assert offenders([LM / 'config.py'], ('lm.',)) == ['lm/config.py imports lm.mesh_axes']
  assert not offenders([LM / 'mesh_axes.py'], ('lm',))


def test_only_the_command_line_reaches_up_to_glue():
  below = [p for p in LM.rglob('*.py') if not {'glue', 'scaling', 'commands'} & set(p.parts) and p.name != 'cli.py']
  assert not offenders(below, ('lm.jobs.glue', 'lm.jobs.scaling'))


def test_loading_a_preset_loads_no_model_or_data_module():
  code = ("import sys; from lm.config import load_config; load_config('gpt_tiny', ['model.d_model=128']); "
          "print(' '.join(m for m in sys.modules if m.startswith(('lm.models', 'lm.data', 'jax', 'flax'))))")
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert done.stdout.split() == []


# lm's layers, bottom up (the top-level module or package under lm/): a module imports its own layer and those below.
LAYERS = [
  ('config', 'mesh_axes', 'report'),
  ('parallel', 'ops', 'distributed'),
  ('data', 'models'),
  ('assembly', 'storage'),
  ('train',),
  ('jobs', 'planning'),
  ('commands', 'cli'),
]


def module_name(path: Path) -> str:
  parts = list(path.relative_to(LM.parent).with_suffix('').parts)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def import_graph() -> dict[str, set[str]]:
  """lm's modules -> the lm modules each imports (`from package import module` names the module)."""
  modules = {module_name(p): p for p in LM.rglob('*.py')}

  def owner(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition('.')[0]
    return name or None

  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps |= {owner(a.name) for a in node.names if a.name.startswith('lm.')}
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or '').startswith('lm'):
        deps |= {owner(f'{node.module}.{a.name}') for a in node.names}
    graph[name] = deps - {None, name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  layer = {name: i for i, names in enumerate(LAYERS) for name in names}
  top = lambda module: module.split('.')[1] if '.' in module else ''
  unplaced = {top(m) for m in graph if m != 'lm'} - set(layer)
  assert not unplaced, f'place {sorted(unplaced)} in LAYERS'
  return sorted(f'{m} imports {d}' for m, deps in graph.items() for d in deps
                if '.' in m and '.' in d and layer[top(d)] > layer[top(m)])


def test_lm_has_no_import_cycle_and_no_import_against_the_layer_order():
  graph = import_graph()
  assert cycles(graph) == []
  assert layer_violations(graph) == []


def test_the_checks_find_a_cycle_and_an_upward_import():
  graph = {'lm.models.a': {'lm.models.b'}, 'lm.models.b': {'lm.train.c'}, 'lm.train.c': {'lm.models.a'}}
  assert cycles(graph) == [['lm.models.a', 'lm.models.b', 'lm.train.c']]
  assert layer_violations(graph) == ['lm.models.b imports lm.train.c']
  with pytest.raises(AssertionError, match='nowhere'):
    layer_violations({'lm.nowhere.x': set()})


LONGEST_FUNCTION = 60  # lines, decorators and docstring included: split a longer one into named steps


def long_functions(files) -> list[str]:
  found = []
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > LONGEST_FUNCTION:
          found.append(f'{path.relative_to(LM.parent)}:{node.lineno} {node.name} ({lines} lines)')
  return found


def test_no_function_in_lm_is_over_sixty_lines(tmp_path):
  assert long_functions(sorted(LM.rglob('*.py'))) == []
  (tmp_path / 'lm').mkdir()
  long = tmp_path / 'lm' / 'long.py'
  long.write_text('def f():\n' + '  x = 1\n' * LONGEST_FUNCTION)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sys.modules[__name__], 'LM', tmp_path / 'lm')
    assert long_functions([long]) == ['lm/long.py:1 f (61 lines)']
