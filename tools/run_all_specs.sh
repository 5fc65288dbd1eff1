#!/usr/bin/env bash
# `make test`: the specs of tools/run_specs.sh (busted, one process), then
# the multi-rank CPU specs of tools/run_mpi_specs.sh (mpirun, 1-4 ranks),
# and one closing line "N passed, N failed" adding both up. The two
# scripts' own closing lines are shown as "specs: ..." and "mpi specs: ...".
#   tools/run_all_specs.sh [busted args...]
# MS_MPI_SPECS=0 skips the MPI part. Exit status 1 on any failure.
set -u
cd "$(dirname "$0")/.."
summary='^([0-9]+) passed, ([0-9]+) failed$'
total_ok=0; total_fail=0; status=0
part() {
  local label=$1; shift
  local line="" ok fail
  # stream the output, holding back the closing summary line
  while IFS= read -r l; do
    if [[ $l =~ $summary ]]; then line=$l; else printf '%s\n' "$l"; fi
  done < <("$@" 2>&1; echo "__status $?")
  return 0
}
part() {
  local label=$1; shift
  local out rc line
  exec 3>&1
  line=$( { "$@" 2>&1; echo "__rc $?"; } | while IFS= read -r l; do
      if [[ $l =~ $summary ]]; then echo "$l" >&4; elif [[ $l =~ ^__rc\ ([0-9]+)$ ]]; then echo "__rc ${BASH_REMATCH[1]}" >&4; else printf '%s\n' "$l" >&3; fi
    done 4>&1 )
  exec 3>&-
  rc=$(echo "$line" | sed -nE 's/^__rc ([0-9]+)$/\1/p')
  line=$(echo "$line" | grep -E "$summary" | tail -n 1)
  if [ -z "$line" ]; then
    echo "$label: no summary line (exit status ${rc:-?})"
    total_fail=$((total_fail + 1)); status=1; return
  fi
  echo "$label: $line"
  ok=$(echo "$line" | sed -nE "s/$summary/\1/p"); fail=$(echo "$line" | sed -nE "s/$summary/\2/p")
  total_ok=$((total_ok + ok)); total_fail=$((total_fail + fail))
  [ "${rc:-1}" -ne 0 ] && status=1
}
part specs bash tools/run_specs.sh "$@"
if [ "${MS_MPI_SPECS:-1}" != 0 ]; then part "mpi specs" bash tools/run_mpi_specs.sh; fi
if [ "${MS_MPI_SPECS:-1}" != 0 ]; then part "fsdp checkpoint specs" bash tools/run_fsdp_ckpt_specs.sh; fi
echo "$total_ok passed, $total_fail failed"
if [ "$status" -ne 0 ] || [ "$total_fail" -gt 0 ]; then exit 1; fi
