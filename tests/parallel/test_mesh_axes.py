"""The mesh axes are declared once (lm/mesh_axes.py): an axis added there reaches the config, its validation, the
mesh builder, the error texts and the reports without another edit."""
import subprocess
import sys
import textwrap

from lm.config import MeshConfig
from lm.mesh_axes import MESH_AXES, mesh_text
from lm.parallel.mesh import make_mesh
from lm.parallel.rules import MESH_FIELDS

THROWAWAY = textwrap.dedent('''
  import contextlib, io
  import lm.mesh_axes as axes
  axes.MESH_AXES += (axes.MeshAxis('replica', 'rp'),)  # the one edit

  from lm import cli
  from lm.config import ConfigError, load_config
  from lm.parallel.mesh import make_mesh, mesh_shape, strategy_name

  def error(overrides, devices=8):
    try:
      mesh_shape(load_config('gpt_tiny', overrides).mesh, devices)
    except ConfigError as e:
      return str(e)
    raise AssertionError(f'{overrides} raised nothing')

  config = load_config('gpt_tiny', ['mesh.replica=2', 'mesh.data=-1', 'mesh.fsdp=2'])
  assert config.mesh.replica == 2 and 'replica: 2' in config.to_yaml()
  mesh = make_mesh(config.mesh)
  want = {'slice': 1, 'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'sequence': 1, 'tensor': 1, 'replica': 2}
  assert dict(mesh.shape) == want, dict(mesh.shape)
  assert strategy_name(dict(mesh.shape)) == 'dp+fsdp+rp'
  assert error(['mesh.replica=0']) == 'mesh.replica=0 must be a positive size or -1 (fill the remaining devices)'
  assert error(['mesh.replica=-1']) == (
    'only one of mesh.stage, mesh.data, mesh.fsdp, mesh.expert, mesh.sequence, mesh.tensor, mesh.replica may be -1')
  assert error(['mesh.data=1', 'mesh.replica=4']) == (
    'mesh stage*data*fsdp*expert*sequence*tensor*replica = 1*1*1*1*1*1*4 = 4 but there are 8 devices; make the product '
    'equal 8 or set one size to -1')
  assert 'choose mesh.stage/mesh.data/mesh.fsdp/mesh.expert/mesh.sequence/mesh.tensor/mesh.replica whose' in error(
    ['mesh.replica=3'])
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert cli.main(['info', '--config', 'gpt_tiny', 'mesh.replica=4']) == 0
  assert 'slice=1 stage=1 data=2 fsdp=1 expert=1 sequence=1 tensor=1 replica=4 (dp+rp, 8 cpu devices)' in out.getvalue(), \
      out.getvalue()
  print('seen everywhere')
''')


def test_an_axis_declared_in_one_place_is_seen_everywhere():
  done = subprocess.run([sys.executable, '-c', THROWAWAY], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0 and done.stdout.strip().endswith('seen everywhere'), done.stdout + done.stderr[-3000:]


def test_the_declaration_is_what_the_config_the_rules_and_the_mesh_use():
  assert [f for f in MeshConfig.__dataclass_fields__] == ['slices', 'stage', 'data', 'fsdp', 'expert', 'sequence', 'tensor',
                                                         'stage_slices']
  assert MESH_FIELDS == {'slice': 'mesh.slices', 'stage': 'mesh.stage', 'data': 'mesh.data', 'fsdp': 'mesh.fsdp', 'expert': 'mesh.expert',
                         'sequence': 'mesh.sequence', 'tensor': 'mesh.tensor'}
  assert make_mesh(MeshConfig(data=2, fsdp=1, sequence=2, tensor=2)).axis_names == tuple(a.name for a in MESH_AXES)
  sizes = {'slice': 2, 'data': 1, 'fsdp': 4, 'sequence': 2, 'tensor': 1}
  assert mesh_text(sizes) == 'slice=2 data=1 fsdp=4 sequence=2 tensor=1'
