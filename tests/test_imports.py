"""The import layers: config at the bottom, data beside models (never importing them), GLUE and scaling on top."""
import ast
import subprocess
import sys
from pathlib import Path

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
  assert not offenders((LM / 'data').rglob('*.py'), ('lm.models', 'lm.train', 'lm.assembly', 'lm.glue'))


def test_models_and_ops_never_import_training_assembly_or_checkpoints():
  files = [*(LM / 'models').rglob('*.py'), *(LM / 'ops').rglob('*.py'), *(LM / 'parallel').rglob('*.py')]
  assert not offenders(files, ('lm.train', 'lm.assembly', 'lm.checkpoint', 'lm.run_dir', 'lm.pretraining'))


def test_config_imports_nothing_of_lm_but_the_mesh_axes_leaf():
  assert offenders([LM / 'config.py'], ('lm.',)) == ['lm/config.py imports lm.mesh_axes']
  assert not offenders([LM / 'mesh_axes.py'], ('lm',))


def test_only_the_cli_reaches_up_to_glue():
  below = [p for p in LM.rglob('*.py') if not {'glue', 'scaling'} & set(p.parts) and p.name != 'cli.py']
  assert not offenders(below, ('lm.glue', 'lm.scaling'))


def test_loading_a_preset_loads_no_model_or_data_module():
  code = ("import sys; from lm.config import load_config; load_config('gpt_tiny', ['model.d_model=128']); "
          "print(' '.join(m for m in sys.modules if m.startswith(('lm.models', 'lm.data', 'jax', 'flax'))))")
  done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert done.stdout.split() == []
