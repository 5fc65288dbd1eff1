// kernels/vec.cuh — what the fused kernels (norm.cu, adamw.cu, rope.cu)
// share: storage <-> compute conversion per dtype (f32 math for f32, bf16,
// f16; f64 for f64), 16-byte vector packs, dtype dispatch into templates,
// deterministic warp sums, and the device's SM count.
#pragma once

#include "common.cuh"

// storage type T <-> compute type (float, or double for double)
template <typename T> struct conv;
template <> struct conv<float> {
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct conv<__nv_bfloat16> {
    static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct conv<__half> {
    static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <> struct conv<double> {
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};

// v rounded to T's precision and back (bf16: one bf16 rounding)
template <typename T, typename A>
__device__ __forceinline__ A round_as(A v) { return (A)conv<T>::load(conv<T>::store(v)); }

// V consecutive elements of T moved as one access (16 bytes when V·sizeof(T)
// is 16); the address must be aligned to V·sizeof(T)
template <typename T, int V>
struct alignas(sizeof(T) * V) vpack {
    T v[V];
};

template <typename A, typename T, int V>
__device__ __forceinline__ void load_v(A *dst, const T *p) {
    vpack<T, V> q = *reinterpret_cast<const vpack<T, V> *>(p);
#pragma unroll
    for (int k = 0; k < V; k++) dst[k] = (A)conv<T>::load(q.v[k]);
}

template <typename T, int V, typename A>
__device__ __forceinline__ void store_v(T *p, const A *src) {
    vpack<T, V> q;
#pragma unroll
    for (int k = 0; k < V; k++) q.v[k] = conv<T>::store(src[k]);
    *reinterpret_cast<vpack<T, V> *>(p) = q;
}

// sum over the 32 lanes, every lane gets it; a fixed butterfly order, so
// the result does not depend on timing
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// f(T{}) with T the storage type of a low-or-single-precision float dtype;
// returns -1 (message set) for the others
template <typename F>
int with_float32_type(int dtype, const char *what, F &&f) {
    switch (dtype) {
    case MS_F32: return f(float{});
    case MS_BF16: return f(__nv_bfloat16{});
    case MS_F16: return f(__half{});
    }
    return ms_errorf("%s: dtype %s is not supported by the kernel", what, ms_dtype_name(dtype));
}

static inline bool ms_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// streaming multiprocessors of `device` (cached)
static inline int ms_sm_count(int device) {
    static int cache[64];
    if (device < 0 || device >= 64) return 1;
    if (!cache[device]) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) n = 1;
        cache[device] = n;
    }
    return cache[device];
}

// blocks of `kernel` (threads, dynamic smem bytes) resident on all of
// device's SMs at once: one wave, for grid-stride kernels whose blocks each
// leave a partial row to add up. The occupancy query runs once per (kernel,
// device, threads, smem) seen, not per launch: the last few are kept (norm
// and GELU backwards run it every layer). 0 on error.
template <typename K>
static inline long long ms_one_wave(K kernel, int device, int threads, size_t smem) {
    struct entry { const void *fn; int device, threads; size_t smem; long long blocks; };
    static entry seen[8];
    static int nseen;
    const void *fn = (const void *)kernel;
    for (int i = 0; i < nseen; i++)
        if (seen[i].fn == fn && seen[i].device == device && seen[i].threads == threads && seen[i].smem == smem)
            return seen[i].blocks;
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) return 0;
    if (per_sm < 1) per_sm = 1;
    const long long blocks = (long long)ms_sm_count(device) * per_sm;
    seen[nseen < 8 ? nseen++ : 7] = {fn, device, threads, smem, blocks};
    return blocks;
}
