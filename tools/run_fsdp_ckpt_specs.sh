#!/usr/bin/env bash
# Runs spec/fsdp_ckpt_reshard_spec.lua (FSDP checkpoints across world
# sizes, #mpi) in phases, one mpirun each, over one temporary folder
# (MS_FSDP_CKPT_DIR): save with 4 ranks, then load with 2, 3 and 1.
# Prints a closing line "N passed, N failed" counting every rank's outcome
# of every spec, as tools/run_mpi_specs.sh does.
#   tools/run_fsdp_ckpt_specs.sh [NP:PHASE...]     default: 4:save 2:load 3:load 1:load
# A run is killed after MS_MPI_SPEC_TIMEOUT seconds (300). The logs of a
# run with a failure are printed. Exit status 1 on any failure, a missing
# summary, or when mpirun is absent.
set -u
cd "$(dirname "$0")/.."
export LUA_PATH="./lua/?.lua;./lua/?/init.lua;./?.lua;${LUA_PATH:-;}"
busted_bin=${BUSTED_LUA:-$(command -v busted || echo /usr/bin/busted)}
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(4:save 2:load 3:load 1:load)
if ! command -v mpirun >/dev/null 2>&1; then
  echo "run_fsdp_ckpt_specs: mpirun not found (apt-get install openmpi-bin)"
  echo "0 passed, 1 failed"
  exit 1
fi
. tools/mpi_env.sh
spec=spec/fsdp_ckpt_reshard_spec.lua
logdir=$(mktemp -d)
export MS_FSDP_CKPT_DIR="$logdir/ckpt"
mkdir -p "$MS_FSDP_CKPT_DIR"
trap 'rm -rf "$logdir"' EXIT
# MS_FSDP_CKPT_LPATH: Lua paths searched before the tree's own (e.g. ";"-terminated)
export MS_FSDP_CKPT_LPATH=${MS_FSDP_CKPT_LPATH:-}
total_ok=0; total_fail=0
for run in "${runs[@]}"; do
  np=${run%%:*}; phase=${run#*:}
  t0=$(date +%s.%N)
  MS_FSDP_CKPT_PHASE=$phase timeout -k 5 "${MS_MPI_SPEC_TIMEOUT:-300}" mpirun -np "$np" $MS_MPIRUN_FLAGS \
    -x MS_FSDP_CKPT_DIR -x MS_FSDP_CKPT_PHASE -x MS_FSDP_CKPT_LPATH \
    sh -c 'exec luajit "$0" --lpath="${MS_FSDP_CKPT_LPATH}./lua/?.lua;./lua/?/init.lua;./?.lua" -o utfTerminal --no-auto-insulate \
      --tags=mpi "$@" >"'"$logdir"'/np'"$np"'-'"$phase"'.rank$OMPI_COMM_WORLD_RANK.log" 2>&1' \
    "$busted_bin" "$spec" >"$logdir/np$np-$phase.mpirun.log" 2>&1
  status=$?
  ok=0; fail=0; bad=0
  for r in $(seq 0 $((np - 1))); do
    log="$logdir/np$np-$phase.rank$r.log"
    line=$(grep -aE '[0-9]+ success(es)? / [0-9]+ failures? / [0-9]+ errors?' "$log" 2>/dev/null | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g')
    if [ -z "$line" ]; then bad=$((bad + 1)); continue; fi
    s=$(echo "$line" | sed -nE 's/.*([^0-9]|^)([0-9]+) success.*/\2/p')
    f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failures?.*/\1/p')
    e=$(echo "$line" | sed -nE 's/.* ([0-9]+) errors?.*/\1/p')
    p=$(echo "$line" | sed -nE 's/.* ([0-9]+) pending.*/\1/p')
    ok=$((ok + ${s:-0})); fail=$((fail + ${f:-0} + ${e:-0}))
    # a phase that ran nothing (pending only) is a failure here
    if [ "${s:-0}" -eq 0 ] && [ "${p:-0}" -gt 0 ]; then fail=$((fail + 1)); fi
  done
  fail=$((fail + bad))
  if [ "$status" -ne 0 ] && [ "$fail" -eq 0 ]; then fail=1; fi
  secs=$(echo "$(date +%s.%N) - $t0" | bc 2>/dev/null || echo '?')
  printf 'fsdp checkpoints, mpirun -np %d (%s): %d passed, %d failed (ranks x specs; %.1f s)\n' "$np" "$phase" "$ok" "$fail" "$secs" 2>/dev/null \
    || echo "fsdp checkpoints, mpirun -np $np ($phase): $ok passed, $fail failed"
  if [ "$fail" -gt 0 ]; then
    [ "$status" -eq 124 ] && echo "  (killed after ${MS_MPI_SPEC_TIMEOUT:-300} s)"
    for f in "$logdir"/np$np-$phase.*.log; do echo "----- $(basename "$f")"; cat "$f"; done
  fi
  total_ok=$((total_ok + ok)); total_fail=$((total_fail + fail))
done
echo "$total_ok passed, $total_fail failed"
if [ "$total_fail" -gt 0 ] || [ "$total_ok" -eq 0 ]; then exit 1; fi
