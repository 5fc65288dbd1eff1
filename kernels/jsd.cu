// kernels/jsd.cu — the fused linear JSD's row pass on CUDA (core/flce.h
// ms_jsd_rows has the semantics, core/jsd.c the checks and the CPU
// reference, lua/moonshard/jsd.lua the chunk loop and its GEMMs).
//
// One block a row of V student logits s and teacher logits t (already
// divided by the temperature; f32, or bf16/f16: the logit GEMMs' output in
// the inputs' dtype, as x @ W.T gives in PyTorch), read in 16-byte packs
// where the rows are aligned; three sweeps over the row:
//   1. each thread's online max and sum-exp of its s and t elements, then
//      the block's (the pairs merged in a fixed order): lse_s, lse_t;
//   2. the row's loss and Σ q·h (q = exp(s − lse_s), p = exp(t − lse_t),
//      h as in core/flce.h), summed in a fixed order (at beta 0 with a
//      gradient, the loss is summed in sweep 3: two sweeps);
//   3. the gradient q − p or q·(h − Σ q h), times scale, stored in g's dtype
//      (bf16 for the GEMMs that follow under autocast), in place of s when
//      g is s.
// The row is read three times (from L2 when it fits, else DRAM) and the
// gradient written once: ~3·2·2 + 2 bytes an element with bf16 logits,
// against the two logit GEMMs' and the gradient GEMMs' 2·H flops an element
// each. Math in f32; the same bits on every run. No host sync.
#include <type_traits>

#include "vec.cuh"
#include "kernels.h"
#include "flce.h"

extern "C" {
#include "../core/flce.h"
}

namespace {

constexpr int kThreads = 512;
constexpr unsigned kFull = 0xffffffffu;

// (max, sum-exp) pairs merged: the sum rescaled to the larger max
__device__ __forceinline__ float2 lse_merge(float2 a, float2 b) {
    float m = fmaxf(a.x, b.x);
    if (m == -INFINITY) return make_float2(m, 0.f);
    return make_float2(m, a.y * __expf(a.x - m) + b.y * __expf(b.x - m));
}

// the block's two (max, sum-exp) pairs, on every thread
__device__ void block_lse2(float2 &a, float2 &b, float4 *sh) {
    for (int o = 16; o; o >>= 1) {
        float2 oa = make_float2(__shfl_xor_sync(kFull, a.x, o), __shfl_xor_sync(kFull, a.y, o));
        float2 ob = make_float2(__shfl_xor_sync(kFull, b.x, o), __shfl_xor_sync(kFull, b.y, o));
        a = lse_merge(a, oa);
        b = lse_merge(b, ob);
    }
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (l == 0) sh[w] = make_float4(a.x, a.y, b.x, b.y);
    __syncthreads();
    if (w == 0) {
        float4 v = l < nw ? sh[l] : make_float4(-INFINITY, 0.f, -INFINITY, 0.f);
        a = make_float2(v.x, v.y);
        b = make_float2(v.z, v.w);
        for (int o = 16; o; o >>= 1) {
            float2 oa = make_float2(__shfl_xor_sync(kFull, a.x, o), __shfl_xor_sync(kFull, a.y, o));
            float2 ob = make_float2(__shfl_xor_sync(kFull, b.x, o), __shfl_xor_sync(kFull, b.y, o));
            a = lse_merge(a, oa);
            b = lse_merge(b, ob);
        }
        if (l == 0) sh[0] = make_float4(a.x, a.y, b.x, b.y);
    }
    __syncthreads();
    float4 r = sh[0];
    a = make_float2(r.x, r.y);
    b = make_float2(r.z, r.w);
    __syncthreads();   // (sh is written again by the next reduction)
}

// the block's two sums, on every thread
__device__ void block_sum2(float &x, float &y, float4 *sh) {
    for (int o = 16; o; o >>= 1) {
        x += __shfl_xor_sync(kFull, x, o);
        y += __shfl_xor_sync(kFull, y, o);
    }
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (l == 0) sh[w] = make_float4(x, y, 0.f, 0.f);
    __syncthreads();
    if (w == 0) {
        float4 v = l < nw ? sh[l] : make_float4(0.f, 0.f, 0.f, 0.f);
        x = v.x;
        y = v.y;
        for (int o = 16; o; o >>= 1) {
            x += __shfl_xor_sync(kFull, x, o);
            y += __shfl_xor_sync(kFull, y, o);
        }
        if (l == 0) sh[0] = make_float4(x, y, 0.f, 0.f);
    }
    __syncthreads();
    x = sh[0].x;
    y = sh[0].y;
    __syncthreads();
}

__device__ __forceinline__ float logaddexpf(float a, float b) {
    float m = fmaxf(a, b);
    if (m == -INFINITY) return m;
    return m + __logf(__expf(a - m) + __expf(b - m));
}

__device__ __forceinline__ long long label_at(const void *lb, int ldt, long long i) {
    return ldt == MS_I64 ? ((const long long *)lb)[i] : (long long)((const int *)lb)[i];
}

// a pack of P values more into a thread's (max, sum-exp): one rescale a pack
template <int P>
__device__ __forceinline__ void lse_push_pack(float2 &a, const float *v) {
    float m = v[0];
#pragma unroll
    for (int e = 1; e < P; e++) m = fmaxf(m, v[e]);
    if (m > a.x) {
        a.y *= __expf(a.x - m);   // (0 while a.x is -inf)
        a.x = m;
    }
    if (a.x == -INFINITY) return;
#pragma unroll
    for (int e = 0; e < P; e++) a.y += __expf(v[e] - a.x);
}

// mode 0: beta 0; 1: beta 1; 2: otherwise. L: the logits' storage type
// (f32, or bf16/f16: the logit GEMMs' output in the inputs' dtype), G the
// gradient's; g may be s itself (same type): each thread reads its pack of
// s before it writes that pack of g. P: elements a pack (16 bytes of L when
// the rows are 16-byte aligned, else 1)
template <typename L, typename G, int MODE, int P>
__global__ void __launch_bounds__(kThreads)
jsd_rows_kernel(G *g, float *loss, const L *s, const L *t, const void *labels, int ldt, long long ignore,
                long long V, float beta, float scale) {
    __shared__ float4 sh[kThreads / 32];
    const long long i = blockIdx.x, np = V / P;
    const L *sr = s + i * V, *tr = t + i * V;
    G *gr = g ? g + i * V : nullptr;
    float sv[P], tv[P];
    if (labels && label_at(labels, ldt, i) == ignore) {
        if (gr)
            for (long long j = threadIdx.x; j < V; j += blockDim.x) ms_st(gr + j, 0.f);
        if (threadIdx.x == 0) loss[i] = 0.f;
        return;
    }
    // 1. lse of s and t
    float2 a = make_float2(-INFINITY, 0.f), b = make_float2(-INFINITY, 0.f);
    for (long long k = threadIdx.x; k < np; k += blockDim.x) {
        load_v<float, L, P>(sv, sr + k * P);
        load_v<float, L, P>(tv, tr + k * P);
        lse_push_pack<P>(a, sv);
        lse_push_pack<P>(b, tv);
    }
    block_lse2(a, b, sh);
    const float lse_s = a.x + __logf(a.y), lse_t = b.x + __logf(b.y);
    const float lb = beta > 0.f ? __logf(beta) : 0.f, l1b = beta < 1.f ? log1pf(-beta) : 0.f;
    // 2. the loss and Σ q h (at beta 0 with a gradient to write, the
    // gradient q − p needs no Σ: the loss is summed in sweep 3 instead)
    float L_ = 0.f, QH = 0.f;
    const bool fused = MODE == 0 && gr != nullptr;
    for (long long k = threadIdx.x; k < np && !fused; k += blockDim.x) {
        load_v<float, L, P>(sv, sr + k * P);
        load_v<float, L, P>(tv, tr + k * P);
#pragma unroll
        for (int e = 0; e < P; e++) {
            const float ls = sv[e] - lse_s, lt = tv[e] - lse_t;
            const float q = __expf(ls);
            if (MODE == 0) {
                L_ += __expf(lt) * (lt - ls);
            } else if (MODE == 1) {
                L_ += q * (ls - lt);
            } else {
                const float p = __expf(lt), lm = logaddexpf(ls + l1b, lt + lb);
                L_ += beta * p * (lt - lm) + (1.f - beta) * q * (ls - lm);
                QH += q * (1.f - beta) * (ls - lm);
            }
        }
    }
    if (!fused) {
        block_sum2(L_, QH, sh);
        if (MODE == 1) QH = L_;
        if (threadIdx.x == 0) loss[i] = L_;
        if (!gr) return;
    }
    // 3. the gradient in s
    for (long long k = threadIdx.x; k < np; k += blockDim.x) {
        load_v<float, L, P>(sv, sr + k * P);
        load_v<float, L, P>(tv, tr + k * P);
        float d[P];
#pragma unroll
        for (int e = 0; e < P; e++) {
            const float ls = sv[e] - lse_s, lt = tv[e] - lse_t;
            const float q = __expf(ls);
            if (MODE == 0) {
                const float p = __expf(lt);
                L_ += p * (lt - ls);
                d[e] = (q - p) * scale;
            } else {
                const float h = MODE == 1 ? ls - lt : (1.f - beta) * (ls - logaddexpf(ls + l1b, lt + lb));
                d[e] = q * (h - QH) * scale;
            }
        }
        if constexpr (sizeof(G) * P <= 16) {
            store_v<G, P, float>(gr + k * P, d);
        } else {
#pragma unroll
            for (int e = 0; e < P; e++) ms_st(gr + k * P + e, d[e]);
        }
    }
    if (fused) {
        block_sum2(L_, QH, sh);
        if (threadIdx.x == 0) loss[i] = L_;
    }
}

template <typename L, typename G, int P>
int launch_p(G *g, float *loss, const L *s, const L *t, const void *labels, int ldt, long long ignore, long long n,
             long long V, int mode, float beta, float scale, cudaStream_t st) {
    if (mode == 0)
        jsd_rows_kernel<L, G, 0, P><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, beta, scale);
    else if (mode == 1)
        jsd_rows_kernel<L, G, 1, P><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, beta, scale);
    else
        jsd_rows_kernel<L, G, 2, P><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, beta, scale);
    LAUNCH_CHECK("jsd_rows_kernel");
    return 0;
}

template <typename L, typename G>
int launch(G *g, float *loss, const L *s, const L *t, const void *labels, int ldt, long long ignore, long long n,
           long long V, double beta, double scale, cudaStream_t st) {
    const int mode = beta == 0 ? 0 : (beta == 1 ? 1 : 2);
    constexpr int P = 16 / sizeof(L);
    // packs need every row 16-byte aligned (and g's when it is stored in packs)
    const bool packed = V % P == 0 && ms_aligned16(s) && ms_aligned16(t) &&
                        (!g || sizeof(G) * P > 16 || ms_aligned16(g));
    if (packed) return launch_p<L, G, P>(g, loss, s, t, labels, ldt, ignore, n, V, mode, (float)beta, (float)scale, st);
    return launch_p<L, G, 1>(g, loss, s, t, labels, ldt, ignore, n, V, mode, (float)beta, (float)scale, st);
}

// the gradient's type for logits of type L
template <typename L>
int launch_g(const L *sp, const L *tp, ms_tensor *g, float *lp, const void *lb, int ldt, long long ignore, long long n,
             long long V, double beta, double scale, cudaStream_t st) {
    if (!g) return launch<L, float>(nullptr, lp, sp, tp, lb, ldt, ignore, n, V, beta, scale, st);
    void *gp = ms_tensor_data(g);
    switch (g->dtype_id) {
    case MS_F32: return launch(static_cast<float *>(gp), lp, sp, tp, lb, ldt, ignore, n, V, beta, scale, st);
    case MS_BF16:
        if (std::is_same<L, __half>::value) break;
        return launch(static_cast<__nv_bfloat16 *>(gp), lp, sp, tp, lb, ldt, ignore, n, V, beta, scale, st);
    case MS_F16:
        if (std::is_same<L, __nv_bfloat16>::value) break;
        return launch(static_cast<__half *>(gp), lp, sp, tp, lb, ldt, ignore, n, V, beta, scale, st);
    }
    return ms_errorf("jsd_rows: a %s gradient from %s logits is not supported on cuda", ms_dtype_name(g->dtype_id),
                     std::is_same<L, float>::value ? "f32" : (std::is_same<L, __half>::value ? "f16" : "bf16"));
}

}  // namespace

extern "C" int ms_cuda_jsd_rows(ms_tensor *g, ms_tensor *loss, const ms_tensor *s, const ms_tensor *t,
                                const ms_tensor *labels, int64_t ignore_index, double beta, double scale) {
    const int device = s->device_id;
    if (ms_cuda_activate(device)) return -1;
    const long long n = s->sizes[0], V = s->sizes[1];
    if (n > 2147483647LL) return ms_errorf("jsd_rows: %lld rows in one call (at most 2^31 - 1)", n);
    cudaStream_t st = ms_cuda_stream_of(device);
    float *lp = (float *)ms_tensor_data(loss);
    const void *sp = ms_tensor_data(s), *tp = ms_tensor_data(t);
    const void *lb = labels ? ms_tensor_data(labels) : nullptr;
    const int ldt = labels ? labels->dtype_id : MS_I64;
    switch (s->dtype_id) {
    case MS_F32:
        return launch_g((const float *)sp, (const float *)tp, g, lp, lb, ldt, ignore_index, n, V, beta, scale, st);
    case MS_BF16:
        return launch_g((const __nv_bfloat16 *)sp, (const __nv_bfloat16 *)tp, g, lp, lb, ldt, ignore_index, n, V, beta,
                        scale, st);
    case MS_F16:
        return launch_g((const __half *)sp, (const __half *)tp, g, lp, lb, ldt, ignore_index, n, V, beta, scale, st);
    }
    return ms_errorf("jsd_rows: cuda logits must be f32, bf16 or f16, got %s", ms_dtype_name(s->dtype_id));
}
