"""FLOPs per token against XLA's cost analysis of the compiled train step; MFU arithmetic."""
import dataclasses

import jax
import pytest

from lm.assembly import assemble
from lm.assembly.accounting import flops_per_sequence, flops_per_token, mfu
from lm.config import load_config
from lm.train.step import compile_train_step

SEQ, BATCH = 64, 4


@pytest.mark.parametrize('name', ['gpt_tiny', 'bert_tiny', 't5_tiny', 't5_v1_0_tiny', 'llama_tiny'])
@pytest.mark.variants
def test_flops_agree_with_xla_cost_analysis(name):
  """Unscanned layers: XLA's cost analysis counts a while loop's body once, not per iteration."""
  config = load_config(name, ['model.num_layers=2', 'model.num_decoder_layers=2', f'data.seq_len={SEQ}',
                              f'model.max_len={SEQ}', f'train.global_batch={BATCH}', 'mesh.data=1',
                              'model.execution.scan_layers=false', 'model.execution.remat=none'])
  assembly = assemble(config, jax.devices()[:1])
  cost = compile_train_step(assembly).cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)['flops']
  # The XLA attention path computes every score of a causal square at this length: count 'full'.
  ours = flops_per_sequence(assembly.abstract_params, config.model, SEQ, 'full') * BATCH
  # XLA also counts the elementwise work (norms, softmax, activations, the optimizer): 1.6-4.5% here, while
  # the smallest matmul term (attention) is about 4%, so dropping a term or counting one twice fails.
  assert 1.0 <= xla / ours < 1.05, (xla, ours)


def hand_count(name: str, seq: int, target: int | None) -> float:
  """Training FLOPs of one row written out from each architecture: 2 per weight per token it sees, forward;
  attention 2 * 2 * heads * head_dim per query-key pair (scores, weighted values), the full square; x3 for
  forward + backward."""
  m = load_config(name, ['model.num_layers=2', 'model.num_decoder_layers=2']).model
  d, vocab, layers = m.d_model, m.vocab_size, m.num_layers
  hd, kv = m.num_heads * m.resolved_head_dim, m.resolved_kv_heads * m.resolved_head_dim
  mlp = (3 if m.activation in ('swiglu', 'geglu', 'geglu_tanh') else 2) * d * m.resolved_d_ff
  block = 2 * d * hd + 2 * d * kv + mlp  # query and output; key and value (fewer heads under GQA); the MLP
  pair = 2 * 2 * hd
  if name in ('gpt_tiny', 'llama_tiny'):  # decoder only; gpt ties the output layer to the table, llama does not
    forward = 2 * seq * (layers * block + vocab * d) + layers * seq * seq * pair
  elif name == 'bert_tiny':  # encoder, then the MLM transform (d x d) and the tied output at every position
    forward = 2 * seq * (layers * block + d * d + vocab * d) + layers * seq * seq * pair
  else:  # t5: an encoder on `seq` inputs; a decoder on `target` tokens whose cross-attention reads the encoder
    dec_layers = m.resolved_decoder_layers
    encoder = 2 * seq * layers * block + layers * seq * seq * pair
    cross = 2 * (seq + target) * dec_layers * 2 * d * hd  # keys and values of the inputs; queries and output
    decoder = 2 * target * (dec_layers * block + vocab * d) + dec_layers * (target * target + target * seq) * pair
    forward = encoder + cross + decoder
  return 3 * forward


@pytest.mark.parametrize('name', ['gpt_tiny', 'bert_tiny', 't5_tiny', 't5_v1_0_tiny', 'llama_tiny'])
def test_flops_equal_a_count_by_hand(name):
  config = load_config(name, ['model.num_layers=2', 'model.num_decoder_layers=2', f'data.seq_len={SEQ}',
                              f'model.max_len={SEQ}', 'mesh.data=1'])
  assembly = assemble(config, jax.devices()[:1])
  target = assembly.family.target_length(SEQ) if hasattr(assembly.family, 'target_length') else None
  ours = flops_per_sequence(assembly.abstract_params, config.model, SEQ, 'full')
  assert ours == hand_count(name, SEQ, target)


def test_causal_half_counts_half_the_attention_and_mfu_divides_by_the_peak():
  config = load_config('gpt_tiny')
  params, m, seq = assemble(config, jax.devices()[:1]).abstract_params, config.model, config.data.seq_len
  attention_full = 12 * m.num_layers * m.d_model * seq  # per token, forward + backward
  full, half = flops_per_token(params, m, seq, 'full'), flops_per_token(params, m, seq, 'half')
  assert full - half == pytest.approx(attention_full / 2)
  assert mfu(1000.0, half, 4, 1e12) == pytest.approx(1000.0 * half / 4e12)
  assert mfu(1000.0, half, 4, None) is None


def test_a_sliding_window_counts_the_pairs_it_allows():
  """Query i sees min(i + 1, w) keys: summed, w n - w^2 / 2 pairs (the half-square's n^2 / 2 past the window's
  edge, to the O(n) terms both counts leave out); the window does not change the dense square XLA computes."""
  w, seq = 16, 64
  config = load_config('llama_tiny', [f'model.sliding_window={w}', f'data.seq_len={seq}'])
  params, m = assemble(config, jax.devices()[:1]).abstract_params, config.model
  per_pair = 3 * 4 * m.num_heads * m.resolved_head_dim * m.num_layers  # forward + backward, all layers
  windowed = flops_per_sequence(params, m, seq, 'half')
  unwindowed = flops_per_sequence(params, dataclasses.replace(m, sliding_window=0), seq, 'half')
  assert unwindowed - windowed == pytest.approx(per_pair * (seq * seq / 2 - (w * seq - w * w / 2)))
  assert flops_per_sequence(params, m, seq, 'full') == flops_per_sequence(
    params, dataclasses.replace(m, sliding_window=0), seq, 'full')


def test_alternating_global_layers_count_the_full_square_in_theirs():
  w, seq = 16, 64
  config = load_config('gemma2_tiny', [f'model.sliding_window={w}', f'data.seq_len={seq}'])
  params, m = assemble(config, jax.devices()[:1]).abstract_params, config.model
  per_pair = 3 * 4 * m.num_heads * m.resolved_head_dim * m.num_layers
  mixed = flops_per_sequence(params, m, seq, 'half')
  unwindowed = flops_per_sequence(params, dataclasses.replace(m, sliding_window=0, global_every=0), seq, 'half')
  assert unwindowed - mixed == pytest.approx(per_pair / 2 * (seq * seq / 2 - (w * seq - w * w / 2)))  # half local
