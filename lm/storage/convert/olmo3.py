"""OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's layout with sliding-window attention in the layers `layer_types` makes
sliding (three of four as released: `model.global_every=4`), one rotary setting for both kinds of layer."""
from __future__ import annotations

from lm.storage.convert.llama import Architecture, converter
from lm.storage.convert.olmo2 import OLMO2_DEFAULTS

ARCHITECTURE = 'Olmo3ForCausalLM'
OLMO3 = Architecture(ARCHITECTURE, 'olmo3', {**OLMO2_DEFAULTS, 'sliding_window': 4096}, {'attention_bias': False},
                     qk_norm=True, qk_norm_scope='all_heads', norm_position='post_branch', layer_windows=True,
                     global_every=4)

load, save = converter(OLMO3)
