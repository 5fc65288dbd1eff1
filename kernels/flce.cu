// kernels/flce.cu — fused linear cross-entropy on CUDA: the steps between
// the GEMMs (core/flce.h has the semantics, core/flce.c the chunk loop).
//
// Per chunk of n tokens, core/flce.c runs
//   logits (n, V) = x_c Wᵀ                  cuBLASLt, 2·n·V·H flops
//   flce_rows_kernel                        this file: the fused row pass
//   grad_x[c] (n, H) = dlogits W            cuBLASLt, 2·n·V·H flops
//   grad_W (V, H) += dlogitsᵀ x_c           cuBLASLt, 2·n·V·H flops, f32 accumulator
//   grad_bias (V) += Σ_rows dlogits         flce_colsum_kernel (with a bias only)
// so the whole op costs the three GEMMs' 6·BT·V·H flops plus, per chunk, one
// read and write of the grad_W accumulator (2·V·H·4 bytes; hence chunks of
// ~1k rows, see ms_flce_chunk_rows) and the row pass's 3·n·V·2 bytes (bf16).
//
// Why fused: the row pass is the whole of softmax + cross-entropy + z-loss +
// accuracy + softmax backward in one kernel, one block per token, with the
// logits read twice (online max/sum-exp, then the gradient) and overwritten
// once by d loss / d logits. Nothing of size (n, V) is allocated besides the
// chunk buffer, and the (BT, V) logits never exist. Math is f32, exponentials
// in base 2 (exp2f of logits pre-scaled by log2 e); the logits and their
// gradient are stored in the input dtype (bf16 for bf16 inputs, as x@Wᵀ in
// PyTorch stores them), so the GEMMs read bf16 and accumulate in f32.
//
// No host sync: the valid-token count and the summed target weights (the
// divisors of 'mean') are computed on the device by flce_prep_kernel before
// the first chunk and read by the row pass; out-of-range targets set the
// device flag (kernels/common.cuh) with position and value, raised at the
// next sync point, and count as ignored meanwhile. Reductions run in a fixed
// order (warp butterflies, one block for the final sums): the same bits on
// every run.
#include "common.cuh"
#include "kernels.h"
#include "flce.h"

extern "C" {
#include "../core/flce.h"
}

#include <limits.h>

#include <type_traits>

// ---------------------------------------------------------------- kernels

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kRowThreads = 512;
constexpr int kOneBlock = 1024;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ void flce_flag_bad(ms_device_flag *f, long long pos, long long v, long long lim) {
    if (atomicCAS(&f->code, 0, 1) == 0) {
        f->position = pos;
        f->value = v;
        f->limit = lim;
    }
}

__device__ __forceinline__ long long target_at(const void *tg, int tdt, long long i) {
    return tdt == MS_I64 ? ((const long long *)tg)[i] : (long long)((const int *)tg)[i];
}

// VEC elements loaded or stored in one instruction (16 bytes when VEC·sizeof(T) is)
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

// (m, s) of a base-2 online sum-exp: Σ 2^(u - m) = s
__device__ __forceinline__ void merge_sumexp(float &m, float &s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * exp2f(m - mm) + s2 * exp2f(m2 - mm);
    m = mm;
}

// larger value wins, the smaller index on ties (torch.argmax: the first)
__device__ __forceinline__ void merge_argmax(float &b, int &i, float b2, int i2) {
    if (b2 > b || (b2 == b && i2 < i)) {
        b = b2;
        i = i2;
    }
}

// What one thread (then, reduced, one block) knows of its row after pass 1.
struct RowStat {
    float m;    // max of u = z·log2 e (base 2)
    float s;    // Σ 2^(u - m)
    float best; // max z
    int idx;    // the first index of best (INT_MAX: none seen)
    float swz;  // Σ w z (label smoothing only)
    float zy;   // z of the target (0 where the target is not among the row's classes; summed)
};

__device__ __forceinline__ RowStat row_stat_empty() { return RowStat{-INFINITY, 0.0f, -INFINITY, INT_MAX, 0.0f, 0.0f}; }

// pass 1 over a row of V classes (bias and softcap applied): this thread's
// elements. yl: the target's index among these classes (any other value:
// not here).
// cache (or NULL): shared memory of V elements that keeps what this thread
// read, for row_pass2 (each thread reads back only its own elements: no
// barrier needed between the passes for it)
template <typename T, int VEC>
__device__ __forceinline__ RowStat row_pass1(const T *row, const T *bias, const float *cew, int V, long long yl,
                                             float cap, float inv_cap, bool smooth, T *cache = nullptr) {
    RowStat st = row_stat_empty();
    for (int k0 = threadIdx.x * VEC; k0 < V; k0 += blockDim.x * VEC) {
        Pack<T, VEC> pk = *(const Pack<T, VEC> *)(row + k0);
        if (cache) *(Pack<T, VEC> *)(cache + k0) = pk;
        float u[VEC];
        float vmax = -INFINITY;
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            float z = ms_ld(&pk.v[e]);
            if (bias) z += ms_ld(bias + k0 + e);
            if (cap > 0) z = cap * tanhf(z * inv_cap);
            if (z > st.best) {
                st.best = z;
                st.idx = k0 + e;
            }
            if (smooth) st.swz += (cew ? cew[k0 + e] : 1.0f) * z;
            if (k0 + e == yl) st.zy = z;
            u[e] = z * kLog2e;
            vmax = fmaxf(vmax, u[e]);
        }
        float mm = fmaxf(st.m, vmax);
        if (mm == -INFINITY) continue;
        float acc = st.s * exp2f(st.m - mm);
#pragma unroll
        for (int e = 0; e < VEC; e++) acc += exp2f(u[e] - mm);
        st.s = acc;
        st.m = mm;
    }
    return st;
}

__device__ __forceinline__ void warp_merge(RowStat &a) {
    for (int off = 16; off > 0; off >>= 1) {
        merge_sumexp(a.m, a.s, __shfl_xor_sync(kFull, a.m, off), __shfl_xor_sync(kFull, a.s, off));
        merge_argmax(a.best, a.idx, __shfl_xor_sync(kFull, a.best, off), __shfl_xor_sync(kFull, a.idx, off));
        a.swz += __shfl_xor_sync(kFull, a.swz, off);
        a.zy += __shfl_xor_sync(kFull, a.zy, off);
    }
}

// the block's statistics of its row, in every thread (warp butterflies,
// then warp 0 over the warps: a fixed order, the same bits on every run);
// called once per kernel
__device__ RowStat block_reduce_row(RowStat st) {
    __shared__ RowStat sh[32];
    warp_merge(st);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    if (lane == 0) sh[warp] = st;
    __syncthreads();
    if (warp == 0) {
        st = lane < nwarps ? sh[lane] : row_stat_empty();
        warp_merge(st);
        if (lane == 0) sh[0] = st;
    }
    __syncthreads();
    return sh[0];
}

// d(g·loss)/dz_j = a·p_j - s·w_j - [j == y]·y, from scal = (D, Σw, N)
struct Coefs {
    float a, s, y;
};

__device__ __forceinline__ Coefs row_coefs(const ms_flce_params &p, const double *scal, float g, float wy, float lse) {
    const double D = scal[0], wsum = scal[1], N = scal[2];
    float c = g, cz = g;
    if (p.reduction == MS_FLCE_MEAN) {
        c = D > 0 ? (float)(g / D) : 0.0f;
        cz = N > 0 ? (float)(g / N) : 0.0f;
    }
    const float eps = p.label_smoothing, inv_v = 1.0f / (float)p.vtot;
    Coefs k;
    k.a = c * ((1 - eps) * wy + eps * inv_v * (float)wsum) + cz * 2 * p.lse_square_scale * lse;
    k.y = c * (1 - eps) * wy;
    k.s = c * eps * inv_v;
    return k;
}

// ce_i = (1-ε)·w_y·(lse - z_y) + (ε/V)·(Σw·lse - Σ w z)
__device__ __forceinline__ float row_ce(const ms_flce_params &p, float wsum, float wy, float lse, float zy, float swz) {
    const float eps = p.label_smoothing;
    return (1 - eps) * wy * (lse - zy) + eps / (float)p.vtot * (wsum * lse - swz);
}

// pass 2: the row's logits become the gradient, in place
template <typename T, int VEC>
__device__ __forceinline__ void row_pass2(T *row, const T *bias, const float *cew, int V, long long yl, float cap,
                                          float inv_cap, float lse2, const Coefs &k, const T *cache = nullptr) {
    for (int k0 = threadIdx.x * VEC; k0 < V; k0 += blockDim.x * VEC) {
        Pack<T, VEC> pk = *(const Pack<T, VEC> *)((cache ? cache : row) + k0);
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            const int j = k0 + e;
            float z = ms_ld(&pk.v[e]), t = 0.0f;
            if (bias) z += ms_ld(bias + j);
            if (cap > 0) {
                t = tanhf(z * inv_cap);
                z = cap * t;
            }
            float d = k.a * exp2f(z * kLog2e - lse2);
            if (k.s != 0.0f) d -= k.s * (cew ? cew[j] : 1.0f);
            if (j == yl) d -= k.y;
            if (cap > 0) d *= 1.0f - t * t;
            ms_st(&pk.v[e], d);
        }
        *(Pack<T, VEC> *)(row + k0) = pk;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void row_zero(T *row, int V) {
    Pack<T, VEC> zero;
#pragma unroll
    for (int e = 0; e < VEC; e++) ms_st(&zero.v[e], 0.0f);
    for (int k = threadIdx.x * VEC; k < V; k += blockDim.x * VEC) *(Pack<T, VEC> *)(row + k) = zero;
}

__device__ __forceinline__ bool target_valid(const ms_flce_params &p, long long y) {
    return y != p.ignore_index && y >= 0 && y < p.vtot;
}

// The plain case (no bias, class weights, softcap or label smoothing; the
// z-loss and every reduction allowed), with the per-element work cut to
// what the math needs (the row pass was bound by integer/logic issue, not
// by memory): pass 1 keeps the max and the first pack that reaches it, not
// a per-element argmax, and neither pass compares indices with the target
// (its logit is read once, its gradient fixed up by the thread that owns
// it). Same results as the general passes.
// the U packs of a thread at kb, kb + stride, ... (those below V), all
// loaded before any is used: more bytes in flight a thread
template <typename T, int VEC, int U>
__device__ __forceinline__ void load_packs(Pack<T, VEC> (&pks)[U], const T *src, int kb, int stride, int V) {
#pragma unroll
    for (int u = 0; u < U; u++)
        if (kb + u * stride < V) pks[u] = *(const Pack<T, VEC> *)(src + kb + u * stride);
}

// this thread's 16-byte packs of the row (k0 = thread*VEC, + stride, ...)
// into the same places of the shared copy, all in flight at once (cp.async),
// landed when it returns: each thread reads back only its own packs
template <typename T, int VEC>
__device__ __forceinline__ void row_prefetch(T *cache, const T *row, int V) {
    static_assert(sizeof(Pack<T, VEC>) == 16, "16-byte packs");
    const int stride = blockDim.x * VEC;
    for (int k0 = threadIdx.x * VEC; k0 < V; k0 += stride)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(cache + k0)),
                     "l"(row + k0)
                     : "memory");
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

template <typename T, int VEC, int U>
__device__ __forceinline__ RowStat row_pass1_plain(const T *row, int V, T *cache, bool prefetch) {
    // prefetch (cache, 16-byte packs): the whole row into the shared copy
    // first, every pack of the thread in flight at once, then read from
    // there (one 16-byte load a thread in flight left pass 1 waiting on
    // device memory: 77% of its stall samples, 65% of DRAM bandwidth).
    // Otherwise U packs a thread loaded before any is used (see
    // row_unroll_forced); each thread still takes its packs in the order k0,
    // k0 + stride, ...: the same bits either way
    if constexpr (sizeof(Pack<T, VEC>) == 16) {
        if (prefetch && cache) {
            row_prefetch<T, VEC>(cache, row, V);
            row = cache;
        }
    }
    const bool keep = cache && row != cache;
    RowStat st = row_stat_empty();
    const int stride = blockDim.x * VEC;
    for (int kb = threadIdx.x * VEC; kb < V; kb += U * stride) {
        Pack<T, VEC> pks[U];
        load_packs<T, VEC, U>(pks, row, kb, stride, V);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k0 = kb + u * stride;
            if (k0 >= V) break;
            const Pack<T, VEC> &pk = pks[u];
            if (keep) *(Pack<T, VEC> *)(cache + k0) = pk;
            float z[VEC];
            float zmax = -INFINITY;
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                z[e] = ms_ld(&pk.v[e]);
                zmax = fmaxf(zmax, z[e]);
            }
            if (zmax > st.best) {   // the first pack of this thread's max (its exact index: row_first_max)
                st.best = zmax;
                st.idx = k0;
            }
            const float mm = fmaxf(st.m, zmax * kLog2e);
            if (mm == -INFINITY) continue;
            float acc = st.s * exp2f(st.m - mm);
#pragma unroll
            for (int e = 0; e < VEC; e++) acc += exp2f(fmaf(z[e], kLog2e, -mm));
            st.s = acc;
            st.m = mm;
        }
    }
    return st;
}

// the first index in the pack at k0 whose logit equals best (the block's
// argmax, torch's first-index rule: packs are merged smaller-k0-first)
template <typename T, int VEC>
__device__ __forceinline__ int row_first_max(const T *src, int k0, float best) {
    Pack<T, VEC> pk = *(const Pack<T, VEC> *)(src + k0);
#pragma unroll
    for (int e = 0; e < VEC; e++)
        if (ms_ld(&pk.v[e]) == best) return k0 + e;
    return k0;
}

template <typename T, int VEC, int U>
__device__ __forceinline__ void row_pass2_plain(T *row, int V, int yl, float lse2, const Coefs &k, const T *cache) {
    const T *src = cache ? cache : row;
    // the target's element belongs to this thread's packs or to no other:
    // its logit read before the loop overwrites it, its gradient rewritten
    // after (the same thread's stores, in order)
    const bool owner = ((yl / VEC) % (int)blockDim.x) == (int)threadIdx.x;
    const float zy = owner ? ms_ld(src + yl) : 0.0f;
    const int stride = blockDim.x * VEC;
    for (int kb = threadIdx.x * VEC; kb < V; kb += U * stride) {
        Pack<T, VEC> pks[U];   // loaded first, as in pass 1
        load_packs<T, VEC, U>(pks, src, kb, stride, V);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k0 = kb + u * stride;
            if (k0 >= V) break;
#pragma unroll
            for (int e = 0; e < VEC; e++) ms_st(&pks[u].v[e], k.a * exp2f(fmaf(ms_ld(&pks[u].v[e]), kLog2e, -lse2)));
            *(Pack<T, VEC> *)(row + k0) = pks[u];
        }
    }
    if (owner) ms_st(row + yl, k.a * exp2f(fmaf(zy, kLog2e, -lse2)) - k.y);
}

// One block per token of the chunk. Row r of `logits` (V) holds x_i·Wᵀ on
// entry and d(Σ grad_scale·loss)/d logits on exit (want_grad); rows[i] gets
// (ce_i, zl_i, hit_i). scal: (D, Σw, N) from flce_prep_kernel.
template <typename T, int VEC, bool PLAIN, int U = 1>
__global__ void __launch_bounds__(kRowThreads)
flce_rows_kernel(T *logits, const T *bias, const float *cew, const void *tg, int tdt, const float *gs,
                 int gs_per_row, const double *scal, float *rows, ms_flce_params p, int row_cached, int row_prefetch) {
    const long long r = blockIdx.x, i = p.row0 + r;
    const int V = (int)p.v;
    T *row = logits + r * p.v;
    const long long y = target_at(tg, tdt, i);
    if (!target_valid(p, y)) {  // ignored (or flagged by prep): no loss, no gradient
        if (p.want_grad) row_zero<T, VEC>(row, V);
        if (threadIdx.x == 0) rows[3 * i] = rows[3 * i + 1] = rows[3 * i + 2] = 0.0f;
        return;
    }
    const float cap = p.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    // the row in shared memory between the passes when the launch gave room
    // for it (row_cache_bytes): pass 2 then reads no device memory
    extern __shared__ __align__(16) unsigned char row_smem[];
    T *cache = p.want_grad && row_cached ? reinterpret_cast<T *>(row_smem) : nullptr;
    if constexpr (PLAIN) {
        const RowStat st = block_reduce_row(row_pass1_plain<T, VEC, U>(row, V, cache, row_prefetch != 0));
        const float lse2 = st.m + log2f(st.s), lse = lse2 * kLn2;
        const T *src = cache ? cache : row;   // (block_reduce_row's barrier: every thread's copy is in)
        const int yl = (int)y;
        // reads of the row here are each by the thread that overwrites that
        // pack in pass 2, before it does (without the shared copy, src is the
        // row itself): the target's owner writes the loss, the max's owner
        // the hit
        if (((yl / VEC) % (int)blockDim.x) == (int)threadIdx.x)
            rows[3 * i] = row_ce(p, (float)scal[1], 1.0f, lse, ms_ld(src + yl), 0.0f);
        if (threadIdx.x == 0) rows[3 * i + 1] = p.lse_square_scale * lse * lse;
        if (st.idx != INT_MAX && ((st.idx / VEC) % (int)blockDim.x) == (int)threadIdx.x)
            rows[3 * i + 2] = row_first_max<T, VEC>(src, st.idx, st.best) == yl ? 1.0f : 0.0f;
        else if (st.idx == INT_MAX && threadIdx.x == 0)
            rows[3 * i + 2] = 0.0f;
        if (!p.want_grad) return;
        const float g = gs ? gs[gs_per_row ? i : 0] : 1.0f;
        row_pass2_plain<T, VEC, U>(row, V, yl, lse2, row_coefs(p, scal, g, 1.0f, lse), cache);
        return;
    }
    const RowStat st =
        block_reduce_row(row_pass1<T, VEC>(row, bias, cew, V, y, cap, inv_cap, p.label_smoothing > 0, cache));
    const float lse2 = st.m + log2f(st.s), lse = lse2 * kLn2;
    const float wy = cew ? cew[y] : 1.0f;
    if (threadIdx.x == 0) {
        rows[3 * i] = row_ce(p, (float)scal[1], wy, lse, st.zy, st.swz);
        rows[3 * i + 1] = p.lse_square_scale * lse * lse;
        rows[3 * i + 2] = st.idx == y ? 1.0f : 0.0f;
    }
    if (!p.want_grad) return;
    const float g = gs ? gs[gs_per_row ? i : 0] : 1.0f;
    row_pass2<T, VEC>(row, bias, cew, V, y, cap, inv_cap, lse2, row_coefs(p, scal, g, wy, lse), cache);
}

// Vocabulary-parallel, step 1: this rank's statistics of each row into
// st (7, n): m (base 2), best, s, z_y, Σ w z, w_y (0 when the target is
// another rank's), the global index of the first best (+inf: none).
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
flce_vp_stats_kernel(const T *logits, const T *bias, const float *cew, const void *tg, int tdt, float *st,
                     ms_flce_params p) {
    const long long r = blockIdx.x, i = p.row0 + r, n = p.n;
    const long long y = target_at(tg, tdt, i), yl = y - p.v0;
    float v[7] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, INFINITY};
    if (target_valid(p, y)) {  // the same rows on every rank: ignored ones stay zeros
        const float cap = p.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
        const RowStat s = block_reduce_row(
            row_pass1<T, VEC>(logits + r * p.v, bias, cew, (int)p.v, yl, cap, inv_cap, p.label_smoothing > 0));
        const bool local = yl >= 0 && yl < p.v;
        v[0] = s.m;
        v[1] = s.best;
        v[2] = s.s;
        v[3] = s.zy;
        v[4] = s.swz;
        v[5] = local ? (cew ? cew[yl] : 1.0f) : 0.0f;
        v[6] = s.idx == INT_MAX ? INFINITY : (float)(p.v0 + s.idx);
    }
    if (threadIdx.x == 0)
        for (int k = 0; k < 7; k++) st[k * n + r] = v[k];
}

// step 2, after the MAX all-reduce of st's first two rows into mx: each
// rank's sum-exp moves to the group's max; its index stays only where it
// holds the group's best (then the MIN all-reduce picks the first one)
__global__ void flce_vp_fix_kernel(float *st, const float *mx, long long n) {
    for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < n; r += (long long)gridDim.x * blockDim.x) {
        const float m = st[r];
        st[2 * n + r] = m == -INFINITY ? 0.0f : st[2 * n + r] * exp2f(m - mx[r]);
        if (st[n + r] != mx[n + r]) st[6 * n + r] = INFINITY;
    }
}

// step 3, after the SUM (rows 2..5) and MIN (row 6) all-reduces: rows and
// this rank's part of the gradient, from the group's statistics
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
flce_vp_grad_kernel(T *logits, const T *bias, const float *cew, const void *tg, int tdt, const float *gs,
                    int gs_per_row, const double *scal, const float *st, const float *mx, float *rows,
                    ms_flce_params p) {
    const long long r = blockIdx.x, i = p.row0 + r, n = p.n;
    const int V = (int)p.v;
    T *row = logits + r * p.v;
    const long long y = target_at(tg, tdt, i);
    if (!target_valid(p, y)) {
        if (p.want_grad) row_zero<T, VEC>(row, V);
        if (threadIdx.x == 0) rows[3 * i] = rows[3 * i + 1] = rows[3 * i + 2] = 0.0f;
        return;
    }
    const float lse2 = mx[r] + log2f(st[2 * n + r]), lse = lse2 * kLn2;
    const float wy = st[5 * n + r];
    if (threadIdx.x == 0) {
        rows[3 * i] = row_ce(p, (float)scal[1], wy, lse, st[3 * n + r], st[4 * n + r]);
        rows[3 * i + 1] = p.lse_square_scale * lse * lse;
        rows[3 * i + 2] = st[6 * n + r] == (float)y ? 1.0f : 0.0f;
    }
    if (!p.want_grad) return;
    const float cap = p.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const float g = gs ? gs[gs_per_row ? i : 0] : 1.0f;
    row_pass2<T, VEC>(row, bias, cew, V, y - p.v0, cap, inv_cap, lse2, row_coefs(p, scal, g, wy, lse));
}

// sum of a double over one block, in a fixed order; the result in thread 0
__device__ double block_sum(double v, double *sh) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = 0;
    if (warp == 0) {
        v = lane < nwarps ? sh[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
    }
    return v;
}

// one block: scal = (Σ w_y over valid targets among the classes [v0, v0+v),
// Σ_k w_k, #valid); targets outside [0, vtot) flagged
__global__ void __launch_bounds__(kOneBlock)
flce_prep_kernel(const void *tg, int tdt, long long bt, const float *cew, long long v0, long long v, long long vtot,
                 long long ignore, double *scal, ms_device_flag *flag) {
    __shared__ double sh[32];
    double d = 0, n = 0, ws = 0;
    for (long long i = threadIdx.x; i < bt; i += blockDim.x) {
        long long y = target_at(tg, tdt, i);
        if (y == ignore) continue;
        if (y < 0 || y >= vtot) {
            flce_flag_bad(flag, i, y, vtot);
            continue;
        }
        n += 1;
        if (y >= v0 && y < v0 + v) d += cew ? (double)cew[y - v0] : 1.0;
    }
    if (cew)
        for (long long k = threadIdx.x; k < v; k += blockDim.x) ws += cew[k];
    d = block_sum(d, sh);
    n = block_sum(n, sh);
    ws = block_sum(ws, sh);
    if (threadIdx.x == 0) {
        scal[0] = d;
        scal[1] = cew ? ws : (double)v;
        scal[2] = n;
    }
}

// acc (V) = (accumulate ? acc : 0) + Σ_r dl[r, :], rows in order
template <typename T, typename A>
__global__ void flce_colsum_kernel(A *acc, const T *dl, long long n, long long v, int accumulate) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < v;
         k += (long long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (long long r = 0; r < n; r++) s += ms_ld(dl + r * v + k);
        ms_st(acc + k, (accumulate ? ms_ld(acc + k) : 0.0f) + s);
    }
}

// one block: rows (BT, 3) -> loss, z-loss, accuracy (null pointers skipped)
__global__ void __launch_bounds__(kOneBlock)
flce_finish_kernel(const float *rows, long long bt, const double *scal, int reduction, float *loss,
                   long long loss_st, float *zl, long long zl_st, float *acc) {
    __shared__ double sh[32];
    double ce = 0, z = 0, hit = 0;
    for (long long i = threadIdx.x; i < bt; i += blockDim.x) {
        float a = rows[3 * i], b = rows[3 * i + 1];
        ce += a;
        z += b;
        hit += rows[3 * i + 2];
        if (reduction == MS_FLCE_NONE) {
            if (loss) loss[i * loss_st] = a + b;
            if (zl) zl[i * zl_st] = b;
        }
    }
    ce = block_sum(ce, sh);
    z = block_sum(z, sh);
    hit = block_sum(hit, sh);
    if (threadIdx.x != 0) return;
    const double D = scal[0], N = scal[2];
    if (reduction == MS_FLCE_MEAN) {
        ce = D > 0 ? ce / D : 0.0;
        z = N > 0 ? z / N : 0.0;
    }
    if (reduction != MS_FLCE_NONE) {
        if (loss) *loss = (float)(ce + z);
        if (zl) *zl = (float)z;
    }
    if (acc) *acc = N > 0 ? (float)(hit / N) : 0.0f;
}

// t *= g[0], skipped (every block returns at once) when g[0] == 1: the
// launcher caps the grid at a few blocks an SM (the loop strides), since a
// grid of one block per 256 elements costs its launch even when every block
// returns at once (~0.6 ms for a 128256 x 2048 grad_W on an H200)
template <typename T>
__global__ void flce_scale_kernel(T *t, long long n, const void *g, int gdt) {
    const float s = (float)ld_any(g, gdt, 0);
    if (s == 1.0f) return;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        ms_st(t + i, ms_ld(t + i) * s);
}

}  // namespace

// -------------------------------------------------------------- launchers

namespace {

template <typename T>
struct tag {
    using type = T;
};

// f(tag<T>{}) for the float dtypes the row pass takes
template <typename F>
int by_dtype(int dtype, F f) {
    switch (dtype) {
    case MS_F32: return f(tag<float>{});
    case MS_BF16: return f(tag<__nv_bfloat16>{});
    case MS_F16: return f(tag<__half>{});
    default: return ms_errorf("flce: dtype %s is not supported on cuda", ms_dtype_name(dtype));
    }
}

// launch(vec) with vec = std::integral_constant<int, VEC>: 16-byte loads
// when every row starts 16-byte aligned (V a multiple of VEC), else one
// element at a time
template <typename T, typename L>
int row_launch(const ms_tensor *lg, const ms_flce_params *p, L launch) {
    constexpr int VEC = 16 / sizeof(T);
    if (p->v % VEC == 0 && ((uintptr_t)ms_tensor_data(lg) % 16) == 0) launch(std::integral_constant<int, VEC>{});
    else launch(std::integral_constant<int, 1>{});
    return 0;
}

template <typename T>
int launch_colsum(ms_tensor *acc, const ms_tensor *dl, int accumulate, cudaStream_t st) {
    long long n = dl->sizes[0], v = dl->sizes[1];
    const T *d = (const T *)ms_tensor_data(dl);
    int grid = ms_grid(v, 256);
    if (acc->dtype_id == MS_F32)
        flce_colsum_kernel<T, float><<<grid, 256, 0, st>>>((float *)ms_tensor_data(acc), d, n, v, accumulate);
    else if (acc->dtype_id == dl->dtype_id)
        flce_colsum_kernel<T, T><<<grid, 256, 0, st>>>((T *)ms_tensor_data(acc), d, n, v, accumulate);
    else
        return ms_errorf("flce_colsum: accumulator %s for gradients in %s", ms_dtype_name(acc->dtype_id),
                         ms_dtype_name(dl->dtype_id));
    LAUNCH_CHECK("flce_colsum_kernel");
    return 0;
}

int need_contiguous(const char *what, const ms_tensor *t) {
    char d[200];
    if (t && !ms_tensor_is_contiguous(t))
        return ms_errorf("flce: %s %s must be contiguous here", what, ms_desc(t, d, sizeof d));
    return 0;
}

// the checks every row-pass launcher makes
int row_pass_ready(const ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                   const ms_tensor *targets, const ms_tensor *grad_scale, const ms_flce_params *p) {
    if (p->v > INT_MAX / 2) return ms_errorf("flce: %lld classes are more than the row pass handles", (long long)p->v);
    if (ms_cuda_activate(logits->device_id) || need_contiguous("logits", logits) || need_contiguous("bias", bias) ||
        need_contiguous("targets", targets) || need_contiguous("grad_scale", grad_scale) ||
        need_contiguous("ce_weight", ce_weight))
        return -1;
    if ((ce_weight && ce_weight->dtype_id != MS_F32) || (grad_scale && grad_scale->dtype_id != MS_F32) ||
        (bias && bias->dtype_id != logits->dtype_id))
        return ms_errorf("flce: ce_weight and grad_scale must be f32, bias in the logits' dtype");
    return 0;
}

template <typename T>
const T *data_or_null(const ms_tensor *t) {
    return t ? (const T *)ms_tensor_data(t) : nullptr;
}

}  // namespace

extern "C" int ms_cuda_flce_prep(const ms_tensor *targets, const ms_tensor *ce_weight, int64_t v0, int64_t v,
                                 int64_t vtot, int64_t ignore_index, ms_tensor *scal) {
    int device = targets->device_id;
    if (ms_cuda_activate(device) || need_contiguous("targets", targets) || need_contiguous("ce_weight", ce_weight))
        return -1;
    if (ce_weight && ce_weight->dtype_id != MS_F32) return ms_errorf("flce_prep: ce_weight must be f32");
    ms_device_flag *flag = ms_cuda_device_flag(device);
    if (!flag) return -1;
    flce_prep_kernel<<<1, kOneBlock, 0, ms_cuda_stream_of(device)>>>(
        ms_tensor_data(targets), targets->dtype_id, (long long)targets->sizes[0], data_or_null<float>(ce_weight),
        (long long)v0, (long long)v, (long long)vtot, (long long)ignore_index, (double *)ms_tensor_data(scal), flag);
    LAUNCH_CHECK("flce_prep_kernel");
    return 0;
}

// Shared memory for a row between the two passes of flce_rows_kernel: its
// bytes when two blocks of an SM can each hold one (V up to ~56k in bf16:
// GPT-2's 50304), else 0 and pass 2 reads the row again (from L2 when the
// rows in flight fit there). MS_FLCE_ROW_CACHE=0 turns it off.
size_t row_cache_bytes(int device, long long row_bytes) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("MS_FLCE_ROW_CACHE");
        on = !(e && e[0] == '0');
    }
    static int smem_of[64], optin_of[64];   // per device, read once
    if (device < 0 || device >= 64) return 0;
    if (!optin_of[device]) {
        cudaDeviceGetAttribute(&smem_of[device], cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
        cudaDeviceGetAttribute(&optin_of[device], cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    const int smem_sm = smem_of[device], optin = optin_of[device];
    size_t need = ((size_t)row_bytes + 15) / 16 * 16, stat = 1024;   // + the block's static reduction arrays
    if (!on || need + stat > (size_t)optin || 2 * (need + stat) > (size_t)smem_sm) return 0;
    return need;
}

// How many 16-byte packs a thread of the plain row pass loads before using
// them. 4 when pass 2 reads the row from device memory again (V beyond the
// row cache: more bytes in flight a thread, bench/flce.lua 0.3-0.7% faster
// on an H100), 1 when the row is cached in shared memory (GPT-2's head: 4
// was ~1% slower a step there). MS_FLCE_ROW_UNROLL=1 or 4 (or
// ms_cuda_flce_set_row_unroll) forces one for both; the same bits either way.
int g_row_unroll = -1;   // 0: by the row cache, else forced
int row_unroll_forced() {
    if (g_row_unroll < 0) {
        const char *e = getenv("MS_FLCE_ROW_UNROLL");
        g_row_unroll = e && strcmp(e, "1") == 0 ? 1 : e && strcmp(e, "4") == 0 ? 4 : 0;
    }
    return g_row_unroll;
}
extern "C" int ms_cuda_flce_set_row_unroll(int u) {
    const int old = row_unroll_forced();
    if (u == 0 || u == 1 || u == 4) g_row_unroll = u;
    return old;
}

// MS_FLCE_ROW_PREFETCH=0 (or ms_cuda_flce_set_row_prefetch(0)): the plain
// row pass reads the row from device memory pack by pack in pass 1 (to
// compare) instead of copying it whole into the row cache first
int g_row_prefetch = -1;
bool row_prefetch_on() {
    if (g_row_prefetch < 0) {
        const char *e = getenv("MS_FLCE_ROW_PREFETCH");
        g_row_prefetch = !(e && e[0] == '0');
    }
    return g_row_prefetch == 1;
}
extern "C" int ms_cuda_flce_set_row_prefetch(int on) {
    const int old = row_prefetch_on();
    g_row_prefetch = on != 0;
    return old;
}

// MS_FLCE_PLAIN_ROWS=0: the general row pass for every call (to compare)
bool plain_rows_on() {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("MS_FLCE_PLAIN_ROWS");
        on = !(e && e[0] == '0');
    }
    return on == 1;
}

extern "C" int ms_cuda_flce_rows(ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                                 const ms_tensor *targets, const ms_tensor *grad_scale, const ms_tensor *scal,
                                 ms_tensor *rows, const ms_flce_params *p) {
    if (p->n == 0) return 0;
    if (row_pass_ready(logits, bias, ce_weight, targets, grad_scale, p)) return -1;
    cudaStream_t st = ms_cuda_stream_of(logits->device_id);
    const int per_row = grad_scale && ms_tensor_numel(grad_scale) > 1;
    int rc = by_dtype(logits->dtype_id, [&](auto t) {
        using T = typename decltype(t)::type;
        const size_t cache = row_cache_bytes(logits->device_id, p->v * (long long)sizeof(T));
        const bool plain = !bias && !ce_weight && !(p->softcap > 0) && p->label_smoothing == 0 && plain_rows_on();
        return row_launch<T>(logits, p, [&](auto vec) {
            auto kernel = !plain               ? flce_rows_kernel<T, decltype(vec)::value, false>
                          : (row_unroll_forced() ? row_unroll_forced() : cache ? 1 : 4) == 4
                              ? flce_rows_kernel<T, decltype(vec)::value, true, 4>
                                              : flce_rows_kernel<T, decltype(vec)::value, true, 1>;
            if (cache > 48 * 1024 &&
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cache) != cudaSuccess)
                return;   // reported by LAUNCH_CHECK below
            kernel<<<(unsigned)p->n, kRowThreads, cache, st>>>(
                (T *)ms_tensor_data(logits), data_or_null<T>(bias), data_or_null<float>(ce_weight),
                ms_tensor_data(targets), targets->dtype_id, data_or_null<float>(grad_scale), per_row,
                (const double *)ms_tensor_data(scal), (float *)ms_tensor_data(rows), *p, cache > 0, row_prefetch_on());
        });
    });
    if (rc) return rc;
    LAUNCH_CHECK("flce_rows_kernel");
    return 0;
}

extern "C" int ms_cuda_flce_vp_stats(const ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                                     const ms_tensor *targets, ms_tensor *st, const ms_flce_params *p) {
    if (p->n == 0) return 0;
    if (row_pass_ready(logits, bias, ce_weight, targets, NULL, p) || need_contiguous("statistics", st)) return -1;
    if (st->dtype_id != MS_F32) return ms_errorf("flce_vp_stats: statistics must be f32");
    cudaStream_t s = ms_cuda_stream_of(logits->device_id);
    int rc = by_dtype(logits->dtype_id, [&](auto t) {
        using T = typename decltype(t)::type;
        return row_launch<T>(logits, p, [&](auto vec) {
            flce_vp_stats_kernel<T, decltype(vec)::value><<<(unsigned)p->n, kRowThreads, 0, s>>>(
                data_or_null<T>(logits), data_or_null<T>(bias), data_or_null<float>(ce_weight),
                ms_tensor_data(targets), targets->dtype_id, (float *)ms_tensor_data(st), *p);
        });
    });
    if (rc) return rc;
    LAUNCH_CHECK("flce_vp_stats_kernel");
    return 0;
}

extern "C" int ms_cuda_flce_vp_fix(ms_tensor *st, const ms_tensor *mx) {
    long long n = st->sizes[1];
    if (n == 0) return 0;
    if (ms_cuda_activate(st->device_id) || need_contiguous("statistics", st) || need_contiguous("maxima", mx))
        return -1;
    flce_vp_fix_kernel<<<ms_grid(n, 256), 256, 0, ms_cuda_stream_of(st->device_id)>>>(
        (float *)ms_tensor_data(st), (const float *)ms_tensor_data(mx), n);
    LAUNCH_CHECK("flce_vp_fix_kernel");
    return 0;
}

extern "C" int ms_cuda_flce_vp_grad(ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                                    const ms_tensor *targets, const ms_tensor *grad_scale, const ms_tensor *scal,
                                    const ms_tensor *st, const ms_tensor *mx, ms_tensor *rows,
                                    const ms_flce_params *p) {
    if (p->n == 0) return 0;
    if (row_pass_ready(logits, bias, ce_weight, targets, grad_scale, p) || need_contiguous("statistics", st) ||
        need_contiguous("maxima", mx))
        return -1;
    cudaStream_t s = ms_cuda_stream_of(logits->device_id);
    const int per_row = grad_scale && ms_tensor_numel(grad_scale) > 1;
    int rc = by_dtype(logits->dtype_id, [&](auto t) {
        using T = typename decltype(t)::type;
        return row_launch<T>(logits, p, [&](auto vec) {
            flce_vp_grad_kernel<T, decltype(vec)::value><<<(unsigned)p->n, kRowThreads, 0, s>>>(
                (T *)ms_tensor_data(logits), data_or_null<T>(bias), data_or_null<float>(ce_weight),
                ms_tensor_data(targets), targets->dtype_id, data_or_null<float>(grad_scale), per_row,
                (const double *)ms_tensor_data(scal), (const float *)ms_tensor_data(st),
                (const float *)ms_tensor_data(mx), (float *)ms_tensor_data(rows), *p);
        });
    });
    if (rc) return rc;
    LAUNCH_CHECK("flce_vp_grad_kernel");
    return 0;
}

extern "C" int ms_cuda_flce_colsum(ms_tensor *acc, const ms_tensor *dl, int accumulate) {
    int device = dl->device_id;
    if (dl->sizes[1] == 0) return 0;
    if (ms_cuda_activate(device) || need_contiguous("dlogits", dl) || need_contiguous("grad_bias", acc)) return -1;
    cudaStream_t st = ms_cuda_stream_of(device);
    switch (dl->dtype_id) {
    case MS_F32: return launch_colsum<float>(acc, dl, accumulate, st);
    case MS_BF16: return launch_colsum<__nv_bfloat16>(acc, dl, accumulate, st);
    case MS_F16: return launch_colsum<__half>(acc, dl, accumulate, st);
    default: return ms_errorf("flce: dtype %s is not supported on cuda", ms_dtype_name(dl->dtype_id));
    }
}

extern "C" int ms_cuda_flce_finish(const ms_tensor *rows, const ms_tensor *scal, int reduction, ms_tensor *loss,
                                   ms_tensor *z_loss, ms_tensor *accuracy) {
    int device = rows->device_id;
    if (ms_cuda_activate(device)) return -1;
    const ms_tensor *outs[3] = {loss, z_loss, accuracy};
    for (int k = 0; k < 3; k++)
        if (outs[k] && outs[k]->dtype_id != MS_F32) return ms_errorf("flce_finish: outputs must be f32");
    flce_finish_kernel<<<1, kOneBlock, 0, ms_cuda_stream_of(device)>>>(
        (const float *)ms_tensor_data(rows), (long long)rows->sizes[0], (const double *)ms_tensor_data(scal),
        reduction, loss ? (float *)ms_tensor_data(loss) : nullptr, loss && loss->ndim == 1 ? loss->strides[0] : 0,
        z_loss ? (float *)ms_tensor_data(z_loss) : nullptr, z_loss && z_loss->ndim == 1 ? z_loss->strides[0] : 0,
        accuracy ? (float *)ms_tensor_data(accuracy) : nullptr);
    LAUNCH_CHECK("flce_finish_kernel");
    return 0;
}

extern "C" int ms_cuda_flce_scale(ms_tensor *t, const ms_tensor *g) {
    int device = t->device_id;
    long long n = ms_tensor_numel(t);
    if (n == 0) return 0;
    if (ms_cuda_activate(device) || need_contiguous("the scaled tensor", t)) return -1;
    cudaStream_t st = ms_cuda_stream_of(device);
    int grid = ms_grid(n, 256);
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1) {
        cudaGetLastError();
        sms = 16;
    }
    if (grid > sms * 8) grid = sms * 8;   // 2048 threads an SM: enough for the bandwidth
    const void *gp = ms_tensor_data(g);
    switch (t->dtype_id) {
    case MS_F32: flce_scale_kernel<<<grid, 256, 0, st>>>((float *)ms_tensor_data(t), n, gp, g->dtype_id); break;
    case MS_BF16:
        flce_scale_kernel<<<grid, 256, 0, st>>>((__nv_bfloat16 *)ms_tensor_data(t), n, gp, g->dtype_id);
        break;
    case MS_F16: flce_scale_kernel<<<grid, 256, 0, st>>>((__half *)ms_tensor_data(t), n, gp, g->dtype_id); break;
    default: return ms_errorf("flce_scale_: dtype %s is not supported on cuda", ms_dtype_name(t->dtype_id));
    }
    LAUNCH_CHECK("flce_scale_kernel");
    return 0;
}
