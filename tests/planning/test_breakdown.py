"""`lm compile --memory-breakdown`: the compiler's account of what is live at the step's peak, read back and summed
by part and by path."""
import jax
import pytest

from lm.assembly import assemble
from lm.assembly.accounting import shard_bytes
from lm.config import load_config
from lm.planning.breakdown import compile_with_breakdown, format_breakdown, part_of, read_peak, summarize
from lm.train.step import lower_train_step
from tests.conftest import SMALL

# The shape of the TPU compiler's live-range dump (moe_tiny on v5p-8), cut to a few buffers.
DUMP = """\
  Live ranges at 1697 (peak):
    pad.286{}: 1048576 bytes (cumulative: 1048576 bytes)
  Stack trace breakdown for peak usage: 5 772 800 bytes
    main.312_spmd (100.0%, total: 5 771 776 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      ├── state (25.0%, total: 1 441 792 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      │   └── params (25.0%, total: 1 441 792 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      │       └── decoder (25.0%, total: 1 441 792 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      │           ├── layers_0 (12.5%, total: 720 896 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      │           │   └── mlp (12.5%, total: 720 896 bytes, current: 0 bytes, remaining: 5 771 776 bytes)
      │           │       └── wi_0 (12.5%, total: 720 896 bytes, current: 720 896 bytes, remaining: 5 050 880 bytes)
      │           └── layers_1 (12.5%, total: 720 896 bytes, current: 0 bytes, remaining: 5 050 880 bytes)
      │               └── mlp (12.5%, total: 720 896 bytes, current: 0 bytes, remaining: 5 050 880 bytes)
      │                   └── wi_0 (12.5%, total: 720 896 bytes, current: 720 896 bytes, remaining: 4 329 984 bytes)
      ├── jit(step)/jvp(CausalDecoder)/CausalDecoder._decode/decoder/layers_0/mlp/mlp._experts/shard_map/jit(_pad)/pad \
(63.6%, total: 3 670 016 bytes, current: 3 670 016 bytes, remaining: 659 968 bytes)
      ├── jit(step)/transpose(jvp(CausalDecoder))/CausalDecoder._decode/decoder/layers_1/attention/sub{1} \
(5.7%, total: 327 680 bytes, current: 327 680 bytes, remaining: 332 288 bytes)
      ├── state.opt_state[1][0].mu['decoder']['layers_0']['mlp']['wi_0'] \
(5.8%, total: 332 288 bytes, current: 332 288 bytes, remaining: 0 bytes)
      └── jit(step)/jvp(CausalDecoder)/CausalDecoder._decode/decoder/while{5} \
(0.0%, total: 1 024 bytes, current: 1 024 bytes, remaining: 0 bytes)
"""


def test_the_dumps_tree_is_read_as_paths_and_summed_by_part_and_by_layer_stack():
  peak, entries = read_peak(DUMP)
  assert peak == 5_772_800 and sum(size for _, size in entries) == peak
  assert entries[0] == ('state/params/decoder/layers_0/mlp/wi_0', 720_896)
  summary = summarize(peak, entries, top=3)
  assert summary['parts'] == {'experts': 3_670_016, 'params': 1_441_792, 'optimizer state': 332_288,
                              'attention': 327_680, 'saved layer inputs': 1_024}
  assert summary['largest'][:2] == [
    {'path': 'decoder/layers_*/mlp/mlp._experts/shard_map/jit(_pad)/pad', 'bytes': 3_670_016, 'buffers': 1},
    {'path': 'state/params/decoder/layers_*/mlp/wi_0', 'bytes': 1_441_792, 'buffers': 2}]
  assert any(row['path'] == 'backward: decoder/layers_*/attention/sub{1}' for row in summarize(peak, entries)['largest'])
  assert 'state/params/decoder/layers_*/mlp/wi_0 (x2)' in format_breakdown(summary)


@pytest.mark.parametrize('path, part', [
  # llama2_7b's TPU step: the forward scan's body writes each layer's input into the stack full remat keeps ...
  ('decoder/while/wide.region_0.5_spmd.clone.clone.sunk/decoder/while/body/jit(dynamic_update_index_in_dim)/'
   'dynamic_update_slice', 'saved layer inputs'),
  # ... and a backward scan's stacking is the weights' gradients
  ('jit(step)/transpose(jvp(CausalDecoder))/decoder/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice',
   'other'),
  # MaxText's mixtral-8x7b step (bench/maxtext_breakdown.py)
  ('jit(train_step)/while{3}', 'saved layer inputs'),
  ('state/model/decoder/layers/MoeBlock_0/wi_0/value', 'params'),
  ("state['optimizer']['opt_state'][0]['mu']['decoder']['layers']['MoeBlock_0']['wo'].value", 'optimizer state'),
  ('jit(train_step)/while/body/eval_jaxpr/checkpoint/shard_map/ffn_act/jit(silu)/add_any', 'experts')])
def test_tpu_and_maxtext_paths_fall_in_their_parts(path, part):
  assert part_of(path) == part


def test_a_compiled_steps_peak_holds_the_params_whole():
  """gpt_tiny's step compiled for one CPU device (the compiler writes the same dump as TPU's): the params live at
  the peak are every byte of the abstract params."""
  assembly = assemble(load_config('gpt_tiny', SMALL), jax.devices()[:1])
  lower_train_step(assembly).compile()  # the suite's persistent cache may now hold it: the breakdown compiles anew
  compiled, summary = compile_with_breakdown(lower_train_step(assembly))
  assert summary['parts']['params'] == shard_bytes(assembly.abstract_params)
  assert sum(summary['parts'].values()) == summary['peak']
  memory = compiled.memory_analysis()
  assert summary['peak'] <= memory.temp_size_in_bytes + memory.argument_size_in_bytes
