"""The scaling-table presets: every one loads, and parameter counts match the published figures."""
import pytest

from lm.assembly.accounting import count_params
from lm.config import CONFIG_DIR, load_config
from lm.models import abstract_params, build_model

# preset: (published parameters, relative tolerance, source)
PUBLISHED = {
  'transformer_base': (65e6, 0.03, 'Vaswani et al. 2017, Table 3 (rounded)'),
  'transformer_big': (213e6, 0.02, 'Vaswani et al. 2017, Table 3'),
  'bert_base': (110e6, 0.02, 'Devlin et al. 2019'),
  'bert_large': (340e6, 0.02, 'Devlin et al. 2019'),
  'xlnet_large': (340e6, 0.02, 'Yang et al. 2019 (the size of BERT-Large)'),
  'roberta_large': (355e6, 0.02, 'Liu et al. 2019'),
  'gpt2_xl': (1542e6, 0.02, 'Radford et al. 2019, Table 2'),
  'megatron_8b': (8.3e9, 0.02, 'Shoeybi et al. 2019, Table 2'),
  'turing_nlg_17b': (17e9, 0.02, 'Microsoft Turing-NLG'),
  'gpt3_175b': (175e9, 0.02, 'Brown et al. 2020, Table 2.1'),
  # The GPT-3 ladder and the T5 sizes, as published (T5-Large's 770M is the paper's rounding of 738M).
  'gpt3_125m': (125e6, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_350m': (350e6, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_760m': (760e6, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_1_3b': (1.3e9, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_2_7b': (2.7e9, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_6_7b': (6.7e9, 0.02, 'Brown et al. 2020, Table 2.1'),
  'gpt3_13b': (13e9, 0.02, 'Brown et al. 2020, Table 2.1'),
  't5_small': (60e6, 0.02, 'Raffel et al. 2020'),
  't5_base': (220e6, 0.02, 'Raffel et al. 2020'),
  't5_large': (770e6, 0.05, 'Raffel et al. 2020 (738M as released)'),
  't5_3b': (2.85e9, 0.02, 'released checkpoint (the paper says 3B)'),
  't5_11b': (11.3e9, 0.02, 'released checkpoint (the paper says 11B)'),
  'deepseek_v3_671b': (671e9, 0.001, 'DeepSeek-AI 2024, arXiv:2412.19437 (671B, multi-token prediction apart)'),
  'kimi_k2_1t': (1.04e12, 0.02, 'Moonshot AI 2025, arXiv:2507.20534 (1.04T)'),
  't5_v1_1_small': (77e6, 0.02, 'released checkpoint'),
  't5_v1_1_base': (248e6, 0.02, 'released checkpoint'),
  't5_v1_1_large': (783e6, 0.02, 'released checkpoint'),
  't5_v1_1_xl': (2.85e9, 0.02, 'released checkpoint'),
  't5_v1_1_xxl': (11.3e9, 0.02, 'released checkpoint'),
  'gpt2_small': (124e6, 0.02, 'released checkpoint (the paper says 117M)'),
  'gpt2_medium': (355e6, 0.02, 'released checkpoint (the paper says 345M)'),
  'gpt2_large': (774e6, 0.02, 'released checkpoint (the paper says 762M)'),
  'llama2_7b': (6.74e9, 0.01, 'Touvron et al. 2023 (Llama 2), released checkpoint'),
  'llama2_13b': (13.02e9, 0.01, 'Touvron et al. 2023 (Llama 2), released checkpoint'),
  'llama2_70b': (68.98e9, 0.01, 'Touvron et al. 2023 (Llama 2), released checkpoint'),
}


def params_of(name: str) -> int:
  config = load_config(name)
  return count_params(abstract_params(build_model(config.model)))['total']


@pytest.mark.parametrize('name', sorted(PUBLISHED))
def test_parameter_count_matches_the_published_figure(name):
  published, tolerance, source = PUBLISHED[name]
  ours = params_of(name)
  assert abs(ours / published - 1) <= tolerance, f'{name}: {ours:,} vs {published:,.0f} ({source})'


def test_every_preset_loads_and_validates():
  names = sorted(p.stem for p in CONFIG_DIR.glob('*.yaml'))
  assert set(PUBLISHED) <= set(names)
  for name in names:
    load_config(name)


def test_ladder_presets_carry_their_published_shapes():
  """Context lengths and MLP widths as published: GPT-3 2048 tokens and 4d, T5 512 inputs."""
  for name in [n for n in PUBLISHED if n.startswith('gpt3_')]:
    c = load_config(name)
    assert c.data.seq_len == c.model.max_len == 2048 and c.model.resolved_d_ff == 4 * c.model.d_model
  assert load_config('gpt2_xl').data.seq_len == 1024
  t5 = {'t5_3b': (16384, 32, 128), 't5_11b': (65536, 128, 128), 't5_v1_1_xxl': (10240, 64, 64)}
  for name, (d_ff, heads, head_dim) in t5.items():
    m = load_config(name).model
    assert (m.d_ff, m.num_heads, m.head_dim, m.vocab_size) == (d_ff, heads, head_dim, 32128)


# preset, overrides to the released vocabulary, transformers class and config of the released checkpoint, its
# parameter count as transformers reports it, and what that count includes.
RELEASED = {
  'gpt2_small': (['model.vocab_size=50257'], 'GPT2LMHeadModel', dict(), 124_439_808,
                 'gpt2: embeddings (the output layer tied to them) and 12 blocks; the preset pads the vocabulary '
                 'to 50304'),
  'bert_base': ([], 'BertForPreTraining', dict(), 110_106_428,
                'bert-base-uncased with its pretraining heads: BertModel (109,482,240, with the pooler) plus the '
                'MLM transform, norm and output bias (622,650) and NSP (1,538)'),
  't5_small': ([], 'T5ForConditionalGeneration', dict(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6,
                                                        num_heads=8, d_kv=64), 60_506_624,
               't5-small: the shared embedding (tied output), encoder and decoder'),
  'llama2_7b': ([], 'LlamaForCausalLM', dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                             num_hidden_layers=32, num_attention_heads=32), 6_738_415_616,
                'Llama-2-7b: embeddings, 32 blocks, final norm and the untied output layer'),
  # today's open models: embeddings, blocks (Qwen2.5's q/k/v biases, Qwen3's query/key norms), final norm and
  # the untied output layer
  'llama3_8b': ([], 'LlamaForCausalLM', dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                8_030_261_248, 'Meta-Llama-3-8B'),
  'llama3_70b': ([], 'LlamaForCausalLM', dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
                 70_553_706_496, 'Meta-Llama-3-70B'),
  'llama3_1_405b': ([], 'LlamaForCausalLM', dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                                                 num_hidden_layers=126, num_attention_heads=128,
                                                 num_key_value_heads=8), 405_853_388_800, 'Meta-Llama-3.1-405B'),
  'mistral_7b': ([], 'MistralForCausalLM', dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                 7_248_023_552, 'Mistral-7B-v0.3'),
  'qwen2_5_7b': ([], 'Qwen2ForCausalLM', dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
                 7_615_616_512, 'Qwen2.5-7B'),
  'qwen3_8b': ([], 'Qwen3ForCausalLM', dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                            head_dim=128), 8_190_735_360, 'Qwen3-8B-Base'),
  'gemma2_9b': ([], 'Gemma2ForCausalLM', dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                              num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                              head_dim=256), 9_241_705_984, 'gemma-2-9b (tied output)'),
  # the Pythia suite (EleutherAI/pythia-*): GPT-NeoX blocks with biases, untied embed_out, a quarter of each head
  # rotating
  'pythia_70m': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6,
                                          num_attention_heads=8, intermediate_size=2048,
                                          rotary_pct=0.25), 70_426_624, 'pythia-70m'),
  'pythia_160m': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12,
                                          num_attention_heads=12, intermediate_size=3072,
                                          rotary_pct=0.25), 162_322_944, 'pythia-160m'),
  'pythia_410m': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=24,
                                          num_attention_heads=16, intermediate_size=4096,
                                          rotary_pct=0.25), 405_334_016, 'pythia-410m'),
  'pythia_1b': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=16,
                                          num_attention_heads=8, intermediate_size=8192,
                                          rotary_pct=0.25), 1_011_781_632, 'pythia-1b'),
  'pythia_1_4b': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=24,
                                          num_attention_heads=16, intermediate_size=8192,
                                          rotary_pct=0.25), 1_414_647_808, 'pythia-1.4b'),
  'pythia_2_8b': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50304, hidden_size=2560, num_hidden_layers=32,
                                          num_attention_heads=32, intermediate_size=10240,
                                          rotary_pct=0.25), 2_775_208_960, 'pythia-2.8b'),
  'pythia_6_9b': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50432, hidden_size=4096, num_hidden_layers=32,
                                          num_attention_heads=32, intermediate_size=16384,
                                          rotary_pct=0.25), 6_857_302_016, 'pythia-6.9b'),
  'pythia_12b': ([], 'GPTNeoXForCausalLM', dict(vocab_size=50688, hidden_size=5120, num_hidden_layers=36,
                                          num_attention_heads=40, intermediate_size=20480,
                                          rotary_pct=0.25), 11_846_072_320, 'pythia-12b'),
  # OLMo 2 (allenai/OLMo-2-*): norms after each branch and over all heads' queries and keys, untied output
  'olmo2_1b': ([], 'Olmo2ForCausalLM', dict(vocab_size=100352, hidden_size=2048, num_hidden_layers=16,
                                        num_attention_heads=16, intermediate_size=8192), 1_484_916_736,
               'OLMo-2-0425-1B'),
  'olmo2_7b': ([], 'Olmo2ForCausalLM', dict(vocab_size=100352, hidden_size=4096, num_hidden_layers=32,
                                        num_attention_heads=32, intermediate_size=11008), 7_298_617_344,
               'OLMo-2-1124-7B'),
  'olmo2_13b': ([], 'Olmo2ForCausalLM', dict(vocab_size=100352, hidden_size=5120, num_hidden_layers=40,
                                        num_attention_heads=40, intermediate_size=13824), 13_716_198_400,
               'OLMo-2-1124-13B'),
  'gemma2_27b': ([], 'Gemma2ForCausalLM', dict(vocab_size=256000, hidden_size=4608, intermediate_size=36864,
                                               num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16,
                                               head_dim=128), 27_227_128_320, 'gemma-2-27b (tied output)'),
  'gemma3_1b': ([], 'Gemma3ForCausalLM', dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                              num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=256), 999_885_952, 'gemma-3-1b-pt (tied output)'),
  # Mixture-of-experts releases: every expert counted
  'mixtral_8x7b': ([], 'MixtralForCausalLM', {}, 46_702_792_704, 'Mixtral-8x7B-v0.1'),
  'qwen3_30b_a3b': ([], 'Qwen3MoeForCausalLM', dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                                    head_dim=128, num_experts=128, num_experts_per_tok=8,
                                                    moe_intermediate_size=768), 30_532_122_624, 'Qwen3-30B-A3B-Base'),
  'olmoe_1b_7b': ([], 'OlmoeForCausalLM', dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                               num_hidden_layers=16, num_attention_heads=16, num_experts=64,
                                               num_experts_per_tok=8), 6_919_161_856, 'OLMoE-1B-7B-0924'),
  # GPT-OSS: the model card's (arXiv:2508.10925, Table 1) 20.91B and 116.83B to the parameter
  'gpt_oss_20b': ([], 'GptOssForCausalLM', dict(num_hidden_layers=24, num_local_experts=32), 20_914_757_184,
                  'gpt-oss-20b'),
  'gpt_oss_120b': ([], 'GptOssForCausalLM', {}, 116_829_156_672, 'gpt-oss-120b'),
  # DeepSeek-V3: transformers' defaults are the release; 671,026,404,352 without its multi-token prediction layer
  'deepseek_v3_671b': ([], 'DeepseekV3ForCausalLM', {}, 671_026_404_352, 'DeepSeek-V3-Base (main model)'),
}
CONFIG_CLASSES = {'Gemma3ForCausalLM': 'Gemma3TextConfig'}
# Gemma 3's larger releases are multimodal: their language models' blocks against the report's Table 1 (millions of
# non-embedding parameters; Gemma Team 2025, arXiv:2503.19786), and the whole language model against transformers'
GEMMA3 = {'gemma3_4b': (dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                             num_key_value_heads=4), 3209e6),
          'gemma3_12b': (dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                              num_key_value_heads=8), 10759e6),
          'gemma3_27b': (dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                              num_key_value_heads=16, head_dim=128), 25600e6)}
# Their active parameters (k of E experts), as the releases state them; OLMoE's "1B active" is 1.28B
ACTIVE = {'mixtral_8x7b': 12_879_925_248, 'qwen3_30b_a3b': 3_353_032_704, 'olmoe_1b_7b': 1_282_017_280}
# GPT-OSS's model card counts the active ones outside the embedding (its output layer in): 3.61B and 5.13B
ACTIVE_NON_EMBEDDING = {'gpt_oss_20b': 3.61e9, 'gpt_oss_120b': 5.13e9}
# DeepSeek-V3's 37B and Kimi K2's 32B activated, which the reports round down: between the figure and the next
ACTIVE_ROUNDED = {'deepseek_v3_671b': 37e9, 'kimi_k2_1t': 32e9}


@pytest.mark.parametrize('name', sorted(RELEASED))
def test_parameter_count_equals_the_released_checkpoint_exactly(name):
  """Ours, transformers' count of the same architecture (built on the meta device: no memory), and the released
  checkpoint's published count agree to the parameter."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  overrides, cls, kwargs, released, _ = RELEASED[name]
  config_cls = getattr(transformers, CONFIG_CLASSES.get(cls) or cls.replace('LMHeadModel', 'Config').replace(
    'ForPreTraining', 'Config').replace('ForConditionalGeneration', 'Config').replace('ForCausalLM', 'Config'))
  with torch.device('meta'):
    theirs = getattr(transformers, cls)(config_cls(**kwargs)).num_parameters()
  ours = count_params(abstract_params(build_model(load_config(name, overrides).model)))['total']
  assert ours == theirs == released, (ours, theirs, released)


@pytest.mark.parametrize('name', sorted(GEMMA3))
def test_gemma3_language_models_equal_transformers_and_the_reports_table(name):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  kwargs, published = GEMMA3[name]
  with torch.device('meta'):
    theirs = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(vocab_size=262208, **kwargs)).num_parameters()
  ours = count_params(abstract_params(build_model(load_config(name).model)))
  assert ours['total'] == theirs
  assert abs(ours['non_embedding'] / published - 1) < 5e-4, ours  # the table rounds to millions


@pytest.mark.parametrize('name', sorted(ACTIVE) + sorted(ACTIVE_NON_EMBEDDING) + sorted(ACTIVE_ROUNDED))
def test_active_parameters_of_the_moe_releases(name):
  config = load_config(name).model
  counts = count_params(abstract_params(build_model(config)), config)
  if name in ACTIVE:
    assert counts['active'] == ACTIVE[name]
  elif name in ACTIVE_ROUNDED:
    assert ACTIVE_ROUNDED[name] <= counts['active'] < ACTIVE_ROUNDED[name] + 1e9, counts
  else:  # the card rounds to 10M
    assert abs(counts['active_non_embedding'] - ACTIVE_NON_EMBEDDING[name]) < 5e6, counts
