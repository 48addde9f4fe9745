"""Init scale in one place (`lm.models.parametrization.Init`): the standard init of a converted model's config
reproduces the reference implementation's own init, param by param (empirical std of a random HF model read
through our converter vs ours): GPT-2's N(0, 0.02) with residual projections / sqrt(2 layers), T5's fan-in init of
the stack and its unit-scale embedding (HF's `_init_weights`)."""
import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
import transformers

from lm.models import init_params
from lm.storage.convert.hf import load_hf

MODELS = {
  'gpt2': lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
    vocab_size=512, n_embd=128, n_layer=3, n_head=4, n_positions=64)),
  # gated MLP, untied output layer (whose init, and the relative position table's, follow Mesh-TF: not compared)
  't5': lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
    vocab_size=256, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, feed_forward_proj='gated-gelu',
    tie_word_embeddings=False)),
}
COMPARED = {'gpt2': lambda path: True, 't5': lambda path: 'layers_' in path or 'token_embed' in path}


@pytest.mark.parametrize('name', MODELS)
@pytest.mark.variants
def test_standard_init_matches_the_reference_implementation(name, tmp_path):
  torch.manual_seed(0)
  MODELS[name]().save_pretrained(tmp_path)
  model, theirs = load_hf(tmp_path)
  ours = nn.unbox(init_params(model, jax.random.key(0), 8))
  compared = 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
    where = jax.tree_util.keystr(path)
    if b.size < 4096 or not np.std(b) or not COMPARED[name](where):  # biases, norms: constants
      continue
    np.testing.assert_allclose(np.std(np.asarray(a)), np.std(b), rtol=0.05, err_msg=where)
    compared += 1
  assert compared >= {'gpt2': 10, 't5': 20}[name]
