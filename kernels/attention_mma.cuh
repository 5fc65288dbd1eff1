// kernels/attention_mma.cuh — the default tensor-core path of kernels/attention.cu
// for bf16/f16 with head dims 64, 128 and 192 (DeepSeek-V3's q/k heads) on sm_80+,
// and q/k 192 with v 128 (DeepSeek-V3's MLA: every kernel takes q/k's width D
// and v's DV apart; S, dQ and dK run over D, O, dP, dV and Delta over DV): FlashAttention-2 written on
// raw mma.sync.m16n8k16 (inline PTX, f32 accumulation). Unlike the WMMA path
// (attention_tc.cuh) no score tile ever leaves the registers: S = Q.K^T lands
// in accumulator fragments, the online softmax runs on them (row max and sum
// over the four lanes of a quad), and P, rounded to 16 bits, is used in place
// as the A operand of P.V (the fragment identity in mma_ops.cuh). K/V (forward, dq) and
// Q/dO (dk/dv) tiles stream through shared memory with cp.async, double
// buffered; rows are padded to D+8 (v and dO: DV+8) elements so every
// ldmatrix phase (8 rows of 16 bytes) hits 32 distinct banks.
//
// Every kernel has 4 warps, each owning 16*MT rows (MT m-tiles; config<D, DV>
// below: MT = 2 at D = 64, so each ldmatrix'd K/V/Q/dO fragment feeds two
// m-tiles' MMAs; MT = 1 at D = 128 and 192, where the dk/dv kernel takes
// 16-query steps at D = 192: dK and dV hold 192 f32 registers a thread (160
// with DV = 128), and 32-query steps spill):
//   forward  64*MT query rows a block, 64-key tiles; causal tiles past the
//            diagonal are never loaded, only the diagonal ones are masked.
//   dk, dv   64*MT keys a block, looping over the query heads of the kv group
//            and their BQ-query tiles: S^T = K.Q^T and dP^T = V.dO^T have
//            keys as rows, so P^T and dS^T are already A fragments for
//            dV += P^T.dO and dK += dS^T.Q.
//   dq       64*MT queries a block, looping over 64-key tiles: dQ += dS.K
//            (S and dP recomputed: 3.5x the forward's flops for the whole
//            backward, against FA2's 2.5x with atomic dQ).
// No atomics by default: every gradient element is owned by one thread, so
// the results are the same bits on every run. MS_ATTENTION_BWD=onepass (or
// ms_cuda_attention_set_onepass) runs FA2's one pass instead: the dk/dv
// kernel also sums dq with f32 atomics (dkdv_kernel's DQ). Included by attention.cu only (it uses that
// file's qkv_layout, at() and kLog2e).
#include "mma_ops.cuh"

namespace mma {

// the A fragment of the 16 x 16 block made of C tiles c[2kk], c[2kk+1]
// (the identity above), rounded to T
template <typename T>
__device__ __forceinline__ void c_to_a(unsigned a[4], const float (*c)[4], int kk) {
    a[0] = op<T>::pack(c[2 * kk][0], c[2 * kk][1]);
    a[1] = op<T>::pack(c[2 * kk][2], c[2 * kk][3]);
    a[2] = op<T>::pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = op<T>::pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// acc[mt] += C[mt] · Bᵀ over one 64-wide step: C the f32 accumulators of
// the warp's MT m-tiles (16 x 64 each, turned into A fragments in
// registers), B the D x 64 tile in shared memory (row stride LD) read
// transposed: the P·V of the forward and the dS·K of the dq pass
template <typename T, int LD, int MT, int D>
__device__ __forceinline__ void acc_c_times_bt(float (*acc)[D / 8][4], float (*c)[8][4], const T *B, int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) c_to_a<T>(a[mt], c[mt], kk);
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
            unsigned b[4];
            ldbt<T, LD>(b, B, dn * 16, kk * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                op<T>::mma(acc[mt][2 * dn], a[mt], b[0], b[1]);
                op<T>::mma(acc[mt][2 * dn + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[mt] (16 x 64 each) += A · Bᵀ over NK k16 steps: A the warp's MT
// m-tiles from row R0 of tile A, B the 64-row tile B, both of row stride LD
// (the dq kernel's S = Q·Kᵀ and dP = dO·Vᵀ apart, when v's width is its own)
template <typename T, int LD, int MT, int NK>
__device__ __forceinline__ void acc_a_times_bt64(float (*acc)[8][4], const T *A, const T *B, int R0, int lane) {
#pragma unroll
    for (int kk = 0; kk < NK; kk++) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) lda<T, LD>(a[mt], A, R0 + mt * 16, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < 4; np++) {
            unsigned b[4];
            ldb<T, LD>(b, B, np * 16, kk * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                op<T>::mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                op<T>::mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// rows [t0, t0+R) of (b, h), all D columns, into s (R x LD, LD = D + 8) with
// cp.async, 16 bytes a lane; rows past Tn are zero-filled (so masked keys
// multiply zeros, never stale data)
template <typename T, int R, int D, int NT>
__device__ __forceinline__ void load_rows(T *s, const T *src, const qkv_layout &l, long long b, long long h,
                                          long long t0, long long Tn) {
    constexpr int CPR = D / 8, N = R * CPR, LD = D + 8;
#pragma unroll
    for (int it = 0; it < (N + NT - 1) / NT; it++) {
        const int e = threadIdx.x + it * NT;
        if (N % NT == 0 || e < N) {
            const int r = e / CPR, c = e - r * CPR;
            const long long t = t0 + r;
            const bool ok = t < Tn;
            cp_async16(s + r * LD + c * 8, ok ? src + at(l, b, h, t) + c * 8 : src, ok);
        }
    }
}

// a warp's 16*NR rows of D columns (from row R0 of tile s, row stride LD:
// D + 8, or the wider tile's whose rows the warp stages them in) to rows
// t0+R0.. of (b, h) in dst, 16 bytes a lane, rows past Tn skipped
template <typename T, int D, int NR, int LD = D + 8>
__device__ __forceinline__ void store_rows(T *dst, const qkv_layout &l, long long b, long long h, long long t0,
                                           long long Tn, const T *s, int R0, int lane) {
    constexpr int CPR = D / 8;
    static_assert(LD >= D + 8, "rows at least D + 8 apart");
    static_assert(16 * NR * CPR % 32 == 0, "whole rounds of 32 lanes");
#pragma unroll
    for (int it = 0; it < 16 * NR * CPR / 32; it++) {
        const int e = lane + it * 32, r = e / CPR, c = e - r * CPR;
        const long long t = t0 + R0 + r;
        if (t < Tn)
            *reinterpret_cast<uint4 *>(dst + at(l, b, h, t) + c * 8) =
                *reinterpret_cast<const uint4 *>(s + (R0 + r) * LD + c * 8);
    }
}

// C fragments (n-tiles 0..D/8 of rows R, R+8 where R = R0 + g) scaled by
// mul[0] (row R) and mul[1] (row R+8), rounded, into rows of tile s (row
// stride LD, as store_rows)
template <typename T, int D, int LD = D + 8>
__device__ __forceinline__ void frag_to_smem(T *s, const float (*c)[4], int R0, int lane, float mul0, float mul1) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++) {
        *reinterpret_cast<unsigned *>(s + (R0 + g) * LD + dn * 8 + 2 * t) =
            op<T>::pack(c[dn][0] * mul0, c[dn][1] * mul0);
        *reinterpret_cast<unsigned *>(s + (R0 + g + 8) * LD + dn * 8 + 2 * t) =
            op<T>::pack(c[dn][2] * mul1, c[dn][3] * mul1);
    }
}

// The tile configuration attention.cu launches per head dims (q/k D, v DV;
// and the emulator checks): m-tiles (16 rows) per warp, and queries per
// dk/dv step. More m-tiles per warp feed each ldmatrix'd B fragment to more
// MMAs (shared memory bandwidth is the limit of mma.sync at one m-tile);
// these are the largest without register spills (ptxas -v, sm_90a: 222-255
// registers). (192, 128) keeps D = 192's tiling.
template <int D, int DV = D>
struct config {
    static const int fwd_mt = D == 64 ? 2 : 1;   // 128 query rows a block at D = 64
    static const int dkdv_mt = D == 64 ? 2 : 1;  // 128 keys a block at D = 64
    static const int dkdv_bq = D > 128 ? 16 : 32;  // (D = 192: dK and dV take 192 of the registers)
    static const int dq_mt = D == 64 ? 2 : 1;    // 128 queries a block at D = 64
};

// --------------------------------------------------------------- forward
template <typename T, int D, int DV, int MT>
size_t fwd_smem() {
    // Q, then K and V double-buffered
    return ((size_t)(64 * MT + 2 * 64) * (D + 8) + (size_t)2 * 64 * (DV + 8)) * sizeof(T);
}

// (D: q/k's head width, DV: v's and the output's, at most D: the output is
// staged in the Q tile's rows)
template <typename T, int D, int DV, int MT>
__global__ void __launch_bounds__(128) fwd_kernel(T *out, float *lse, const T *q, const T *k, const T *v,
                                                  qkv_layout lq, qkv_layout lk, qkv_layout lv, qkv_layout lo, int H,
                                                  int Hkv, long long Tq, long long Tk, float scale, int causal) {
    constexpr int BM = 64 * MT, BN = 64, LD = D + 8, LDV = DV + 8, NT = 128, NDV = DV / 8, NK = D / 16;
    static_assert(DV <= D && DV % 16 == 0, "v no wider than q/k, whole k16 steps");
    extern __shared__ __align__(128) unsigned char sm[];
    T *Qs = (T *)sm, *Ks = Qs + BM * LD, *Vs = Ks + 2 * BN * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const int wrow = warp * 16 * MT;                                    // this warp's first row in the tile
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * BM;  // longest causal rows first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;  // causal: key j visible to query i when j <= i + off
    const long long kend = causal ? max(0ll, min(Tk, i0 + BM + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const float sl = scale * kLog2e;

    load_rows<T, BM, D, NT>(Qs, q, lq, b, h, i0, Tq);
    if (ntiles > 0) {
        load_rows<T, BN, D, NT>(Ks, k, lk, b, g, 0, Tk);
        load_rows<T, BN, DV, NT>(Vs, v, lv, b, g, 0, Tk);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    // Q fragments in registers when they fit beside O and S (else re-read per tile)
    constexpr bool QREG = MT * NK <= 8;
    unsigned qa[QREG ? MT : 1][QREG ? NK : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int kk = 0; kk < NK; kk++) lda<T, LD>(qa[mt][kk], Qs, wrow + mt * 16, kk * 16, lane);
    }
    float o[MT][NDV][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int dn = 0; dn < NDV; dn++) o[mt][dn][0] = o[mt][dn][1] = o[mt][dn][2] = o[mt][dn][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int t = 0; t < ntiles; t++) {
        if (t > 0) {
            cp_async_wait_all();  // tile t has landed (this thread's part) ...
            __syncthreads();      // ... everyone's, and tile t-1's buffer is free
        }
        if (t + 1 < ntiles) {
            const int nb = (t + 1) & 1;
            load_rows<T, BN, D, NT>(Ks + nb * BN * LD, k, lk, b, g, (long long)(t + 1) * BN, Tk);
            load_rows<T, BN, DV, NT>(Vs + nb * BN * LDV, v, lv, b, g, (long long)(t + 1) * BN, Tk);
        }
        cp_async_commit();
        const long long j0 = (long long)t * BN;
        // a warp whose rows see none of these keys (causal) skips the tile
        if (causal && j0 > i0 + wrow + 16 * MT - 1 + off) continue;
        const T *Kb = Ks + (t & 1) * BN * LD, *Vb = Vs + (t & 1) * BN * LDV;

        // S = Q K^T: 16*MT rows x 64 keys (8 n-tiles) in registers
        float s[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < 8; n++) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            unsigned aqr[MT][4];
            const unsigned *aq[MT];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if constexpr (QREG) {
                    aq[mt] = qa[mt][kk];
                } else {
                    lda<T, LD>(aqr[mt], Qs, wrow + mt * 16, kk * 16, lane);
                    aq[mt] = aqr[mt];
                }
            }
#pragma unroll
            for (int np = 0; np < 4; np++) {
                unsigned kb[4];
                ldb<T, LD>(kb, Kb, np * 16, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    op<T>::mma(s[mt][2 * np], aq[mt], kb[0], kb[1]);
                    op<T>::mma(s[mt][2 * np + 1], aq[mt], kb[2], kb[3]);
                }
            }
        }

        // online softmax in the exp2 domain; masks only on edge/diagonal tiles
        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0 + wrow + off);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {  // row g8 (c0, c1) and row g8 + 8 (c2, c3)
                // the last key column this row sees in the tile (-1: none)
                int cmax = (int)min((long long)BN, Tk - j0) - 1;
                if (causal) cmax = (int)min((long long)cmax, max(-1ll, i0 + wrow + mt * 16 + g8 + 8 * r + off - j0));
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float x = s[mt][n][2 * r + e] * sl;
                        if (edge && n * 8 + 2 * t4 + e > cmax) x = -INFINITY;
                        s[mt][n][2 * r + e] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mnew = fmaxf(m[mt][r], mx);
                const float mu = mnew == -INFINITY ? 0.f : mnew;  // a row with no key yet: p = 0
                const float alpha = fast_exp2(m[mt][r] - mu);
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float p = fast_exp2(s[mt][n][2 * r + e] - mu);
                        s[mt][n][2 * r + e] = p;
                        sum += p;  // f32 row sum of this lane's columns; the quad adds up at the end
                    }
                l[mt][r] = l[mt][r] * alpha + sum;
                m[mt][r] = mnew;
#pragma unroll
                for (int dn = 0; dn < NDV; dn++) {
                    o[mt][dn][2 * r] *= alpha;
                    o[mt][dn][2 * r + 1] *= alpha;
                }
            }
        }

        // O += P V, P straight from the S registers
        acc_c_times_bt<T, LDV, MT, DV>(o, s, Vb, lane);
    }

    // out = O / l through this warp's rows of the Q tile (only it read them;
    // at the Q tile's row stride, so no other warp's rows are touched); lse
    // in natural log as the other kernels
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float lt = l[mt][r];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            inv[r] = lt > 0.f ? 1.f / lt : 0.f;
            const long long i = i0 + wrow + mt * 16 + g8 + 8 * r;
            if (t4 == 0 && i < Tq)
                lse[((long long)b * H + h) * Tq + i] = lt > 0.f ? (m[mt][r] + log2f(lt)) / kLog2e : -INFINITY;
        }
        frag_to_smem<T, DV, LD>(Qs, o[mt], wrow + mt * 16, lane, inv[0], inv[1]);
    }
    __syncwarp();
    store_rows<T, DV, MT, LD>(out, lo, b, h, i0, Tq, Qs, wrow, lane);
}

// -------------------------------------------------------------- backward
// dk, dv for 64*MT keys of one (b, kv head); warp w owns keys
// 16*MT*w..16*MT*(w+1)-1 and sees BQ queries at a time.
// DQ (the one-pass backward, FA2's): the block also adds its keys' share
// of dQ = scale dS K into dqacc, an f32 (B, H, Tq, D) buffer zeroed
// before, with float atomics: each step's dS^T tile goes to shared memory
// (double-buffered Ss, [key][query]), and at the top of the next step,
// after the barrier, warp w multiplies it by columns [w D/4, (w+1) D/4) of
// the block's K tile (the step's Q tile is B/4 x D; the last one after the
// loop). 2.5x the forward's flops instead of 3.5x; the sums' order, and so
// dq's last bits, then vary from run to run.
template <typename T, int D, int DV, int BQ, int MT, bool DQ = false>
size_t dkdv_smem() {
    // K, V; Q, dO double-buffered; lse and delta; DQ: dS^T double-buffered
    return ((size_t)(64 * MT + 2 * BQ) * (D + 8) + (size_t)(64 * MT + 2 * BQ) * (DV + 8)) * sizeof(T) +
           4 * BQ * sizeof(float) + (DQ ? (size_t)2 * 64 * MT * (BQ + 8) * sizeof(T) : 0);
}

// dQ (+)= scale dS K for the BQ queries of step `it` (see dkdv_kernel):
// this warp's D/4 columns, dS^T from Ss ([key][query], row stride BQ + 8)
template <typename T, int D, int BQ, int BN>
__device__ __forceinline__ void dq_from_ds(float *dqacc, const T *Ss, const T *Ks, int warp, int lane, long long b,
                                           int hq, long long i0, int H, long long Tq, float scale) {
    constexpr int LD = D + 8, LS = BQ + 8, NC = D / 4, NNT = NC / 8, MQ = BQ / 16;
    float acc[MQ][NNT][4];
#pragma unroll
    for (int mq = 0; mq < MQ; mq++)
#pragma unroll
        for (int n = 0; n < NNT; n++) acc[mq][n][0] = acc[mq][n][1] = acc[mq][n][2] = acc[mq][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        unsigned a[MQ][4];
#pragma unroll
        for (int mq = 0; mq < MQ; mq++) ldat<T, LS>(a[mq], Ss, mq * 16, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < NNT / 2; np++) {
            unsigned kb[4];
            ldbt<T, LD>(kb, Ks, warp * NC + np * 16, kk * 16, lane);
#pragma unroll
            for (int mq = 0; mq < MQ; mq++) {
                op<T>::mma(acc[mq][2 * np], a[mq], kb[0], kb[1]);
                op<T>::mma(acc[mq][2 * np + 1], a[mq], kb[2], kb[3]);
            }
        }
    }
    const int g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mq = 0; mq < MQ; mq++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long i = i0 + mq * 16 + g8 + 8 * r;
            if (i >= Tq) continue;
            float *row = dqacc + (((long long)b * H + hq) * Tq + i) * D + warp * NC + 2 * t4;
#pragma unroll
            for (int n = 0; n < NNT; n++) {
                atomicAdd(row + n * 8, acc[mq][n][2 * r] * scale);
                atomicAdd(row + n * 8 + 1, acc[mq][n][2 * r + 1] * scale);
            }
        }
}

template <typename T, int D, int DV, int BQ, int MT, bool DQ = false>
__global__ void __launch_bounds__(128) dkdv_kernel(T *dk, T *dv, const T *q, const T *k, const T *v, const T *dout,
                                                   const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                   qkv_layout lv, qkv_layout lg, qkv_layout ldk, qkv_layout ldv, int H,
                                                   int Hkv, long long Tq, long long Tk, float scale, int causal,
                                                   float *dqacc = nullptr) {
    constexpr int BN = 64 * MT, LD = D + 8, LDV = DV + 8, NT = 128, ND = D / 8, NDV = DV / 8, NK = D / 16,
                  NKV = DV / 16, NQ = BQ / 8, LS = BQ + 8;
    static_assert(DV <= D && DV % 16 == 0, "v no wider than q/k, whole k16 steps");
    constexpr bool KREG = D <= 64 && MT == 1;  // K, V fragments live in registers (else re-read from shared)
    extern __shared__ __align__(128) unsigned char sm[];
    T *Ks = (T *)sm, *Vs = Ks + BN * LD, *Qs = Vs + BN * LDV, *Gs = Qs + 2 * BQ * LD;
    float *Ls = (float *)(Gs + 2 * BQ * LDV), *Ds = Ls + 2 * BQ;
    T *Ss = (T *)(Ds + 2 * BQ);   // DQ: dS^T of the last two steps, BN x LS each
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const int wrow = warp * 16 * MT;
    const long long j0 = (long long)blockIdx.x * BN;
    const int bg = blockIdx.y, b = bg / Hkv, g = bg % Hkv, rep = H / Hkv;
    const long long off = Tk - Tq;  // causal: j <= i + off
    const long long istart = causal && j0 - off > 0 ? (j0 - off) / BQ * BQ : 0;
    const long long nq = istart < Tq ? (Tq - istart + BQ - 1) / BQ : 0;
    const long long total = rep * nq;  // (query head, query tile) pairs, head-major
    const float sl = scale * kLog2e;

    // step `it`: its Q, dO rows into buffer `buf` (cp.async), and for lane
    // threadIdx.x < BQ the lse and delta of its query into Lv, Dv; those are
    // stored (lse in the log2 domain, +inf for rows past Tq or without keys:
    // p = 0) at the top of the step that uses them, so the load's latency
    // hides behind this step's products
    static_assert(BQ <= NT, "one lse/delta per thread");
    float Lv = INFINITY, Dv = 0.f;
    auto issue = [&](long long it, int buf) {
        const int hq = g * rep + (int)(it / nq);
        const long long ib = istart + (it % nq) * BQ;
        load_rows<T, BQ, D, NT>(Qs + buf * BQ * LD, q, lq, b, hq, ib, Tq);
        load_rows<T, BQ, DV, NT>(Gs + buf * BQ * LDV, dout, lg, b, hq, ib, Tq);
        const long long i = ib + threadIdx.x, row = ((long long)b * H + hq) * Tq + i;
        if (threadIdx.x < BQ && i < Tq) {
            Lv = lse[row];
            Dv = delta[row];
        } else {
            Lv = INFINITY;
            Dv = 0.f;
        }
    };
    load_rows<T, BN, D, NT>(Ks, k, lk, b, g, j0, Tk);
    load_rows<T, BN, DV, NT>(Vs, v, lv, b, g, j0, Tk);
    if (total > 0) issue(0, 0);
    cp_async_commit();

    float dka[MT][ND][4], dva[MT][NDV][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int dn = 0; dn < ND; dn++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                dka[mt][dn][e] = 0.f;
                if (dn < NDV) dva[mt][dn][e] = 0.f;
            }
    unsigned ka[KREG ? NK : 1][4], va[KREG ? NKV : 1][4];

    for (long long it = 0; it < total; it++) {
        const int buf = (int)(it & 1);
        cp_async_wait_all();
        if (threadIdx.x < BQ) {  // buffer buf was last read two steps ago
            Ls[buf * BQ + threadIdx.x] = Lv == -INFINITY ? INFINITY : Lv * kLog2e;
            Ds[buf * BQ + threadIdx.x] = Dv;
        }
        __syncthreads();
        if constexpr (KREG) {
            if (it == 0) {
#pragma unroll
                for (int kk = 0; kk < NK; kk++) {
                    lda<T, LD>(ka[kk], Ks, wrow, kk * 16, lane);
                    if (kk < NKV) lda<T, LDV>(va[kk], Vs, wrow, kk * 16, lane);
                }
            }
        }
        if constexpr (DQ) {   // the previous step's dQ: every warp wrote its rows of that Ss before the barrier
            if (it > 0)
                dq_from_ds<T, D, BQ, BN>(dqacc, Ss + (buf ^ 1) * BN * LS, Ks, warp, lane, b,
                                         g * rep + (int)((it - 1) / nq), istart + ((it - 1) % nq) * BQ, H, Tq, scale);
        }
        if (it + 1 < total) issue(it + 1, buf ^ 1);
        cp_async_commit();
        const long long i0 = istart + (it % nq) * BQ;
        // causal: this warp's keys are after every query of the tile
        if (causal && j0 + wrow > i0 + BQ - 1 + off) {
            if constexpr (DQ) {   // its rows of dS^T are zero
                T *Sb = Ss + buf * BN * LS;
                for (int e = lane; e < 16 * MT * (BQ / 8); e += 32) {
                    const int r = e / (BQ / 8), c = (e - r * (BQ / 8)) * 8;
                    *reinterpret_cast<uint4 *>(Sb + (wrow + r) * LS + c) = uint4{0u, 0u, 0u, 0u};
                }
            }
            continue;
        }
        const T *Qb = Qs + buf * BQ * LD, *Gb = Gs + buf * BQ * LDV;
        const float *Lb = Ls + buf * BQ, *Db = Ds + buf * BQ;

        // S^T = K_w Q^T (over D) and dP^T = V_w dO^T (over DV): 16*MT keys x
        // BQ queries
        float st[MT][NQ][4], dpt[MT][NQ][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < NQ; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[mt][n][e] = dpt[mt][n][e] = 0.f;
        // (kk < NKV: a v step beside the q/k one; past DV the q/k steps alone)
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            unsigned akr[MT][4], avr[MT][4];
            const unsigned *ak[MT], *av[MT];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if constexpr (KREG) {
                    ak[mt] = ka[kk];
                    av[mt] = va[kk < NKV ? kk : 0];
                } else {
                    lda<T, LD>(akr[mt], Ks, wrow + mt * 16, kk * 16, lane);
                    if (kk < NKV) lda<T, LDV>(avr[mt], Vs, wrow + mt * 16, kk * 16, lane);
                    ak[mt] = akr[mt];
                    av[mt] = avr[mt];
                }
            }
#pragma unroll
            for (int np = 0; np < NQ / 2; np++) {
                unsigned qb[4], gb[4];
                ldb<T, LD>(qb, Qb, np * 16, kk * 16, lane);
                if (kk < NKV) ldb<T, LDV>(gb, Gb, np * 16, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    op<T>::mma(st[mt][2 * np], ak[mt], qb[0], qb[1]);
                    op<T>::mma(st[mt][2 * np + 1], ak[mt], qb[2], qb[3]);
                    if (kk < NKV) {
                        op<T>::mma(dpt[mt][2 * np], av[mt], gb[0], gb[1]);
                        op<T>::mma(dpt[mt][2 * np + 1], av[mt], gb[2], gb[3]);
                    }
                }
            }
        }
        // P^T = exp2(S^T sl - L), dS^T = P^T (dP^T - delta); columns are queries
        const bool edge = i0 + BQ > Tq || j0 + BN > Tk || (causal && j0 + wrow + 16 * MT - 1 > i0 + off);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            // query columns [cmin[r], cmax[r]) of the tile see key row r (g8, g8 + 8)
            int cmin[2], cmax[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const long long j = j0 + wrow + mt * 16 + g8 + 8 * r;
                cmin[r] = causal ? (int)min((long long)BQ, max(0ll, j - off - i0)) : 0;
                cmax[r] = j < Tk ? (int)min((long long)BQ, Tq - i0) : 0;
            }
#pragma unroll
            for (int n = 0; n < NQ; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = n * 8 + 2 * t4 + (e & 1);
                    float p = fast_exp2(st[mt][n][e] * sl - Lb[c]);
                    if (edge && (c < cmin[e >> 1] || c >= cmax[e >> 1])) p = 0.f;
                    st[mt][n][e] = p;
                    dpt[mt][n][e] = p * (dpt[mt][n][e] - Db[c]);
                }
        }
        if constexpr (DQ) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) frag_to_smem<T, BQ>(Ss + buf * BN * LS, dpt[mt], wrow + mt * 16, lane, 1.f, 1.f);
        }
        // dV_w += P^T dO (DV columns), dK_w += dS^T Q (D columns); A operands
        // straight from registers
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) {
            unsigned pa[MT][4], da[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                c_to_a<T>(pa[mt], st[mt], kk);
                c_to_a<T>(da[mt], dpt[mt], kk);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                unsigned gb[4], qb[4];
                if (dp < NKV) ldbt<T, LDV>(gb, Gb, dp * 16, kk * 16, lane);
                ldbt<T, LD>(qb, Qb, dp * 16, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (dp < NKV) {
                        op<T>::mma(dva[mt][2 * dp], pa[mt], gb[0], gb[1]);
                        op<T>::mma(dva[mt][2 * dp + 1], pa[mt], gb[2], gb[3]);
                    }
                    op<T>::mma(dka[mt][2 * dp], da[mt], qb[0], qb[1]);
                    op<T>::mma(dka[mt][2 * dp + 1], da[mt], qb[2], qb[3]);
                }
            }
        }
    }

    // out through this warp's rows of the K and V tiles (only it read them);
    // the wait covers K/V copies still in flight when the loop never ran
    cp_async_wait_all();
    __syncthreads();
    if constexpr (DQ) {   // the last step's dQ, before K's tile is reused
        if (total > 0) {
            dq_from_ds<T, D, BQ, BN>(dqacc, Ss + ((total - 1) & 1) * BN * LS, Ks, warp, lane, b,
                                     g * rep + (int)((total - 1) / nq), istart + ((total - 1) % nq) * BQ, H, Tq, scale);
            __syncthreads();
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        frag_to_smem<T, D>(Ks, dka[mt], wrow + mt * 16, lane, scale, scale);
        frag_to_smem<T, DV>(Vs, dva[mt], wrow + mt * 16, lane, 1.f, 1.f);
    }
    __syncwarp();
    store_rows<T, D, MT>(dk, ldk, b, g, j0, Tk, Ks, wrow, lane);
    store_rows<T, DV, MT>(dv, ldv, b, g, j0, Tk, Vs, wrow, lane);
}

// dq for 64*MT queries of one (b, h); warp w owns queries 16*MT*w..16*MT*(w+1)-1
template <typename T, int D, int DV, int MT>
size_t dq_smem() {
    // Q, dO; K and V double-buffered
    return ((size_t)(64 * MT + 2 * 64) * (D + 8) + (size_t)(64 * MT + 2 * 64) * (DV + 8)) * sizeof(T);
}

template <typename T, int D, int DV, int MT>
__global__ void __launch_bounds__(128) dq_kernel(T *dq, const T *q, const T *k, const T *v, const T *dout,
                                                 const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                 qkv_layout lv, qkv_layout lg, qkv_layout ldq, int H, int Hkv,
                                                 long long Tq, long long Tk, float scale, int causal) {
    constexpr int BM = 64 * MT, BN = 64, LD = D + 8, LDV = DV + 8, NT = 128, ND = D / 8, NK = D / 16, NKV = DV / 16;
    static_assert(DV <= D && DV % 16 == 0, "v no wider than q/k, whole k16 steps");
    constexpr bool QREG = D <= 64 && MT == 1;  // Q, dO fragments live in registers (else re-read from shared)
    extern __shared__ __align__(128) unsigned char sm[];
    T *Qs = (T *)sm, *Gs = Qs + BM * LD, *Ks = Gs + BM * LDV, *Vs = Ks + 2 * BN * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const int wrow = warp * 16 * MT;
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * BM;  // longest causal rows first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;
    const long long kend = causal ? max(0ll, min(Tk, i0 + BM + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const float sl = scale * kLog2e;

    // lse (log2 domain, +inf: p = 0) and delta of this lane's rows g8, g8 + 8 of each m-tile
    float Lr[MT][2], Dr[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long i = i0 + wrow + mt * 16 + g8 + 8 * r, row = ((long long)b * H + h) * Tq + i;
            const float L = i < Tq ? lse[row] : INFINITY;
            Lr[mt][r] = L == -INFINITY ? INFINITY : L * kLog2e;
            Dr[mt][r] = i < Tq ? delta[row] : 0.f;
        }
    load_rows<T, BM, D, NT>(Qs, q, lq, b, h, i0, Tq);
    load_rows<T, BM, DV, NT>(Gs, dout, lg, b, h, i0, Tq);
    if (ntiles > 0) {
        load_rows<T, BN, D, NT>(Ks, k, lk, b, g, 0, Tk);
        load_rows<T, BN, DV, NT>(Vs, v, lv, b, g, 0, Tk);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned qa[QREG ? NK : 1][4], ga[QREG ? NK : 1][4];   // (QREG: DV == D)
    if constexpr (QREG) {
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            lda<T, LD>(qa[kk], Qs, wrow, kk * 16, lane);
            lda<T, LD>(ga[kk], Gs, wrow, kk * 16, lane);
        }
    }
    float dqa[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int dn = 0; dn < ND; dn++) dqa[mt][dn][0] = dqa[mt][dn][1] = dqa[mt][dn][2] = dqa[mt][dn][3] = 0.f;

    for (int t = 0; t < ntiles; t++) {
        if (t > 0) {
            cp_async_wait_all();
            __syncthreads();
        }
        if (t + 1 < ntiles) {
            const int nb = (t + 1) & 1;
            load_rows<T, BN, D, NT>(Ks + nb * BN * LD, k, lk, b, g, (long long)(t + 1) * BN, Tk);
            load_rows<T, BN, DV, NT>(Vs + nb * BN * LDV, v, lv, b, g, (long long)(t + 1) * BN, Tk);
        }
        cp_async_commit();
        const long long j0 = (long long)t * BN;
        if (causal && j0 > i0 + wrow + 16 * MT - 1 + off) continue;
        const T *Kb = Ks + (t & 1) * BN * LD, *Vb = Vs + (t & 1) * BN * LDV;

        // S = Q_w K^T (over D), dP = dO_w V^T (over DV): 16*MT queries x 64 keys
        float s[MT][8][4], dp[MT][8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[mt][n][e] = dp[mt][n][e] = 0.f;
        if constexpr (DV == D) {   // one k16 loop for both
#pragma unroll
            for (int kk = 0; kk < NK; kk++) {
                unsigned aqr[MT][4], agr[MT][4];
                const unsigned *aq[MT], *ag[MT];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if constexpr (QREG) {
                        aq[mt] = qa[kk];
                        ag[mt] = ga[kk];
                    } else {
                        lda<T, LD>(aqr[mt], Qs, wrow + mt * 16, kk * 16, lane);
                        lda<T, LD>(agr[mt], Gs, wrow + mt * 16, kk * 16, lane);
                        aq[mt] = aqr[mt];
                        ag[mt] = agr[mt];
                    }
                }
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    unsigned kb[4], vb[4];
                    ldb<T, LD>(kb, Kb, np * 16, kk * 16, lane);
                    ldb<T, LD>(vb, Vb, np * 16, kk * 16, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        op<T>::mma(s[mt][2 * np], aq[mt], kb[0], kb[1]);
                        op<T>::mma(s[mt][2 * np + 1], aq[mt], kb[2], kb[3]);
                        op<T>::mma(dp[mt][2 * np], ag[mt], vb[0], vb[1]);
                        op<T>::mma(dp[mt][2 * np + 1], ag[mt], vb[2], vb[3]);
                    }
                }
            }
        } else {
            // dP over DV first, then S over D: two loops (one loop with the
            // dP steps stopping at DV spills 24 bytes at (192, 128), sm_90a)
            static_assert(!QREG, "v of its own width: Q, dO re-read from shared memory");
            acc_a_times_bt64<T, LDV, MT, NKV>(dp, Gs, Vb, wrow, lane);
            acc_a_times_bt64<T, LD, MT, NK>(s, Qs, Kb, wrow, lane);
        }
        // dS = P (dP - delta), P = exp2(S sl - L); kept in s
        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0 + wrow + off);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            int cmax[2];  // the last key column row r (g8, g8 + 8) sees in the tile (-1: none)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                cmax[r] = (int)min((long long)BN, Tk - j0) - 1;
                if (causal)
                    cmax[r] = (int)min((long long)cmax[r], max(-1ll, i0 + wrow + mt * 16 + g8 + 8 * r + off - j0));
            }
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1;
                    float p = fast_exp2(s[mt][n][e] * sl - Lr[mt][r]);
                    if (edge && n * 8 + 2 * t4 + (e & 1) > cmax[r]) p = 0.f;
                    s[mt][n][e] = p * (dp[mt][n][e] - Dr[mt][r]);
                }
        }
        // dQ_w += dS K
        acc_c_times_bt<T, LD, MT, D>(dqa, s, Kb, lane);
    }

    // out through this warp's rows of the Q tile (only it reads them)
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; mt++) frag_to_smem<T, D>(Qs, dqa[mt], wrow + mt * 16, lane, scale, scale);
    __syncwarp();
    store_rows<T, D, MT>(dq, ldq, b, h, i0, Tq, Qs, wrow, lane);
}

}  // namespace mma
