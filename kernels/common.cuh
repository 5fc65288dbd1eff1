// kernels/common.cuh — what every kernel file shares: error checks that turn
// CUDA failures into moonshard error values, the current stream, dtype
// load/store in f32, and launch geometry.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "fp8.h"

extern "C" {
#include "tensor.h"
#include "internal.h"
#include "cuda.h"
}

// Every CUDA call goes through these: on failure the message names the file,
// line, call and CUDA's own text, and the enclosing function returns -1.
#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t err_ = (call);                                                         \
        if (err_ != cudaSuccess)                                                           \
            return ms_errorf("%s:%d: %s failed: %s", __FILE__, __LINE__, #call,            \
                             cudaGetErrorString(err_));                                    \
    } while (0)

// After every launch: catches bad configurations at once (asynchronous faults
// surface at the next synchronising call).
#define LAUNCH_CHECK(what)                                                                 \
    do {                                                                                   \
        cudaError_t err_ = cudaGetLastError();                                             \
        if (err_ != cudaSuccess)                                                           \
            return ms_errorf("%s:%d: launch of %s failed: %s", __FILE__, __LINE__, what,   \
                             cudaGetErrorString(err_));                                    \
    } while (0)

// the stream kernels for `device` launch on
cudaStream_t ms_cuda_stream_of(int device);
int ms_cuda_activate(int device);  // cudaSetDevice when needed
// cudaMalloc that is legal during this thread's CUDA graph capture too
// (memory a kernel file keeps for good, e.g. a GEMM workspace)
cudaError_t ms_cuda_malloc_any(void **p, size_t n);
// the CUDA event behind a Lua-visible one (core/cuda.h)
extern "C" cudaEvent_t ms_cuda_event_raw(const struct ms_cuda_event *e);

// a device-side int flag per device for errors found inside kernels
// (out-of-range ids): kernels atomically set it, the host checks it at sync
// points through ms_cuda_check_device_flags
struct ms_device_flag {
    int code;      // 0 clear; 1 index out of range
    long long position;
    long long value;
    long long limit;
};
ms_device_flag *ms_cuda_device_flag(int device);

__device__ __forceinline__ float ms_ld(const float *p) { return *p; }
__device__ __forceinline__ float ms_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ms_ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void ms_st(float *p, float v) { *p = v; }
__device__ __forceinline__ void ms_st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void ms_st(__half *p, float v) { *p = __float2half_rn(v); }

// a scratch tensor freed (back to the caching allocator, in stream order)
// when it goes out of scope
struct ms_tmp {
    ms_tensor *t = nullptr;
    ~ms_tmp() { ms_tensor_free(t); }
};

static inline int ms_grid(int64_t n, int block) {
    int64_t g = (n + block - 1) / block;
    return (int)(g > 65535 * 32 ? 65535 * 32 : (g < 1 ? 1 : g));
}

// shape/stride descriptor passed to kernels by value (up to 8 dims)
struct ms_layout {
    int ndim;
    int64_t sizes[8];
    int64_t strides[8];
};

static inline ms_layout ms_layout_of(const ms_tensor *t) {
    ms_layout l;
    l.ndim = t->ndim;
    for (int i = 0; i < 8; i++) {
        l.sizes[i] = i < t->ndim ? t->sizes[i] : 1;
        l.strides[i] = i < t->ndim ? t->strides[i] : 0;
    }
    return l;
}

// offset (in elements) of the i-th element in row-major order of `shape`
// within a tensor of strides `l.strides` (same ndim)
__device__ __forceinline__ int64_t ms_offset(const ms_layout &l, int64_t i) {
    int64_t off = 0;
    for (int d = l.ndim - 1; d >= 0; d--) {
        int64_t s = l.sizes[d];
        int64_t q = i / s;
        off += (i - q * s) * l.strides[d];
        i = q;
    }
    return off;
}

// any dtype <-> double (the general, layout-agnostic paths)
__device__ __forceinline__ double ld_any(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case MS_F64: return ((const double *)p)[i];
    case MS_F32: return ((const float *)p)[i];
    case MS_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case MS_F16: return __half2float(((const __half *)p)[i]);
    case MS_I64: return (double)((const long long *)p)[i];
    case MS_I32: return ((const int *)p)[i];
    case MS_U8: return ((const unsigned char *)p)[i];
    case MS_F8E4M3: return ms_fp8_to_f32(((const unsigned char *)p)[i], 0);
    case MS_F8E5M2: return ms_fp8_to_f32(((const unsigned char *)p)[i], 1);
    default: return ((const unsigned char *)p)[i] ? 1.0 : 0.0;
    }
}

__device__ __forceinline__ void st_any(void *p, int dtype, int64_t i, double v) {
    switch (dtype) {
    case MS_F64: ((double *)p)[i] = v; break;
    case MS_F32: ((float *)p)[i] = (float)v; break;
    // through f32, as the CPU reference rounds (core/tensor.c ms_store)
    case MS_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
    case MS_F16: ((__half *)p)[i] = __float2half_rn((float)v); break;
    case MS_I64: ((long long *)p)[i] = (long long)v; break;
    case MS_I32: ((int *)p)[i] = (int)v; break;
    case MS_U8: ((unsigned char *)p)[i] = (unsigned char)(long long)v; break;
    // one rounding from f64 or f32, as the CPU's (core/fp8.h)
    case MS_F8E4M3: ((unsigned char *)p)[i] = ms_fp8_from_f64(v, 0, 0); break;
    case MS_F8E5M2: ((unsigned char *)p)[i] = ms_fp8_from_f64(v, 1, 0); break;
    default: ((unsigned char *)p)[i] = v != 0; break;
    }
}

