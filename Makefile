# moonshard — one build: build/libmoonshard.so (C core, plus CUDA kernels when
# nvcc is present and kernels/*.cu exist).
#   make            build the library and the FFI definitions
#   make test       install missing Debian packages, build, run the CPU specs
#   make test-gpu   run the #gpu specs (on a GPU host)
#   make test-asan  run the CPU specs against an AddressSanitizer build
CC      ?= gcc
BUILD   ?= build
CFLAGS  ?= -O3
CFLAGS  += -std=c99 -D_GNU_SOURCE -fPIC -fopenmp -Wall -Wextra -Werror -Wno-unused-parameter \
           -I/usr/include/x86_64-linux-gnu/openblas-pthread
LDLIBS  += -lopenblas -lz -lm -fopenmp -pthread

C_SRCS  := $(wildcard core/*.c core/io/*.c core/dist/*.c core/fsdp/*.c)
HEADERS := core/tensor.h core/ops.h core/cuda.h core/flce.h core/dist/comm.h core/fsdp/flat.h $(wildcard core/io/*.h)
C_OBJS  := $(patsubst %.c,$(BUILD)/%.o,$(C_SRCS))

# MPI, the CPU collectives (core/dist/mpi.c): built when mpicc is present
# (Debian: libopenmpi-dev); `make MPICC=` builds without it
MPICC   ?= $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
CFLAGS  += -DMS_WITH_MPI $(patsubst -I%,-isystem %,$(shell $(MPICC) --showme:compile))
LDLIBS  += $(shell $(MPICC) --showme:link)
endif

NVCC    ?= $(shell command -v nvcc 2>/dev/null)
CU_SRCS := $(wildcard kernels/*.cu)
ifneq ($(NVCC),)
ifneq ($(CU_SRCS),)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# NCCL, the GPU collectives (core/dist/nccl.cu): built when nccl.h is found
NCCL_HOME ?= $(CUDA_HOME)
NCCL_H  := $(firstword $(wildcard $(NCCL_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h))
ifneq ($(NCCL_H),)
NCCL_LIB := $(firstword $(wildcard $(NCCL_HOME)/lib64/libnccl.so $(NCCL_HOME)/lib/libnccl.so \
              /usr/lib/x86_64-linux-gnu/libnccl.so /usr/local/lib/libnccl.so))
ifneq ($(NCCL_LIB),)
CU_SRCS += $(wildcard core/dist/*.cu)
# (no -isystem for /usr/include: it would break the compilers' include_next)
NCCL_FLAGS := -DMS_WITH_NCCL $(if $(filter /usr/include/,$(dir $(NCCL_H))),,-isystem $(dir $(NCCL_H)))
LDLIBS  += -L$(dir $(NCCL_LIB)) -Wl,-rpath,$(dir $(NCCL_LIB)) -lnccl
endif
endif
CU_OBJS := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRCS))
NVFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -Xcompiler -Wall -Werror all-warnings \
           -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=sm_80
CFLAGS  += -DMS_WITH_CUDA
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lcublasLt -lstdc++
endif
endif

LIB     := $(BUILD)/libmoonshard.so
FFI     := $(BUILD)/ffi_cdef.lua
PROBE   := $(BUILD)/ffi_probe

all: $(LIB) $(FFI) $(PROBE)

$(BUILD)/%.o: %.c $(HEADERS) core/internal.h core/ops_cpu.h core/fused_cpu.h core/fp8.h core/prof.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cu $(wildcard kernels/*.h kernels/*.cuh kernels/*.inc) $(HEADERS) core/fp8.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -Icore $(NCCL_FLAGS) -c $< -o $@

# the blockwise many-ops' indexing, shared by the CPU and the kernels
$(BUILD)/core/float8.o $(BUILD)/kernels/float8.o: core/f8many.h

# the communicator's objects share its internal header (nccl.o: the CUDA runtime's too)
$(patsubst %.c,$(BUILD)/%.o,$(wildcard core/dist/*.c)) $(patsubst %.cu,$(BUILD)/%.o,$(wildcard core/dist/*.cu)): \
  core/dist/dist_internal.h kernels/common.cuh

$(LIB): $(C_OBJS) $(CU_OBJS)
	$(CC) -shared -Wl,-z,nodelete -o $@ $^ $(LDLIBS)

$(FFI) $(BUILD)/ffi_probe.c: tools/gen_ffi.lua $(HEADERS) core/prof.h
	@mkdir -p $(BUILD)
	luajit tools/gen_ffi.lua $(FFI) $(BUILD)/ffi_probe.c $(HEADERS) core/prof.h

$(PROBE): $(BUILD)/ffi_probe.c $(HEADERS)
	$(CC) -std=c99 -Wall -Werror -I. $< -o $@

# Debian packages the build and the specs need; installed only when missing
DEBS := luajit libluajit-5.1-dev lua-busted lua-dkjson libopenblas-dev zlib1g-dev openmpi-bin libopenmpi-dev gnuplot-nox libreadline8 tmux libicu-dev
deps:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

# the CPU specs, then the multi-rank ones (#mpi) under mpirun with 1-4 ranks;
# one closing line adds both up (tools/run_all_specs.sh)
test: deps
	$(MAKE) all
	bash tools/run_all_specs.sh --exclude-tags=gpu,multi,slow,mpi spec

test-all: deps
	$(MAKE) all
	bash tools/run_all_specs.sh --exclude-tags=gpu,multi,mpi spec

test-gpu: all
	bash tools/run_specs.sh --tags=gpu --exclude-tags=multi spec

# the #multi specs: NCCL with one rank per GPU, started by the launcher
test-multi: all
	bash tools/run_multi_specs.sh $(or $(NP),2)

# AddressSanitizer over the CPU specs: a CPU-only build in build-asan/ with
# -fsanitize=address (CFLAGS/LDLIBS passed through the environment so the
# Makefile's own flags still apply). luajit itself is not instrumented, so
# libasan is preloaded into it alone (tools/run_specs.sh, MS_PRELOAD), and
# LeakSanitizer checks at exit that every storage and handle was freed (no
# suppressions needed: LuaJIT frees everything at lua_close, and the library
# is linked -z nodelete so OpenMP/OpenBLAS threads outlive no unloaded code).
# Under ASan, CPU storages are allocated at their exact size (core/tensor.c),
# so an access one byte past a tensor is reported.
ASAN_LIB = $(shell $(CC) -print-file-name=libasan.so)
ASAN_ENV = ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
test-asan: deps
	CFLAGS="-O1 -g -fsanitize=address -fno-omit-frame-pointer" LDLIBS="-fsanitize=address" \
	  $(MAKE) BUILD=build-asan NVCC= all
	MS_BUILD=build-asan MS_PRELOAD=$(ASAN_LIB) $(ASAN_ENV) \
	  bash tools/run_specs.sh --exclude-tags=gpu,multi,slow,noasan spec

clean:
	rm -rf build build-asan

.PHONY: all deps test test-all test-gpu test-multi test-asan clean
