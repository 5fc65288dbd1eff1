// kernels/jsd.cu — the fused linear JSD's row pass on CUDA (core/flce.h
// ms_jsd_rows has the semantics, core/jsd.c the checks and the CPU
// reference, lua/moonshard/jsd.lua the chunk loop and its GEMMs).
//
// One block a row of V student logits s and teacher logits t (f32, already
// divided by the temperature), three sweeps over the row:
//   1. each thread's online max and sum-exp of its s and t elements, then
//      the block's (the pairs merged in a fixed order): lse_s, lse_t;
//   2. the row's loss and Σ q·h (q = exp(s − lse_s), p = exp(t − lse_t),
//      h as in core/flce.h), summed in a fixed order;
//   3. the gradient q − p or q·(h − Σ q h), times scale, stored in g's dtype
//      (bf16 for the GEMMs that follow under autocast).
// The row is read three times (from L2 when it fits, else DRAM) and the
// gradient written once: ~3·2·4 + 2 bytes an element, against the two
// logit GEMMs' and the gradient GEMMs' 2·H flops an element each. Math in
// f32; the same bits on every run. No host sync.
#include "common.cuh"
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

// one more value into a thread's (max, sum-exp)
__device__ __forceinline__ void lse_push(float2 &a, float v) {
    if (v > a.x) {
        a.y = a.y * __expf(a.x - v) + 1.f;
        a.x = v;
    } else if (v != -INFINITY) {
        a.y += __expf(v - a.x);
    }
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

// mode 0: beta 0; 1: beta 1; 2: otherwise
template <typename G, int MODE>
__global__ void __launch_bounds__(kThreads)
jsd_rows_kernel(G *g, float *loss, const float *s, const float *t, const void *labels, int ldt, long long ignore,
                long long V, float beta, float scale) {
    __shared__ float4 sh[kThreads / 32];
    const long long i = blockIdx.x;
    const float *sr = s + i * V, *tr = t + i * V;
    G *gr = g ? g + i * V : nullptr;
    if (labels && label_at(labels, ldt, i) == ignore) {
        if (gr)
            for (long long j = threadIdx.x; j < V; j += blockDim.x) ms_st(gr + j, 0.f);
        if (threadIdx.x == 0) loss[i] = 0.f;
        return;
    }
    // 1. lse of s and t
    float2 a = make_float2(-INFINITY, 0.f), b = make_float2(-INFINITY, 0.f);
    for (long long j = threadIdx.x; j < V; j += blockDim.x) {
        lse_push(a, sr[j]);
        lse_push(b, tr[j]);
    }
    block_lse2(a, b, sh);
    const float lse_s = a.x + __logf(a.y), lse_t = b.x + __logf(b.y);
    const float lb = beta > 0.f ? __logf(beta) : 0.f, l1b = beta < 1.f ? log1pf(-beta) : 0.f;
    // 2. the loss and Σ q h
    float L = 0.f, QH = 0.f;
    for (long long j = threadIdx.x; j < V; j += blockDim.x) {
        const float ls = sr[j] - lse_s, lt = tr[j] - lse_t;
        const float q = __expf(ls);
        if (MODE == 0) {
            L += __expf(lt) * (lt - ls);
        } else if (MODE == 1) {
            L += q * (ls - lt);
        } else {
            const float p = __expf(lt), lm = logaddexpf(ls + l1b, lt + lb);
            L += beta * p * (lt - lm) + (1.f - beta) * q * (ls - lm);
            QH += q * (1.f - beta) * (ls - lm);
        }
    }
    block_sum2(L, QH, sh);
    if (MODE == 1) QH = L;
    if (threadIdx.x == 0) loss[i] = L;
    if (!gr) return;
    // 3. the gradient in s
    for (long long j = threadIdx.x; j < V; j += blockDim.x) {
        const float ls = sr[j] - lse_s, lt = tr[j] - lse_t;
        const float q = __expf(ls);
        float d;
        if (MODE == 0) {
            d = q - __expf(lt);
        } else {
            const float h = MODE == 1 ? ls - lt : (1.f - beta) * (ls - logaddexpf(ls + l1b, lt + lb));
            d = q * (h - QH);
        }
        ms_st(gr + j, d * scale);
    }
}

template <typename G>
int launch(G *g, float *loss, const float *s, const float *t, const void *labels, int ldt, long long ignore,
           long long n, long long V, double beta, double scale, cudaStream_t st) {
    const int mode = beta == 0 ? 0 : (beta == 1 ? 1 : 2);
    const float fb = (float)beta, fs = (float)scale;
    if (mode == 0)
        jsd_rows_kernel<G, 0><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, fb, fs);
    else if (mode == 1)
        jsd_rows_kernel<G, 1><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, fb, fs);
    else
        jsd_rows_kernel<G, 2><<<(unsigned)n, kThreads, 0, st>>>(g, loss, s, t, labels, ldt, ignore, V, fb, fs);
    LAUNCH_CHECK("jsd_rows_kernel");
    return 0;
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
    const float *sp = (const float *)ms_tensor_data(s), *tp = (const float *)ms_tensor_data(t);
    const void *lb = labels ? ms_tensor_data(labels) : nullptr;
    const int ldt = labels ? labels->dtype_id : MS_I64;
    if (!g) return launch<float>(nullptr, lp, sp, tp, lb, ldt, ignore_index, n, V, beta, scale, st);
    switch (g->dtype_id) {
    case MS_F32:
        return launch((float *)ms_tensor_data(g), lp, sp, tp, lb, ldt, ignore_index, n, V, beta, scale, st);
    case MS_BF16:
        return launch((__nv_bfloat16 *)ms_tensor_data(g), lp, sp, tp, lb, ldt, ignore_index, n, V, beta, scale, st);
    case MS_F16:
        return launch((__half *)ms_tensor_data(g), lp, sp, tp, lb, ldt, ignore_index, n, V, beta, scale, st);
    default: return ms_errorf("jsd_rows: g's dtype %s is not supported on cuda", ms_dtype_name(g->dtype_id));
    }
}
