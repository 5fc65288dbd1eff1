// kernels/attention.cu — fused causal attention, forward and backward,
// flash-style: scores live only in 64x64 tiles in shared memory, never as a
// T x T matrix in device memory (FlashAttention-2's algorithm).
//
//   q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) (query head h
//   reads kv head h / (H/Hkv)), out (B, H, Tq, Dv), lse (B, H, Tq) f32; unit
//   stride along D, any strides for B, H, T (the views models make by
//   transposing (B,T,H,D)). Dv = D everywhere but the mma and wgmma
//   kernels' D = 192, Dv = 128 (DeepSeek's MLA); ms_cuda_attention_widths
//   says which widths run, and sdpa pads the others
//   (lua/moonshard/nn/functional.lua).
//
// Forward: a block owns 64 query rows of one (b, h); it streams 64-key tiles
// of K and V through shared memory, keeps a running max and sum per row
// (online softmax in the exp2 domain) and the output row in registers.
// Backward: Delta_i = dout_i . out_i; one kernel per 64-key tile (dk, dv in
// registers, looping over the query tiles and query heads that see it) and
// one per 64-query tile (dq), recomputing P from lse: no atomics, so the
// gradients are the same bits on every run.
// Four implementations, picked per call (pick_impl below; forced with
// ms_cuda_attention_set_impl or MS_ATTENTION_IMPL=wgmma|mma|wmma|simt):
//   wgmma Hopper's warpgroup MMA where the mma kernels fit, at (64, 64),
//         (128, 128), (192, 128) and the (192, 192) forward (attention_wgmma.cuh)
//         — the default on compute capability 9.x;
//   mma   bf16/f16, head dims 64, 128, 192 and (q/k 192, v 128), sm_80+,
//         16-byte aligned rows:
//         FlashAttention-2 on mma.sync.m16n8k16 with scores, softmax and P
//         in registers (attention_mma.cuh) — the default elsewhere where it fits;
//   wmma  bf16/f16, head dims 16/32/64/128: WMMA tile products with the
//         score tile round-tripping through shared memory (attention_tc.cuh);
//   simt  f32 and any head dim up to 128: the kernels below (f32 math on
//         CUDA cores).
// Flops: forward 4*B*H*Tq*Tk*D (halved when causal), backward 2.5x that
// (the mma/wmma backward recompute S and dP in the dq pass: 3.5x); bytes:
// q, k, v, out read/written once per pass plus K/V re-reads per query tile
// (from L2).
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <math.h>
#include <mma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

const int kTile = 64;     // query rows and key columns per tile
const int kThreads = 128; // two threads per tile row, each with half of D
const int kMaxD = 128;
// the one head dim above kMaxD: the mma kernels' (DeepSeek-V3's q/k heads),
// with v that wide or kMmaWideDv (DeepSeek-V3's v heads: its own instantiation)
const int kMmaWideD = 192, kMmaWideDv = 128;

struct qkv_layout {
    long long sb, sh, st;  // strides of B, H, T (elements); D has stride 1
};

qkv_layout layout4(const ms_tensor *t) { return {t->strides[0], t->strides[1], t->strides[2]}; }

__device__ __forceinline__ long long at(const qkv_layout &l, long long b, long long h, long long t) {
    return b * l.sb + h * l.sh + t * l.st;
}

// load rows [t0, t0+64) of (b, h) into s (64 x ld floats, zero past T),
// multiplied by mul
template <typename T>
__device__ void load_tile(float *s, int ld, const T *src, const qkv_layout &l, long long b, long long h, long long t0,
                          long long Tn, int D, float mul) {
    for (int e = threadIdx.x; e < kTile * D; e += kThreads) {
        int r = e / D, d = e - r * D;
        long long t = t0 + r;
        s[r * ld + d] = t < Tn ? ms_ld(src + at(l, b, h, t) + d) * mul : 0.f;
    }
}

const float kLog2e = 1.4426950408889634f;

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(
    T *out, float *lse, const T *q, const T *k, const T *v, qkv_layout lq, qkv_layout lk, qkv_layout lv,
    qkv_layout lo, int H, int Hkv, long long Tq, long long Tk, int D, float scale, int causal) {
    extern __shared__ float smem[];
    const int ld = D + 1;
    float *Qs = smem, *Ks = Qs + kTile * ld, *Vs = Ks + kTile * ld, *Ps = Vs + kTile * ld;
    const long long i0 = (long long)blockIdx.x * kTile;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int dh = (D + 1) / 2, d0 = half * dh, d1 = min(D, d0 + dh);
    load_tile(Qs, ld, q, lq, b, h, i0, Tq, D, scale * kLog2e);
    float m = -INFINITY, l = 0.f;
    float o[kMaxD / 2];
#pragma unroll
    for (int x = 0; x < kMaxD / 2; x++) o[x] = 0.f;
    const long long i = i0 + r, off = Tk - Tq;  // causal: j <= i + off
    long long kend = causal ? max(0ll, min(Tk, i0 + kTile + off)) : Tk;
    for (long long j0 = 0; j0 < kend; j0 += kTile) {
        __syncthreads();
        load_tile(Ks, ld, k, lk, b, g, j0, Tk, D, 1.f);
        load_tile(Vs, ld, v, lv, b, g, j0, Tk, D, 1.f);
        __syncthreads();
        float sv[kTile / 2];
        float tmax = -INFINITY;
#pragma unroll 4
        for (int cc = 0; cc < kTile / 2; cc++) {
            int c = half * (kTile / 2) + cc;
            long long j = j0 + c;
            float s = -INFINITY;
            if (j < Tk && (!causal || j <= i + off)) {
                s = 0.f;
                for (int e = 0; e < D; e++) s += Qs[r * ld + e] * Ks[c * ld + e];
            }
            sv[cc] = s;
            tmax = fmaxf(tmax, s);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        float mnew = fmaxf(m, tmax);
        float alpha = mnew == -INFINITY ? 1.f : exp2f(m - mnew);
        float psum = 0.f;
        for (int cc = 0; cc < kTile / 2; cc++) {
            float p = mnew == -INFINITY ? 0.f : exp2f(sv[cc] - mnew);
            psum += p;
            Ps[r * (kTile + 1) + half * (kTile / 2) + cc] = p;
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        l = l * alpha + psum;
        m = mnew;
        __syncwarp();
#pragma unroll
        for (int x = 0; x < kMaxD / 2; x++) o[x] *= alpha;
        for (int c = 0; c < kTile; c++) {
            float p = Ps[r * (kTile + 1) + c];
            if (p == 0.f) continue;
#pragma unroll
            for (int x = 0; x < kMaxD / 2; x++)
                if (d0 + x < d1) o[x] += p * Vs[c * ld + d0 + x];
        }
    }
    if (i < Tq) {
        float inv = l > 0.f ? 1.f / l : 0.f;
        T *dst = out + at(lo, b, h, i);
#pragma unroll
        for (int x = 0; x < kMaxD / 2; x++)
            if (d0 + x < d1) ms_st(dst + d0 + x, o[x] * inv);
        if (half == 0) lse[((long long)b * H + h) * Tq + i] = l > 0.f ? (m + log2f(l)) / kLog2e : -INFINITY;
    }
}

// Delta_i = sum_d dout_i,d * out_i,d (warp per row)
template <typename T>
__global__ void attention_delta_kernel(float *delta, const T *out, const T *dout, qkv_layout lo, qkv_layout lg, int H,
                                       long long Tq, int D, long long rows) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    long long b = row / (H * Tq), rem = row % (H * Tq), h = rem / Tq, t = rem % Tq;
    const T *o = out + at(lo, b, h, t), *g = dout + at(lg, b, h, t);
    float acc = 0.f;
    for (int d = lane; d < D; d += 32) acc += ms_ld(o + d) * ms_ld(g + d);
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) delta[row] = acc;
}

// the same for 2-byte dtypes with 16-byte aligned rows and D a multiple of
// 8: TPR threads a row (a power of two, at most 32), 8 elements a load, so a
// warp keeps 32/TPR rows' loads in flight instead of one row's
template <typename T, int TPR>
__global__ void attention_delta_vec_kernel(float *delta, const T *out, const T *dout, qkv_layout lo, qkv_layout lg,
                                           int H, long long Tq, int D, long long rows) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / TPR;
    int part = threadIdx.x & (TPR - 1);
    float acc = 0.f;
    if (row < rows) {
        long long b = row / (H * Tq), rem = row % (H * Tq), h = rem / Tq, t = rem % Tq;
        const T *o = out + at(lo, b, h, t), *g = dout + at(lg, b, h, t);
        for (int d = part * 8; d < D; d += TPR * 8) {
            float a[8], c[8];
            load_v<float, T, 8>(a, o + d);
            load_v<float, T, 8>(c, g + d);
#pragma unroll
            for (int i = 0; i < 8; i++) acc = fmaf(a[i], c[i], acc);
        }
    }
#pragma unroll
    for (int off = TPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (part == 0 && row < rows) delta[row] = acc;
}

// dk, dv for 64 keys of one (b, kv head): loop over the query heads of the
// group and the query tiles that see these keys
template <typename T>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(
    T *dk, T *dv, const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta,
    qkv_layout lq, qkv_layout lk, qkv_layout lv, qkv_layout lg, qkv_layout ldk, qkv_layout ldv, int H, int Hkv,
    long long Tq, long long Tk, int D, float scale, int causal) {
    extern __shared__ float smem[];
    const int ld = D + 1, lp = kTile + 1;
    float *Ks = smem, *Vs = Ks + kTile * ld, *Qs = Vs + kTile * ld, *Gs = Qs + kTile * ld;
    float *Ps = Gs + kTile * ld, *Ss = Ps + kTile * lp, *Ls = Ss + kTile * lp, *Ds = Ls + kTile;
    const long long j0 = (long long)blockIdx.x * kTile;
    const int bg = blockIdx.y, b = bg / Hkv, g = bg % Hkv, rep = H / Hkv;
    const int c = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int dh = (D + 1) / 2, d0 = half * dh, d1 = min(D, d0 + dh);
    const long long j = j0 + c;
    load_tile(Ks, ld, k, lk, b, g, j0, Tk, D, 1.f);
    load_tile(Vs, ld, v, lv, b, g, j0, Tk, D, 1.f);
    float dkr[kMaxD / 2], dvr[kMaxD / 2];
#pragma unroll
    for (int x = 0; x < kMaxD / 2; x++) dkr[x] = dvr[x] = 0.f;
    const long long off = Tk - Tq;  // causal: j <= i + off
    const long long istart = causal ? max(0ll, (j0 - off) / kTile * kTile) : 0;
    for (int h = g * rep; h < (g + 1) * rep; h++) {
        for (long long i0 = istart; i0 < Tq; i0 += kTile) {
            __syncthreads();
            load_tile(Qs, ld, q, lq, b, h, i0, Tq, D, 1.f);
            load_tile(Gs, ld, dout, lg, b, h, i0, Tq, D, 1.f);
            for (int e = threadIdx.x; e < kTile; e += kThreads) {
                long long i = i0 + e;
                Ls[e] = i < Tq ? lse[((long long)b * H + h) * Tq + i] : INFINITY;
                Ds[e] = i < Tq ? delta[((long long)b * H + h) * Tq + i] : 0.f;
            }
            __syncthreads();
            // P and dS for rows r of this thread's half, column c
            for (int rr = 0; rr < kTile / 2; rr++) {
                int r = half * (kTile / 2) + rr;
                long long i = i0 + r;
                float p = 0.f, ds = 0.f;
                if (i < Tq && j < Tk && (!causal || j <= i + off) && Ls[r] != -INFINITY) {
                    float s = 0.f, dp = 0.f;
                    for (int e = 0; e < D; e++) {
                        s += Qs[r * ld + e] * Ks[c * ld + e];
                        dp += Gs[r * ld + e] * Vs[c * ld + e];
                    }
                    p = expf(s * scale - Ls[r]);
                    ds = p * (dp - Ds[r]);
                }
                Ps[r * lp + c] = p;
                Ss[r * lp + c] = ds;
            }
            __syncwarp();
            for (int r = 0; r < kTile; r++) {
                float p = Ps[r * lp + c], ds = Ss[r * lp + c];
                if (p == 0.f && ds == 0.f) continue;
#pragma unroll
                for (int x = 0; x < kMaxD / 2; x++)
                    if (d0 + x < d1) {
                        dvr[x] += p * Gs[r * ld + d0 + x];
                        dkr[x] += ds * Qs[r * ld + d0 + x];
                    }
            }
        }
    }
    if (j < Tk) {
#pragma unroll
        for (int x = 0; x < kMaxD / 2; x++)
            if (d0 + x < d1) {
                ms_st(dk + at(ldk, b, g, j) + d0 + x, dkr[x] * scale);
                ms_st(dv + at(ldv, b, g, j) + d0 + x, dvr[x]);
            }
    }
}

// dq for 64 queries of one (b, h): loop over the key tiles it sees
template <typename T>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(
    T *dq, const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, qkv_layout lq,
    qkv_layout lk, qkv_layout lv, qkv_layout lg, qkv_layout ldq, int H, int Hkv, long long Tq, long long Tk, int D,
    float scale, int causal) {
    extern __shared__ float smem[];
    const int ld = D + 1, lp = kTile + 1;
    float *Qs = smem, *Gs = Qs + kTile * ld, *Ks = Gs + kTile * ld, *Vs = Ks + kTile * ld, *Ss = Vs + kTile * ld;
    const long long i0 = (long long)blockIdx.x * kTile;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int dh = (D + 1) / 2, d0 = half * dh, d1 = min(D, d0 + dh);
    const long long i = i0 + r;
    load_tile(Qs, ld, q, lq, b, h, i0, Tq, D, 1.f);
    load_tile(Gs, ld, dout, lg, b, h, i0, Tq, D, 1.f);
    const float L = i < Tq ? lse[((long long)b * H + h) * Tq + i] : -INFINITY;
    const float Dl = i < Tq ? delta[((long long)b * H + h) * Tq + i] : 0.f;
    float dqr[kMaxD / 2];
#pragma unroll
    for (int x = 0; x < kMaxD / 2; x++) dqr[x] = 0.f;
    const long long off = Tk - Tq;  // causal: j <= i + off
    long long kend = causal ? max(0ll, min(Tk, i0 + kTile + off)) : Tk;
    for (long long j0 = 0; j0 < kend; j0 += kTile) {
        __syncthreads();
        load_tile(Ks, ld, k, lk, b, g, j0, Tk, D, 1.f);
        load_tile(Vs, ld, v, lv, b, g, j0, Tk, D, 1.f);
        __syncthreads();
        for (int cc = 0; cc < kTile / 2; cc++) {
            int c = half * (kTile / 2) + cc;
            long long j = j0 + c;
            float ds = 0.f;
            if (i < Tq && j < Tk && (!causal || j <= i + off) && L != -INFINITY) {
                float s = 0.f, dp = 0.f;
                for (int e = 0; e < D; e++) {
                    s += Qs[r * ld + e] * Ks[c * ld + e];
                    dp += Gs[r * ld + e] * Vs[c * ld + e];
                }
                float p = expf(s * scale - L);
                ds = p * (dp - Dl);
            }
            Ss[r * lp + c] = ds;
        }
        __syncwarp();
        for (int c = 0; c < kTile; c++) {
            float ds = Ss[r * lp + c];
            if (ds == 0.f) continue;
#pragma unroll
            for (int x = 0; x < kMaxD / 2; x++)
                if (d0 + x < d1) dqr[x] += ds * Ks[c * ld + d0 + x];
        }
    }
    if (i < Tq) {
#pragma unroll
        for (int x = 0; x < kMaxD / 2; x++)
            if (d0 + x < d1) ms_st(dq + at(ldq, b, h, i) + d0 + x, dqr[x] * scale);
    }
}

typedef ms_tmp holder;

// a view with unit stride along D (copy when not)
int unit_d(const ms_tensor *t, holder &h, const ms_tensor **res) {
    if (t->strides[3] == 1 || t->sizes[3] == 1) {
        *res = t;
        return 0;
    }
    if (ms_tensor_clone(&h.t, t)) return -1;
    *res = h.t;
    return 0;
}

// the (q/k, v) head widths the kernels run (D, Dv) of dtype at: the narrowest
// pair they take at least that wide (false: none). One width up to kMaxD
// (every implementation), else bf16/f16 on the mma kernels: q/k kMmaWideD
// with v kMmaWideDv or kMmaWideD.
bool kernel_widths(int dtype, int64_t D, int64_t Dv, int64_t *dqk, int64_t *dv) {
    const bool low = dtype == MS_BF16 || dtype == MS_F16;
    if ((dtype != MS_F32 && !low) || D < 1 || Dv < 1) return false;
    const int64_t w = D > Dv ? D : Dv;
    if (w <= kMaxD) *dqk = *dv = w;
    else if (low && D <= kMmaWideD && Dv <= kMmaWideDv) *dqk = kMmaWideD, *dv = kMmaWideDv;
    else if (low && w <= kMmaWideD) *dqk = *dv = kMmaWideD;
    else return false;
    return true;
}

const char *kWidthsTaken = "the kernels take one head width up to 128 (f32, bf16, f16) or 192 (bf16/f16), or "
                           "q/k 192 with v 128 (bf16/f16)";

int check_kernel_args(const char *op, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v) {
    char d[200], e[200], f[200];
    if (q->dtype_id != MS_F32 && q->dtype_id != MS_BF16 && q->dtype_id != MS_F16)
        return ms_errorf("%s: cuda kernel takes f32, bf16 or f16, got %s", op, ms_desc(q, d, sizeof d));
    // (192 and (192, 128): the mma and wgmma kernels only; pick_impl's callers refuse the rest)
    int64_t wq = 0, wv = 0;
    if (!kernel_widths(q->dtype_id, q->sizes[3], v->sizes[3], &wq, &wv) || wq != q->sizes[3] || wv != v->sizes[3])
        return ms_errorf("%s: no CUDA kernel takes q %s, k %s, v %s: %s (nn.functional.scaled_dot_product_attention "
                         "pads to them)", op, ms_desc(q, d, sizeof d), ms_desc(k, e, sizeof e),
                         ms_desc(v, f, sizeof f), kWidthsTaken);
    if (q->sizes[0] * q->sizes[1] > 65535)
        return ms_errorf("%s: B*H = %lld is above 65535", op, (long long)(q->sizes[0] * q->sizes[1]));
    return 0;
}

template <typename T, typename K>
int set_smem(K kernel, size_t bytes) {
    if (bytes > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return 0;
}

#include "attention_tc.cuh"
#include "attention_mma.cuh"
#include "attention_wgmma.cuh"

// Which kernels run a call. bf16/f16: mma (attention_mma.cuh, head dims 64,
// 128 and 192, and q/k 192 with v 128, sm_80+, 16-byte aligned rows), else
// wmma (attention_tc.cuh, head dims 16/32/64/128), else simt (up to 128); f32
// always simt. Only the mma kernels take head dim 192 or a v width of its
// own: a call they cannot take is refused (wide_refused). ms_cuda_attention_set_impl
// forces one (what does not fit the call falls back along that order), else
// the environment does: MS_ATTENTION_IMPL=mma|wmma|simt, or MS_ATTENTION_SIMT
// (any value) for simt. On compute capability 9.x, calls the mma kernels take
// at head dim 64 or 128 (q, k, v alike) run the wgmma kernels instead
// (attention_wgmma.cuh; MS_ATTENTION_IMPL=mma keeps mma.sync), and so do
// q/k 192 with v 128 or 192, except the backward at q/k/v 192, whose dk/dv
// kernel wgmma does not have (wg_dims).
int g_impl_set = MS_ATTENTION_AUTO, g_impl_last = MS_ATTENTION_AUTO;

int impl_requested() {
    if (g_impl_set != MS_ATTENTION_AUTO) return g_impl_set;
    static int env = -1;
    if (env < 0) {
        const char *s = getenv("MS_ATTENTION_IMPL");
        env = MS_ATTENTION_AUTO;
        if (s && !strcmp(s, "mma")) env = MS_ATTENTION_MMA;
        else if (s && !strcmp(s, "wmma")) env = MS_ATTENTION_WMMA;
        else if (s && !strcmp(s, "simt")) env = MS_ATTENTION_SIMT;
        else if (s && !strcmp(s, "wgmma")) env = MS_ATTENTION_WGMMA;
        else if (getenv("MS_ATTENTION_SIMT")) env = MS_ATTENTION_SIMT;
    }
    return env;
}

// rows of 16-byte-aligned 16-bit elements: cp.async and vector stores apply
bool rows_aligned16(const ms_tensor *t) {
    if (((uintptr_t)ms_tensor_data(t) & 15) != 0) return false;
    for (int d = 0; d < 3; d++)
        if (t->sizes[d] > 1 && t->strides[d] % 8 != 0) return false;
    return true;
}

// a call only the mma kernels take (head dim 192, or v of its own width;
// bf16/f16): its inputs need 16-byte aligned rows, so one that has not
// (a view at an odd offset) is copied rather than the call refused
bool mma_only(const ms_tensor *q, const ms_tensor *v) {
    return q->dtype_id != MS_F32 && (q->sizes[3] > kMaxD || v->sizes[3] != q->sizes[3]);
}
int aligned_rows(const ms_tensor *t, holder &h, const ms_tensor **res) {
    *res = t;
    if (rows_aligned16(t) || h.t) return 0;   // (h.t: already a contiguous copy)
    if (ms_tensor_clone(&h.t, t)) return -1;
    *res = h.t;
    return 0;
}

int cc_major(int device) {
    static int cache[64];
    if (device < 0 || device >= 64) return 0;
    if (!cache[device] && cudaDeviceGetAttribute(&cache[device], cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
        cache[device] = 0;
        cudaGetLastError();  // not left for the next launch check to report
    }
    return cache[device];
}

// the (q/k, v) head widths the wgmma kernels take: 64, 128 (alike), q/k 192
// with v 128, and for the forward (backward = false) q/k/v 192
bool wg_dims(int D, int Dv, bool backward) {
    return ((D == 64 || D == 128) && Dv == D) ||
           (D == kMmaWideD && (Dv == kMmaWideDv || (Dv == kMmaWideD && !backward)));
}

// the implementation for a call on tensors ts[0..n) (q first), remembered
// for ms_cuda_attention_last_impl
// (D: q/k's head width, Dv: v's; backward: the call is the backward's)
template <typename T>
int pick_impl(int D, int Dv, const ms_tensor *const *ts, int n, bool backward) {
    int want = impl_requested(), got = MS_ATTENTION_SIMT;
    if (sizeof(T) == 2 && want != MS_ATTENTION_SIMT) {
        const bool mma_dims = (D == Dv && (D == 64 || D == 128 || D == kMmaWideD)) ||
                              (D == kMmaWideD && Dv == kMmaWideDv);
        bool mma_ok = want != MS_ATTENTION_WMMA && mma_dims && cc_major(ts[0]->device_id) >= 8;
        for (int i = 0; i < n && mma_ok; i++) mma_ok = rows_aligned16(ts[i]);
        const bool wg_ok = mma_ok && (want == MS_ATTENTION_WGMMA || want == MS_ATTENTION_AUTO) &&
                           wg_dims(D, Dv, backward) && cc_major(ts[0]->device_id) == 9;
        if (wg_ok) got = MS_ATTENTION_WGMMA;
        else if (mma_ok) got = MS_ATTENTION_MMA;
        else if (D == Dv && (D == 16 || D == 32 || D == 64 || D == 128)) got = MS_ATTENTION_WMMA;
    }
    g_impl_last = got;
    return got;
}

// a head dim above kMaxD, or a v width of its own, that the mma kernels
// cannot take here
int wide_refused(const char *op, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v) {
    char d[200], e[200], f[200];
    return ms_errorf("%s: q/k head dim %lld with v's %lld runs on the mma kernels only (bf16/f16, sm_80+, "
                     "MS_ATTENTION_IMPL not wmma or simt), got q %s, k %s, v %s", op,
                     (long long)q->sizes[3], (long long)v->sizes[3], ms_desc(q, d, sizeof d), ms_desc(k, e, sizeof e),
                     ms_desc(v, f, sizeof f));
}

// (D: q/k's head width, DV: v's)
template <typename T, int D, int DV>
int mma_fwd(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, float scale,
            int causal) {
    constexpr int MT = mma::config<D, DV>::fwd_mt, BM = 64 * MT;  // query rows a block
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    size_t smem = mma::fwd_smem<T, D, DV, MT>();
    if (set_smem<T>(mma::fwd_kernel<T, D, DV, MT>, smem)) return -1;
    dim3 grid((unsigned)((Tq + BM - 1) / BM), (unsigned)(B * H));
    mma::fwd_kernel<T, D, DV, MT><<<grid, 128, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, scale, causal);
    LAUNCH_CHECK("mma::fwd_kernel");
    return 0;
}

// the one-pass backward's dq: the f32 sums (B, H, Tq, D) rounded into dq's
// dtype and layout, 8 elements a thread
template <typename T>
__global__ void dq_store_kernel(T *dq, const float *acc, qkv_layout l, int H, long long Tq, int D, long long n8) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n8) return;
    const long long idx = e * 8, row = idx / D;
    const int d = (int)(idx - row * D);
    const long long t = row % Tq, bh = row / Tq;
    T *dst = dq + at(l, bh / H, bh % H, t) + d;
#pragma unroll
    for (int i = 0; i < 8; i++) dst[i] = (T)acc[idx + i];
}

// MS_ATTENTION_BWD=onepass: the mma backward as FA2's one pass (dq summed
// with float atomics inside the dk/dv kernel: fewer flops, run-to-run
// variation in dq's last bits); the default is the deterministic pair of
// kernels. ms_cuda_attention_set_onepass overrides the environment.
int g_onepass = -1;
// a switch read once from the environment: 1 when `name` is "onepass"
int env_onepass(int &cached, const char *name) {
    if (cached < 0) {
        const char *e = getenv(name);
        cached = e && strcmp(e, "onepass") == 0;
    }
    return cached;
}
bool onepass() { return env_onepass(g_onepass, "MS_ATTENTION_BWD") == 1; }

template <typename T, int D, int DV>
int mma_bwd(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
            const ms_tensor *dout, const float *l, const float *delta, float scale, int causal, cudaStream_t s) {
    typedef mma::config<D, DV> C;
    constexpr int BQ = C::dkdv_bq, KMT = C::dkdv_mt, QMT = C::dq_mt;
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    if (onepass() && Tk > 0 && Tq > 0 && B * Hkv > 0) {
        holder acc;
        int64_t shape[4] = {B, H, Tq, D};
        if (ms_tensor_empty(&acc.t, 4, shape, MS_F32, q->device_id)) return -1;
        CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(acc.t), 0, (size_t)B * H * Tq * D * sizeof(float), s));
        size_t smem = mma::dkdv_smem<T, D, DV, BQ, KMT, true>();
        if (set_smem<T>(mma::dkdv_kernel<T, D, DV, BQ, KMT, true>, smem)) return -1;
        dim3 grid((unsigned)((Tk + 64 * KMT - 1) / (64 * KMT)), (unsigned)(B * Hkv));
        mma::dkdv_kernel<T, D, DV, BQ, KMT, true><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dk), layout4(dv), H, Hkv, Tq, Tk, scale, causal, (float *)ms_tensor_data(acc.t));
        LAUNCH_CHECK("mma::dkdv_kernel (one pass)");
        long long n8 = (long long)B * H * Tq * D / 8;
        dq_store_kernel<T><<<(unsigned)((n8 + 255) / 256), 256, 0, s>>>((T *)ms_tensor_data(dq),
                                                                       (const float *)ms_tensor_data(acc.t),
                                                                       layout4(dq), H, Tq, D, n8);
        LAUNCH_CHECK("dq_store_kernel");
        // the buffer goes back to the allocator in stream order (holder frees it)
        return 0;
    }
    if (Tk > 0 && B * Hkv > 0) {
        size_t smem = mma::dkdv_smem<T, D, DV, BQ, KMT>();
        if (set_smem<T>(mma::dkdv_kernel<T, D, DV, BQ, KMT>, smem)) return -1;
        dim3 grid((unsigned)((Tk + 64 * KMT - 1) / (64 * KMT)), (unsigned)(B * Hkv));
        mma::dkdv_kernel<T, D, DV, BQ, KMT><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dk), layout4(dv), H, Hkv, Tq, Tk, scale, causal);
        LAUNCH_CHECK("mma::dkdv_kernel");
    }
    if (Tq > 0 && B * H > 0) {
        size_t smem = mma::dq_smem<T, D, DV, QMT>();
        if (set_smem<T>(mma::dq_kernel<T, D, DV, QMT>, smem)) return -1;
        dim3 grid((unsigned)((Tq + 64 * QMT - 1) / (64 * QMT)), (unsigned)(B * H));
        mma::dq_kernel<T, D, DV, QMT><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dq), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dq), H, Hkv, Tq, Tk, scale, causal);
        LAUNCH_CHECK("mma::dq_kernel");
    }
    return 0;
}

// out[c] = Σ_r part[r·cols + c], rows in order (0 for no rows)
// a block per 32 columns: lane = column, warp w sums rows w, w + 8, ... (4
// loads in flight), then warp 0 adds the 8 warps' sums in warp order: a
// fixed order, the same bits every run. (One thread a column over all the
// rows, 3 blocks at GPT-2's 768 columns, took ~40 us a call: 1.9% of the
// step with the sums on.)
constexpr int kColsumWarps = 8;
__global__ void __launch_bounds__(32 * kColsumWarps) part_colsum_kernel(float *out, const float *part, long long rows,
                                                                        int cols) {
    __shared__ float red[kColsumWarps][32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, c = blockIdx.x * 32 + lane;
    float s = 0.f;
    if (c < cols) {
        long long r = w;
        for (; r + 3 * kColsumWarps < rows; r += 4 * kColsumWarps) {
            const float a = part[r * cols + c], b = part[(r + kColsumWarps) * cols + c],
                        d = part[(r + 2 * kColsumWarps) * cols + c], e = part[(r + 3 * kColsumWarps) * cols + c];
            s = (((s + a) + b) + d) + e;
        }
        for (; r < rows; r += kColsumWarps) s += part[r * cols + c];
    }
    red[w][lane] = s;
    __syncthreads();
    if (w == 0 && c < cols) {
        float t = 0.f;
#pragma unroll
        for (int i = 0; i < kColsumWarps; i++) t += red[i][lane];
        out[c] = t;
    }
}

// the wgmma kernels (attention_wgmma.cuh: sm_90a, D = 64 and 128, q/k 192
// with v 128 or 192). Forward key tile 64 (MS_ATTENTION_WG_BN=128 for 128
// at D = 64; wider heads always 64: 128-key tiles of 256-byte rows would
// leave one block an SM)
int wg_bn() {
    static int bn = 0;
    if (!bn) {
        const char *e = getenv("MS_ATTENTION_WG_BN");
        bn = e && atoi(e) == 128 ? 128 : 64;
    }
    return bn;
}

template <typename T, int BN, int D = 64, int DV = D>
int wg_fwd_bn(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, float scale,
              int causal) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    size_t smem = wg::fwd_smem<BN, D, DV>();
    if (set_smem<T>(wg::fwd_kernel<T, BN, D, DV>, smem)) return -1;
    dim3 grid((unsigned)((Tq + 63) / 64), (unsigned)(B * H));
    wg::fwd_kernel<T, BN, D, DV><<<grid, 128, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, scale, causal);
    LAUNCH_CHECK("wg::fwd_kernel");
    return 0;
}

// MS_ATTENTION_WG_FWD picks the wgmma forward at q/k 128 or 192 with v 128
// (other widths ignore it): "base" fwd_kernel; "ovl" fwd_ovl_kernel
// (attention_wgmma.cuh: FA3's intra-warpgroup overlap, S_t's softmax under
// P_{t-1}.V_{t-1}); "ovlq" the same with Q's fragments in registers (S =
// Q.K^T reading only K from shared memory); unset or "ws" (the default)
// fwd_ws_kernel, FA3's block of two consumer warpgroups (128 queries, ovlq's
// step each) sharing each K/V tile a producer warpgroup copies, the
// consumers' products in turns. One H200, causal bf16, 2x16x4096, forward
// ms: base 0.402, ovlq 0.355-0.360, ws 0.344 at 128; 0.443, 0.407, 0.356-0.359
// at 192 x 128. Read at every call (a scan of the environment, well under a
// microsecond against a forward's tens), so that a process can switch it
// through setenv, as spec/gpu_attention_spec.lua and bench/attention.lua
// do. -1: a value it does not know.
int wg_fwd_variant() {
    const char *e = getenv("MS_ATTENTION_WG_FWD");
    if (!e || !*e || !strcmp(e, "ws")) return 3;
    if (!strcmp(e, "base")) return 0;
    if (!strcmp(e, "ovl")) return 1;
    if (!strcmp(e, "ovlq")) return 2;
    return -1;
}

template <typename T, int D, int DV, bool QR>
int wg_fwd_ovl(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
               float scale, int causal) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    size_t smem = wg::fwd_ovl_smem<D, DV>();
    if (set_smem<T>(wg::fwd_ovl_kernel<T, D, DV, QR>, smem)) return -1;
    dim3 grid((unsigned)((Tq + 63) / 64), (unsigned)(B * H));
    wg::fwd_ovl_kernel<T, D, DV, QR><<<grid, 128, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, scale, causal);
    LAUNCH_CHECK("wg::fwd_ovl_kernel");
    return 0;
}

// fwd_ws_kernel: 128 queries a block of 384 threads (one block an SM)
template <typename T, int D, int DV>
int wg_fwd_ws(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
              float scale, int causal) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    size_t smem = wg::fwd_ws_smem<D, DV>();
    if (set_smem<T>(wg::fwd_ws_kernel<T, D, DV>, smem)) return -1;
    dim3 grid((unsigned)((Tq + 127) / 128), (unsigned)(B * H));
    wg::fwd_ws_kernel<T, D, DV><<<grid, 384, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, scale, causal);
    LAUNCH_CHECK("wg::fwd_ws_kernel");
    return 0;
}

template <typename T>
int wg_fwd(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, float scale,
           int causal) {
    const int var = wg_fwd_variant();
    if (var < 0)
        return ms_errorf("attention: MS_ATTENTION_WG_FWD=%s: the wgmma forwards are base, ovl, ovlq and ws",
                         getenv("MS_ATTENTION_WG_FWD"));
    if (var == 3 && q->sizes[3] == 128) return wg_fwd_ws<T, 128, 128>(out, lse, q, k, v, scale, causal);
    if (var == 3 && q->sizes[3] == kMmaWideD && v->sizes[3] == kMmaWideDv)
        return wg_fwd_ws<T, kMmaWideD, kMmaWideDv>(out, lse, q, k, v, scale, causal);
    if (var > 0 && q->sizes[3] == 128)
        return var == 1 ? wg_fwd_ovl<T, 128, 128, false>(out, lse, q, k, v, scale, causal)
                        : wg_fwd_ovl<T, 128, 128, true>(out, lse, q, k, v, scale, causal);
    if (var > 0 && q->sizes[3] == kMmaWideD && v->sizes[3] == kMmaWideDv)
        return var == 1 ? wg_fwd_ovl<T, kMmaWideD, kMmaWideDv, false>(out, lse, q, k, v, scale, causal)
                        : wg_fwd_ovl<T, kMmaWideD, kMmaWideDv, true>(out, lse, q, k, v, scale, causal);
    if (q->sizes[3] == 128) return wg_fwd_bn<T, 64, 128>(out, lse, q, k, v, scale, causal);
    if (q->sizes[3] == kMmaWideD)
        return v->sizes[3] == kMmaWideDv ? wg_fwd_bn<T, 64, kMmaWideD, kMmaWideDv>(out, lse, q, k, v, scale, causal)
                                         : wg_fwd_bn<T, 64, kMmaWideD, kMmaWideD>(out, lse, q, k, v, scale, causal);
    return wg_bn() == 64 ? wg_fwd_bn<T, 64>(out, lse, q, k, v, scale, causal)
                         : wg_fwd_bn<T, 128>(out, lse, q, k, v, scale, causal);
}

// MS_ATTENTION_WG_BWD=onepass: the wgmma backward in one kernel, dq added
// inside the dk/dv kernel in a fixed key-block order (the same bits run to
// run; causal attention with Tk >= Tq at head dim 64 only, without the
// column sums); the
// default is dkdv_kernel then dq_kernel. ms_cuda_attention_set_wg_onepass overrides
// the environment. (Measured slower than the two kernels: docs/perf-notes.md;
// with float atomics for dq instead of the order, slower still.)
int g_wg_onepass = -1;
bool wg_onepass() { return env_onepass(g_wg_onepass, "MS_ATTENTION_WG_BWD") == 1; }

// the one-pass backward applies to this call (its conditions in one place)
bool wg_onepass_for(bool dsum, int B, int Hkv, long long Tq, long long Tk, int causal, int D) {
    return wg_onepass() && D == 64 && !dsum && Tq > 0 && Tk > 0 && B * Hkv > 0 && causal && Tk >= Tq;
}

// The wgmma two-kernel backward computes Delta = rowsum(out * dout) inside
// dq_kernel, which then runs first (no delta kernel; default on).
// MS_ATTENTION_FUSED_DELTA=0 or ms_cuda_attention_set_fused_delta(0): the
// delta kernel, then dkdv_kernel and dq_kernel.
int g_fused_delta = -1;
bool fused_delta() {
    if (g_fused_delta < 0) {
        const char *e = getenv("MS_ATTENTION_FUSED_DELTA");
        g_fused_delta = (e && e[0] == '0') ? 0 : 1;
    }
    return g_fused_delta == 1;
}

// D: q/k's head dim (64 or 128, or 192 with DV = 128; the one pass at 64
// only), DV: v's
// dsum (or NULL): the column sums of dq, dk, dv as stored, [H·D | Hkv·D |
// Hkv·DV] f32, from the kernels' per-block partial rows (part_colsum_kernel
// adds them in a fixed order)
// out (or NULL): compute Delta in dq_kernel from out and dout into delta
// (then written, not read), dq_kernel before dkdv_kernel
template <typename T, int D, int DV = D>
int wg_bwd(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
           const ms_tensor *dout, const float *l, float *delta, float scale, int causal, cudaStream_t s,
           float *dsum = nullptr, const ms_tensor *out = nullptr) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    const long long rq = (long long)B * ((Tq + 63) / 64), rk = (long long)B * ((Tk + 63) / 64);
    if (wg_onepass_for(dsum != nullptr, B, Hkv, Tq, Tk, causal, D)) {
        // dq inside the dk/dv kernel (attention_wgmma.cuh: OP): f32 sums
        // and the counters that order their additions, zeroed
        const long long nqt = (Tq + 63) / 64;
        holder acc, sem;
        int64_t ashape[4] = {B, H, Tq, 64}, sshape[1] = {1 + (int64_t)B * H * nqt};
        if (ms_tensor_empty(&acc.t, 4, ashape, MS_F32, q->device_id)) return -1;
        if (ms_tensor_empty(&sem.t, 1, sshape, MS_I32, q->device_id)) return -1;
        CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(sem.t), 0, (size_t)sshape[0] * sizeof(int), s));
        size_t smem = wg::dkdv_smem(true);
        if (set_smem<T>(wg::dkdv_kernel<T, true>, smem)) return -1;
        dim3 grid((unsigned)((Tk + 63) / 64), (unsigned)(B * Hkv));
        wg::dkdv_kernel<T, true><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dk), layout4(dv), H, Hkv, Tq, Tk, scale, causal, nullptr, (T *)ms_tensor_data(dq),
            layout4(dq), (float *)ms_tensor_data(acc.t), (int *)ms_tensor_data(sem.t));
        LAUNCH_CHECK("wg::dkdv_kernel (one pass)");
        // the buffers go back to the allocator in stream order (holder frees them)
        return 0;
    }
    holder part;
    float *pq = nullptr, *pkv = nullptr;
    if (dsum) {
        int64_t n[1] = {(int64_t)(rq * H * D + rk * Hkv * (D + DV))};
        if (n[0] > 0 && ms_tensor_empty(&part.t, 1, n, MS_F32, q->device_id)) return -1;
        if (n[0] > 0) {
            pq = (float *)ms_tensor_data(part.t);
            pkv = pq + rq * H * D;
        }
    }
    auto run_dkdv = [&]() -> int {
        if (!(Tk > 0 && B * Hkv > 0)) return 0;
        constexpr int BQ = wg::dkdv_bq<D>();
        size_t smem = wg::dkdv_smem<D, DV, BQ>();
        if (set_smem<T>(wg::dkdv_kernel<T, false, D, DV, BQ>, smem)) return -1;
        dim3 grid((unsigned)((Tk + 63) / 64), (unsigned)(B * Hkv));
        wg::dkdv_kernel<T, false, D, DV, BQ><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dk), layout4(dv), H, Hkv, Tq, Tk, scale, causal, pkv);
        LAUNCH_CHECK("wg::dkdv_kernel");
        return 0;
    };
    auto run_dq = [&]() -> int {
        if (!(Tq > 0 && B * H > 0)) return 0;
        size_t smem = wg::dq_smem<D, DV>();
        if (set_smem<T>(wg::dq_kernel<T, D, DV>, smem)) return -1;
        dim3 grid((unsigned)((Tq + 63) / 64), (unsigned)(B * H));
        wg::dq_kernel<T, D, DV><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dq), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dq), H, Hkv, Tq, Tk, scale, causal, pq,
            out ? (const T *)ms_tensor_data(out) : nullptr, out ? layout4(out) : qkv_layout{}, out ? delta : nullptr);
        LAUNCH_CHECK("wg::dq_kernel");
        return 0;
    };
    // with the fused Delta, dq_kernel writes what dkdv_kernel reads
    if (out ? (run_dq() || run_dkdv()) : (run_dkdv() || run_dq())) return -1;
    if (dsum) {
        const int cq = H * D, ckv = Hkv * D, cv = Hkv * DV;
        const struct { float *out; const float *part; long long rows; int cols; } seg[3] = {
            {dsum, pq, Tq > 0 ? rq : 0, cq},
            {dsum + cq, pkv, Tk > 0 ? rk : 0, ckv},
            {dsum + cq + ckv, pkv ? pkv + rk * ckv : nullptr, Tk > 0 ? rk : 0, cv}};
        for (const auto &sg : seg) {
            part_colsum_kernel<<<(unsigned)((sg.cols + 31) / 32), 32 * kColsumWarps, 0, s>>>(sg.out, sg.part, sg.rows,
                                                                                          sg.cols);
            LAUNCH_CHECK("part_colsum_kernel");
        }
    }
    return 0;
}

template <typename T, int D>
int tc_fwd(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, float scale,
           int causal) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    size_t smem = tc::fwd_smem<T, D>();
    if (set_smem<T>(tc::fwd_kernel<T, D>, smem)) return -1;
    dim3 grid((unsigned)((Tq + 63) / 64), (unsigned)(B * H));
    tc::fwd_kernel<T, D><<<grid, 128, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, scale, causal);
    LAUNCH_CHECK("tc::fwd_kernel");
    return 0;
}

template <typename T, int D>
int tc_bwd(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
           const ms_tensor *dout, const float *l, const float *delta, float scale, int causal, cudaStream_t s) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    if (Tk > 0 && B * Hkv > 0) {
        size_t smem = tc::dkdv_smem<T, D>();
        if (set_smem<T>(tc::dkdv_kernel<T, D>, smem)) return -1;
        dim3 grid((unsigned)((Tk + 63) / 64), (unsigned)(B * Hkv));
        tc::dkdv_kernel<T, D><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dk), layout4(dv), H, Hkv, Tq, Tk, scale, causal);
        LAUNCH_CHECK("tc::dkdv_kernel");
    }
    if (Tq > 0 && B * H > 0) {
        size_t smem = tc::dq_smem<T, D>();
        if (set_smem<T>(tc::dq_kernel<T, D>, smem)) return -1;
        dim3 grid((unsigned)((Tq + 63) / 64), (unsigned)(B * H));
        tc::dq_kernel<T, D><<<grid, 128, smem, s>>>(
            (T *)ms_tensor_data(dq), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), l, delta, layout4(q), layout4(k), layout4(v),
            layout4(dout), layout4(dq), H, Hkv, Tq, Tk, scale, causal);
        LAUNCH_CHECK("tc::dq_kernel");
    }
    return 0;
}

template <typename T>
int tc_fwd_any(int D, ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
               float scale, int causal) {
    switch (D) {
    case 16: return tc_fwd<T, 16>(out, lse, q, k, v, scale, causal);
    case 32: return tc_fwd<T, 32>(out, lse, q, k, v, scale, causal);
    case 64: return tc_fwd<T, 64>(out, lse, q, k, v, scale, causal);
    default: return tc_fwd<T, 128>(out, lse, q, k, v, scale, causal);
    }
}

template <typename T>
int tc_bwd_any(int D, ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k,
               const ms_tensor *v, const ms_tensor *dout, const float *l, const float *delta, float scale, int causal,
               cudaStream_t s) {
    switch (D) {
    case 16: return tc_bwd<T, 16>(dq, dk, dv, q, k, v, dout, l, delta, scale, causal, s);
    case 32: return tc_bwd<T, 32>(dq, dk, dv, q, k, v, dout, l, delta, scale, causal, s);
    case 64: return tc_bwd<T, 64>(dq, dk, dv, q, k, v, dout, l, delta, scale, causal, s);
    default: return tc_bwd<T, 128>(dq, dk, dv, q, k, v, dout, l, delta, scale, causal, s);
    }
}

template <typename T>
int fwd(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, float scale,
        int causal) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1], D = (int)q->sizes[3];
    const int Dv = (int)v->sizes[3];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    if (Tq == 0 || B * H == 0) return 0;  // (an empty grid is a launch error)
    const ms_tensor *ts[4] = {q, k, v, out};
    int impl = pick_impl<T>(D, Dv, ts, 4, false);
    if ((D > kMaxD || Dv != D) && impl != MS_ATTENTION_MMA && impl != MS_ATTENTION_WGMMA)
        return wide_refused("attention", q, k, v);
    // the wgmma forward scales each row's max after taking it: a positive scale only
    if (impl == MS_ATTENTION_WGMMA && !(scale > 0.f)) impl = MS_ATTENTION_MMA;
    if constexpr (sizeof(T) == 2) {
        if (impl == MS_ATTENTION_WGMMA) return wg_fwd<T>(out, lse, q, k, v, scale, causal);
        if (impl == MS_ATTENTION_MMA)
            return D == 64    ? mma_fwd<T, 64, 64>(out, lse, q, k, v, scale, causal)
                   : D == 128 ? mma_fwd<T, 128, 128>(out, lse, q, k, v, scale, causal)
                   : Dv == kMmaWideDv ? mma_fwd<T, kMmaWideD, kMmaWideDv>(out, lse, q, k, v, scale, causal)
                              : mma_fwd<T, kMmaWideD, kMmaWideD>(out, lse, q, k, v, scale, causal);
        if (impl == MS_ATTENTION_WMMA) return tc_fwd_any<T>(D, out, lse, q, k, v, scale, causal);
    }
    size_t smem = sizeof(float) * (3 * kTile * (D + 1) + kTile * (kTile + 1));
    if (set_smem<T>(attention_fwd_kernel<T>, smem)) return -1;
    dim3 grid((unsigned)((Tq + kTile - 1) / kTile), (unsigned)(B * H));
    attention_fwd_kernel<T><<<grid, kThreads, smem, ms_cuda_stream_of(q->device_id)>>>(
        (T *)ms_tensor_data(out), (float *)ms_tensor_data(lse), (const T *)ms_tensor_data(q),
        (const T *)ms_tensor_data(k), (const T *)ms_tensor_data(v), layout4(q), layout4(k), layout4(v), layout4(out), H,
        Hkv, Tq, Tk, D, scale, causal);
    LAUNCH_CHECK("attention_fwd_kernel");
    return 0;
}

template <typename T>
int bwd(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
        const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout, float scale, int causal, float *dsum,
        int *summed) {
    int B = (int)q->sizes[0], H = (int)q->sizes[1], Hkv = (int)k->sizes[1], D = (int)q->sizes[3];
    const int Dv = (int)v->sizes[3];
    long long Tq = q->sizes[2], Tk = k->sizes[2];
    int device = q->device_id;
    cudaStream_t s = ms_cuda_stream_of(device);
    holder delta, clse;
    int64_t dshape[1] = {(int64_t)B * H * Tq};
    if (ms_tensor_empty(&delta.t, 1, dshape, MS_F32, device)) return -1;
    const ms_tensor *l = lse;
    if (!ms_tensor_is_contiguous(lse)) {
        if (ms_tensor_clone(&clse.t, lse)) return -1;
        l = clse.t;
    }
    const ms_tensor *ts[7] = {q, k, v, dout, dq, dk, dv};
    int impl = pick_impl<T>(D, Dv, ts, 7, true);
    if ((D > kMaxD || Dv != D) && impl != MS_ATTENTION_MMA && impl != MS_ATTENTION_WGMMA)
        return wide_refused("attention_backward", q, k, v);
    // the wgmma two-kernel backward computes Delta in its dq kernel
    bool fuse = false;
    if constexpr (sizeof(T) == 2)
        fuse = impl == MS_ATTENTION_WGMMA && fused_delta() &&
               !wg_onepass_for(dsum != nullptr, B, Hkv, Tq, Tk, causal, D) &&
               rows_aligned16(out) && rows_aligned16(dout);
    if (Tq > 0 && B * H > 0 && !fuse) {
        long long rows = (long long)B * H * Tq;
        float *dd = (float *)ms_tensor_data(delta.t);
        const T *op = (const T *)ms_tensor_data(out), *gp = (const T *)ms_tensor_data(dout);
        // (Delta_i = dout_i . out_i over v's width)
        if (sizeof(T) == 2 && Dv % 8 == 0 && rows_aligned16(out) && rows_aligned16(dout)) {
            int tpr = 1;
            while (tpr * 2 <= Dv / 8 && tpr < 32) tpr *= 2;
            unsigned blocks = (unsigned)((rows * tpr + 255) / 256);
            switch (tpr) {
            case 1: attention_delta_vec_kernel<T, 1><<<blocks, 256, 0, s>>>(dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows); break;
            case 2: attention_delta_vec_kernel<T, 2><<<blocks, 256, 0, s>>>(dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows); break;
            case 4: attention_delta_vec_kernel<T, 4><<<blocks, 256, 0, s>>>(dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows); break;
            case 8: attention_delta_vec_kernel<T, 8><<<blocks, 256, 0, s>>>(dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows); break;
            default: attention_delta_vec_kernel<T, 16><<<blocks, 256, 0, s>>>(dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows); break;
            }
            LAUNCH_CHECK("attention_delta_vec_kernel");
        } else {
            attention_delta_kernel<T><<<(unsigned)((rows * 32 + 255) / 256), 256, 0, s>>>(
                dd, op, gp, layout4(out), layout4(dout), H, Tq, Dv, rows);
            LAUNCH_CHECK("attention_delta_kernel");
        }
    }
    if constexpr (sizeof(T) == 2) {
        const float *lp = (const float *)ms_tensor_data(l), *dp = (const float *)ms_tensor_data(delta.t);
        if (impl == MS_ATTENTION_WGMMA) {
            if (dsum) *summed = 1;
            float *dd = (float *)ms_tensor_data(delta.t);
            const ms_tensor *fo = fuse ? out : nullptr;
            return D == 128         ? wg_bwd<T, 128>(dq, dk, dv, q, k, v, dout, lp, dd, scale, causal, s, dsum, fo)
                   : D == kMmaWideD ? wg_bwd<T, kMmaWideD, kMmaWideDv>(dq, dk, dv, q, k, v, dout, lp, dd, scale, causal, s, dsum, fo)
                                    : wg_bwd<T, 64>(dq, dk, dv, q, k, v, dout, lp, dd, scale, causal, s, dsum, fo);
        }
        if (impl == MS_ATTENTION_MMA)
            return D == 64    ? mma_bwd<T, 64, 64>(dq, dk, dv, q, k, v, dout, lp, dp, scale, causal, s)
                   : D == 128 ? mma_bwd<T, 128, 128>(dq, dk, dv, q, k, v, dout, lp, dp, scale, causal, s)
                   : Dv == kMmaWideDv ? mma_bwd<T, kMmaWideD, kMmaWideDv>(dq, dk, dv, q, k, v, dout, lp, dp, scale, causal, s)
                              : mma_bwd<T, kMmaWideD, kMmaWideD>(dq, dk, dv, q, k, v, dout, lp, dp, scale, causal, s);
        if (impl == MS_ATTENTION_WMMA) return tc_bwd_any<T>(D, dq, dk, dv, q, k, v, dout, lp, dp, scale, causal, s);
    }
    if (Tk > 0 && B * Hkv > 0) {
        size_t smem = sizeof(float) * (4 * kTile * (D + 1) + 2 * kTile * (kTile + 1) + 2 * kTile);
        if (set_smem<T>(attention_bwd_dkdv_kernel<T>, smem)) return -1;
        dim3 grid((unsigned)((Tk + kTile - 1) / kTile), (unsigned)(B * Hkv));
        attention_bwd_dkdv_kernel<T><<<grid, kThreads, smem, s>>>(
            (T *)ms_tensor_data(dk), (T *)ms_tensor_data(dv), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), (const float *)ms_tensor_data(l),
            (const float *)ms_tensor_data(delta.t), layout4(q), layout4(k), layout4(v), layout4(dout), layout4(dk),
            layout4(dv), H, Hkv, Tq, Tk, D, scale, causal);
        LAUNCH_CHECK("attention_bwd_dkdv_kernel");
    }
    if (Tq > 0 && B * H > 0) {
        size_t smem = sizeof(float) * (4 * kTile * (D + 1) + kTile * (kTile + 1));
        if (set_smem<T>(attention_bwd_dq_kernel<T>, smem)) return -1;
        dim3 grid((unsigned)((Tq + kTile - 1) / kTile), (unsigned)(B * H));
        attention_bwd_dq_kernel<T><<<grid, kThreads, smem, s>>>(
            (T *)ms_tensor_data(dq), (const T *)ms_tensor_data(q), (const T *)ms_tensor_data(k),
            (const T *)ms_tensor_data(v), (const T *)ms_tensor_data(dout), (const float *)ms_tensor_data(l),
            (const float *)ms_tensor_data(delta.t), layout4(q), layout4(k), layout4(v), layout4(dout), layout4(dq), H,
            Hkv, Tq, Tk, D, scale, causal);
        LAUNCH_CHECK("attention_bwd_dq_kernel");
    }
    return 0;
}

}  // namespace

extern "C" int ms_cuda_attention(ms_tensor *out, ms_tensor *lse, const ms_tensor *q_in, const ms_tensor *k_in,
                                 const ms_tensor *v_in, double scale, int causal) {
    if (check_kernel_args("attention", q_in, k_in, v_in)) return -1;
    if (ms_cuda_activate(q_in->device_id)) return -1;
    holder hq, hk, hv, ho;
    const ms_tensor *q, *k, *v;
    if (unit_d(q_in, hq, &q) || unit_d(k_in, hk, &k) || unit_d(v_in, hv, &v)) return -1;
    if (mma_only(q, v) && (aligned_rows(q, hq, &q) || aligned_rows(k, hk, &k) || aligned_rows(v, hv, &v))) return -1;
    ms_tensor *o = out;
    if ((out->strides[3] != 1 && out->sizes[3] != 1) || (mma_only(q, v) && !rows_aligned16(out))) {
        if (ms_tensor_empty(&ho.t, 4, out->sizes, out->dtype_id, out->device_id)) return -1;
        o = ho.t;
    }
    if (!ms_tensor_is_contiguous(lse)) return ms_errorf("attention: lse must be contiguous");
    int rc;
    switch (q->dtype_id) {
    case MS_F32: rc = fwd<float>(o, lse, q, k, v, (float)scale, causal); break;
    case MS_BF16: rc = fwd<__nv_bfloat16>(o, lse, q, k, v, (float)scale, causal); break;
    default: rc = fwd<__half>(o, lse, q, k, v, (float)scale, causal); break;
    }
    if (!rc && o != out) rc = ms_cuda_convert(out, o);
    return rc;
}

extern "C" int ms_cuda_attention_backward(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q_in,
                                          const ms_tensor *k_in, const ms_tensor *v_in, const ms_tensor *out_in,
                                          const ms_tensor *lse, const ms_tensor *dout_in, double scale, int causal,
                                          float *dsum, int *summed) {
    if (summed) *summed = 0;
    if (check_kernel_args("attention_backward", q_in, k_in, v_in)) return -1;
    if (ms_cuda_activate(q_in->device_id)) return -1;
    holder hq, hk, hv, ho, hg, hdq, hdk, hdv;
    const ms_tensor *q, *k, *v, *out, *dout;
    if (unit_d(q_in, hq, &q) || unit_d(k_in, hk, &k) || unit_d(v_in, hv, &v) || unit_d(out_in, ho, &out) ||
        unit_d(dout_in, hg, &dout))
        return -1;
    if (mma_only(q, v) && (aligned_rows(q, hq, &q) || aligned_rows(k, hk, &k) || aligned_rows(v, hv, &v) ||
                           aligned_rows(out, ho, &out) || aligned_rows(dout, hg, &dout)))
        return -1;
    ms_tensor *gq = dq, *gk = dk, *gv = dv;
    const bool mo = mma_only(q, v);   // (outputs the mma kernels cannot write: through a buffer)
    if ((dq->strides[3] != 1 || (mo && !rows_aligned16(dq))) &&
        ms_tensor_empty(&hdq.t, 4, dq->sizes, dq->dtype_id, dq->device_id) == 0)
        gq = hdq.t;
    if ((dk->strides[3] != 1 || (mo && !rows_aligned16(dk))) &&
        ms_tensor_empty(&hdk.t, 4, dk->sizes, dk->dtype_id, dk->device_id) == 0)
        gk = hdk.t;
    if ((dv->strides[3] != 1 || (mo && !rows_aligned16(dv))) &&
        ms_tensor_empty(&hdv.t, 4, dv->sizes, dv->dtype_id, dv->device_id) == 0)
        gv = hdv.t;
    int rc, sm = 0;
    float *ds = summed ? dsum : nullptr;
    switch (q->dtype_id) {
    case MS_F32: rc = bwd<float>(gq, gk, gv, q, k, v, out, lse, dout, (float)scale, causal, ds, &sm); break;
    case MS_BF16: rc = bwd<__nv_bfloat16>(gq, gk, gv, q, k, v, out, lse, dout, (float)scale, causal, ds, &sm); break;
    default: rc = bwd<__half>(gq, gk, gv, q, k, v, out, lse, dout, (float)scale, causal, ds, &sm); break;
    }
    if (summed) *summed = sm;
    if (!rc && gq != dq) rc = ms_cuda_convert(dq, gq);
    if (!rc && gk != dk) rc = ms_cuda_convert(dk, gk);
    if (!rc && gv != dv) rc = ms_cuda_convert(dv, gv);
    return rc;
}

extern "C" int ms_cuda_attention_widths(int dtype, int64_t D, int64_t Dv, int64_t *dqk, int64_t *dv) {
    if (kernel_widths(dtype, D, Dv, dqk, dv)) return 0;
    return ms_errorf("attention_widths: no CUDA kernel takes q/k head width %lld with v's %lld in %s: %s", (long long)D,
                     (long long)Dv, ms_dtype_name(dtype), kWidthsTaken);
}

extern "C" int ms_cuda_attention_set_impl(int impl) {
    if (impl < MS_ATTENTION_AUTO || impl > MS_ATTENTION_WGMMA)
        return ms_errorf("attention_set_impl: %d is not one of MS_ATTENTION_AUTO/MMA/WMMA/SIMT/WGMMA (0-4)", impl);
    g_impl_set = impl;
    return 0;
}

extern "C" int ms_cuda_attention_get_impl(void) { return g_impl_set; }

// 1: the one-pass mma backward (dq through f32 atomics), 0: the deterministic
// two kernels; returns the previous setting
extern "C" int ms_cuda_attention_set_onepass(int on) {
    int old = onepass() ? 1 : 0;
    g_onepass = on ? 1 : 0;
    return old;
}

// 1: the one-pass wgmma backward (dq in the dk/dv kernel, deterministic),
// 0: dkdv_kernel and dq_kernel; returns the previous setting
extern "C" int ms_cuda_attention_set_wg_onepass(int on) {
    int old = wg_onepass() ? 1 : 0;
    g_wg_onepass = on ? 1 : 0;
    return old;
}

// 1: the wgmma backward's dq kernel computes Delta (no delta kernel), 0:
// the delta kernel first; returns the previous setting
extern "C" int ms_cuda_attention_set_fused_delta(int on) {
    int old = fused_delta() ? 1 : 0;
    g_fused_delta = on ? 1 : 0;
    return old;
}

extern "C" int ms_cuda_attention_last_impl(void) { return g_impl_last; }

// ------------------------------------------- merging key blocks (moonshard.cp)
// One warp a row (b, h, t): the row's weights from the two log-sum-exps,
// then its D elements (f32 math; acc f32). The contracts: core/ops.h.
namespace {

struct rows3 {
    long long sb, sh, st;
};
rows3 layout3(const ms_tensor *t) { return {t->strides[0], t->strides[1], t->strides[2]}; }

template <typename TO, typename TL>
__global__ void attention_merge_kernel(float *acc, float *al, const TO *o, const TL *lb, qkv_layout la4, rows3 la3,
                                       qkv_layout lo4, rows3 lb3, int H, long long Tn, int D, long long rows,
                                       int first) {
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    long long t = row % Tn, bh = row / Tn;
    long long h = bh % H, b = bh / H;
    float *pa = acc + at(la4, b, h, t);
    const TO *po = o + at(lo4, b, h, t);
    float *pl = al + b * la3.sb + h * la3.sh + t * la3.st;
    float vb = (float)lb[b * lb3.sb + h * lb3.sh + t * lb3.st];
    if (first) {
        for (int d = lane; d < D; d += 32) pa[d] = conv<TO>::load(po[d]);
        if (lane == 0) *pl = vb;
        return;
    }
    float va = *pl, m = fmaxf(va, vb);
    if (m == -INFINITY) return;
    float wa = __expf(va - m), wb = __expf(vb - m), s = wa + wb;
    wa /= s;
    wb /= s;
    for (int d = lane; d < D; d += 32) pa[d] = pa[d] * wa + conv<TO>::load(po[d]) * wb;
    __syncwarp();
    if (lane == 0) *pl = m + __logf(s);
}

template <typename TG, typename TO>
__global__ void attention_block_grad_kernel(TO *out, const TG *g, const float *l1, const float *l2, qkv_layout lo4,
                                            qkv_layout lg4, rows3 l13, rows3 l23, int H, long long Tn, int D,
                                            long long rows) {
    long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    long long t = row % Tn, bh = row / Tn;
    long long h = bh % H, b = bh / H;
    float w = __expf(l1[b * l13.sb + h * l13.sh + t * l13.st] - l2[b * l23.sb + h * l23.sh + t * l23.st]);
    const TG *pg = g + at(lg4, b, h, t);
    TO *po = out + at(lo4, b, h, t);
    for (int d = lane; d < D; d += 32) po[d] = conv<TO>::store(conv<TG>::load(pg[d]) * w);
}

int unit_last(const char *op, const char *what, const ms_tensor *t) {
    char d[200];
    if (t->sizes[3] > 1 && t->strides[3] != 1)
        return ms_errorf("%s: %s is %s; the CUDA kernel needs its last dim with stride 1", op, what, ms_desc(t, d, sizeof d));
    return 0;
}

}  // namespace

extern "C" int ms_cuda_attention_merge(ms_tensor *acc, ms_tensor *acc_lse, const ms_tensor *o, const ms_tensor *lse,
                                       int first) {
    const char *op = "attention_merge_";
    char d[200];
    if (acc->dtype_id != MS_F32 || lse->dtype_id != MS_F32)
        return ms_errorf("%s: the CUDA kernel takes an f32 acc and lse, got %s", op, ms_desc(acc, d, sizeof d));
    if (unit_last(op, "acc", acc) || unit_last(op, "o", o)) return -1;
    if (ms_cuda_activate(acc->device_id)) return -1;
    int H = (int)acc->sizes[1], D = (int)acc->sizes[3];
    long long Tn = acc->sizes[2], rows = acc->sizes[0] * acc->sizes[1] * Tn;
    if (rows == 0 || D == 0) return 0;
    cudaStream_t s = ms_cuda_stream_of(acc->device_id);
    unsigned blocks = (unsigned)((rows * 32 + 255) / 256);
    float *pa = (float *)ms_tensor_data(acc), *pl = (float *)ms_tensor_data(acc_lse);
    const float *pb = (const float *)ms_tensor_data(lse);
    switch (o->dtype_id) {
    case MS_F32:
        attention_merge_kernel<float, float><<<blocks, 256, 0, s>>>(pa, pl, (const float *)ms_tensor_data(o), pb,
            layout4(acc), layout3(acc_lse), layout4(o), layout3(lse), H, Tn, D, rows, first);
        break;
    case MS_BF16:
        attention_merge_kernel<__nv_bfloat16, float><<<blocks, 256, 0, s>>>(pa, pl,
            (const __nv_bfloat16 *)ms_tensor_data(o), pb, layout4(acc), layout3(acc_lse), layout4(o), layout3(lse), H,
            Tn, D, rows, first);
        break;
    case MS_F16:
        attention_merge_kernel<__half, float><<<blocks, 256, 0, s>>>(pa, pl, (const __half *)ms_tensor_data(o), pb,
            layout4(acc), layout3(acc_lse), layout4(o), layout3(lse), H, Tn, D, rows, first);
        break;
    default: return ms_errorf("%s: o is %s; the CUDA kernel takes f32, bf16 or f16", op, ms_desc(o, d, sizeof d));
    }
    LAUNCH_CHECK("attention_merge_kernel");
    return 0;
}

template <typename TG>
static int block_grad_to(ms_tensor *out, const ms_tensor *g, const float *l1, const float *l2, rows3 r1, rows3 r2,
                         int H, long long Tn, int D, long long rows, cudaStream_t s) {
    unsigned blocks = (unsigned)((rows * 32 + 255) / 256);
    const TG *pg = (const TG *)ms_tensor_data(g);
    switch (out->dtype_id) {
    case MS_F32:
        attention_block_grad_kernel<TG, float><<<blocks, 256, 0, s>>>((float *)ms_tensor_data(out), pg, l1, l2,
            layout4(out), layout4(g), r1, r2, H, Tn, D, rows);
        break;
    case MS_BF16:
        attention_block_grad_kernel<TG, __nv_bfloat16><<<blocks, 256, 0, s>>>((__nv_bfloat16 *)ms_tensor_data(out), pg,
            l1, l2, layout4(out), layout4(g), r1, r2, H, Tn, D, rows);
        break;
    case MS_F16:
        attention_block_grad_kernel<TG, __half><<<blocks, 256, 0, s>>>((__half *)ms_tensor_data(out), pg, l1, l2,
            layout4(out), layout4(g), r1, r2, H, Tn, D, rows);
        break;
    default: return ms_errorf("attention_block_grad: the CUDA kernel writes f32, bf16 or f16");
    }
    LAUNCH_CHECK("attention_block_grad_kernel");
    return 0;
}

extern "C" int ms_cuda_attention_block_grad(ms_tensor *out, const ms_tensor *g, const ms_tensor *lse_b,
                                            const ms_tensor *lse) {
    const char *op = "attention_block_grad";
    char d[200];
    if (lse_b->dtype_id != MS_F32 || lse->dtype_id != MS_F32)
        return ms_errorf("%s: the CUDA kernel takes f32 log-sum-exps, got %s", op, ms_desc(lse_b, d, sizeof d));
    if (unit_last(op, "g", g) || unit_last(op, "out", out)) return -1;
    if (ms_cuda_activate(g->device_id)) return -1;
    int H = (int)g->sizes[1], D = (int)g->sizes[3];
    long long Tn = g->sizes[2], rows = g->sizes[0] * g->sizes[1] * Tn;
    if (rows == 0 || D == 0) return 0;
    cudaStream_t s = ms_cuda_stream_of(g->device_id);
    const float *l1 = (const float *)ms_tensor_data(lse_b), *l2 = (const float *)ms_tensor_data(lse);
    switch (g->dtype_id) {
    case MS_F32: return block_grad_to<float>(out, g, l1, l2, layout3(lse_b), layout3(lse), H, Tn, D, rows, s);
    case MS_BF16: return block_grad_to<__nv_bfloat16>(out, g, l1, l2, layout3(lse_b), layout3(lse), H, Tn, D, rows, s);
    case MS_F16: return block_grad_to<__half>(out, g, l1, l2, layout3(lse_b), layout3(lse), H, Tn, D, rows, s);
    default: return ms_errorf("%s: g is %s; the CUDA kernel takes f32, bf16 or f16", op, ms_desc(g, d, sizeof d));
    }
}
