#!/usr/bin/env bash
# The FSDP runtime's own cost: bench/fsdp.lua's per-phase GPU times for the
# Llama without FSDP (plain bf16 autocast), under FSDP on one GPU and on two
# (after tools/gpu_run.sh's setup). Logs in $OUT.
set -u
skip=${MULTI_SKIP:-}
TAIL=${TAIL:-5}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_fsdp_phases
export NCCL_NVLS_ENABLE=0
M=${PHASES_MODEL:-llama}
step nofsdp timeout 200 luajit bench/fsdp.lua --model $M --no-fsdp
step fsdp-1 timeout 200 bin/train --nproc-per-node 1 --device cuda bench/fsdp.lua --model $M
step fsdp-2 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model $M
