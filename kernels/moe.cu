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
#include "vec.cuh"

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

// SwiGLU on a gate-and-up product gu (M, 2 I): h = silu(gate) up, and its
// backward into d13 (M, 2 I): d gate = silu'(gate) dh up, d up = silu(gate)
// dh. One block a row, f32 math (f64 for f64), each element read and
// written once.
template <typename A> __device__ __forceinline__ A sigmoid_a(A x) { return A(1) / (A(1) + exp(-x)); }

template <typename T>
__global__ void swiglu_kernel(T *h, const T *gu, long long I) {
    typedef typename acc_of<T>::type A;
    const long long r = blockIdx.x;
    const T *g = gu + r * 2 * I, *u = g + I;
    T *o = h + r * I;
    for (long long c = threadIdx.x; c < I; c += blockDim.x) {
        A x = ld(g + c);
        st(o + c, x * sigmoid_a(x) * (A)ld(u + c));
    }
}

template <typename T>
__global__ void swiglu_backward_kernel(T *d13, const T *gu, const T *dh, long long I) {
    typedef typename acc_of<T>::type A;
    const long long r = blockIdx.x;
    const T *g = gu + r * 2 * I, *u = g + I, *d = dh + r * I;
    T *dg = d13 + r * 2 * I, *du = dg + I;
    for (long long c = threadIdx.x; c < I; c += blockDim.x) {
        A x = ld(g + c), y = ld(d + c), s = sigmoid_a(x);
        st(du + c, x * s * y);
        st(dg + c, y * (A)ld(u + c) * s * (A(1) + x * (A(1) - s)));
    }
}

const int kThreads = 256;
const int kThreadsVec = 256;

// the same with 16-byte vectors (8 bf16, 4 f32) where I is a multiple of
// a vector and the tensors are 16-byte aligned: a grid-stride loop over
// the vectors, IX the index type (32-bit when the count fits)
template <typename T, typename IX>
__global__ void swiglu_vec_kernel(T *h, const T *gu, IX n, IX iv) {
    typedef typename acc_of<T>::type A;
    const int V = 16 / sizeof(T);
    for (IX i = blockIdx.x * (IX)blockDim.x + threadIdx.x; i < n; i += (IX)gridDim.x * blockDim.x) {
        const IX r = i / iv, c = (i - r * iv) * V, I = iv * V;
        A g[V], u[V], o[V];
        load_v<A, T, V>(g, gu + r * 2 * I + c);
        load_v<A, T, V>(u, gu + r * 2 * I + I + c);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] * sigmoid_a(g[k]) * u[k];
        store_v<T, V, A>(h + r * I + c, o);
    }
}

template <typename T, typename IX>
__global__ void swiglu_backward_vec_kernel(T *d13, const T *gu, const T *dh, IX n, IX iv) {
    typedef typename acc_of<T>::type A;
    const int V = 16 / sizeof(T);
    for (IX i = blockIdx.x * (IX)blockDim.x + threadIdx.x; i < n; i += (IX)gridDim.x * blockDim.x) {
        const IX r = i / iv, c = (i - r * iv) * V, I = iv * V;
        A g[V], u[V], d[V], dg[V], du[V];
        load_v<A, T, V>(g, gu + r * 2 * I + c);
        load_v<A, T, V>(u, gu + r * 2 * I + I + c);
        load_v<A, T, V>(d, dh + r * I + c);
#pragma unroll
        for (int k = 0; k < V; k++) {
            A s = sigmoid_a(g[k]);
            du[k] = g[k] * s * d[k];
            dg[k] = d[k] * u[k] * s * (A(1) + g[k] * (A(1) - s));
        }
        store_v<T, V, A>(d13 + r * 2 * I + c, dg);
        store_v<T, V, A>(d13 + r * 2 * I + I + c, du);
    }
}

// blocks for n vectors: enough to fill the device a few times over
static unsigned vec_blocks(long long n, int device) {
    long long b = (n + kThreadsVec - 1) / kThreadsVec, cap = 16LL * ms_sm_count(device);
    return (unsigned)(b < cap ? b : cap);
}


template <typename F> int by_dtype(int dt, F f) {
    switch (dt) {
    case MS_F64: return f((double *)nullptr);
    case MS_F32: return f((float *)nullptr);
    case MS_BF16: return f((__nv_bfloat16 *)nullptr);
    case MS_F16: return f((__half *)nullptr);
    default: return ms_errorf("moe rows: a float dtype is needed, got %d", dt);
    }
}

// (value, index) a before b: the higher value, then the lower index
template <typename T> __device__ __forceinline__ bool sel_before(T va, int ia, T vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}
// (v, i) into the n best so far (best first, at most cap); returns the count
template <typename T> __device__ __forceinline__ int sel_insert(T *bv, int *bi, int n, int cap, T v, int i) {
    if (n == cap && !sel_before(v, i, bv[n - 1], bi[n - 1])) return n;
    int at = n < cap ? n : cap - 1;
    while (at > 0 && sel_before(v, i, bv[at - 1], bi[at - 1])) {
        bv[at] = bv[at - 1];
        bi[at] = bi[at - 1];
        at--;
    }
    bv[at] = v;
    bi[at] = i;
    return n < cap ? n + 1 : n;
}

// one token a thread: core/ops.h ms_moe_select (core/moe.c is the reference)
template <typename T>
__global__ void select_kernel(long long *ids, const T *scores, const T *bias, long long N, int E, int G, int TG,
                              int how, int k) {
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const T *row = scores + n * E;
    const int per = E / G;
    unsigned long long keep = ~0ull;
    if (G > 1) {
        T gv[MS_MOE_SELECT_MAX];
        int gi[MS_MOE_SELECT_MAX];
        int ng = 0;
        for (int g = 0; g < G; g++) {
            T b1 = -INFINITY, b2 = -INFINITY;
            for (int j = 0; j < per; j++) {
                const int e = g * per + j;
                const T v = row[e] + (bias ? bias[e] : T(0));
                if (v > b1) b2 = b1, b1 = v;
                else if (v > b2) b2 = v;
            }
            ng = sel_insert(gv, gi, ng, TG, how == 0 ? T(b1 + b2) : b1, g);
        }
        keep = 0;
        for (int t = 0; t < ng; t++) keep |= 1ull << gi[t];
    }
    T bv[MS_MOE_SELECT_MAX];
    int bi[MS_MOE_SELECT_MAX];
    int nb = 0;
    for (int e = 0; e < E; e++)
        if (keep >> (e / per) & 1) nb = sel_insert(bv, bi, nb, k, T(row[e] + (bias ? bias[e] : T(0))), e);
    for (int j = 0; j < k; j++) ids[n * k + j] = j < nb ? bi[j] : 0;
}

}  // namespace

extern "C" int ms_cuda_moe_select(ms_tensor *ids, const ms_tensor *scores, const ms_tensor *bias, int G, int TG,
                                  int how, int k) {
    const long long N = scores->sizes[0];
    const int E = (int)scores->sizes[1];
    if (ms_cuda_activate(scores->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(scores->device_id);
    const unsigned blocks = (unsigned)((N + 127) / 128);
    if (scores->dtype_id == MS_F64) {
        select_kernel<double><<<blocks, 128, 0, st_>>>((long long *)ms_tensor_data(ids),
                                                       (const double *)ms_tensor_data(scores),
                                                       bias ? (const double *)ms_tensor_data(bias) : nullptr, N, E, G,
                                                       TG, how, k);
    } else {
        select_kernel<float><<<blocks, 128, 0, st_>>>((long long *)ms_tensor_data(ids),
                                                      (const float *)ms_tensor_data(scores),
                                                      bias ? (const float *)ms_tensor_data(bias) : nullptr, N, E, G, TG,
                                                      how, k);
    }
    LAUNCH_CHECK("moe select_kernel");
    return 0;
}

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

extern "C" int ms_cuda_moe_swiglu(ms_tensor *h, const ms_tensor *gu) {
    long long M = h->sizes[0], I = h->sizes[1];
    if (M == 0 || I == 0) return 0;
    if (ms_cuda_activate(h->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(h->device_id);
    return by_dtype(h->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        const int V = 16 / sizeof(T);
        T *ph = (T *)ms_tensor_data(h);
        const T *pg = (const T *)ms_tensor_data(gu);
        if (I % V == 0 && ms_aligned16(ph) && ms_aligned16(pg)) {
            const long long n = M * (I / V);
            if ((long long)M * 2 * I < (1LL << 31))   // (every offset, d13 and gu the largest, in 32 bits)
                swiglu_vec_kernel<T, unsigned><<<vec_blocks(n, h->device_id), kThreadsVec, 0, st_>>>(ph, pg, (unsigned)n, (unsigned)(I / V));
            else
                swiglu_vec_kernel<T, long long><<<vec_blocks(n, h->device_id), kThreadsVec, 0, st_>>>(ph, pg, n, I / V);
            LAUNCH_CHECK("moe swiglu_vec_kernel");
            return 0;
        }
        swiglu_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(ph, pg, I);
        LAUNCH_CHECK("moe swiglu_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_swiglu_backward(ms_tensor *d13, const ms_tensor *gu, const ms_tensor *dh) {
    long long M = dh->sizes[0], I = dh->sizes[1];
    if (M == 0 || I == 0) return 0;
    if (ms_cuda_activate(dh->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(dh->device_id);
    return by_dtype(dh->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        const int V = 16 / sizeof(T);
        T *pd = (T *)ms_tensor_data(d13);
        const T *pg = (const T *)ms_tensor_data(gu), *ph = (const T *)ms_tensor_data(dh);
        if (I % V == 0 && ms_aligned16(pd) && ms_aligned16(pg) && ms_aligned16(ph)) {
            const long long n = M * (I / V);
            const unsigned nb = vec_blocks(n, dh->device_id);
            if ((long long)M * 2 * I < (1LL << 31))   // (every offset, d13 and gu the largest, in 32 bits)
                swiglu_backward_vec_kernel<T, unsigned><<<nb, kThreadsVec, 0, st_>>>(pd, pg, ph, (unsigned)n, (unsigned)(I / V));
            else
                swiglu_backward_vec_kernel<T, long long><<<nb, kThreadsVec, 0, st_>>>(pd, pg, ph, n, I / V);
            LAUNCH_CHECK("moe swiglu_backward_vec_kernel");
            return 0;
        }
        swiglu_backward_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(pd, pg, ph, I);
        LAUNCH_CHECK("moe swiglu_backward_kernel");
        return 0;
    });
}
