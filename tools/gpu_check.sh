#!/usr/bin/env bash
# The first GPU run of a session, in one call on the lent host (after
# tools/gpu_run.sh's setup: run it as  bash tools/gpu_run.sh "bash tools/gpu_check.sh"):
#   make test-gpu, bench/attention.lua, bench/gpt2_124m.lua --ablate 1,
#   bench/flce.lua, and the ncu profile of a 2-layer B=8 step (when ncu is
#   there). Each log goes to $OUT (or /tmp/gpu_check), its tail to stdout.
#   GPU_CHECK_SKIP="flce ncu" leaves parts out.
set -u
skip=${GPU_CHECK_SKIP:-}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_check
step test-gpu make test-gpu
step attention luajit bench/attention.lua
step gpt2 luajit bench/gpt2_124m.lua --ablate 1
step flce luajit bench/flce.lua
if command -v ncu >/dev/null 2>&1; then
  step ncu timeout 180 ncu --csv --metrics gpu__time_duration.sum luajit bench/profile_step.lua \
    --batch 8 --steps 1 --hooks 0 --layers 2
  case " $skip " in *" ncu "*) ;; *)
    grep -v '^==' "$out/ncu.log" > "$out/ncu.csv"
    luajit tools/ncu_summary.lua "$out/ncu.csv" 3 40 > "$out/ncu_summary.txt" 2>&1
    head -n 45 "$out/ncu_summary.txt" ;;
  esac
fi
