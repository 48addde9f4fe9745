"""KV-cached generation: step logits equal uncached forwards, greedy/EOS/sampling rules, `lm generate`."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import cli
from lm.config import ConfigError, load_config
from lm.data.tokenizers import ByteTokenizer
from lm.jobs.generate import decode_ids, decoding, encode_prompt, generate, generate_text, generate_with_logits
from lm.storage.source import open_model
from lm.models import build_model, init_params
from lm.models.decode import Sampling, decode_batch, init_cache, pad_prompts, sample_logits
from lm.jobs.pretraining import Pretraining
from tests.conftest import built_once

TINY = ['model.d_model=32', 'model.num_layers=2', 'model.num_heads=4', 'model.d_ff=64', 'model.max_len=64',
        'data.seq_len=32']
OVERRIDES = {'gpt_tiny': TINY, 't5_tiny': TINY + ['model.num_decoder_layers=2'],
             'llama_tiny': TINY + ['model.num_kv_heads=2']}
# (preset, overrides): a 3-token window, shorter than the prompts and the generated rows, in every layer (Mistral)
# and in alternate layers (Gemma 2, with both soft-caps)
VARIANTS = {'mistral_window': ('llama_tiny', OVERRIDES['llama_tiny'] + ['model.sliding_window=3']),
            'gemma2_window': ('gemma2_tiny', TINY + ['model.num_kv_heads=2', 'model.num_layers=4',
                                                     'model.sliding_window=3', 'model.attention_scale_dim=8']),
            # GPT-OSS's sinks beside a window: the ring cache's rows and the sink share each softmax
            'sinks_window': ('llama_tiny', OVERRIDES['llama_tiny'] + ['model.sliding_window=3',
                                                                      'model.attention_sinks=true']),
            # DeepSeek's latent attention: the cache holds each token's latent and rotated key part, attended to
            # with the key expansion absorbed into the queries
            'mla': ('llama_tiny', TINY + ['model.num_kv_heads=null', 'model.mla.kv_lora_rank=16',
                                          'model.mla.q_lora_rank=12', 'model.mla.rope_head_dim=4',
                                          'model.mla.v_head_dim=6', 'model.rope.interleaved=true'])}
PROMPTS = [[1, 76, 105, 116, 116, 108, 101, 36], [1, 72], [1, 104, 105, 106, 36]]  # three lengths


@functools.cache
def tiny(preset, scan=True):
  base, overrides = VARIANTS.get(preset, (preset, OVERRIDES.get(preset)))
  cfg = load_config(base, overrides + [f'model.execution.scan_layers={str(scan).lower()}']).model
  model = build_model(cfg)
  return model, nn.unbox(jax.jit(lambda r: init_params(model, r, 16))(jax.random.key(1)))


@functools.cache
def uncached(model):
  return jax.jit(lambda params, *xs: model.apply({'params': params}, *xs))


def reference_logits(model, params, prompt, new):
  """[len(new), vocab]: row t is an uncached forward over the unpadded prefix prompt + new[:t].

  The prefixes form one batch, right-padded (GPT: to 24 tokens, one compile); causal attention keeps
  each prefix's last position blind to the padding after it.
  """
  n = len(new)
  if decoding(model.cfg).shares_context:
    seqs, _ = pad_prompts([prompt + new[:t] for t in range(n)] + [[0] * 24], 0, left=False)
    logits = uncached(model)(params, jnp.asarray(seqs[:n]))
    return np.asarray(logits)[np.arange(n), len(prompt) - 1 + np.arange(n)]
  decoder_inputs, _ = pad_prompts([[0] + new[:t] for t in range(n)], 0, left=False)
  logits = uncached(model)(params, jnp.asarray([prompt] * n), jnp.asarray(decoder_inputs))
  return np.asarray(logits)[np.arange(n), np.arange(n)]


def relative_error(got, want):
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize('scan', [True, False], ids=['scanned', 'unrolled'])
@pytest.mark.parametrize('preset', ['gpt_tiny', pytest.param('t5_tiny', marks=pytest.mark.long(0.2)), 'llama_tiny',
                                    'mistral_window', 'gemma2_window', 'sinks_window', 'mla'])
@pytest.mark.variants
def test_cached_step_logits_match_uncached_forward(preset, scan):
  model, params = tiny(preset, scan)
  rows, logits = generate_with_logits(model, params, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0),
                                      rng=jax.random.key(0))
  assert [len(r) for r in rows] == [8, 8, 8]
  errors = [relative_error(got, reference_logits(model, params, prompt, row))
            for prompt, row, got in zip(PROMPTS, rows, logits)]
  print(f'{preset} scan={scan}: max relative step-logit error {max(errors):.2e}')
  assert max(errors) < 1e-5


def test_latent_attention_caches_less_than_grouped_heads_by_the_ratio_lm_info_prints():
  """The cache's bytes per token of context, counted from the arrays decoding allocates, equal `lm info`'s figure
  (`cache_bytes_per_token`) for latent attention (16 + 4 features a layer) and for grouped-query attention (2
  heads of 8 keys and 8 values), so their ratio is the one `lm info` prints."""
  from lm.assembly.accounting import cache_bytes_per_token
  counted = {}
  for preset in ('mla', 'llama_tiny'):
    model, _ = tiny(preset, False)
    cache = init_cache(model, 2, 40)
    counted[preset] = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
                          if path[-1].key in ('cached_key', 'cached_value')) / (2 * 40)
    assert counted[preset] == cache_bytes_per_token(model.cfg), preset
  assert counted['llama_tiny'] / counted['mla'] == pytest.approx(32 / 20)


@pytest.mark.parametrize('preset, layers, windowed', [('mistral_window', 2, {0, 1}), ('gemma2_window', 4, {0, 2})])
@pytest.mark.variants
def test_windowed_layers_cache_only_their_window(preset, layers, windowed):
  """Windowed layers keep a ring of `window` slots (memory bounded by the window, not the context); global layers
  keep every slot, and so does a scanned stack that has both kinds (its layers share one cache shape)."""
  key = "['decoder']['layers{}']['attention']['cached_key']"
  unrolled = {key.format(f'_{i}'): 3 if i in windowed else 40 for i in range(layers)}
  scanned = {key.format(''): 3 if len(windowed) == layers else 40}
  for scan, want in ((False, unrolled), (True, scanned)):
    model, _ = tiny(preset, scan)
    slots = {jax.tree_util.keystr(path): leaf.shape[-3] for path, leaf
             in jax.tree_util.tree_leaves_with_path(init_cache(model, 2, 40)) if path[-1].key == 'cached_key'}
    assert slots == want


@pytest.mark.parametrize('preset', ['gpt_tiny', pytest.param('t5_tiny', marks=pytest.mark.long(0.2))])
def test_greedy_is_deterministic_argmax_and_stops_at_eos(preset):
  model, params = tiny(preset)
  greedy = generate(model, params, PROMPTS, max_new_tokens=8)
  assert generate(model, params, PROMPTS, max_new_tokens=8) == greedy
  for prompt, row in zip(PROMPTS, greedy):
    assert row == np.argmax(reference_logits(model, params, prompt, row), axis=-1).tolist()

  eos = greedy[0][2]
  stopped = generate(model, params, PROMPTS, max_new_tokens=8, eos_id=eos)
  assert stopped == [row[:row.index(eos) + 1] if eos in row else row for row in greedy]
  # On arrays: padding after EOS, and a lone finished row ends the loop (later steps never run).
  prompt, segment_ids = pad_prompts(PROMPTS[:1], 0, left=preset == 'gpt_tiny')
  out, logits = decode_batch(model, params, prompt, segment_ids, jax.random.key(0), decoding=decoding(model.cfg),
                             max_new_tokens=8, sampling=Sampling(), eos_id=eos, pad_id=0, decoder_start_id=0,
                             keep_logits=True)
  end = greedy[0].index(eos) + 1
  assert np.asarray(out[0]).tolist() == greedy[0][:end] + [0] * (8 - end)
  assert np.all(np.asarray(logits)[0, end:] == 0) and np.all(np.asarray(logits)[0, :end] != 0)


@pytest.mark.long(0.2)
def test_top_k_one_and_tiny_top_p_equal_greedy_and_sampling_is_reproducible():
  model, params = tiny('gpt_tiny')
  run = functools.partial(generate, model, params, PROMPTS, max_new_tokens=8)
  greedy = run()
  assert run(sampling=Sampling(1.0, top_k=1), rng=jax.random.key(5)) == greedy
  assert run(sampling=Sampling(1.0, top_p=1e-6), rng=jax.random.key(5)) == greedy

  sample = functools.partial(generate_with_logits, model, params, PROMPTS, max_new_tokens=8,
                             sampling=Sampling(2.0, top_k=5))
  rows, logits = sample(rng=jax.random.key(7))
  assert sample(rng=jax.random.key(7))[0] == rows and sample(rng=jax.random.key(8))[0] != rows
  for row, step_logits in zip(rows, logits):
    top5 = np.argsort(step_logits, axis=-1)[:, -5:]
    assert all(token in allowed for token, allowed in zip(row, top5))


def test_sample_logits_keeps_top_k_and_nucleus_sets():
  logits = jnp.log(jnp.tile(jnp.array([[0.05, 0.5, 0.15, 0.3]]), (4000, 1)))
  draw = lambda sampling: np.asarray(sample_logits(logits, jax.random.key(0), sampling))
  assert set(draw(Sampling())) == {1}
  assert set(draw(Sampling(1.0, top_k=2))) == {1, 3}
  nucleus = draw(Sampling(1.0, top_p=0.75))  # 0.5 + 0.3 reaches 0.75
  assert set(nucleus) == {1, 3} and abs(np.mean(nucleus == 1) - 0.5 / 0.8) < 0.03
  assert set(draw(Sampling(1.0, top_p=0.85))) == {1, 2, 3}
  assert set(draw(Sampling(1.0))) == {0, 1, 2, 3}


def sampling_reference(logits, temperature, top_k=None, top_p=None):
  """float64 NumPy: softmax(logits / T) over the top-k tokens, then the smallest likeliest set whose mass
  reaches top_p, renormalised."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z)
  keep = np.zeros(len(z), bool)
  keep[order[:top_k or len(z)]] = True
  probs = np.where(keep, np.exp(z - z.max()), 0.0)
  probs /= probs.sum()
  if top_p is not None:
    ranked = probs[order]
    above = np.cumsum(ranked) - ranked
    nucleus = np.zeros(len(z), bool)
    nucleus[order[above < top_p]] = True
    probs = np.where(nucleus, probs, 0.0)
    probs /= probs.sum()
  return probs


@pytest.mark.parametrize('temperature, top_k, top_p', [
  (0.5, None, None), (2.0, None, None), (2.0, 4, None), (0.7, None, 0.8), (1.5, 5, 0.7),
])
@pytest.mark.variants
def test_sampled_frequencies_follow_the_tempered_truncated_softmax(temperature, top_k, top_p):
  """20,000 draws against the float64 reference: a chi-square test over its support (p > 1e-3; the seed is
  fixed, so the outcome is too) and no draw outside it."""
  from scipy.stats import chisquare
  logits = np.array([2.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.5])
  n = 20_000
  draws = np.asarray(sample_logits(jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)), jax.random.key(0),
                                   Sampling(temperature, top_k, top_p)))
  want = sampling_reference(logits, temperature, top_k, top_p)
  counts = np.bincount(draws, minlength=len(logits))
  assert np.all(counts[want == 0] == 0)
  support = want > 0
  assert chisquare(counts[support], n * want[support]).pvalue > 1e-3
  if temperature != 1:  # the temperature matters: the untempered distribution is rejected
    untempered = sampling_reference(logits, 1.0, top_k, top_p)
    if np.all(untempered[support] > 0) and np.all(untempered[~support] == 0):
      assert chisquare(counts[support], n * untempered[support]).pvalue < 1e-6


def test_t5_prompts_name_sentinels_and_outputs_show_them():
  config = load_config('t5_tiny', OVERRIDES['t5_tiny'])
  tokenizer = ByteTokenizer()
  top = tokenizer.vocab_size + 99  # T5's convention: <extra_id_N> is V + 99 - N above a plain vocabulary of V
  assert encode_prompt(config, tokenizer, 'a<extra_id_0>b<extra_id_1>') == [101, top, 102, top - 1, 2]
  assert decode_ids(config, tokenizer, [top, 101, 102, top - 2, 2]) == '<extra_id_0>ab<extra_id_2>'


@pytest.fixture(scope='module')
def trained_run():
  """A 2-step gpt_tiny run (width 32) with a checkpoint."""
  def build(root):
    config = load_config('gpt_tiny', TINY + ['train.steps=2', 'train.global_batch=8', 'train.eval_batches=0',
                                             'train.progress=false', 'mesh.data=1', f'train.run_dir={root}/run'])
    Pretraining(config, jax.devices()[:1]).run()
  return built_once('generate_run', build) / 'run'


@pytest.mark.long(0.2)
def test_cli_prints_continuations(trained_run, capsys):
  argv = ['generate', '--run', str(trained_run), '--prompt', 'def ', '--prompt', 'The', '--max-new-tokens', '12']
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  _, assembly, params = open_model(trained_run)
  config = assembly.config
  texts = generate_text(config, params, ['def ', 'The'], max_new_tokens=12)
  assert out == f"--- 'def '\n{texts[0]}\n--- 'The'\n{texts[1]}\n"
  assert any(texts)
  sampled = argv + ['--temperature', '0.8', '--top-k', '20', '--top-p', '0.9', '--seed', '3']
  assert cli.main(sampled) == 0 and cli.main(sampled) == 0
  first, second = capsys.readouterr().out.split("--- 'def '")[1:]
  assert first == second
  # The flags reach the sampler: the output is the library's with the same settings, and not with any one
  # of them left at its default.
  texts = lambda *settings: generate_text(config, params, ['def ', 'The'], max_new_tokens=12,
                                          sampling=Sampling(*settings), rng=jax.random.key(3))
  assert first == f"\n{texts(0.8, 20, 0.9)[0]}\n--- 'The'\n{texts(0.8, 20, 0.9)[1]}\n"
  for other in [(0.05, 20, 0.9), (0.8, None, 0.9), (0.8, 20, None)]:  # a tiny model: logits near uniform
    assert texts(*other) != texts(0.8, 20, 0.9), other


@pytest.mark.parametrize('argv, message', [
  (['--prompt', ''], 'prompt is empty'),
  (['--prompt', 'abc', '--max-new-tokens', '61'], 'exceeds the position table model.max_len=64'),
  (['--prompt', 'abc', '--top-k', '0'], 'top_k=0'),
  (['--prompt', 'abc', '--temperature', '-1'], 'temperature=-1.0'),
])
def test_cli_rejects_bad_input(trained_run, capsys, argv, message):
  assert cli.main(['generate', '--run', str(trained_run)] + argv) == 2
  err = capsys.readouterr().err
  assert err.startswith('lm: error:') and message in err and err.count('\n') == 1


def test_runs_without_checkpoints_and_other_misuse_are_config_errors(tmp_path, trained_run, capsys):
  assert cli.main(['generate', '--run', str(tmp_path), '--prompt', 'x']) == 2
  assert 'neither a run directory' in capsys.readouterr().err
  (tmp_path / 'config.yaml').write_text((trained_run / 'config.yaml').read_text())
  with pytest.raises(ConfigError, match='holds no checkpoint'):
    open_model(tmp_path)
  model, params = tiny('gpt_tiny')
  with pytest.raises(ConfigError, match='explicit rng'):
    generate(model, params, PROMPTS, max_new_tokens=2, sampling=Sampling(1.0))
  with pytest.raises(ConfigError, match='at least one token'):
    generate(model, params, [[1], []], max_new_tokens=2)
  with pytest.raises(ConfigError, match='top_p'):
    Sampling(1.0, top_p=1.5)
  bert = build_model(load_config('bert_tiny').model)
  with pytest.raises(ConfigError, match="model.family='bert' cannot generate text; generation needs one of: "
                                       "gpt, t5, llama"):
    generate(bert, {}, PROMPTS, max_new_tokens=2)
