#!/usr/bin/env bash
# bench/pp_host_cost.sh — the host's cost of a pipeline step: bin/train on
# CPU ranks through mpirun (--threads 1), the tiny DeepSeek-V3 of
# spec/trace_pins_spec.lua (4 layers of 32, 8 routed experts and a shared
# one, latent attention), batch 4 x 16 in four one-sequence micro-batches,
# where the kernels take next to nothing and a step is the op-issue path
# (Lua, the FFI, the autograd, the schedule's bookkeeping) of every rank.
#   bench/pp_host_cost.sh [ROUNDS] [TREE...]
# For each layout (LAYOUTS, ';'-separated; default "--pp 2 --tp 2" and
# "--pp 2 --tp 2 --sequence-parallel"; NP ranks, default 4) and each tree
# (default: this one), ROUNDS (default 3) runs interleaved, each of STEPS
# (default 100) steps; a run's figures: the median wall ms of steps 21 on
# (rank 0's metrics.jsonl elapsed_s; the ranks share the machine's cores,
# so a step's wall time is their summed host work when they outnumber the
# cores) and the CPU ms a step of all the processes (user + sys over the
# whole run, start-up included, / STEPS). Printed: every run, then the
# median over the rounds.
set -u
cd "$(dirname "$0")/.."
here=$(pwd)
rounds=${1:-3}
shift || true
trees=("$@")
[ ${#trees[@]} -eq 0 ] && trees=("$here")
steps=${STEPS:-100}
np=${NP:-4}
if [ -n "${LAYOUTS:-}" ]; then IFS=';' read -r -a layouts <<< "$LAYOUTS"
else layouts=("--pp 2 --tp 2" "--pp 2 --tp 2 --sequence-parallel"); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
luajit -e "package.path='./lua/?.lua;./lua/?/init.lua;./?.lua;'..package.path
  require('spec.support').fixed_corpus('$work', 20000)" > /dev/null
model="models/deepseek_v3.lua --preset tiny --model.num_hidden_layers 4 --model.hidden_size 32 \
 --model.intermediate_size 64 --model.moe_intermediate_size 16 --model.kv_lora_rank 16 --model.q_lora_rank 24 \
 --model.qk_rope_head_dim 8 --model.v_head_dim 8 --model.qk_nope_head_dim 8 --model.aux_loss_alpha 0.01 \
 --moe-bias-rate 1e-2 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 \
 --log-every 50 --batch-size 4 --no-save --threads 1"
# one run: tree, layout -> "wall_ms cpu_ms" (or "failed")
one() {
  local out="$work/run" t
  rm -rf "$out"
  ( cd "$1" && /usr/bin/time -o "$work/time" -f '%U %S' luajit bin/train --nproc-per-node "$np" --device cpu \
      $model --data "$work/corpus.txt" $2 --steps "$steps" --out "$out" > "$work/log" 2>&1 ) || { echo failed; return; }
  t=$(tail -n 1 "$work/time")
  luajit -e "
    local t = {}
    for l in io.lines('$out/metrics.jsonl') do
      local s, e = l:match('\"step\":(%d+),\"elapsed_s\":([%d.e-]+)')
      if s then t[tonumber(s)] = tonumber(e) end
    end
    local d = {}
    for k = 21, #t do d[#d + 1] = (t[k] - t[k - 1]) * 1e3 end
    table.sort(d)
    local u, s = ('$t'):match('([%d.]+) ([%d.]+)')
    io.write(('%.2f %.2f\n'):format(d[math.floor((#d + 1) / 2)], (u + s) * 1e3 / $steps))"
}
med() { tr ' ' '\n' | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
declare -A walls cpus
for ((r = 1; r <= rounds; r++)); do
  for li in "${!layouts[@]}"; do
    for ti in "${!trees[@]}"; do
      res=$(one "${trees[$ti]}" "${layouts[$li]}")
      echo "round $r | ${layouts[$li]} | ${trees[$ti]} | wall ms a step, CPU ms a step: $res"
      [ "$res" = failed ] && { tail -n 20 "$work/log"; exit 1; }
      walls[$li,$ti]="${walls[$li,$ti]:-} ${res%% *}"
      cpus[$li,$ti]="${cpus[$li,$ti]:-} ${res##* }"
    done
  done
done
printf '\n| layout | tree | wall ms a step (median of %d) | CPU ms a step | runs (wall) |\n|---|---|---|---|---|\n' "$rounds"
for li in "${!layouts[@]}"; do
  for ti in "${!trees[@]}"; do
    printf '| %s | %s | %s | %s | %s |\n' "${layouts[$li]}" "${trees[$ti]}" \
      "$(echo ${walls[$li,$ti]} | med)" "$(echo ${cpus[$li,$ti]} | med)" "$(echo ${walls[$li,$ti]})"
  done
done
