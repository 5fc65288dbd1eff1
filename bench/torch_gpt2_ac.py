"""bench/torch_gpt2_ac.py: the PyTorch side of the activation-checkpointing rows.

Runs ../shared/bench/torch_gpt2.py (GPT-2 124M, bf16 autocast, fused AdamW,
its own timing and RESULT line) with every Block's forward wrapped in
torch.utils.checkpoint.checkpoint (non-reentrant), torchtitan's full mode,
unless AC=0. Beside bench/gpt2_124m.lua --ac full on the same GPU:

  python3 bench/torch_gpt2_ac.py DIR_OF_torch_gpt2.py --compile none|blocks [--batch 32]
"""
import os
import sys

sys.path.insert(0, sys.argv.pop(1))
import torch.utils.checkpoint as cp  # noqa: E402
import torch_gpt2 as ref  # noqa: E402

if os.environ.get("AC", "1") == "1":
    block_forward = ref.Block.forward

    def checkpointed(self, x):
        return cp.checkpoint(block_forward, self, x, use_reentrant=False)

    ref.Block.forward = checkpointed

ref.main()
