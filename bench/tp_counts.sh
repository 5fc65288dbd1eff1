#!/usr/bin/env bash
# bench/tp_counts.sh — the tensor-parallel group's collectives of a step,
# counted on CPU ranks: bin/train through mpirun with MS_DIST_COUNT=1
# (dist.trace, docs/dist.md), f32, step 2's table of each rank in RANKS
# summed by kind and direction over the rank's TP group (the rows whose
# ranks hold it and are neither one rank nor the whole world: the
# pipeline's p2p and whole-world scalars left out): calls, bytes (the
# collectives' sizes, nccl-tests' convention) and bytes on the links a
# rank ((N-1)/N of a gather's or reduce-scatter's, 2(N-1)/N of an
# all-reduce's). No GPU: counts and bytes, not times.
#   bench/tp_counts.sh MODEL [NP] [RANKS]
# MODEL: gpt2, llama or deepseek (the tiny shapes of spec/dist_sp_counts_spec:
# 4 layers of 48; DeepSeek-V3 with latent attention and 4 experts, the first
# layer dense); NP ranks (default 4); RANKS the ranks whose tables are
# printed (default "0 2": --pp 2 --tp 2's first and last stages).
# LAYOUTS (';'-separated; default "--pp 2 --tp 2 --sequence-parallel;--pp 2
# --tp 2"), each also run with MS_TP_SP_ENDS_RS=0 when it is sequence
# parallel (the ends' all-reduces, the layout before; docs/tp.md).
# Batch 4 x 16 (BATCH, SEQ).
set -u
cd "$(dirname "$0")/.."
name=${1:-llama}
np=${2:-4}
ranks=${3:-"0 2"}
case "$name" in
  gpt2) model="models/gpt2.lua --model.vocab_size 257 --model.n_positions 32 --model.n_embd 48 --model.n_layer 4 \
    --model.n_head 12" ;;
  llama) model="models/llama.lua --model.vocab_size 257 --model.hidden_size 48 --model.intermediate_size 96 \
    --model.num_hidden_layers 4 --model.num_attention_heads 24 --model.num_key_value_heads 12 \
    --model.max_position_embeddings 32" ;;
  deepseek) model="models/deepseek_v3.lua --model.vocab_size 257 --model.hidden_size 48 --model.intermediate_size 96 \
    --model.moe_intermediate_size 24 --model.num_hidden_layers 4 --model.num_attention_heads 12 --model.num_key_value_heads 12 \
    --model.n_shared_experts 1 --model.n_routed_experts 4 --model.routed_scaling_factor 1.5 --model.kv_lora_rank 16 \
    --model.q_lora_rank 20 --model.qk_rope_head_dim 4 --model.v_head_dim 6 --model.qk_nope_head_dim 4 \
    --model.n_group 2 --model.topk_group 1 --model.num_experts_per_tok 2 --model.first_k_dense_replace 1 \
    --model.max_position_embeddings 32" ;;
  *) echo "tp_counts: MODEL is gpt2, llama or deepseek, got $name"; exit 2 ;;
esac
if [ -n "${LAYOUTS:-}" ]; then IFS=';' read -r -a layouts <<< "$LAYOUTS"
else layouts=("--pp 2 --tp 2 --sequence-parallel" "--pp 2 --tp 2"); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
luajit -e "package.path='./lua/?.lua;./lua/?/init.lua;./?.lua;'..package.path
  require('spec.support').fixed_corpus('$work', 20000)" > /dev/null
run() {   # $1: MS_TP_SP_ENDS_RS, $2: layout
  MS_TP_SP_ENDS_RS=$1 MS_DIST_COUNT=1 luajit bin/train --nproc-per-node "$np" --device cpu $model --data "$work/corpus.txt" \
    --batch-size "${BATCH:-4}" --seq-len "${SEQ:-16}" --steps 2 --eval-every 0 --eval-iters 1 --sample-tokens 0 \
    --no-save --threads 1 --out "$work/out" $2 2>&1
}
for layout in "${layouts[@]}"; do
  # (sequence parallel: --sequence-parallel, or --tp without --pp and without --no-sequence-parallel)
  modes=(1)
  if [[ "$layout" == *"--sequence-parallel"* ]] || [[ "$layout" != *"--pp"* && "$layout" != *"--no-sequence-parallel"* ]]
  then modes=(1 0); fi
  for ends in "${modes[@]}"; do
    log=$(run "$ends" "$layout")
    label="$layout"
    [ ${#modes[@]} -gt 1 ] && label="$layout, ends $([ "$ends" = 1 ] && echo reduce-scattered || echo 'all-reduced (MS_TP_SP_ENDS_RS=0)')"
    if ! printf '%s\n' "$log" | grep -q 'dist trace, step 2'; then
      printf '%s: failed\n%s\n' "$label" "$(printf '%s\n' "$log" | tail -n 20)"
      continue
    fi
    for r in $ranks; do
      printf '%s, rank %s, step 2 (the TP group):\n' "$label" "$r"
      # rank r's step-2 table: rows "kind ranks calls bytes-each bytes-all dir where"; the TP group's rows
      # are those whose ranks hold r and are not the whole world nor a p2p
      printf '%s\n' "$log" | awk -v r="$r" -v np="$np" '
        $0 ~ "^\\[rank " r "\\] dist trace, step 2" { on = 1; next }
        on && $0 ~ "^\\[rank " r "\\] dist trace" { on = 0 }
        on && $0 ~ "^\\[rank " r "\\]   total" { on = 0 }
        on && $0 ~ "^\\[rank " r "\\]   " {
          line = $0; sub("^\\[rank " r "\\]   ", "", line)
          if (line ~ /^kind/) next
          # the kind may hold spaces ("all_reduce (flce: grad_x)"): the fields from the right
          n = split(line, f, /[ ]+/)
          # f: kind words..., ranks, calls, each, all, dir, where...
          for (i = 1; i <= n; i++) if (f[i] ~ /^[0-9]+(,[0-9]+)*$/ && f[i+1] ~ /^[0-9]+$/) { k = i; break }
          kind = f[1]; for (i = 2; i < k; i++) kind = kind " " f[i]
          rk = f[k]; calls = f[k+1]; all = f[k+3]; dir = f[k+4]
          if (kind ~ /^p2p|^host read/) next
          cnt = split(rk, rr, ","); if (cnt == np || cnt < 2) next
          hit = 0; for (i = 1; i <= cnt; i++) if (rr[i] == r) hit = 1
          if (!hit) next
          # (on the links, each rank: (N-1)/N of a gather or reduce-scatter, 2(N-1)/N of an all-reduce)
          link = all * (cnt - 1) / cnt; if (kind ~ /^all_reduce/) link = 2 * link
          key = sprintf("%-30s %-4s", kind, dir); c[key] += calls; b[key] += all; l[key] += link
          tc += calls; tb += all; tl += link
        }
        END {
          for (key in c) printf "  %s %6d calls %12d bytes %12d on the links\n", key, c[key], b[key], l[key] | "sort"
          close("sort")
          printf "  %-35s %6d calls %12d bytes %12d on the links\n", "all", tc, tb, tl
        }'
    done
  done
done
