#!/usr/bin/env bash
# Runs the multi-rank CPU specs (spec/dist_*_spec.lua files tagged #mpi)
# under mpirun with 1, 2, 3 and 4 ranks, oversubscribed (CI has 2 cores),
# and prints a closing line "N passed, N failed" that counts every rank's
# outcome of every spec (a spec passed by all 4 ranks of a run counts 4).
#   tools/run_mpi_specs.sh [NP...]            default: 1 2 3 4
# Each rank's busted output goes to a log, in TAP form: a failure's message
# is written when the spec ends, so it survives a rank that MPI aborts
# afterwards (a rank that failed an assertion and went on to the next
# spec's collectives makes its peers' messages mismatch). The logs of a run
# with a failure are printed. A run is killed after MS_MPI_SPEC_TIMEOUT
# seconds (300).
# Exit status 1 on any failure, a missing summary, or when mpirun is absent.
set -u
cd "$(dirname "$0")/.."
export LUA_PATH="./lua/?.lua;./lua/?/init.lua;./?.lua;${LUA_PATH:-;}"
busted_bin=${BUSTED_LUA:-$(command -v busted || echo /usr/bin/busted)}
nps=("$@")
[ ${#nps[@]} -eq 0 ] && nps=(1 2 3 4)
if ! command -v mpirun >/dev/null 2>&1; then
  echo "run_mpi_specs: mpirun not found (apt-get install openmpi-bin)"
  echo "0 passed, 1 failed"
  exit 1
fi
. tools/mpi_env.sh
# MS_MPI_SPECS: a list of spec files to run instead of every #mpi spec
specs=${MS_MPI_SPECS:-$(ls spec/dist_*_spec.lua 2>/dev/null | xargs grep -l '#mpi' 2>/dev/null)}
logdir=$(mktemp -d)
trap 'rm -rf "$logdir"' EXIT
total_ok=0; total_fail=0
for np in "${nps[@]}"; do
  t0=$(date +%s.%N)
  # each rank writes its own log; the wrapper passes the rank's number on
  timeout -k 5 "${MS_MPI_SPEC_TIMEOUT:-300}" mpirun -np "$np" $MS_MPIRUN_FLAGS \
    sh -c 'exec luajit "$0" --lpath="./lua/?.lua;./lua/?/init.lua;./?.lua" -o TAP --no-auto-insulate \
      --tags=mpi "$@" >"'"$logdir"'/np'"$np"'.rank$OMPI_COMM_WORLD_RANK.log" 2>&1' \
    "$busted_bin" $specs >"$logdir/np$np.mpirun.log" 2>&1
  status=$?
  ok=0; fail=0; bad=0
  for r in $(seq 0 $((np - 1))); do
    log="$logdir/np$np.rank$r.log"
    # TAP: "ok N - name" (a pending one "ok N - # SKIP ..."), "not ok N - name",
    # and the plan "1..N" last: a log without it is a rank that did not finish
    if ! grep -aqE '^1\.\.[0-9]+$' "$log" 2>/dev/null; then
      bad=$((bad + 1))
      fail=$((fail + $(grep -acE '^not ok [0-9]+' "$log" 2>/dev/null || true)))
      continue
    fi
    s=$(grep -aE '^ok [0-9]+' "$log" | grep -avc '^ok [0-9]* - # SKIP' || true)
    f=$(grep -acE '^not ok [0-9]+' "$log" || true)
    ok=$((ok + ${s:-0})); fail=$((fail + ${f:-0}))
  done
  fail=$((fail + bad))
  if [ "$status" -ne 0 ] && [ "$fail" -eq 0 ]; then fail=1; fi
  secs=$(echo "$(date +%s.%N) - $t0" | bc 2>/dev/null || echo '?')
  printf 'mpirun -np %d: %d passed, %d failed (ranks x specs; %.1f s)\n' "$np" "$ok" "$fail" "$secs" 2>/dev/null \
    || echo "mpirun -np $np: $ok passed, $fail failed"
  if [ "$fail" -gt 0 ]; then
    [ "$status" -eq 124 ] && echo "  (killed after ${MS_MPI_SPEC_TIMEOUT:-300} s)"
    for f in "$logdir"/np$np.*.log; do echo "----- $(basename "$f")"; cat "$f"; done
  fi
  total_ok=$((total_ok + ok)); total_fail=$((total_fail + fail))
done
echo "$total_ok passed, $total_fail failed"
if [ "$total_fail" -gt 0 ] || [ "$total_ok" -eq 0 ]; then exit 1; fi
