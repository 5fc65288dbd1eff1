#!/usr/bin/env bash
# On the lent GPU host, from the repository root: unpack LuaJIT/busted from
# .debs, put the shared fixtures where the specs look (../shared), build, and
# run what is asked: tools/gpu_run.sh [make-target-or-command...]
set -uo pipefail
. .carry/device/gpu-env.sh .debs >/dev/null
if [ ! -d ../shared/fixtures ]; then mkdir -p ../shared && cp -r .carry/* ../shared/; fi
export BUSTED_LUA=/tmp/lj/usr/bin/busted
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
make -j16 all >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
for cmd in "$@"; do
  echo "=== $cmd"
  eval "$cmd"
done
