#!/usr/bin/env bash
# The float8 runs on the lent GPU host, in one call, after the setup of
# tools/gpu_prep.sh (no build: the library comes carried):
#   bash tools/gpu_float8.sh
# bench/flce.lua beside torch_flce.py (issue #5's rows), make test-gpu's specs, gpu_float8_spec, bench/float8.lua, the 1.25B Llama's step in bf16 and in
# float8 (bench/fsdp.lua --no-fsdp, tensorwise, rowwise and rowwise_with_gw_hp, and fully_shard on a world
# of one), then PyTorch's (torch_llama.py with torchao's float8 recipes and without, per-block compile) when
# .whl has torchao.
# Each log goes to $OUT (or /tmp/gpu_float8), its tail to stdout;
# GPU_CHECK_SKIP="torch ..." leaves parts out.
set -u
skip=${GPU_CHECK_SKIP:-}
. "$(dirname "$0")/gpu_steps.sh" /tmp/gpu_float8
TAIL=14 step flce luajit bench/flce.lua --methods fused,fused_master,fused_bf16acc,gemms
TAIL=8 step torch_flce python3 ../shared/bench/torch_flce.py --methods eager,compile
TAIL=30 step testgpu bash tools/run_specs.sh --tags=gpu --exclude-tags=multi spec
TAIL=40 step spec bash tools/run_specs.sh --tags=gpu spec/gpu_float8_spec.lua
TAIL=22 step micro luajit bench/float8.lua
TAIL=22 step micro_row luajit bench/float8.lua --recipe rowwise
TAIL=4 step llama luajit bench/fsdp.lua --model llama --no-fsdp --steps 14 --warmup 4
TAIL=4 step llama8 luajit bench/fsdp.lua --model llama --no-fsdp --steps 14 --warmup 4 --float8
TAIL=4 step llama8r luajit bench/fsdp.lua --model llama --no-fsdp --steps 14 --warmup 4 --float8 --recipe rowwise
TAIL=4 step llama8g luajit bench/fsdp.lua --model llama --no-fsdp --steps 14 --warmup 4 --float8 --recipe rowwise_with_gw_hp
TAIL=4 step fsdp luajit bench/fsdp.lua --model llama --steps 14 --warmup 4 --no-skip
TAIL=4 step fsdp8 luajit bench/fsdp.lua --model llama --steps 14 --warmup 4 --no-skip --float8
TAIL=2 step fsdp_mem luajit bench/fsdp.lua --model llama --steps 8 --warmup 4 --no-skip --mem-phases
TAIL=2 step fsdp8_mem luajit bench/fsdp.lua --model llama --steps 8 --warmup 4 --no-skip --float8 --mem-phases
TAIL=3 step gpt2 luajit bench/fsdp.lua --model gpt2 --no-fsdp --steps 14 --warmup 4
TAIL=3 step gpt2f8 luajit bench/fsdp.lua --model gpt2 --no-fsdp --steps 14 --warmup 4 --float8
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  TAIL=3 step torch8 python3 bench/torch_llama_float8.py ../shared/bench --compile blocks --steps 14
  FLOAT8_RECIPE=rowwise TAIL=3 step torch8r python3 bench/torch_llama_float8.py ../shared/bench --compile blocks --steps 14
  FLOAT8_RECIPE=rowwise_with_gw_hp TAIL=3 step torch8g python3 bench/torch_llama_float8.py ../shared/bench --compile blocks --steps 14
  FLOAT8=0 TAIL=3 step torch python3 bench/torch_llama_float8.py ../shared/bench --compile blocks --steps 14
  TAIL=2 step torch_shared python3 ../shared/bench/torch_llama.py --compile blocks --steps 14
fi
