#!/usr/bin/env bash
# tools/gpu_ckpt_check.sh — sharded checkpoints on four GPUs (run on the lent host):
# a Llama (small preset) under --tp 2 --fsdp on 4 GPUs, stopped at 10,
# resumed as saved, at --pp 2 --tp 2, at --tp 2 (2 GPUs), and in one process; step-20 losses vs uninterrupted
M="models/llama.lua --preset tiny --model.hidden_size 256 --model.num_hidden_layers 4 --model.vocab_size 1000"
C="--batch-size 8 --seq-len 128 --steps 20 --log-every 1 --progress plain --eval-every 0 --sample-tokens 0 --dtype f32 --autocast off --fsdp-mixed-precision none"
T=/tmp/ck; rm -rf $T; mkdir -p $T
bin/train --nproc-per-node 4 --device cuda $M $C --tp 2 --fsdp FULL_SHARD --out $T/full > $T/full.log 2>&1; echo "uninterrupted: $(grep -o 'step 20/20 | loss [0-9.]*' $T/full.log)"
bin/train --nproc-per-node 4 --device cuda $M $C --tp 2 --fsdp FULL_SHARD --save-every 10 --stop-at 10 --out $T/a > $T/a.log 2>&1; echo "stopped: rc $? $(ls $T/a)"; ls $T/a/ckpt-10 | head
for v in "4|--tp 2 --fsdp FULL_SHARD|b" "4|--pp 2 --tp 2|c" "2|--tp 2|d" "1||e"; do
  IFS='|' read -r np lay name <<< "$v"
  cp -r $T/a $T/$name
  # tokens per step kept: batch x data-parallel ranks
  dp=$(( np / 2 )); [ "$name" = c ] && dp=1; [ "$name" = e ] && dp=1
  bs=$(( 16 / (dp > 0 ? dp : 1) )); [ "$name" = b ] && bs=8
  bin/train --nproc-per-node $np --device cuda --resume $T/$name $lay --batch-size $bs > $T/$name.log 2>&1
  echo "resumed np $np [$lay] bs $bs: rc $? $(grep -o 'step 20/20 | loss [0-9.]*' $T/$name.log) $(grep -i 'error\|fail' $T/$name.log | head -3)"
done
