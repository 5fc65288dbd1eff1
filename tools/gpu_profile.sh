#!/usr/bin/env bash
# Where a model's step goes on one GPU (after tools/gpu_run.sh's setup):
#   PROFILE_MODEL=models/llama.lua PROFILE_ARGS="--preset llama-1.25b --batch 4 --seq 2048" \
#     bash tools/gpu_run.sh "bash tools/gpu_profile.sh"
# bench/profile_step.lua with and without module hooks, then ncu over a
# 2-layer step (kernel times at the real clocks, caches as they are).
set -u
skip=${PROFILE_SKIP:-}
TAIL=${TAIL:-40}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_profile
M=${PROFILE_MODEL:-models/llama.lua}
A=${PROFILE_ARGS:---preset llama-1.25b --batch 4 --seq 2048}
step total luajit bench/profile_step.lua $M $A --steps 5 --hooks 0
step modules luajit bench/profile_step.lua $M $A --steps 3 --hooks 1
if command -v ncu >/dev/null 2>&1; then
  step ncu timeout 300 ncu --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \
    luajit bench/profile_step.lua $M $A --steps 1 --hooks 0 --layers 2
  case " $skip " in *" ncu "*) ;; *)
    grep -v '^==' "$out/ncu.log" > "$out/ncu.csv"
    luajit tools/ncu_summary.lua "$out/ncu.csv" 3 60 > "$out/ncu_summary.txt" 2>&1
    head -n 65 "$out/ncu_summary.txt" ;;
  esac
else
  echo "no ncu on this host"
fi
