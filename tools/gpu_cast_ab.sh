#!/usr/bin/env bash
# The float8 cast's two tilings on the same host (after tools/gpu_prep.sh):
# kernel times under ncu (bench/float8.lua --casts, the 1.25B Llama's input
# widths) with MS_FLOAT8_TILE128=1 and =0, then the Llama step with each,
# alternating. Logs to $OUT (or /tmp/gpu_cast_ab).
set -u
out=${OUT:-/tmp/gpu_cast_ab}
mkdir -p "$out"
for t in 1 0; do
  MS_FLOAT8_TILE128=$t ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum \
    -k regex:'cast|amax' luajit bench/float8.lua --casts --shapes 2048x1,5632x1 > "$out/ncu$t.csv" 2>&1
  echo "=== tile128=$t"
  grep -v '^==' "$out/ncu$t.csv" > "$out/ncu$t.clean.csv"
  luajit tools/ncu_summary.lua "$out/ncu$t.clean.csv" 1 10 2>&1 | head -14
done
for r in 1 2; do
  for t in 1 0; do
    MS_FLOAT8_TILE128=$t luajit bench/fsdp.lua --model llama --no-fsdp --steps 14 --warmup 4 --float8 > "$out/llama8_t$t.$r.log" 2>&1
    echo "tile128=$t round $r: $(tail -n 1 "$out/llama8_t$t.$r.log")"
  done
done
