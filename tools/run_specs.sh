#!/usr/bin/env bash
# Runs busted under LuaJIT with the repository's paths and prints a closing
# line "N passed, N failed" (errors count as failed). Exit status 1 on any failure
# or when no spec ran at all.
set -u
cd "$(dirname "$0")/.."
export LUA_PATH="./lua/?.lua;./lua/?/init.lua;./?.lua;${LUA_PATH:-;}"
busted_bin=${BUSTED_LUA:-$(command -v busted || echo /usr/bin/busted)}
log=$(mktemp)
# MS_PRELOAD: a library preloaded into luajit (make test-asan: libasan). The
# processes the specs start (bin/train, scripts) inherit it and keep ASan's
# checks, but not its leak check: a process that ends with os.exit(n) without
# closing its Lua state leaves its live handles unfreed, which is no leak.
preload=()
if [ -n "${MS_PRELOAD:-}" ]; then
  child="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
  preload=(env "LD_PRELOAD=$MS_PRELOAD" luajit -e "local ffi = require 'ffi'
    ffi.cdef'int ms_spec_setenv(const char *, const char *, int) asm(\"setenv\");'
    ffi.C.ms_spec_setenv('ASAN_OPTIONS', '$child', 1)")
else
  preload=(luajit)
fi
# one run of busted: its output in $log, its exit status in $status
run() {
  "${preload[@]}" "$busted_bin" --lpath='./lua/?.lua;./lua/?/init.lua;./?.lua' -o utfTerminal --no-auto-insulate "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  line=$(grep -aE '[0-9]+ success(es)? / [0-9]+ failures? / [0-9]+ errors?' "$log" | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g')
  ok=$(echo "$line" | sed -nE 's/.*([^0-9]|^)([0-9]+) success.*/\2/p')
  fail=$(echo "$line" | sed -nE 's/.* ([0-9]+) failures?.*/\1/p')
  err=$(echo "$line" | sed -nE 's/.* ([0-9]+) errors?.*/\1/p')
  ok=${ok:-0}; fail=${fail:-0}; err=${err:-0}
}
run "$@"
# LeakSanitizer's own stop-the-world tracer sometimes dies at the process's
# exit ("Tracer caught signal 11", then "LeakSanitizer has encountered a fatal
# error"; google/sanitizers#1353, about one exit in a few hundred): the leak
# check did not run, so nothing was found or cleared. Only that, with every
# spec passed and no sanitizer report, is run again, once; a second crash, a
# leak or any other failure stays a failure.
if [ -n "${MS_PRELOAD:-}" ] && [ "$status" -ne 0 ] && [ -n "$line" ] && [ "$((fail + err))" -eq 0 ] && [ "$ok" -gt 0 ] &&
  grep -aq 'Tracer caught signal' "$log" && grep -aq 'LeakSanitizer has encountered a fatal error' "$log" &&
  ! grep -aqE 'ERROR: (LeakSanitizer|AddressSanitizer)' "$log"; then
  echo "run_specs: LeakSanitizer's tracer crashed at exit (no leak check ran): running the specs once more"
  run "$@"
fi
rm -f "$log"
if [ -z "$line" ]; then err=1; echo "busted printed no summary (exit status $status)"; fi
echo "$ok passed, $((fail + err)) failed"
if [ "$((fail + err))" -gt 0 ] || [ "$ok" -eq 0 ] || [ "$status" -ne 0 ]; then exit 1; fi
