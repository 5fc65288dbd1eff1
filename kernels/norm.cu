// kernels/norm.cu — fused LayerNorm and RMSNorm, forward and backward
// (contract in core/ops.h; CPU reference core/norm_cpu.c).
//
// Over the last dim C of x, seen as N rows:
//   LayerNorm  y = (x - mean)·rstd·w + b     rstd = 1/sqrt(var + eps)
//   RMSNorm    y = round_x(x·rstd)·w          rstd = 1/sqrt(mean(x²) + eps)
// Why fused: the composed path (mean, sub, square, mean, rsqrt, mul, mul,
// add, and as many ops again in backward) reads and writes N·C elements
// about ten times and keeps an f32 copy of xhat for backward. Here the
// forward reads x and writes y once (its second and third passes over a row
// hit L1) and saves only mean and rstd (N values); the backward reads g and
// x once and writes dx once.
// Shapes: x, y, g, dx (N, C); mean, rstd (N); w, b, dw, db (C).
// Bytes: forward N·C·(|x| + |y|); backward N·C·(|g| + |x| + |dx|) plus the
// dw/db partial sums (blocks·C·8 written and read). Flops are negligible.
// Math in f32 (f64 for f64 x); bf16/f16 storage is converted on load and
// rounded once on store.
//
// Forward: one warp per row, lanes moving 16-byte vectors (8 bf16 / 4 f32)
// when the rows allow it; two reductions (mean, then the centred variance,
// which is exact where E[x²]-E[x]² would cancel) by warp shuffles.
// Backward: one block per row at a time, blocks striding over the rows;
// each thread owns the same columns in every row, so its dw/db partial sums
// live in shared memory without atomics; at the end each block writes its
// partial row, and column_sum_kernel adds the blocks' rows in a fixed order.
// dxl_sum (the backward with a residual gradient, core/ops.h): the column
// sums of dxl (dx in g's dtype: the gradient of a branch output h = x·W + b,
// so its column sums are b's gradient). The warp-per-row kernel adds the
// values it stores (rounded as stored) into a shared-memory row per warp
// and writes a partial row per block, as for dw/db: the bias gradient
// costs no pass of its own over the N·C gradient (cuBLASLt's BGRAD
// epilogue reads it again). Other shapes: column_rows_kernel, a separate
// read of dxl (N·C·|g| bytes).
// No float atomics anywhere: the result is the same on every run.
// Gradient rule (core/ops.h, lua/moonshard/autograd.lua): dx, dw and db are
// written (=), never accumulated; adding dw/db into .grad is the autograd's.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------- kernels

// one warp per row; lane l takes the V-element chunks l·V, (l+32)·V, ...
// RES (the residual add before the norm): the row normalised is
// s = x + h, rounded to X and written to `res` (h in Y's dtype); the later
// passes read it back from there (this lane's own writes)
template <typename X, typename Y, typename A, int V, bool RMS, bool RES>
__global__ void norm_fwd_kernel(Y *__restrict__ y, A *__restrict__ mean, A *__restrict__ rstd,
                                const X *__restrict__ x, const A *__restrict__ w, const A *__restrict__ b,
                                long long N, int C, A eps, const Y *__restrict__ h, X *__restrict__ res) {
    const int lane = threadIdx.x & 31;
    const long long wpb = blockDim.x >> 5;
    for (long long row = blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        const X *xr = RES ? res + row * C : x + row * C;
        A s = 0;
        for (int i = lane * V; i < C; i += 32 * V) {
            A v[V];
            load_v<A, X, V>(v, x + row * C + i);
            if (RES) {
                A hv[V];
                load_v<A, Y, V>(hv, h + row * C + i);
#pragma unroll
                for (int k = 0; k < V; k++) v[k] = round_as<X>(v[k] + hv[k]);
                store_v<X, V>(res + row * C + i, v);
            }
#pragma unroll
            for (int k = 0; k < V; k++) s += RMS ? v[k] * v[k] : v[k];
        }
        s = warp_sum(s);
        A mu = 0, var = s / (A)C;
        if (!RMS) {
            mu = s / (A)C;
            A q = 0;
            for (int i = lane * V; i < C; i += 32 * V) {
                A v[V];
                load_v<A, X, V>(v, xr + i);
#pragma unroll
                for (int k = 0; k < V; k++) q += (v[k] - mu) * (v[k] - mu);
            }
            var = warp_sum(q) / (A)C;
        }
        const A rs = (A)1 / sqrt(var + eps);
        Y *yr = y + row * C;
        for (int i = lane * V; i < C; i += 32 * V) {
            A v[V];
            load_v<A, X, V>(v, xr + i);
#pragma unroll
            for (int k = 0; k < V; k++) {
                A t = (v[k] - mu) * rs;
                if (RMS) t = round_as<X>(t);
                if (w) t *= w[i + k];
                if (b) t += b[i + k];
                v[k] = t;
            }
            store_v<Y, V>(yr + i, v);
        }
        if (lane == 0) {
            if (mean) mean[row] = mu;
            if (rstd) rstd[row] = rs;
        }
    }
}

// The same forward with the row kept in registers (rows up to 32·V·NCH
// wide): lane l holds the chunks (j·32 + l)·V, the chunk order of the kernel
// above, so the sums are added in the same order and the results are the
// same bits; the variance and output passes read registers instead of
// re-reading the row.
template <typename X, typename Y, int V, int NCH, bool RMS, bool RES>
__global__ void norm_fwd_reg_kernel(Y *__restrict__ y, float *__restrict__ mean, float *__restrict__ rstd,
                                    const X *__restrict__ x, const float *__restrict__ w, const float *__restrict__ b,
                                    long long N, int C, float eps, const Y *__restrict__ h, X *__restrict__ res) {
    const int lane = threadIdx.x & 31;
    const long long wpb = blockDim.x >> 5;
    for (long long row = blockIdx.x * wpb + (threadIdx.x >> 5); row < N; row += (long long)gridDim.x * wpb) {
        float v[NCH][V], s = 0.f;
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const int i = (j * 32 + lane) * V;
            if (i < C) {
                load_v<float, X, V>(v[j], x + row * C + i);
                if (RES) {
                    float hv[V];
                    load_v<float, Y, V>(hv, h + row * C + i);
#pragma unroll
                    for (int k = 0; k < V; k++) v[j][k] = round_as<X>(v[j][k] + hv[k]);
                    store_v<X, V>(res + row * C + i, v[j]);
                }
#pragma unroll
                for (int k = 0; k < V; k++) s += RMS ? v[j][k] * v[j][k] : v[j][k];
            }
        }
        s = warp_sum(s);
        float mu = 0.f, var = s / (float)C;
        if (!RMS) {
            mu = s / (float)C;
            float q = 0.f;
#pragma unroll
            for (int j = 0; j < NCH; j++)
                if ((j * 32 + lane) * V < C)
#pragma unroll
                    for (int k = 0; k < V; k++) q += (v[j][k] - mu) * (v[j][k] - mu);
            var = warp_sum(q) / (float)C;
        }
        const float rs = 1.f / sqrtf(var + eps);
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const int i = (j * 32 + lane) * V;
            if (i < C) {
                float o[V];
#pragma unroll
                for (int k = 0; k < V; k++) {
                    float t = (v[j][k] - mu) * rs;
                    if (RMS) t = round_as<X>(t);
                    if (w) t *= w[i + k];
                    if (b) t += b[i + k];
                    o[k] = t;
                }
                store_v<Y, V>(y + row * C + i, o);
            }
        }
        if (lane == 0) {
            if (mean) mean[row] = mu;
            if (rstd) rstd[row] = rs;
        }
    }
}

// the sums of a and b over the block, handed to every thread; red holds 64
// values. Warps add in a fixed order.
template <typename A>
__device__ __forceinline__ void block_sum2(A &a, A &b, A *red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        red[wid] = a;
        red[32 + wid] = b;
    }
    __syncthreads();
    a = 0;
    b = 0;
    for (int k = 0; k < nw; k++) {
        a += red[k];
        b += red[32 + k];
    }
    __syncthreads();  // red is reused by the next row
}

// one chunk of a row, pass 1: adds its terms of sum(d) and sum(d·x̂) to a
// and bsum, d = g·w (g without a weight; wv is the chunk's weight)
template <typename A, int V, bool RMS>
__device__ __forceinline__ void norm_bwd_chunk_sums(A &a, A &bsum, const A (&gv)[V], const A (&xv)[V],
                                                    const A (&wv)[V], bool has_w, A mu, A rs) {
#pragma unroll
    for (int k = 0; k < V; k++) {
        const A xh = (xv[k] - mu) * rs, d = has_w ? gv[k] * wv[k] : gv[k];
        a += d;
        bsum += d * xh;
    }
}

// one chunk of a row, pass 2: its dx into o (with rv, a gradient from
// elsewhere, added when gres), its dw and db terms added to sw and sb
template <typename X, typename A, int V, bool RMS>
__device__ __forceinline__ void norm_bwd_chunk_out(A (&o)[V], A (&sw)[V], A (&sb)[V], const A (&gv)[V],
                                                   const A (&xv)[V], const A (&wv)[V], const A (&rv)[V],
                                                   bool has_w, bool dx, bool gres, bool pw, bool pb, A mu,
                                                   A rs, A a, A bsum) {
#pragma unroll
    for (int k = 0; k < V; k++) {
        const A xh = (xv[k] - mu) * rs;
        if (dx) {
            const A d = has_w ? gv[k] * wv[k] : gv[k];
            o[k] = RMS ? rs * (d - xh * bsum) : rs * (d - a - xh * bsum);
            if (gres) o[k] += rv[k];
        }
        if (pw) sw[k] += gv[k] * (RMS ? round_as<X>(xh) : xh);
        if (pb) sb[k] += gv[k];
    }
}

// one block per row, striding; thread t owns the chunks t·V, (t+nt)·V, ...
// of every row. With one chunk a thread, the chunk's weight and dw/db sums
// live in registers; with several, acc: 2·C partial sums (dw then db) in
// shared memory, or at gacc + blockIdx.x·2C when they do not fit, and pass 2
// reads each chunk of the row again.
// gres (or NULL): a gradient of x from elsewhere (x's dtype), added to dx
// (the residual stream's, when x is a residual sum: one pass, not two)
template <typename G, typename X, typename A, int V, bool RMS>
__global__ void __launch_bounds__(512, 2) norm_bwd_kernel(X *__restrict__ dx, A *__restrict__ part_w, A *__restrict__ part_b,
                                A *__restrict__ gacc, const G *__restrict__ g, const X *__restrict__ x,
                                const A *__restrict__ mean, const A *__restrict__ rstd, const A *__restrict__ w,
                                long long N, int C, const X *__restrict__ gres, G *__restrict__ dxl) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    A *red = reinterpret_cast<A *>(smem_raw);
    A *acc = gacc ? gacc + (long long)blockIdx.x * 2 * C : red + 64;
    const bool pw = part_w != nullptr, pb = part_b != nullptr;
    const int step = blockDim.x * V;
    if (C <= step) {
        // the thread's chunk i of every row: its weight and its dw/db sums
        // in registers across the rows (they lived in shared or global
        // memory behind a generic pointer, with the weight read a column at
        // a time in both passes: the rows ran at 28% of the copy bandwidth
        // at 8192 x 4096 bf16; ncu, tenth session). The same sums in the
        // same order: the same bits.
        const int i = threadIdx.x * V;
        const bool mine = i < C;
        A wv[V], sw[V], sb[V];
#pragma unroll
        for (int k = 0; k < V; k++) {
            sw[k] = sb[k] = (A)0;
            wv[k] = w && mine ? w[i + k] : (A)1;
        }
        for (long long row = blockIdx.x; row < N; row += gridDim.x) {
            const A mu = RMS ? (A)0 : mean[row], rs = rstd[row];
            A gv[V], xv[V], rv[V];
            if (mine) {
                load_v<A, G, V>(gv, g + row * C + i);
                load_v<A, X, V>(xv, x + row * C + i);
                if (dx && gres) load_v<A, X, V>(rv, gres + row * C + i);
            }
            A a = 0, bsum = 0;
            if (dx) {
                if (mine) norm_bwd_chunk_sums<A, V, RMS>(a, bsum, gv, xv, wv, w != nullptr, mu, rs);
                block_sum2(a, bsum, red);
                a /= (A)C;
                bsum /= (A)C;
            }
            if (!mine) continue;
            A o[V];
            norm_bwd_chunk_out<X, A, V, RMS>(o, sw, sb, gv, xv, wv, rv, w != nullptr, dx != nullptr,
                                             gres != nullptr, pw, pb, mu, rs, a, bsum);
            if (dx) store_v<X, V>(dx + row * C + i, o);
            if (dxl) store_v<G, V>(dxl + row * C + i, o);
        }
        if (mine)
#pragma unroll
            for (int k = 0; k < V; k++) {
                if (pw) part_w[(long long)blockIdx.x * C + i + k] = sw[k];
                if (pb) part_b[(long long)blockIdx.x * C + i + k] = sb[k];
            }
        return;
    }
    if (pw || pb)
        for (int i = threadIdx.x * V; i < C; i += step)
#pragma unroll
            for (int k = 0; k < V; k++) acc[i + k] = acc[C + i + k] = 0;
    for (long long row = blockIdx.x; row < N; row += gridDim.x) {
        const G *gr = g + row * C;
        const X *xr = x + row * C;
        const A mu = RMS ? (A)0 : mean[row], rs = rstd[row];
        A a = 0, bsum = 0;
        A gv[V], xv[V], wv[V];
        if (dx) {
            for (int i = threadIdx.x * V; i < C; i += step) {
                load_v<A, G, V>(gv, gr + i);
                load_v<A, X, V>(xv, xr + i);
#pragma unroll
                for (int k = 0; k < V; k++) wv[k] = w ? w[i + k] : (A)1;
                norm_bwd_chunk_sums<A, V, RMS>(a, bsum, gv, xv, wv, w != nullptr, mu, rs);
            }
            block_sum2(a, bsum, red);
            a /= (A)C;
            bsum /= (A)C;
        }
        for (int i = threadIdx.x * V; i < C; i += step) {
            load_v<A, G, V>(gv, gr + i);
            load_v<A, X, V>(xv, xr + i);
            A o[V], rv[V], sw[V], sb[V];
            if (dx && gres) load_v<A, X, V>(rv, gres + row * C + i);
#pragma unroll
            for (int k = 0; k < V; k++) {
                wv[k] = w ? w[i + k] : (A)1;
                sw[k] = pw ? acc[i + k] : (A)0;
                sb[k] = pb ? acc[C + i + k] : (A)0;
            }
            norm_bwd_chunk_out<X, A, V, RMS>(o, sw, sb, gv, xv, wv, rv, w != nullptr, dx != nullptr,
                                             gres != nullptr, pw, pb, mu, rs, a, bsum);
#pragma unroll
            for (int k = 0; k < V; k++) {
                if (pw) acc[i + k] = sw[k];
                if (pb) acc[C + i + k] = sb[k];
            }
            if (dx) store_v<X, V>(dx + row * C + i, o);
            if (dxl) store_v<G, V>(dxl + row * C + i, o);   // dx again in g's dtype (a branch's gradient)
        }
    }
    if (pw || pb)
        for (int i = threadIdx.x * V; i < C; i += step)
#pragma unroll
            for (int k = 0; k < V; k++) {
                if (pw) part_w[(long long)blockIdx.x * C + i + k] = acc[i + k];
                if (pb) part_b[(long long)blockIdx.x * C + i + k] = acc[C + i + k];
            }
}

// The same backward with one warp per row (rows up to 32·V·NCH wide): lane
// l owns the chunks (j·32 + l)·V of every row, its x, g and gres stay in
// registers between the two passes, the row sums are warp shuffles (no
// block barrier per row), and each warp keeps its dw/db partial sums in
// its own rows of shared memory until the end, where the block adds them
// in warp order and writes its partial row: deterministic as the block
// kernel. Chosen for rows up to 1024 f32 / 2048 bf16 wide (GPT-2's 768:
// 1.3x the block kernel's bandwidth, see docs/perf-notes.md). part_l (or
// NULL; needs dxl): the block's column sums of dxl as stored (rounded to
// G), a row of C per warp in shared memory as well, added the same way.
template <typename G, typename X, int V, int NCH, bool RMS>
__global__ void __launch_bounds__(256, 2) norm_bwd_warp_kernel(X *__restrict__ dx, float *__restrict__ part_w,
                                     float *__restrict__ part_b, const G *__restrict__ g, const X *__restrict__ x,
                                     const float *__restrict__ mean, const float *__restrict__ rstd,
                                     const float *__restrict__ w, long long N, int C, const X *__restrict__ gres,
                                     G *__restrict__ dxl, float *__restrict__ part_l) {
    // shared memory: per warp its rows of dw and db sums (2·C) when asked,
    // then per warp its row of dxl's sums (C) when asked; a lane touches only its own columns of its
    // warp's rows, so no barrier until the end. (The dw/db sums lived in
    // registers: 48 more a thread, and the row's three loads could not be
    // in flight together within two blocks an SM.)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *sm = reinterpret_cast<float *>(smem_raw);
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const bool pw = part_w != nullptr, pb = part_b != nullptr, pl = part_l != nullptr, pwb = pw || pb;
    float *wsum = sm + wib * 2 * C;                          // this warp's dw (C) and db (C) sums
    float *lsum = sm + (pwb ? wpb * 2 * C : 0) + wib * C;  // this warp's row of dxl's column sums
    // the weight (or NULL), staged in shared memory for the block: read
    // from device memory (4-byte loads a column, each waited on before its
    // chunk's math, in both passes) it was a quarter of the kernel's stall
    // samples (ncu, tenth session)
    float *wsm = w ? sm + (pwb ? wpb * 2 * C : 0) + (pl ? wpb * C : 0) : nullptr;
    if (w) {
        for (int i = threadIdx.x; i < C; i += blockDim.x) wsm[i] = w[i];
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        const int i = (j * 32 + lane) * V;
        if (i < C) {
            float z[V];
#pragma unroll
            for (int k = 0; k < V; k++) z[k] = 0.f;
            if (pwb) {
                store_v<float, V>(wsum + i, z);
                store_v<float, V>(wsum + C + i, z);
            }
            if (pl) store_v<float, V>(lsum + i, z);
        }
    }
    for (long long row = (long long)blockIdx.x * wpb + wib; row < N; row += (long long)gridDim.x * wpb) {
        const G *gr = g + row * C;
        const X *xr = x + row * C;
        const float mu = RMS ? 0.f : mean[row], rs = rstd[row];
        float gv[NCH][V], xv[NCH][V], rv[NCH][V], a = 0.f, bsum = 0.f;
        // gres is loaded with g and x, before the row's sums: one wait on
        // device memory a row, not two (its values are used after them)
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const int i = (j * 32 + lane) * V;
            if (i < C) {
                load_v<float, G, V>(gv[j], gr + i);
                load_v<float, X, V>(xv[j], xr + i);
                if (dx && gres) load_v<float, X, V>(rv[j], gres + row * C + i);
            }
        }
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const int i = (j * 32 + lane) * V;
            if (i < C) {
                float wv[V];
                if (w) load_v<float, float, V>(wv, wsm + i);
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float xh = (xv[j][k] - mu) * rs, d = w ? gv[j][k] * wv[k] : gv[j][k];
                    a += d;
                    bsum += d * xh;
                }
            }
        }
        a = warp_sum(a) / (float)C;
        bsum = warp_sum(bsum) / (float)C;
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            const int i = (j * 32 + lane) * V;
            if (i < C) {
                float o[V], sw[V], sb[V], wv[V];
                if (pwb) {
                    load_v<float, float, V>(sw, wsum + i);
                    load_v<float, float, V>(sb, wsum + C + i);
                }
                if (w) load_v<float, float, V>(wv, wsm + i);
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float xh = (xv[j][k] - mu) * rs;
                    const float d = w ? gv[j][k] * wv[k] : gv[j][k];
                    o[k] = RMS ? rs * (d - xh * bsum) : rs * (d - a - xh * bsum);
                    if (gres) o[k] += rv[j][k];
                    sw[k] += gv[j][k] * (RMS ? round_as<X>(xh) : xh);
                    sb[k] += gv[j][k];
                }
                if (pwb) {
                    store_v<float, V>(wsum + i, sw);
                    store_v<float, V>(wsum + C + i, sb);
                }
                if (dx) store_v<X, V>(dx + row * C + i, o);
                if (dxl) store_v<G, V>(dxl + row * C + i, o);
                if (pl) {  // the values just stored, as stored
                    float l[V];
                    load_v<float, float, V>(l, lsum + i);
#pragma unroll
                    for (int k = 0; k < V; k++) l[k] += round_as<G>(o[k]);
                    store_v<float, V>(lsum + i, l);
                }
            }
        }
    }
    if (!pwb && !pl) return;
    __syncthreads();
    // the warps' partial sums in warp order (the same order, and bits, as
    // when they were added from registers one warp after another)
    const float *ws0 = sm, *ls0 = sm + (pwb ? wpb * 2 * C : 0);
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        if (pwb) {
            float tw = 0.f, tb = 0.f;
            for (int ww = 0; ww < wpb; ww++) {
                tw += ws0[ww * 2 * C + i];
                tb += ws0[ww * 2 * C + C + i];
            }
            if (pw) part_w[(long long)blockIdx.x * C + i] = tw;
            if (pb) part_b[(long long)blockIdx.x * C + i] = tb;
        }
        if (pl) {  // the warps' rows in warp order
            float t = 0.f;
            for (int ww = 0; ww < wpb; ww++) t += ls0[ww * C + i];
            part_l[(long long)blockIdx.x * C + i] = t;
        }
    }
}

// out[c] = Σ_k part[k·C + c], k in a fixed order, for dw (blockIdx.y 0)
// and db (1): blocks of 8 columns (one 32-byte sector of a row) × 32 row
// lanes, each lane summing every 32nd row, then the lanes in order; the
// sum rounded once into O (dxl_sum: A float, O g's dtype)
template <typename A, typename O = A>
__global__ void column_sum_kernel(O *__restrict__ out_w, const A *__restrict__ part_w, O *__restrict__ out_b,
                                  const A *__restrict__ part_b, int nrows, int C) {
    __shared__ A buf[32][9];
    O *out = blockIdx.y ? out_b : out_w;
    const A *part = blockIdx.y ? part_b : part_w;
    if (!out) return;  // the same for the whole block
    const int c = blockIdx.x * 8 + threadIdx.x;
    A s = 0;
    if (c < C)
        for (int k = threadIdx.y; k < nrows; k += 32) s += part[(long long)k * C + c];
    buf[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        A t = 0;
        for (int k = 0; k < 32; k++) t += buf[k][threadIdx.x];
        out[c] = conv<O>::store(t);
    }
}

// part[blockIdx.y·C + c] = Σ of d[r·C + c] over the rows r of slab
// blockIdx.y (rows_per rows), in f32: blocks of 32 columns (a warp reads
// a row's contiguous 32 values) × 8 row lanes, each lane taking every 8th
// row of the slab, then the lanes in order. dxl_sum where the backward
// kernel does not fuse it (column_sum_kernel adds the slabs after).
template <typename G>
__global__ void column_rows_kernel(float *__restrict__ part, const G *__restrict__ d, long long N, int C,
                                   long long rows_per) {
    __shared__ float buf[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per;
    long long r1 = r0 + rows_per;
    if (r1 > N) r1 = N;
    float s = 0.f;
    if (c < C)
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) s += conv<G>::load(d[r * C + c]);
    buf[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += buf[k][threadIdx.x];
        part[(long long)blockIdx.y * C + c] = t;
    }
}

// -------------------------------------------------------------- launchers

namespace {

typedef ms_tmp tmp_tensor;

template <typename T> T *ptr(const ms_tensor *t) { return t ? (T *)ms_tensor_data(t) : nullptr; }

void rows_of(const ms_tensor *x, long long *N, int *C) {
    *C = (int)x->sizes[x->ndim - 1];
    *N = *C ? (long long)(ms_tensor_numel(x) / *C) : 0;
}

// MS_NORM_WARP_ROWS=0: the block-per-row backward and the forward that
// re-reads the row, for every shape (to compare)
bool warp_rows_on() {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("MS_NORM_WARP_ROWS");
        on = !(e && e[0] == '0');
    }
    return on == 1;
}

template <typename X, typename Y, typename A, bool RMS>
int launch_fwd(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
               const ms_tensor *b, double eps, long long N, int C, const ms_tensor *h = nullptr,
               ms_tensor *res = nullptr) {
    constexpr int VV = 16 / (sizeof(X) > sizeof(Y) ? sizeof(X) : sizeof(Y));
    const bool vec = C % VV == 0 && ms_aligned16(ms_tensor_data(x)) && ms_aligned16(ms_tensor_data(y)) &&
                     (!h || (ms_aligned16(ms_tensor_data(h)) && ms_aligned16(ms_tensor_data(res))));
    cudaStream_t s = ms_cuda_stream_of(x->device_id);
    const int threads = 256;
    long long blocks = (N + threads / 32 - 1) / (threads / 32);
    if (blocks > 65535LL * 32) blocks = 65535LL * 32;
    if constexpr (sizeof(A) == 4) {   // rows up to 32 values a lane: in registers
        constexpr int MAXCH = 32 / VV;
        const int nch = vec ? (C + 32 * VV - 1) / (32 * VV) : 0;
        if (vec && nch <= MAXCH && warp_rows_on()) {
            auto go = [&](auto nc) {
                constexpr int NC = decltype(nc)::value;
                if (h)
                    norm_fwd_reg_kernel<X, Y, VV, NC, RMS, true><<<(unsigned)blocks, threads, 0, s>>>(
                        ptr<Y>(y), ptr<float>(mean), ptr<float>(rstd), ptr<X>(x), ptr<float>(w), ptr<float>(b), N, C,
                        (float)eps, ptr<Y>(h), ptr<X>(res));
                else
                    norm_fwd_reg_kernel<X, Y, VV, NC, RMS, false><<<(unsigned)blocks, threads, 0, s>>>(
                        ptr<Y>(y), ptr<float>(mean), ptr<float>(rstd), ptr<X>(x), ptr<float>(w), ptr<float>(b), N, C,
                        (float)eps, ptr<Y>(h), ptr<X>(res));
            };
            if (nch <= 2) go(std::integral_constant<int, 2>());
            else if (nch <= 4) go(std::integral_constant<int, 4>());
            else if constexpr (MAXCH >= 8) {
                if (nch <= 6) go(std::integral_constant<int, 6>());
                else go(std::integral_constant<int, 8>());
            }
            LAUNCH_CHECK("norm_fwd_reg_kernel");
            return 0;
        }
    }
#define NORM_FWD(V_, RES_)                                                                                   \
    norm_fwd_kernel<X, Y, A, V_, RMS, RES_><<<(unsigned)blocks, threads, 0, s>>>(                             \
        ptr<Y>(y), ptr<A>(mean), ptr<A>(rstd), ptr<X>(x), ptr<A>(w), ptr<A>(b), N, C, (A)eps, ptr<Y>(h), ptr<X>(res))
    if (h) {
        if (vec) NORM_FWD(VV, true);
        else NORM_FWD(1, true);
    } else {
        if (vec) NORM_FWD(VV, false);
        else NORM_FWD(1, false);
    }
#undef NORM_FWD
    LAUNCH_CHECK("norm_fwd_kernel");
    return 0;
}

// y in any float dtype: f32/bf16/f16 x and y directly, f64 x with f64 y;
// other pairs through a temporary of a supported dtype
template <bool RMS>
int norm_forward(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
                 const ms_tensor *b, double eps) {
    const char *op = RMS ? "rms_norm" : "layer_norm";
    long long N;
    int C;
    rows_of(x, &N, &C);
    if (N == 0 || C == 0) return 0;
    if (ms_cuda_activate(x->device_id)) return -1;
    const bool x64 = x->dtype_id == MS_F64, y64 = y->dtype_id == MS_F64;
    if (x64 != y64) {
        tmp_tensor t;
        if (ms_tensor_empty(&t.t, y->ndim, y->sizes, x64 ? MS_F64 : MS_F32, y->device_id)) return -1;
        if (norm_forward<RMS>(t.t, mean, rstd, x, w, b, eps)) return -1;
        return ms_cuda_convert(y, t.t);
    }
    if (x64) return launch_fwd<double, double, double, RMS>(y, mean, rstd, x, w, b, eps, N, C);
    return with_float32_type(x->dtype_id, op, [&](auto xt) {
        using X = decltype(xt);
        return with_float32_type(y->dtype_id, op, [&](auto yt) {
            using Y = decltype(yt);
            return launch_fwd<X, Y, float, RMS>(y, mean, rstd, x, w, b, eps, N, C);
        });
    });
}

template <typename G, typename X, typename A, int V, bool RMS>
int launch_bwd_v(ms_tensor *dx, A *part_w, A *part_b, A *gacc, const ms_tensor *g, const ms_tensor *x,
                 const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, long long N, int C, int blocks,
                 int threads, size_t smem, const ms_tensor *gres, ms_tensor *dxl) {
    auto kernel = norm_bwd_kernel<G, X, A, V, RMS>;
    if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<blocks, threads, smem, ms_cuda_stream_of(x->device_id)>>>(
        ptr<X>(dx), part_w, part_b, gacc, ptr<G>(g), ptr<X>(x), ptr<A>(mean), ptr<A>(rstd), ptr<A>(w), N, C,
        ptr<X>(gres), ptr<G>(dxl));
    LAUNCH_CHECK("norm_bwd_kernel");
    return 0;
}

// dxl_sum (C, G's dtype) = the column sums of dxl (N, C), by a read of its
// own: slabs of rows summed by column_rows_kernel, then the slabs in order
template <typename G>
int launch_dxl_column_sum(ms_tensor *dxl_sum, const ms_tensor *dxl, long long N, int C) {
    const int dev = dxl->device_id;
    cudaStream_t s = ms_cuda_stream_of(dev);
    long long slabs = (N + 255) / 256;
    if (slabs > 1024) slabs = 1024;
    if (slabs < 1) slabs = 1;
    const long long rows_per = (N + slabs - 1) / slabs;
    tmp_tensor part;
    int64_t ps[1] = {(int64_t)slabs * C};
    if (ms_tensor_empty(&part.t, 1, ps, MS_F32, dev)) return -1;
    dim3 rb(32, 8), rg((unsigned)((C + 31) / 32), (unsigned)slabs);
    column_rows_kernel<G><<<rg, rb, 0, s>>>(ptr<float>(part.t), ptr<G>(dxl), N, C, rows_per);
    LAUNCH_CHECK("column_rows_kernel");
    dim3 cb(8, 32), cg((unsigned)((C + 7) / 8), 1);
    column_sum_kernel<float, G><<<cg, cb, 0, s>>>(ptr<G>(dxl_sum), ptr<float>(part.t), nullptr, nullptr, (int)slabs,
                                                  C);
    LAUNCH_CHECK("column_sum_kernel (dxl_sum)");
    return 0;
}

bool norm_bwd_two_waves() {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("MS_NORM_BWD_WAVES");
        on = e && strcmp(e, "2") == 0;
    }
    return on == 1;
}

template <typename G, typename X, int V, int NCH, bool RMS>
int launch_bwd_warp(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                    const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, long long N, int C,
                    const ms_tensor *gres, ms_tensor *dxl, ms_tensor *dxl_sum) {
    const int dev = x->device_id, threads = 256;
    const bool params = dw || db, lsum = dxl_sum && dxl;
    // per warp its dw and db sums (2·C) and, for dxl_sum, its row of C,
    // then the weight (C) (GPT-2's 768: 48 + 24 + 3 KiB)
    const size_t smem = sizeof(float) * ((params ? 2 * threads / 32 : 0) + (lsum ? threads / 32 : 0) + (w ? 1 : 0)) * (size_t)C;
    auto kernel = norm_bwd_warp_kernel<G, X, V, NCH, RMS>;
    if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    // blocks: as many as are resident at once (one wave; the rows are
    // shared out by a grid-stride loop), which registers and shared memory
    // decide (GPT-2's LayerNorm: 128 registers, 2 blocks an SM); it was 4
    // an SM, two waves (MS_NORM_BWD_WAVES=2 restores that, to compare)
    long long nb = norm_bwd_two_waves() ? (long long)ms_sm_count(dev) * 4 : ms_one_wave(kernel, dev, threads, smem);
    if (nb == 0) return ms_errorf("norm backward: the occupancy query failed (%s)", cudaGetErrorString(cudaGetLastError()));
    const long long need = (N + threads / 32 - 1) / (threads / 32);
    if (nb > need) nb = need;
    if (nb < 1) nb = 1;
    const int blocks = (int)nb;
    tmp_tensor pw, pb, pl;
    int64_t ps[1] = {(int64_t)blocks * C};
    if (params) {
        if (dw && ms_tensor_empty(&pw.t, 1, ps, MS_F32, dev)) return -1;
        if (db && ms_tensor_empty(&pb.t, 1, ps, MS_F32, dev)) return -1;
    }
    if (lsum && ms_tensor_empty(&pl.t, 1, ps, MS_F32, dev)) return -1;
    kernel<<<blocks, threads, smem, ms_cuda_stream_of(dev)>>>(ptr<X>(dx), ptr<float>(pw.t), ptr<float>(pb.t), ptr<G>(g),
                                                              ptr<X>(x), ptr<float>(mean), ptr<float>(rstd),
                                                              ptr<float>(w), N, C, ptr<X>(gres), ptr<G>(dxl),
                                                              ptr<float>(pl.t));
    LAUNCH_CHECK("norm_bwd_warp_kernel");
    if (lsum) {
        dim3 cb(8, 32), cg((unsigned)((C + 7) / 8), 1);
        column_sum_kernel<float, G><<<cg, cb, 0, ms_cuda_stream_of(dev)>>>(ptr<G>(dxl_sum), ptr<float>(pl.t),
                                                                           nullptr, nullptr, blocks, C);
        LAUNCH_CHECK("column_sum_kernel (dxl_sum)");
    }
    if (params) {
        dim3 cb(8, 32), cg((unsigned)((C + 7) / 8), 2);
        column_sum_kernel<float><<<cg, cb, 0, ms_cuda_stream_of(dev)>>>(ptr<float>(dw), ptr<float>(pw.t),
                                                                        ptr<float>(db), ptr<float>(pb.t), blocks, C);
        LAUNCH_CHECK("column_sum_kernel");
    }
    return 0;
}

template <typename G, typename X, typename A, bool RMS>
int launch_bwd(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
               const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, long long N, int C,
               const ms_tensor *gres, ms_tensor *dxl = nullptr, ms_tensor *dxl_sum = nullptr) {
    const int dev = x->device_id, adt = sizeof(A) == 8 ? MS_F64 : MS_F32;
    constexpr int VV = 16 / (sizeof(X) > sizeof(G) ? sizeof(X) : sizeof(G));
    const bool vec = C % VV == 0 && ms_aligned16(ms_tensor_data(x)) && ms_aligned16(ms_tensor_data(g)) &&
                     (!dx || ms_aligned16(ms_tensor_data(dx))) && (!gres || ms_aligned16(ms_tensor_data(gres))) &&
                     (!dxl || ms_aligned16(ms_tensor_data(dxl)));
    const int V = vec ? VV : 1;
    if constexpr (sizeof(A) == 4) {
        // rows of up to 32 values a lane (C <= 1024): x, g and the partial
        // sums in registers without spills
        constexpr int MAXCH = 32 / VV;
        const int nch = vec ? (C + 32 * VV - 1) / (32 * VV) : 0;
        if (vec && nch <= MAXCH && warp_rows_on()) {
            if (nch <= 2) return launch_bwd_warp<G, X, VV, 2, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl,
                                                            dxl_sum);
            if (nch <= 4) return launch_bwd_warp<G, X, VV, 4, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl,
                                                            dxl_sum);
            if constexpr (MAXCH >= 8) {
                if (nch <= 6) return launch_bwd_warp<G, X, VV, 6, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl,
                                                            dxl_sum);
                return launch_bwd_warp<G, X, VV, 8, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl,
                                                         dxl_sum);
            }
        }
    }
    // threads: enough for one chunk per thread, a multiple of 32, at most
    // 512 (the kernel's launch bound: its one-chunk path keeps a chunk's
    // weight and sums in registers; 64 a thread for two blocks an SM, with a
    // few spilled: rms_norm bwd at 8192 x 4096 bf16 0.123 ms, against 0.148
    // at one block an SM without spills)
    long long chunks = (C + V - 1) / V;
    int threads = (int)((chunks + 31) / 32 * 32);
    if (threads > 512) threads = 512;
    // blocks: fill the GPU (up to 8 resident blocks per SM), no more than rows
    int per_sm = 2048 / threads;
    per_sm = per_sm < 1 ? 1 : (per_sm > 8 ? 8 : per_sm);
    long long nb = (long long)ms_sm_count(dev) * per_sm;
    if (nb > N) nb = N;
    const int blocks = (int)nb;
    const bool params = dw || db;
    // the per-column partial sums: shared memory when they fit the device's
    // opt-in limit, else a global scratch row per block
    size_t smem = sizeof(A) * 64;
    int optin = 48 * 1024;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    bool global_acc = false;
    if (params) {
        size_t need = smem + sizeof(A) * 2 * (size_t)C;
        if (need <= (size_t)optin) smem = need;
        else global_acc = true;
    }
    tmp_tensor pw, pb, ga;
    if (params) {
        int64_t ps[1] = {(int64_t)blocks * C};
        if (dw && ms_tensor_empty(&pw.t, 1, ps, adt, dev)) return -1;
        if (db && ms_tensor_empty(&pb.t, 1, ps, adt, dev)) return -1;
        int64_t gs[1] = {(int64_t)blocks * 2 * C};
        if (global_acc && ms_tensor_empty(&ga.t, 1, gs, adt, dev)) return -1;
    }
    int rc = vec ? launch_bwd_v<G, X, A, VV, RMS>(dx, ptr<A>(pw.t), ptr<A>(pb.t), ptr<A>(ga.t), g, x, mean, rstd, w,
                                                   N, C, blocks, threads, smem, gres, dxl)
                 : launch_bwd_v<G, X, A, 1, RMS>(dx, ptr<A>(pw.t), ptr<A>(pb.t), ptr<A>(ga.t), g, x, mean, rstd, w,
                                                  N, C, blocks, threads, smem, gres, dxl);
    if (rc) return rc;
    if (dxl_sum && dxl) {  // not fused here: a read of dxl of its own (f32 sums; f64 goes to the caller's)
        if constexpr (sizeof(G) <= 4) {
            if (launch_dxl_column_sum<G>(dxl_sum, dxl, N, C)) return -1;
        } else {
            return ms_errorf("norm.cu: dxl_sum of an f64 dxl is the caller's");
        }
    }
    if (params) {
        dim3 cb(8, 32), cg((unsigned)((C + 7) / 8), 2);
        column_sum_kernel<A><<<cg, cb, 0, ms_cuda_stream_of(dev)>>>(ptr<A>(dw), ptr<A>(pw.t), ptr<A>(db),
                                                                    ptr<A>(pb.t), blocks, C);
        LAUNCH_CHECK("column_sum_kernel");
    }
    return 0;
}

// dx in x's dtype; g any float dtype (an f64 g with an f32 x, or the
// reverse, goes through a converted copy of g)
template <bool RMS>
int norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                  const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, const ms_tensor *gres = nullptr,
                  ms_tensor *dxl = nullptr, ms_tensor *dxl_sum = nullptr) {
    const char *op = RMS ? "rms_norm_backward" : "layer_norm_backward";
    long long N;
    int C;
    rows_of(x, &N, &C);
    if (C == 0) return 0;
    if (ms_cuda_activate(x->device_id)) return -1;
    if (N == 0) {
        if (dw && ms_cuda_fill(dw, 0)) return -1;
        if (db && ms_cuda_fill(db, 0)) return -1;
        if (dxl_sum && ms_cuda_fill(dxl_sum, 0)) return -1;
        return 0;
    }
    const bool x64 = x->dtype_id == MS_F64;
    if ((g->dtype_id == MS_F64) != x64) {
        tmp_tensor t;
        if (ms_tensor_to(&t.t, g, x64 ? MS_F64 : MS_F32, g->device_id)) return -1;
        return norm_backward<RMS>(dx, dw, db, t.t, x, mean, rstd, w, gres);
    }
    if (x64) return launch_bwd<double, double, double, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl, dxl_sum);
    return with_float32_type(g->dtype_id, op, [&](auto gt) {
        using G = decltype(gt);
        return with_float32_type(x->dtype_id, op, [&](auto xt) {
            using X = decltype(xt);
            return launch_bwd<G, X, float, RMS>(dx, dw, db, g, x, mean, rstd, w, N, C, gres, dxl, dxl_sum);
        });
    });
}

}  // namespace

extern "C" int ms_cuda_layer_norm(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x,
                                  const ms_tensor *w, const ms_tensor *b, double eps) {
    return norm_forward<false>(y, mean, rstd, x, w, b, eps);
}

extern "C" int ms_cuda_layer_norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g,
                                           const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd,
                                           const ms_tensor *w) {
    return norm_backward<false>(dx, dw, db, g, x, mean, rstd, w);
}

// the residual add fused in front of the norm (core/ops.h,
// ms_add_layer_norm / ms_add_rms_norm): res = x + h, y = norm(res). Returns
// 1 (nothing done) for the dtype pairs the kernel does not take: h must have
// y's dtype and res x's, f32/bf16/f16 (the caller then adds and normalises
// apart).
// MS_FUSED_ADD_NORM=0 in the environment: always the separate add and norm
static bool add_norm_on() {
    static const bool on = [] {
        const char *e = getenv("MS_FUSED_ADD_NORM");
        return !(e && e[0] == '0');
    }();
    return on;
}

extern "C" int ms_cuda_add_norm(ms_tensor *res, ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x,
                                const ms_tensor *h, const ms_tensor *w, const ms_tensor *b, double eps, int rms) {
    if (!add_norm_on()) return 1;
    if (h->dtype_id != y->dtype_id || res->dtype_id != x->dtype_id || x->dtype_id == MS_F64 ||
        y->dtype_id == MS_F64)
        return 1;
    long long N;
    int C;
    rows_of(x, &N, &C);
    if (N == 0 || C == 0) return 1;
    if (ms_cuda_activate(x->device_id)) return -1;
    return with_float32_type(x->dtype_id, "add_norm", [&](auto xt) {
        using X = decltype(xt);
        return with_float32_type(y->dtype_id, "add_norm", [&](auto yt) {
            using Y = decltype(yt);
            return rms ? launch_fwd<X, Y, float, true>(y, nullptr, rstd, x, w, nullptr, eps, N, C, h, res)
                       : launch_fwd<X, Y, float, false>(y, mean, rstd, x, w, b, eps, N, C, h, res);
        });
    });
}

// a norm's backward with dx += gres in the same pass (gres in x's dtype),
// and with dxl (or NULL) dx written a second time in g's dtype; with
// dxl_sum (or NULL) dxl's column sums (in the warp kernel's pass, else by
// launch_dxl_column_sum). 1 (nothing done): the caller's path.
extern "C" int ms_cuda_norm_backward_add(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g,
                                         const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd,
                                         const ms_tensor *w, const ms_tensor *gres, int rms, ms_tensor *dxl,
                                         ms_tensor *dxl_sum) {
    if (!add_norm_on() || !dx || gres->dtype_id != x->dtype_id) return 1;
    if (dxl && (dxl->dtype_id != g->dtype_id || (g->dtype_id == MS_F64) != (x->dtype_id == MS_F64) ||
                !ms_tensor_is_contiguous(dxl) || !ms_tensor_is_contiguous(g)))
        return 1;
    if (dxl_sum && (!dxl || dxl_sum->dtype_id != dxl->dtype_id || dxl->dtype_id == MS_F64 ||
                    !ms_tensor_is_contiguous(dxl_sum) || ms_tensor_numel(dxl_sum) != x->sizes[x->ndim - 1]))
        return 1;
    return rms ? norm_backward<true>(dx, dw, nullptr, g, x, nullptr, rstd, w, gres, dxl, dxl_sum)
               : norm_backward<false>(dx, dw, db, g, x, mean, rstd, w, gres, dxl, dxl_sum);
}

extern "C" int ms_cuda_rms_norm(ms_tensor *y, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w, double eps) {
    return norm_forward<true>(y, nullptr, rstd, x, w, nullptr, eps);
}

extern "C" int ms_cuda_rms_norm_backward(ms_tensor *dx, ms_tensor *dw, const ms_tensor *g, const ms_tensor *x,
                                         const ms_tensor *rstd, const ms_tensor *w) {
    return norm_backward<true>(dx, dw, nullptr, g, x, nullptr, rstd, w);
}
