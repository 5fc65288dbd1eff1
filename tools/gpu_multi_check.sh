#!/usr/bin/env bash
# A session's two-GPU run in one call on the lent host (after tools/gpu_run.sh's
# setup: bash tools/gpu_run.sh "bash tools/gpu_multi_check.sh"): the #multi
# specs named in MULTI_SPECS (default: every one), bench/fsdp.lua for GPT-2
# 124M and the 1.25B Llama on 1 and 2 GPUs, and PyTorch FSDP2 (per-block
# torch.compile) under torchrun for both. Logs in $OUT; MULTI_SKIP="torch
# llama" leaves parts out.
set -u
skip=${MULTI_SKIP:-}
TAIL=${TAIL:-8}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_multi_check
export NCCL_NVLS_ENABLE=0
step specs env MS_MULTI_OUTPUT=TAP MS_MULTI_SPEC_TIMEOUT=240 MS_MULTI_SPECS="${MULTI_SPECS:-spec/dist_*_spec.lua}" \
  bash tools/run_multi_specs.sh 2
step gpt2-2 timeout 150 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model gpt2
step llama-2 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama
# the LM head unit against the head in the root, and the root's prefetch at
# the optimizer step's end (docs/fsdp.md, "The LM head")
step llama-2-head-in-root timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --head-in-root
step llama-2-prefetch-root timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --prefetch-root
# float8 under FSDP on two GPUs (docs/float8.md)
step llama-2-f8 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --float8
step llama-2-f8g timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --float8 --float8-gather
step llama-2-f8r timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --float8 --recipe rowwise
# float8 with tensor parallelism: each shard's scales, and the TP group's
# (docs/float8.md, "With tensor parallelism")
step llama-2-tp timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp
step llama-2-tp-f8 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --float8
step llama-2-tp-f8grp timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --float8 --tp-scales group
step llama-2-sp-f8 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --sp --float8
step llama-2-tp-f8r timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --float8 --recipe rowwise
step llama-2-tp-f8rgrp timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --float8 --recipe rowwise --tp-scales group
step llama-2-sp-f8grp timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model llama --tp --sp --float8 --tp-scales group
step gpt2-1 timeout 120 bin/train --nproc-per-node 1 --device cuda bench/fsdp.lua --model gpt2
step llama-1 timeout 150 bin/train --nproc-per-node 1 --device cuda bench/fsdp.lua --model llama
. .carry/device/gpu-env.sh .debs >/dev/null 2>&1
step torch timeout 200 torchrun --nproc_per_node 2 .carry/bench/torch_gpt2.py --compile blocks
step torch-llama timeout 240 torchrun --nproc_per_node 2 .carry/bench/torch_llama.py --compile blocks
