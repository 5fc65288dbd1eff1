#!/usr/bin/env bash
# The FSDP runtime's kernels against the plain model's: ncu over 4 steps of a
# 2-layer Llama (bench/fsdp.lua) without FSDP and under FSDP on one GPU
# (after tools/gpu_run.sh's setup). Summaries in $OUT.
set -u
skip=${MULTI_SKIP:-}
TAIL=${TAIL:-3}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_fsdp_ncu
export NCCL_NVLS_ENABLE=0
M=${NCU_MODEL:-llama}
N="ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none"
A="bench/fsdp.lua --model $M --layers 2 --steps 4 --warmup 1 --no-skip"
step ncu-plain timeout 240 $N luajit $A --no-fsdp
step ncu-fsdp timeout 240 $N bin/train --nproc-per-node 1 --device cuda $A
for k in plain fsdp; do
  sed "s/^\[rank [0-9]*\] //" "$out/ncu-$k.log" | grep -v "^==" | grep "^\"" > "$out/ncu-$k.csv"
  luajit tools/ncu_summary.lua "$out/ncu-$k.csv" 4 70 > "$out/summary-$k.txt" 2>&1
  head -n 3 "$out/summary-$k.txt"
done
