"""The checkpointer's write path: small replicated arrays are written whole, with no device program compiled."""
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lm.storage.checkpoint import REPLICA_PARALLEL_MIN_SLICE_BYTES, Checkpointer


def test_small_replicated_arrays_save_whole_and_large_ones_in_replica_slices(tmp_path):
  """On 8 data-parallel devices: arrays whose 1/8 slice is under the gate save without compiling anything (orbax's
  default slices every replicated array, one slice program per shape); an array over it is still written in
  replica slices. Both restore to the saved values."""
  mesh = jax.make_mesh((8,), ('data',))
  replicated = NamedSharding(mesh, P())
  rows = 8 * REPLICA_PARALLEL_MIN_SLICE_BYTES // (4 * 256)  # float32 [rows, 256]: each 1/8 slice at the gate
  values = {'kernel': np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
            'bias': np.linspace(-1, 1, 48, dtype=np.float32), 'large': np.ones((rows, 256), np.float32)}
  params = {name: jax.device_put(value, replicated) for name, value in values.items()}
  compiled = []

  def listen(event: str, seconds: float, **kwargs) -> None:
    if event == '/jax/core/compile/backend_compile_duration':
      compiled.append(seconds)
  checkpoints = Checkpointer(tmp_path, async_save=False)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    checkpoints.save_params(0, {name: params[name] for name in ('kernel', 'bias')}, {})
    small = len(compiled)
    checkpoints.save_params(1, params, {})
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert small == 0
  assert len(compiled) == mesh.size  # the large array's slice program, once per replica's device
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  restored = checkpoints.restore_params(1, abstract)
  for name, value in values.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), value)
