"""FLOPs per token against XLA's cost analysis of the compiled train step; MFU arithmetic."""
import jax
import pytest

from lm.assembly import assemble
from lm.config import load_config
from lm.train.accounting import flops_per_sequence, flops_per_token, mfu
from lm.train.step import compile_train_step

SEQ, BATCH = 64, 4


@pytest.mark.parametrize('name', ['gpt_tiny', 'bert_tiny', 't5_tiny', 't5_v1_0_tiny', 'llama_tiny'])
def test_flops_agree_with_xla_cost_analysis(name):
  """Unscanned layers: XLA's cost analysis counts a while loop's body once, not per iteration."""
  config = load_config(name, ['model.num_layers=2', 'model.num_decoder_layers=2', f'data.seq_len={SEQ}',
                              f'model.max_len={SEQ}', f'train.global_batch={BATCH}', 'mesh.data=1',
                              'model.scan_layers=false', 'model.remat=none'])
  assembly = assemble(config, jax.devices()[:1])
  cost = compile_train_step(assembly).cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)['flops']
  # The XLA attention path computes every score of a causal square at this length: count 'full'.
  ours = flops_per_sequence(assembly.abstract_params, config.model, SEQ, 'full') * BATCH
  assert abs(xla / ours - 1) < 0.05, (xla, ours)


def test_causal_half_counts_half_the_attention_and_mfu_divides_by_the_peak():
  config = load_config('gpt_tiny')
  params, m, seq = assemble(config, jax.devices()[:1]).abstract_params, config.model, config.data.seq_len
  attention_full = 12 * m.num_layers * m.d_model * seq  # per token, forward + backward
  full, half = flops_per_token(params, m, seq, 'full'), flops_per_token(params, m, seq, 'half')
  assert full - half == pytest.approx(attention_full / 2)
  assert mfu(1000.0, half, 4, 1e12) == pytest.approx(1000.0 * half / 4e12)
  assert mfu(1000.0, half, 4, None) is None
