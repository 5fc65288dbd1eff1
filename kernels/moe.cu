// kernels/moe.cu — the row moves of a mixture-of-experts layer (core/ops.h,
// core/moe.c has the CPU reference): a gather of rows with zeros at the
// padding, the weighted sum of each token's k rows, and that sum's
// backward (each row the token's gradient times its weight, and the
// weight's gradient, a dot product). One block a row; the threads stride
// over the row's H elements (coalesced), sums in f32 (f64 for f64). Ids out
// of range set the device flag (raised at the next sync point) and are
// skipped: nothing is read or written out of bounds.
#include "common.cuh"
#include "kernels.h"

#include <type_traits>

namespace {

__device__ __forceinline__ double ld(const double *p) { return *p; }
__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void st(double *p, double v) { *p = v; }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half *p, float v) { *p = __float2half_rn(v); }

template <typename T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

__device__ __forceinline__ void flag_bad(ms_device_flag *f, long long pos, long long v, long long lim) {
    if (atomicCAS(&f->code, 0, 1) == 0) {
        f->position = pos;
        f->value = v;
        f->limit = lim;
    }
}

template <typename T>
__global__ void gather_rows_kernel(T *out, const T *x, const long long *idx, long long N, long long H,
                                   ms_device_flag *flag) {
    long long r = blockIdx.x;
    long long id = idx[r];
    T *o = out + r * H;
    if (id < 0 || id > N) {
        if (threadIdx.x == 0) flag_bad(flag, r, id, N + 1);
        id = N;
    }
    if (id == N) {
        for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = T(0.0f);
        return;
    }
    const T *s = x + id * H;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = s[h];
}

template <typename T>
__global__ void combine_kernel(T *out, const T *ys, const long long *inv, const T *w, int k, long long M, long long H,
                               ms_device_flag *flag) {
    typedef typename acc_of<T>::type A;
    long long n = blockIdx.x;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) {
        A acc = 0;
        for (int j = 0; j < k; j++) {
            long long s = n * k + j, r = inv[s];
            if (r < 0 || r >= M) {
                if (h == threadIdx.x && threadIdx.x == 0) flag_bad(flag, s, r, M);
                continue;
            }
            A wv = w ? (A)ld(w + s) : (A)1;
            acc += wv * (A)ld(ys + r * H + h);
        }
        st(out + n * H + h, acc);
    }
}

template <typename T>
__global__ void combine_backward_kernel(T *gys, T *gw, const T *g, const T *ys, const long long *back, const T *w,
                                        int k, long long Nk, long long H, ms_device_flag *flag) {
    typedef typename acc_of<T>::type A;
    __shared__ A part[32];
    long long r = blockIdx.x;
    long long s = back[r];
    T *o = gys + r * H;
    if (s < 0 || s > Nk) {
        if (threadIdx.x == 0) flag_bad(flag, r, s, Nk + 1);
        s = Nk;
    }
    if (s == Nk) {
        for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = T(0.0f);
        return;
    }
    const T *gr = g + (s / k) * H, *yr = ys + r * H;
    A wv = (A)ld(w + s), dot = 0;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) {
        A gv = (A)ld(gr + h);
        st(o + h, wv * gv);
        dot += gv * (A)ld(yr + h);
    }
    if (!gw) return;
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, off);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) part[wid] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
        A t = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) t += part[i];
        st(gw + s, t);
    }
}

const int kThreads = 256;

template <typename F> int by_dtype(int dt, F f) {
    switch (dt) {
    case MS_F64: return f((double *)nullptr);
    case MS_F32: return f((float *)nullptr);
    case MS_BF16: return f((__nv_bfloat16 *)nullptr);
    case MS_F16: return f((__half *)nullptr);
    default: return ms_errorf("moe rows: a float dtype is needed, got %d", dt);
    }
}

}  // namespace

extern "C" int ms_cuda_moe_gather_rows(ms_tensor *out, const ms_tensor *x, const ms_tensor *idx) {
    long long M = out->sizes[0], N = x->sizes[0], H = x->sizes[1];
    if (M == 0 || H == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(x->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(x->device_id);
    return by_dtype(x->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        gather_rows_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>((T *)ms_tensor_data(out), (const T *)ms_tensor_data(x),
                                                                (const long long *)ms_tensor_data(idx), N, H, flag);
        LAUNCH_CHECK("moe gather_rows_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_combine(ms_tensor *out, const ms_tensor *ys, const ms_tensor *inv, const ms_tensor *w, int k) {
    long long N = out->sizes[0], M = ys->sizes[0], H = ys->sizes[1];
    if (N == 0 || H == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(ys->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(ys->device_id);
    return by_dtype(ys->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        combine_kernel<T><<<(unsigned)N, kThreads, 0, st_>>>((T *)ms_tensor_data(out), (const T *)ms_tensor_data(ys),
                                                            (const long long *)ms_tensor_data(inv),
                                                            w ? (const T *)ms_tensor_data(w) : nullptr, k, M, H, flag);
        LAUNCH_CHECK("moe combine_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_combine_backward(ms_tensor *gys, ms_tensor *gw, const ms_tensor *g, const ms_tensor *ys,
                                            const ms_tensor *back, const ms_tensor *w, int k) {
    long long M = ys->sizes[0], H = ys->sizes[1], Nk = (long long)g->sizes[0] * k;
    if (M == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(ys->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(ys->device_id);
    return by_dtype(ys->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        combine_backward_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(
            (T *)ms_tensor_data(gys), gw ? (T *)ms_tensor_data(gw) : nullptr, (const T *)ms_tensor_data(g),
            (const T *)ms_tensor_data(ys), (const long long *)ms_tensor_data(back), (const T *)ms_tensor_data(w), k, Nk,
            H, flag);
        LAUNCH_CHECK("moe combine_backward_kernel");
        return 0;
    });
}
