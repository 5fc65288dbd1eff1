"""bench/torch_llama_float8.py: the PyTorch side of the float8 rows.

Runs ../shared/bench/torch_llama.py (the 1.25B Llama of Hugging Face
transformers, bf16 autocast, fused AdamW, its own timing and RESULT line)
with every nn.Linear but the LM head converted by torchao's
convert_to_float8_training (Float8LinearConfig.from_recipe_name of
FLOAT8_RECIPE: tensorwise by default, dynamic scaling, e4m3 input and
weight, e5m2 output gradient; or rowwise, rowwise_with_gw_hp; torchtitan
keeps the output layer in bf16 too), unless FLOAT8=0.

With transformers 5, the model's forward makes a key/value cache
(config.use_cache) even in training, and torch.compile of each block then
recompiles per layer until its limit (8) and runs the other blocks eager;
this wrapper sets use_cache = False (USE_CACHE=1 keeps the shared script's
behaviour), so that every block is compiled. Beside
`bench/fsdp.lua --model llama --no-fsdp --float8` on the same GPU:

  python3 bench/torch_llama_float8.py DIR_OF_torch_llama.py --compile blocks [--batch 4]

torchao comes from PYTHONPATH (a wheel carried to the GPU host).
"""
import os
import sys

sys.path.insert(0, sys.argv.pop(1))
from transformers.models.llama import modeling_llama  # noqa: E402

FLOAT8 = os.environ.get("FLOAT8", "1") == "1"
RECIPE = os.environ.get("FLOAT8_RECIPE", "tensorwise")  # or rowwise, rowwise_with_gw_hp
USE_CACHE = os.environ.get("USE_CACHE", "0") == "1"
init = modeling_llama.LlamaForCausalLM.__init__


def patched_init(self, cfg, *args, **kwargs):
    if not USE_CACHE:
        cfg.use_cache = False
    init(self, cfg, *args, **kwargs)
    if FLOAT8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(RECIPE)
        convert_to_float8_training(self, config=config, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    n = sum(1 for m in self.modules() if type(m).__name__ == "Float8Linear")
    print(f"torchao float8 ({RECIPE if FLOAT8 else 'off'}): {n} Float8Linear modules; use_cache {cfg.use_cache}",
          flush=True)


modeling_llama.LlamaForCausalLM.__init__ = patched_init

import torch_llama as ref  # noqa: E402

ref.main()
