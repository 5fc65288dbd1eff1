#!/usr/bin/env bash
# Runs the #multi specs (spec/dist_*_spec.lua files tagged #multi: NCCL, one
# GPU per rank) with NP ranks started by moonshard.launch as bin/train
# --device cuda starts them, and prints "N passed, N failed" over every
# rank's outcome.
#   tools/run_multi_specs.sh [NP]          (default 2; on a host with NP GPUs)
# Each rank's busted output is in a log; the logs are printed on a failure.
set -u
cd "$(dirname "$0")/.."
export LUA_PATH="./lua/?.lua;./lua/?/init.lua;./?.lua;${LUA_PATH:-;}"
busted_bin=${BUSTED_LUA:-$(command -v busted || echo /usr/bin/busted)}
np=${1:-2}
# MS_MULTI_SPECS: spec files to run instead of every #multi one;
# MS_MULTI_OUTPUT: busted's output handler (TAP shows each test as it ends,
# and stdbuf keeps the lines of a rank that dies)
specs=$(ls ${MS_MULTI_SPECS:-spec/dist_*_spec.lua} 2>/dev/null | xargs grep -l '#multi' 2>/dev/null | sed "s/.*/'&',/" | tr -d '\n')
out=${MS_MULTI_OUTPUT:-utfTerminal}
logdir=$(mktemp -d)
trap 'rm -rf "$logdir"' EXIT
export NCCL_NVLS_ENABLE=0
timeout -k 10 "${MS_MULTI_SPEC_TIMEOUT:-900}" luajit -e "
  local launch = require 'moonshard.launch'
  local o = { nproc = $np, nnodes = 1, node_rank = 0, device = 'cuda', spawn = 'direct', log_dir = '$logdir' }
  os.exit(launch.run(o, { 'stdbuf', '-o0', '-e0', 'luajit', '$busted_bin', '--lpath=./lua/?.lua;./lua/?/init.lua;./?.lua',
    '-o', '$out', '--no-auto-insulate', '--tags=multi', $specs }))"
status=$?
ok=0; fail=0
for r in $(seq 0 $((np - 1))); do
  line=$(grep -aE '[0-9]+ success(es)? / [0-9]+ failures? / [0-9]+ errors?' "$logdir/rank$r.log" 2>/dev/null | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g')
  if [ -z "$line" ]; then   # TAP output: count its lines (a rank with none failed)
    s=$(grep -acE '^ok [0-9]' "$logdir/rank$r.log" 2>/dev/null); f=$(grep -acE '^not ok [0-9]' "$logdir/rank$r.log" 2>/dev/null)
    if [ "${s:-0}" -eq 0 ] && [ "${f:-0}" -eq 0 ]; then fail=$((fail + 1)); else ok=$((ok + s)); fail=$((fail + f)); fi
    continue
  fi
  s=$(echo "$line" | sed -nE 's/.*([^0-9]|^)([0-9]+) success.*/\2/p')
  f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failures?.*/\1/p')
  e=$(echo "$line" | sed -nE 's/.* ([0-9]+) errors?.*/\1/p')
  ok=$((ok + ${s:-0})); fail=$((fail + ${f:-0} + ${e:-0}))
done
if [ "$status" -ne 0 ] && [ "$fail" -eq 0 ]; then fail=1; fi
if [ "$fail" -gt 0 ]; then
  for f in "$logdir"/rank*.log; do echo "----- $(basename "$f")"; cat "$f"; done
fi
echo "$ok passed, $fail failed"
if [ "$fail" -gt 0 ] || [ "$ok" -eq 0 ]; then exit 1; fi
