# Sourced on the lent GPU host from the repository root: LuaJIT and busted
# from .debs, ../shared from .carry, busted's path, the GPU named. With
# build/libmoonshard.so carried (built here: the same CUDA 13.0), nothing is
# compiled there; without it, `make all` builds it.
. .carry/device/gpu-env.sh .debs >/dev/null
if [ ! -d ../shared/fixtures ]; then mkdir -p ../shared && cp -r .carry/* ../shared/; fi
export BUSTED_LUA=/tmp/lj/usr/bin/busted
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader
# The library's fat binary is ~33 MB and the carry limit is 64 MiB with the
# tree: it may travel gzipped as .carry/libmoonshard.so.gz (tools/gpu_pack.sh).
if [ -f .carry/libmoonshard.so.gz ]; then mkdir -p build && gzip -dc .carry/libmoonshard.so.gz > build/libmoonshard.so; fi
if [ ! -f build/libmoonshard.so ]; then make -j16 all >/tmp/build.log 2>&1 || tail -40 /tmp/build.log; fi
