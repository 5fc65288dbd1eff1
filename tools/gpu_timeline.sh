#!/usr/bin/env bash
# Two GPUs: where FSDP's communication goes (bench/fsdp.lua --timeline: every
# collective of one step timed on the GPU), the copy-engine all-gathers
# against NCCL's (--nccl-gather), after tools/gpu_run.sh's setup:
# bash tools/gpu_run.sh "bash tools/gpu_timeline.sh". Logs in $OUT;
# MULTI_SKIP="name ..." leaves steps out, MULTI_SPECS picks the spec files.
set -u
skip=${MULTI_SKIP:-}
TAIL=${TAIL:-10}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_timeline
export NCCL_NVLS_ENABLE=0
B="bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua"
step specs env MS_MULTI_OUTPUT=TAP MS_MULTI_SPEC_TIMEOUT=240 \
  MS_MULTI_SPECS="${MULTI_SPECS:-spec/dist_nccl_spec.lua spec/dist_fsdp_rt_multi_spec.lua}" bash tools/run_multi_specs.sh 2
step llama-tl timeout 200 $B --model llama --timeline
step llama-nccl timeout 200 $B --model llama --nccl-gather
step gpt2-tl timeout 150 $B --model gpt2 --timeline
step gpt2-nccl timeout 150 $B --model gpt2 --nccl-gather
