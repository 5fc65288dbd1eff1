#!/usr/bin/env bash
# The FSDP runtime's own cost, after tools/gpu_run.sh's setup (logs in $OUT;
# MULTI_SKIP="name ..." leaves steps out):
#   nofsdp, fsdp-1, fsdp-2  bench/fsdp.lua's per-phase GPU times for the model
#                           (PHASES_MODEL, llama) without FSDP (plain bf16
#                           autocast), under FSDP on one GPU and on two;
#   ncu-plain, ncu-fsdp     ncu over 4 steps of a 2-layer model without FSDP
#                           and under FSDP on one GPU (summaries beside).
set -u
skip=${MULTI_SKIP:-}
TAIL=${TAIL:-5}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_fsdp_cost
export NCCL_NVLS_ENABLE=0
M=${PHASES_MODEL:-llama}
step nofsdp timeout 200 luajit bench/fsdp.lua --model $M --no-fsdp
step fsdp-1 timeout 200 bin/train --nproc-per-node 1 --device cuda bench/fsdp.lua --model $M
step fsdp-2 timeout 200 bin/train --nproc-per-node 2 --device cuda bench/fsdp.lua --model $M
N="ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none"
A="bench/fsdp.lua --model $M --layers 2 --steps 4 --warmup 1 --no-skip"
step ncu-plain timeout 240 $N luajit $A --no-fsdp
step ncu-fsdp timeout 240 $N bin/train --nproc-per-node 1 --device cuda $A
for k in plain fsdp; do
  case " $skip " in *" ncu-$k "*) continue ;; esac
  sed "s/^\[rank [0-9]*\] //" "$out/ncu-$k.log" | grep -v "^==" | grep "^\"" > "$out/ncu-$k.csv"
  luajit tools/ncu_summary.lua "$out/ncu-$k.csv" 4 70 > "$out/summary-$k.txt" 2>&1
  head -n 3 "$out/summary-$k.txt"
done
