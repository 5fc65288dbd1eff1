#!/usr/bin/env bash
# bin/train on a Mixtral-shaped model over NP GPUs of one host: expert
# parallelism (--ep NP, plain and under --fsdp FULL_SHARD / SHARD_GRAD_OP)
# against FSDP alone and plain data parallelism (--fsdp NO_SHARD), each
# rank its own batch, bf16 compute.
# Prints a table of the steady tokens/s (the last progress line's window)
# and rank 0's allocated GPU memory.
#   bench/moe_train.sh [NP] [extra bin/train flags]
# STEPS (default 30) steps of BATCH (8) sequences of SEQ (1024) tokens a rank;
# the model: 8 layers of width 2048, E (8) experts of 5632, TOPK (2) a token,
# vocabulary 32000 (~2.3B parameters, 0.5B active a token); MODEL=deepseek:
# bench/fsdp.lua's DeepSeek-V3 (8 layers of 2048, the first dense, latent
# attention with q/k heads of 128 + 64, E (16) experts of 1408 in 4 groups,
# TOPK (4) a token, 2 shared; 1.34B parameters).
set -u
cd "$(dirname "$0")/.."
np=${1:-2}
shift || true
steps=${STEPS:-30}
model="models/mixtral.lua --model.hidden_size 2048 --model.intermediate_size 5632 --model.num_hidden_layers 8 \
  --model.num_attention_heads 16 --model.num_key_value_heads 8 --model.vocab_size 32000 \
  --model.max_position_embeddings 4096 --model.num_local_experts ${E:-8} --model.num_experts_per_tok ${TOPK:-2} \
  --model.output_router_logits false"
if [ "${MODEL:-mixtral}" = deepseek ]; then
  model="models/deepseek_v3.lua --model.vocab_size 32000 --model.hidden_size 2048 --model.intermediate_size 5632 \
  --model.moe_intermediate_size 1408 --model.num_hidden_layers 8 --model.num_attention_heads 16 \
  --model.num_key_value_heads 16 --model.n_shared_experts 2 --model.n_routed_experts ${E:-16} \
  --model.kv_lora_rank 512 --model.q_lora_rank 512 --model.qk_rope_head_dim 64 --model.v_head_dim 128 \
  --model.qk_nope_head_dim 128 --model.n_group 4 --model.topk_group 2 --model.num_experts_per_tok ${TOPK:-4} \
  --model.first_k_dense_replace 1 --model.max_position_embeddings 4096"
fi
common="--nproc-per-node $np --device cuda $model --batch-size ${BATCH:-8} --seq-len ${SEQ:-1024} --steps $steps \
  --log-every 10 --eval-every 0 --eval-iters 1 --sample-tokens 0 --no-save --warmup 5 --progress plain"
printf '%-28s %12s %10s  %s\n' 'layout' 'tok/s' 'GiB' '(rank 0, the last window)'
# LAYOUTS: the layouts to run, ';'-separated (default: all six below)
if [ -n "${LAYOUTS:-}" ]; then IFS=';' read -r -a layouts <<< "$LAYOUTS"
else layouts=("--ep $np" "--ep $np --fsdp FULL_SHARD" "--ep $np --fsdp SHARD_GRAD_OP" "--fsdp FULL_SHARD"
  "--fsdp SHARD_GRAD_OP" "--fsdp NO_SHARD"); fi
for layout in "${layouts[@]}"; do
  out=$(mktemp -d)
  log=$(luajit bin/train $common $layout --out "$out" "$@" 2>&1)
  line=$(printf '%s\n' "$log" | grep '^\[rank 0\] step' | tail -n 1)
  if [ -z "$line" ]; then
    printf '%-28s failed:\n%s\n' "$layout" "$(printf '%s\n' "$log" | tail -n 15)"
  else
    rate=$(printf '%s\n' "$line" | sed -n 's/.*| \([0-9.]*[kM]*\) tok\/s.*/\1/p')
    mem=$(printf '%s\n' "$line" | sed -n 's/.*| mem \([0-9.]*\) GiB.*/\1/p')
    printf '%-28s %12s %10s\n' "$layout" "$rate" "$mem"
  fi
  rm -rf "$out"
done
