"""Config loading, overrides and the one-line errors for bad input."""
import jax
import pytest
import yaml

from lm import cli
from lm.config import RENAMED, ConfigError, from_dict, load_config, parse_overrides
from lm.assembly import assemble
from lm.parallel.mesh import make_mesh
from lm.train.step import PretrainingLoss, make_train_step


def test_preset_by_name_and_path_agree():
  by_name = load_config('gpt_tiny')
  by_path = load_config(str(load_config.__globals__['CONFIG_DIR'] / 'gpt_tiny.yaml'))
  assert by_name == by_path
  assert by_name.model.d_model == 256 and by_name.name == 'gpt_tiny'


def test_overrides_are_typed():
  cfg = load_config('gpt_tiny', ['model.d_model=128', 'optim.learning_rate=1e-4', 'train.resume=true',
                                 'model.head_dim=null', 'optim.decay_exclude=[bias,scale]'])
  assert cfg.model.d_model == 128 and isinstance(cfg.model.d_model, int)
  assert cfg.optim.learning_rate == pytest.approx(1e-4)
  assert cfg.train.resume is True and cfg.model.head_dim is None
  assert cfg.optim.decay_exclude == ('bias', 'scale')


def test_enum_and_boolean_overrides_accept_the_words_users_write(tmp_path):
  """YAML 1.1 reads off/on/yes/no as booleans and null as None; every enum field takes its own word as written
  (`train.on_spike=off`), null as its `none` or `off`, and booleans take on/off/yes/no, in overrides and in files."""
  cfg = load_config('gpt_tiny', ['train.on_spike=off', 'model.quantization=null', 'model.execution.remat=none',
                                 'train.resume=on', 'model.execution.scan_layers=no'])
  assert cfg.train.on_spike == 'off' and cfg.model.quantization == 'none' and cfg.model.execution.remat == 'none'
  assert cfg.train.resume is True and cfg.model.execution.scan_layers is False
  assert load_config('gpt_tiny', ['train.on_spike=~']).train.on_spike == 'off'
  preset = tmp_path / 'mine.yaml'
  preset.write_text('base: gpt_tiny\ntrain:\n  on_spike: off\n  resume: yes\nmodel:\n  rope:\n    scaling: null\n')
  from_file = load_config(str(preset))
  assert from_file.train.on_spike == 'off' and from_file.train.resume is True
  assert from_file.model.rope.scaling == 'none'
  with pytest.raises(ConfigError, match="train.on_spike='no' is not supported; choose one of: off, skip, rollback"):
    load_config('gpt_tiny', ['train.on_spike=no'])


def test_base_inheritance():
  bench = load_config('gpt_bench')
  tiny = load_config('gpt_tiny')
  assert bench.model.vocab_size == 8192 and bench.train.global_batch == 8
  assert bench.model.num_layers == tiny.model.num_layers and bench.name == 'gpt_bench'


# One value per earlier spelling (lm.config.RENAMED), each valid where it lands.
EARLIER = {'model.rope_theta': 5e5, 'model.rope_scaling': 'linear', 'model.rope_factor': 2.0,
           'model.rope_original_max_len': 64, 'model.rope_low_freq_factor': 1.5, 'model.rope_high_freq_factor': 3.0,
           'model.rope_beta_fast': 16.0, 'model.rope_beta_slow': 2.0, 'model.rope_attention_factor': 1.1,
           'model.mup_base_width': 64, 'model.mup_base_head_dim': 16, 'model.mup_zero_init': True,
           'model.dtype': 'bfloat16', 'model.attention_impl': 'flash', 'model.attention_block_q': 64,
           'model.attention_block_k': 32, 'model.scan_layers': True, 'model.remat': 'full', 'model.loss_chunk': 16,
           'train.checkpoint_every': 7, 'train.checkpoint_every_minutes': 5.0, 'train.keep_checkpoints': 3,
           'train.keep_every': 4, 'train.checkpoint_at': [3, 9], 'train.evals': ['piqa'], 'train.evals_every': 5,
           'train.evals_limit': 10, 'train.evals_num_fewshot': 2, 'train.evals_data_dir': '/tmp/tasks'}


def test_earlier_spellings_load_into_their_groups(tmp_path):
  """Every field a grouping moved keeps its earlier spelling, on the command line and in a YAML file (a run dir's
  config.yaml written before the grouping); a field set under both spellings is refused in one line."""
  assert set(EARLIER) == set(RENAMED)
  fixed = ['model.position=rotary', 'model.parametrization=mup']
  show = lambda v: f'[{",".join(map(str, v))}]' if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else v
  old = load_config('gpt_tiny', fixed + [f'{k}={show(v)}' for k, v in EARLIER.items()])
  new = load_config('gpt_tiny', fixed + [f'{RENAMED[k]}={show(v)}' for k, v in EARLIER.items()])
  assert old == new != load_config('gpt_tiny', fixed + ['model.mup.base_width=64'])
  for dotted, value in EARLIER.items():
    *path, key = RENAMED[dotted].split('.')
    node = new
    for part in path:
      node = getattr(node, part)
    assert getattr(node, key) == (tuple(value) if isinstance(value, list) else value), dotted
  flat = yaml.safe_dump({'model': {'position': 'rotary', 'parametrization': 'mup',
                                   **{k.split('.')[1]: v for k, v in EARLIER.items() if k.startswith('model.')}},
                         'train': {k.split('.')[1]: v for k, v in EARLIER.items() if k.startswith('train.')}})
  (tmp_path / 'old.yaml').write_text(f'base: gpt_tiny\n{flat}')
  assert load_config(str(tmp_path / 'old.yaml')).model == new.model
  with pytest.raises(ConfigError, match='train.checkpoint_every and train.checkpoint.every are both set'):
    load_config('gpt_tiny', ['train.checkpoint_every=3', 'train.checkpoint.every=4'])


def test_parse_overrides_nested():
  assert parse_overrides(['a.b=1', 'a.c=x']) == {'a': {'b': 1, 'c': 'x'}}


@pytest.mark.parametrize('overrides, needle', [
  (['model.widht=3'], "unknown config key 'model.widht'"),
  (['trian.steps=3'], "unknown config key 'trian'"),
  (['model.num_heads=5'], 'model.num_heads=5 does not divide model.d_model=256'),
  (['data.seq_len=512'], 'data.seq_len=512 is longer than the position table model.max_len=256'),
  (['train.global_batch=10', 'train.microbatches=4'], 'not divisible by train.microbatches=4'),
  (['model.d_model=abc'], 'model.d_model: expected an integer'),
  (['model.norm=batchnorm'], "model.norm='batchnorm' is not supported"),
  (['train.steps'], 'is not of the form key.sub=value'),
  (['mesh.data=-1', 'mesh.fsdp=-1'],
   'only one of mesh.stage, mesh.data, mesh.fsdp, mesh.expert, mesh.sequence, mesh.tensor may be -1'),
  (['data.evals=[c4]'], "data.evals entry 'c4': write NAME=embedded, NAME=text:GLOB"),
  (['data.evals=[c4=tfds:c4/en:3.1.0]'], "data.evals entry 'c4=tfds:c4/en:3.1.0': write"),
  (['data.evals=[c4=csv:x]'], "data.evals entry 'c4=csv:x': write"),
  (['data.evals=[a=embedded, a=text:x/*.txt]'], "data.evals names 'a' twice; give each source its own name"),
  (['data.evals=[a=embedded]', 'train.eval_batches=0'], 'data.evals needs train.eval_batches > 0'),
  (['train.eval_batches=-2'], 'train.eval_batches >= -1 (-1: every held-out set whole)'),
  (['train.eval_at=[5,0]'], 'train.eval_at=[5, 0] must list steps >= 1'),
  (['model.position=rotary', 'model.rope.fraction=0.3'], 'model.rope.fraction=0.3 rotates 19 of the head dim 64'),
  (['model.rope.fraction=0.5'], 'model.rope.fraction=0.5 applies to rotary positions, but model.position=learned'),
  (['model.parallel_residual=true', 'model.norm_position=post'], 'but model.norm_position=post; set'),
  (['model.qk_norm_scope=all_heads'], 'model.qk_norm_scope=all_heads scopes a query/key norm, but model.qk_norm=false'),
  (['model.clip_qkv=-1'], 'model.clip_qkv=-1.0 must be >= 0 (0: no clipping)'),
  (['model.sliding_window=8', 'model.global_layers=[0,9]'], 'model.global_layers=[0, 9] names the layers that '
   'attend globally among windowed ones: distinct indices in [0, 4)'),
  (['model.global_layers=[1]'], 'with model.sliding_window > 0 and without model.global_every'),
  (['model.position=rotary', 'model.rope.local_theta=1e4', 'model.sliding_window=8'],
   'model.rope.local_theta=10000.0 rotates windowed layers apart from global ones, but this model has no such mix'),
  (['model.rope.local_theta=1e4'], "model.rope.local_theta=10000.0 is the windowed layers' rotary base wavelength: "
   'it must be >= 0 and needs model.position=rotary'),
  (['model.norm_plus_one=true'], 'model.norm_plus_one=true scales an RMSNorm by (1 + w), but model.norm=layernorm'),
  (['model.moe.num_experts=4', 'model.moe.experts_per_token=5'],
   'model.moe.experts_per_token=5 must lie in [1, model.moe.num_experts=4]'),
  (['model.moe.num_experts=4', 'model.moe.router=relu'], "model.moe.router='relu' is not supported; choose one of"),
  (['model.moe.num_experts=4', 'model.moe.compute=capacity', 'model.moe.capacity_factor=0'],
   'model.moe.capacity_factor=0.0 must be > 0'),
  (['model.moe.num_experts=6', 'model.moe.groups=4'], 'model.moe.groups=4 must divide model.moe.num_experts=6'),
  (['model.moe.num_experts=4', 'model.moe.every=2', 'model.moe.dense_layers=[1,3]'],
   'leave no routed layer among 4; route at least one'),
  (['model.moe.experts_per_token=1'], 'model.moe fields are set but model.moe.num_experts=0'),
  (['model.moe.num_experts=4'], 'model.moe.num_experts=4: the gpt family builds no routed experts'),
  (['model.norm=nonparametric'], 'choose one of: layernorm, rmsnorm, nonparametric_layernorm'),
  (['train.on_spike=restart'], "train.on_spike='restart' is not supported; choose one of: off, skip, rollback"),
  (['train.spike_window=1'], 'train.spike_window=1 must be >= 2'),
  (['train.spike_threshold=0'], 'train.spike_threshold=0.0 must be > 0'),
  (['train.rollback_skip_batches=-1'], 'train.rollback_skip_batches=-1 and train.max_rollbacks=3 must be >= 0'),
  (['train.max_rollbacks=-2'], 'train.max_rollbacks=-2 must be >= 0'),
  (['train.hang_timeout_minutes=-1'], 'train.hang_timeout_minutes=-1.0 must be >= 0 (0: off)'),
  (['train.join_timeout_minutes=0'], 'train.join_timeout_minutes=0.0 > 0'),
  (['model.execution.offload=[layer_input]'], 'with remat=none set model.execution.remat=full (layer inputs) or'),
  (['model.execution.remat=dots', 'model.execution.offload=[mlp_out]'], 'with remat=dots set model.execution.remat'),
  (['model.execution.remat=full', 'model.execution.offload=[residual]'],
   'model.execution.offload names residual; choose among: layer_input, query_proj'),
  (['model.quantization=int4'], "model.quantization='int4' is not supported; choose one of: none, int8"),
  (['model.family=mixtral', 'model.position=rotary', 'model.moe.num_experts=4', 'model.moe.experts_per_token=2',
    'model.quantization=int8'], "the routed experts' grouped matmuls (model.moe) have no int8 path"),
  (['train.local_checkpoint_dir=/tmp/x'], 'train.local_checkpoint_every=0 go together: set both'),
  (['train.local_checkpoint_every=5'], 'train.local_checkpoint_dir=None and train.local_checkpoint_every=5 go'),
  (['train.local_checkpoint_dir=/x', 'train.local_checkpoint_every=-5'], 'train.local_checkpoint_every=-5 go'),
  (['train.local_checkpoint_dir=gs://b/x', 'train.local_checkpoint_every=5'], "must be a path on each host's own"),
  (['train.local_checkpoint_dir=/x', 'train.local_checkpoint_every=500'],
   'train.local_checkpoint_every=500 must be below train.checkpoint.every=100'),
])
def test_bad_config_names_field_and_fix(overrides, needle):
  with pytest.raises(ConfigError, match=None) as info:
    load_config('gpt_tiny', overrides)
  assert needle in str(info.value)


def test_missing_config_file():
  with pytest.raises(ConfigError, match="config file 'no_such_preset' not found.*gpt_tiny"):
    load_config('no_such_preset')


def test_mesh_product_must_equal_device_count():
  cfg = load_config('gpt_tiny', ['mesh.data=3', 'mesh.fsdp=1'])
  with pytest.raises(ConfigError,
                     match=r'stage\*data\*fsdp\*expert\*sequence\*tensor = 1\*3\*1\*1\*1\*1 = 3 but there are 8 devices'):
    make_mesh(cfg.mesh, jax.devices())


def test_batch_must_divide_over_data_parallel():
  cfg = load_config('gpt_tiny', ['mesh.data=8', 'train.global_batch=12'])
  with pytest.raises(ConfigError, match=r'gives 12 rows, not divisible by the data-parallel size '
                                        r'mesh.data=8; use a global batch that is a multiple of 8'):
    make_train_step(a := assemble(cfg, jax.devices()), PretrainingLoss(a))


def test_tensor_must_divide_heads():
  cfg = load_config('gpt_tiny', ['mesh.data=1', 'mesh.tensor=8'])
  with pytest.raises(ConfigError, match=r'model.num_heads=4 is not divisible by mesh.tensor=8 \(parameter '
                                        r'decoder/layers_0/attention/\w+/kernel\); .*change model.num_heads'):
    assemble(cfg, jax.devices())


def test_fsdp_must_divide_the_width_and_tensor_the_mlp():
  cfg = load_config('gpt_tiny', ['mesh.data=1', 'mesh.fsdp=8', 'model.d_model=260', 'model.num_heads=4'])
  with pytest.raises(ConfigError, match=r'model.d_model=260 is not divisible by mesh.fsdp=8'):
    assemble(cfg, jax.devices())
  cfg = load_config('gpt_tiny', ['mesh.data=4', 'mesh.tensor=2', 'model.d_ff=1001'])
  with pytest.raises(ConfigError, match=r'model.d_ff=1001 is not divisible by mesh.tensor=2 \(parameter '
                                        r'decoder/layers_0/mlp/wi/(kernel|bias)\)'):
    assemble(cfg, jax.devices())


def test_kv_heads_fewer_than_tensor_devices_are_replicated():
  """GQA: 2 key/value heads over 8 tensor devices stay whole; the 8 query heads split."""
  def shard_shapes(*overrides):
    cfg = load_config('llama_tiny', ['mesh.data=1', 'model.num_heads=8', 'model.num_kv_heads=2', *overrides])
    params = assemble(cfg, jax.devices()).abstract_params['decoder']['layers_0']['attention']
    return {name: params[name]['kernel'].sharding.shard_shape(params[name]['kernel'].shape) for name in params}
  shapes = shard_shapes('mesh.tensor=8')  # kernels [embed 256, heads, head_dim 32]
  assert shapes['key'] == shapes['value'] == (256, 2, 32) and shapes['query'] == (256, 1, 32)
  shapes = shard_shapes('mesh.data=4', 'mesh.tensor=2')
  assert shapes['key'] == (256, 1, 32) and shapes['query'] == (256, 4, 32)


@pytest.mark.parametrize('argv', [
  ['info', '--config', 'gpt_tiny', 'model.bogus=1'],
  ['info', '--config', 'missing_preset'],
  ['info', '--config', 'gpt_tiny', 'model.num_heads=7'],
  ['info', '--config', 'gpt_tiny', 'mesh.data=3'],
  ['train', '--config', 'gpt_tiny', 'mesh.data=8', 'train.global_batch=4'],
  ['train', '--config', 'gpt_tiny', 'data.seq_len=1024'],
])
def test_cli_reports_one_line_error(argv, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith('lm: error: ') and err.count('\n') == 1 and 'Traceback' not in err


def test_paths_expand_home_and_variables_but_not_uris(monkeypatch):
  """The shell leaves `~` after `key=` alone, so the config expands it (and $VARS) in every path field."""
  monkeypatch.setenv('HOME', '/home/ada')
  monkeypatch.setenv('CORPUS', '/data/corpus')
  config = load_config('gpt_tiny', ['data.data_dir=~/tensorflow_datasets', 'data.source=text',
                                    'data.paths=[$CORPUS/*.txt, gs://bucket/x/*.txt]', 'data.tokenizer=hf:~/tok',
                                    'train.run_dir=~/runs/{name}', 'train.init_from=gs://bucket/run'])
  assert config.data.data_dir == '/home/ada/tensorflow_datasets'
  assert list(config.data.paths) == ['/data/corpus/*.txt', 'gs://bucket/x/*.txt']
  assert config.data.tokenizer == 'hf:/home/ada/tok'
  assert str(config.run_dir) == '/home/ada/runs/gpt_tiny' and config.train.init_from == 'gs://bucket/run'


@pytest.mark.parametrize('overrides, needle', [
  (['mesh.data=1', 'mesh.tensor=8', 'model.vocab_size=260', 'model.num_heads=8'],
   'model.vocab_size=260 is not divisible by mesh.tensor=8 (parameter token_embed/embedding); choose mesh sizes '
   'that divide it or change model.vocab_size'),
  (['mesh.slices=3'], 'mesh.slices=3 does not divide the 8 devices'),
  (['mesh.slices=2', 'mesh.stage_slices=3', 'model.execution.scan_layers=true', 'model.num_layers=6',
    'train.microbatches=3', 'train.global_batch=24'], 'mesh.slices=2 x mesh.stage_slices=3 (6 slices) does not divide the 8 devices'),
  (['mesh.data=-1', 'mesh.fsdp=3'], 'do not fit 8 devices per slice: 3 does not divide 8'),
  (['mesh.data=8', 'train.global_batch=16', 'train.microbatches=4'],
   'train.global_batch=16 over 4 microbatch(es) gives 4 rows, not divisible by the data-parallel size mesh.data=8; '
   'use a global batch that is a multiple of 32'),
  (['mesh.data=2', 'mesh.fsdp=4', 'train.global_batch=16', 'train.microbatches=4'],
   'not divisible by the data-parallel size mesh.data*mesh.fsdp=8; use a global batch that is a multiple of 32'),
])
def test_sizes_that_do_not_divide_over_the_mesh_name_the_field(overrides, needle):
  with pytest.raises(ConfigError) as info:
    cfg = load_config('gpt_tiny', overrides)
    make_train_step(a := assemble(cfg, jax.devices()), PretrainingLoss(a))
  assert needle in str(info.value)


def test_a_size_that_divides_gives_no_error():
  """The checks are not over-eager: the same settings made divisible assemble and build a step."""
  cfg = load_config('gpt_tiny', ['mesh.data=2', 'mesh.fsdp=4', 'train.global_batch=32', 'train.microbatches=4',
                                 'model.vocab_size=264'])
  make_train_step(a := assemble(cfg, jax.devices()), PretrainingLoss(a))


def test_offload_needs_host_memory_the_devices_address():
  """Offloading (remat's saved tensors, optimizer state, params) on a platform whose devices list no pinned_host
  memory: one line naming each setting."""
  from types import SimpleNamespace
  from lm.assembly import check_offload
  memories = lambda *kinds: lambda: [SimpleNamespace(kind=k) for k in kinds]
  cpu = SimpleNamespace(platform='cpu', addressable_memories=memories('device', 'pinned_host'))
  gpu = SimpleNamespace(platform='gpu', addressable_memories=memories('device'))
  remat = from_dict({'model': {'execution': {'remat': 'full', 'offload': ['layer_input']}}})
  check_offload(remat, cpu)
  with pytest.raises(ConfigError, match=r"offload=\['layer_input'\] need host memory the gpu devices can address "
                                        r"\(pinned_host; they have device\); drop it on this platform"):
    check_offload(remat, gpu)
  state = from_dict({'train': {'optimizer_offload': True, 'param_offload': True}})
  with pytest.raises(ConfigError, match=r"^train.optimizer_offload=true and train.param_offload=true need host "):
    check_offload(state, gpu)
  check_offload(from_dict({}), gpu)
