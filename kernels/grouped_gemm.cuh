// kernels/grouped_gemm.cuh — many GEMMs in one launch (the experts of a
// mixture-of-experts layer): C_g = op(A_g) . op(B_g) + beta C_g for groups g
// that share C's column count N and the three row strides, each with its own
// pointers, row count M_g and inner dimension K_g. bf16/f16 operands on
// mma.sync.m16n8k16 (mma_ops.cuh), f32 accumulation, C in the operands'
// dtype or f32.
//
// Tiling: a block computes a 128 x 128 tile of one group's C with 4 warps
// in 2 x 2, each warp 64 x 64 (4 m-tiles x 8 n-tiles: every ldmatrix'd
// fragment feeds 4 or 8 MMAs). K streams through a 4-stage cp.async
// pipeline of 32-wide slices; rows are padded by 8 elements so every
// ldmatrix phase hits 32 distinct banks. The grid is (the groups' m-tiles
// across, the groups' m-tiles in a column): a block finds its group by its
// y index among the groups' first tiles (kernel parameters), so the launch
// needs no device copy of the groups and no host sync. Blocks run x first,
// so the blocks in flight share their A rows and sweep B, which stays in
// L2 (the other order read every expert's rows from DRAM once an n-tile).
//
// Layouts (template flags), row-major storage with unit column stride:
//   AK  A stored [m][k] (op(A) = A), else [k][m] (op(A) = A^T: ldmatrix.trans)
//   BK  B stored [n][k] (op(B) = B^T), else [k][n] (.trans)
// The three the experts need: forward (AK, BK), the input gradient (AK, !BK)
// and the weight gradients (!AK, !BK: K is the expert's row count). Loads
// past M_g, N or K_g are zero-filled 16-byte chunks, so the contiguous
// dimension of each operand must be a multiple of 8 (the host checks);
// stores past M_g or N are skipped. A group with K_g = 0 stores beta C.
// Included by grouped_gemm.cu and by the CPU emulator
// (kernels/attention_mma_emu.cpp), which runs it thread by thread.
#pragma once
#include <string.h>

#include "mma_ops.cuh"
#include "wgmma_ops.cuh"

namespace mma {

constexpr int GG_BM = 128, GG_BN = 128, GG_BK = 32, GG_STAGES = 4, GG_THREADS = 128, GG_MAXG = 64;
constexpr int GG_MAXTILES = 65535;  // m-tiles a launch (gridDim.y)

// one launch's groups (kernel parameters: 2.3 KB at 64 groups)
struct gg_args {
    int groups;
    int n;                // C's columns, every group
    long long lda, ldb, ldc;
    float beta;
    int tile0[GG_MAXG + 1];  // group g owns blocks y in [tile0[g], tile0[g + 1])
    int m[GG_MAXG], k[GG_MAXG];
    const void *a[GG_MAXG], *b[GG_MAXG];
    void *c[GG_MAXG];
};

template <bool AK, bool BK> struct gg_tiles {
    static constexpr int A_LD = AK ? GG_BK + 8 : GG_BM + 8, A_SZ = (AK ? GG_BM : GG_BK) * A_LD;
    static constexpr int B_LD = BK ? GG_BK + 8 : GG_BN + 8, B_SZ = (BK ? GG_BN : GG_BK) * B_LD;
    static constexpr int SMEM = GG_STAGES * (A_SZ + B_SZ) * 2;  // bytes (16-bit elements)
};

// rows x 16-byte chunks of one operand's slice into shared memory (LD
// elements a row): stored rows [r0, r0 + R) (bounded by rlim), columns
// [c0, c0 + 8 CH) (bounded by clim), zero-filled outside
template <typename T, int R, int CH, int LD>
__device__ __forceinline__ void gg_load(T *s, const T *src, long long ld, int r0, int rlim, int c0, int clim,
                                        int tid) {
#pragma unroll
    for (int i = tid; i < R * CH; i += GG_THREADS) {
        const int r = i / CH, c = (i % CH) * 8;
        const bool ok = r0 + r < rlim && c0 + c < clim;
        cp_async16(s + r * LD + c, ok ? src + (long long)(r0 + r) * ld + c0 + c : src, ok);
    }
}

// two adjacent outputs (x, y) at p (p[0] and p[1]), plus beta times what is there
__device__ __forceinline__ void gg_store2(float *p, float x, float y, float beta) {
    if (beta != 0.f) {
        x += beta * p[0];
        y += beta * p[1];
    }
    p[0] = x;
    p[1] = y;
}
template <typename T> __device__ __forceinline__ void gg_store2(T *p, float x, float y, float beta) {
    if (beta != 0.f) {
        x += beta * op<T>::to_float(p[0]);
        y += beta * op<T>::to_float(p[1]);
    }
    *reinterpret_cast<unsigned *>(p) = op<T>::pack(x, y);
}

template <typename T, typename OutT, bool AK, bool BK>
__global__ void __launch_bounds__(GG_THREADS) gg_kernel(const __grid_constant__ gg_args p) {
    typedef gg_tiles<AK, BK> L;
    int g = 0;
    while ((int)blockIdx.y >= p.tile0[g + 1]) g++;
    const int M = p.m[g], K = p.k[g], N = p.n;
    const int m0 = ((int)blockIdx.y - p.tile0[g]) * GG_BM, n0 = (int)blockIdx.x * GG_BN;
    const T *A = (const T *)p.a[g], *B = (const T *)p.b[g];
    OutT *C = (OutT *)p.c[g];
    extern __shared__ __align__(128) unsigned char sm[];
    T *sa = (T *)sm, *sb = sa + GG_STAGES * L::A_SZ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = (warp >> 1) * 64, wn = (warp & 1) * 64;

    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    const int nk = (K + GG_BK - 1) / GG_BK;
    auto load = [&](int stage, int kt) {
        const int k0 = kt * GG_BK;
        T *da = sa + stage * L::A_SZ, *db = sb + stage * L::B_SZ;
        if constexpr (AK) gg_load<T, GG_BM, GG_BK / 8, L::A_LD>(da, A, p.lda, m0, M, k0, K, tid);
        else gg_load<T, GG_BK, GG_BM / 8, L::A_LD>(da, A, p.lda, k0, K, m0, M, tid);
        if constexpr (BK) gg_load<T, GG_BN, GG_BK / 8, L::B_LD>(db, B, p.ldb, n0, N, k0, K, tid);
        else gg_load<T, GG_BK, GG_BN / 8, L::B_LD>(db, B, p.ldb, k0, K, n0, N, tid);
    };
#pragma unroll
    for (int s = 0; s < GG_STAGES - 1; s++) {
        if (s < nk) load(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_n<GG_STAGES - 2>();  // slice kt landed (this thread's part) ...
        __syncthreads();                   // ... every thread's; and slice kt - 1 is read
        if (kt + GG_STAGES - 1 < nk) load((kt + GG_STAGES - 1) % GG_STAGES, kt + GG_STAGES - 1);
        cp_async_commit();
        const T *ta = sa + (kt % GG_STAGES) * L::A_SZ, *tb = sb + (kt % GG_STAGES) * L::B_SZ;
#pragma unroll
        for (int kk = 0; kk < GG_BK; kk += 16) {
            unsigned af[4][4], bf[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                if constexpr (AK) lda<T, L::A_LD>(af[i], ta, wm + 16 * i, kk, lane);
                else ldat<T, L::A_LD>(af[i], ta, wm + 16 * i, kk, lane);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if constexpr (BK) ldb<T, L::B_LD>(bf[j], tb, wn + 16 * j, kk, lane);
                else ldbt<T, L::B_LD>(bf[j], tb, wn + 16 * j, kk, lane);
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    op<T>::mma(acc[i][2 * j], af[i], bf[j][0], bf[j][1]);
                    op<T>::mma(acc[i][2 * j + 1], af[i], bf[j][2], bf[j][3]);
                }
        }
    }
    cp_async_wait_all();  // (the empty groups committed past the last slice)

    // lane (q4, q) owns rows q4, q4 + 8 and columns 2q, 2q + 1 of each 16 x 8 tile
    const int q4 = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int col = n0 + wn + 8 * j + 2 * q;
            if (col >= N) continue;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = m0 + wm + 16 * i + q4 + 8 * h;
                if (row < M) gg_store2(C + (long long)row * p.ldc + col, acc[i][j][2 * h], acc[i][j][2 * h + 1], p.beta);
            }
        }
}

// one group on the host side: its operands, C, and its M_g and K_g
struct gg_group {
    const void *a, *b;
    void *c;
    int m, k;
};

// the launches for G groups (host code, shared by grouped_gemm.cu and the
// emulator): up to GG_MAXG groups and GG_MAXTILES m-tiles a launch (a
// grid's y limit; no one group may have more), groups without rows left
// out; launch(args, blocks in x (N's tiles), blocks in y (m-tiles)) returns
// nonzero to stop
template <typename F>
inline int gg_plan(const gg_group *gs, int G, int n, long long lda, long long ldb, long long ldc, float beta,
                   F launch) {
    int i = 0;
    while (i < G) {
        gg_args p;
        memset(&p, 0, sizeof p);
        p.n = n;
        p.lda = lda;
        p.ldb = ldb;
        p.ldc = ldc;
        p.beta = beta;
        int tiles = 0;
        for (; i < G && p.groups < GG_MAXG; i++) {
            if (gs[i].m <= 0) continue;
            if (p.groups > 0 && tiles + (gs[i].m + GG_BM - 1) / GG_BM > GG_MAXTILES) break;
            const int j = p.groups++;
            p.a[j] = gs[i].a;
            p.b[j] = gs[i].b;
            p.c[j] = gs[i].c;
            p.m[j] = gs[i].m;
            p.k[j] = gs[i].k;
            tiles += (gs[i].m + GG_BM - 1) / GG_BM;
            p.tile0[j + 1] = tiles;
        }
        if (p.groups > 0 && n > 0 && launch(p, (n + GG_BN - 1) / GG_BN, tiles)) return -1;
    }
    return 0;
}

}  // namespace mma

// ------------------------------------------------------------ sm_90a: wgmma
// The same tiles, grid and groups as gg_kernel, on Hopper's warpgroup MMA.
// A block is one warpgroup; its 128 x 128 tile is two m64 halves, each
// d (64 x 128 f32, 64 registers a thread) = A_h . B over 64-wide K slices.
// A stage holds one slice of A and of B, 16 KB each, in the 128-byte
// swizzle (wgmma_ops.cuh): a K-major operand (A [m][k], B [n][k]) as one
// tile of 128 rows of 64 k (the m64 half or a k16 step an offset into it),
// an MN-major one (A [k][m], B [k][n]) as two tiles of 64 k-rows by 64
// (m or n) columns, whose products are n64 wgmmas (the emulator, like our
// layouts, keeps MN-major tiles to one 64-wide atom). S stages: slices
// kt + 1 .. kt + S - 2 load while slice kt's wgmmas run and slice kt - 1's
// finish; a stage is refilled only after the barrier that follows every
// warp's wait for the wgmmas that read it (the warps' shares of one wgmma
// may finish apart).
namespace wg {

template <int S> struct gw_cfg {
    static constexpr int STAGE = 32768, SMEM = S * STAGE + 1024;  // (+ the 1024-byte alignment)
};

// One thread's share of loading an operand's 64-wide slices into swizzled
// tiles of R rows of 64 elements, by cp.async: chunk c = t % 8 of tile
// rows t / 8 + 16 i (all at one swizzle offset: (r + 16 i) & 7 = r & 7).
// KMAJ: the tile's rows are the source's rows [r0, r0 + R) (m or n, below
// rlim) and slice kt its columns 64 kt.. (k, below clim); else the tile's
// rows are the source's rows 64 kt.. (k, below rlim) and its columns
// [c0, c0 + 64) (m or n, below clim). The addresses and bounds are worked
// out once a block: a slice then costs a 64-bit add and a compare a row
// (each cp.async's index arithmetic, redone a slice, was the kernel's
// issue bottleneck).
template <typename T, int R, bool KMAJ> struct gw_src {
    const T *p, *base;   // row t / 8 (slice 0), chunk c; any valid address
    long long step, adv;  // 16 rows; one slice
    int n;                // KMAJ: rows in range from row t / 8 (i < n / 16 ...); else rows left from it
    int lim;              // KMAJ: columns left from chunk c; else whether chunk c is in range
    __device__ __forceinline__ gw_src(const T *src, long long ld, int r0, int rlim, int c0, int clim) : base(src) {
        const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
        p = src + (long long)(r0 + r) * ld + c0 + 8 * c;
        step = 16 * ld;
        adv = KMAJ ? 64 : 64 * ld;
        n = rlim - r0 - r;
        lim = KMAJ ? clim - c0 - 8 * c : (c0 + 8 * c < clim);
    }
    __device__ __forceinline__ void load(unsigned char *tile, int kt) const {
        const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
        unsigned char *d = tile + r * 128 + ((c ^ (r & 7)) << 4);
        const T *a = p + kt * adv;
        const bool slice_ok = KMAJ ? kt * 64 < lim : lim != 0;
        const int left = KMAJ ? n : n - kt * 64;
#pragma unroll
        for (int i = 0; i < R / 16; i++) {
            const bool ok = slice_ok && 16 * i < left;
            mma::cp_async16(d + 2048 * i, ok ? a : base, ok);
            a += step;
        }
    }
};

template <typename T, typename OutT, bool AK, bool BK, int S>
__global__ void __launch_bounds__(mma::GG_THREADS) gw_kernel(const __grid_constant__ mma::gg_args p) {
    static_assert(S >= 3, "two slices in flight besides the one computed");
    static_assert(AK || !BK, "A stored [k][m] with B stored [n][k] has no kernel");
    int g = 0;
    while ((int)blockIdx.y >= p.tile0[g + 1]) g++;
    const int M = p.m[g], K = p.k[g], N = p.n;
    const int m0 = ((int)blockIdx.y - p.tile0[g]) * mma::GG_BM, n0 = (int)blockIdx.x * mma::GG_BN;
    const T *A = (const T *)p.a[g], *B = (const T *)p.b[g];
    OutT *C = (OutT *)p.c[g];
    WG_SMEM;
    unsigned char *base = align1024(wg_smem);

    // acc[2h + nh]: columns 64nh.. of half h (an n128 wgmma writes acc[2h] and acc[2h + 1] as one)
    float acc[4][32];
#pragma unroll
    for (int h = 0; h < 4; h++)
#pragma unroll
        for (int i = 0; i < 32; i++) acc[h][i] = 0.f;

    const int nk = (K + 63) / 64;
    // A: [m][k] one 128-row tile, or [k][m] two of 64 columns; B likewise
    const gw_src<T, AK ? 128 : 64, AK> la0 = AK ? gw_src<T, AK ? 128 : 64, AK>(A, p.lda, m0, M, 0, K)
                                                : gw_src<T, AK ? 128 : 64, AK>(A, p.lda, 0, K, m0, M);
    const gw_src<T, 64, false> la1(A, p.lda, 0, K, m0 + 64, M);
    const gw_src<T, BK ? 128 : 64, BK> lb0 = BK ? gw_src<T, BK ? 128 : 64, BK>(B, p.ldb, n0, N, 0, K)
                                                : gw_src<T, BK ? 128 : 64, BK>(B, p.ldb, 0, K, n0, N);
    const gw_src<T, 64, false> lb1(B, p.ldb, 0, K, n0 + 64, N);
    auto load = [&](int stage, int kt) {
        unsigned char *sa = base + stage * gw_cfg<S>::STAGE, *sb = sa + 16384;
        la0.load(sa, kt);
        if constexpr (!AK) la1.load(sa + 8192, kt);
        lb0.load(sb, kt);
        if constexpr (!BK) lb1.load(sb + 8192, kt);
    };
#pragma unroll
    for (int s = 0; s < S - 2; s++) {
        if (s < nk) load(s, s);
        mma::cp_async_commit();
    }
#pragma unroll 1
    for (int kt = 0; kt < nk; kt++) {
        mma::cp_async_wait_n<S - 3>();  // slice kt landed (this thread's copies) ...
        fence_proxy();
        __syncthreads();  // ... everyone's; and every warp waited for slice kt - 2's wgmmas
        if (kt + S - 2 < nk) load((kt + S - 2) % S, kt + S - 2);
        mma::cp_async_commit();
        unsigned char *sa = base + (kt % S) * gw_cfg<S>::STAGE, *sb = sa + 16384;
#pragma unroll
        for (int i = 0; i < 4; i++) pin<32>(acc[i]);  // (no other instruction touches them while wgmmas run)
        fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if constexpr (AK && BK) {
                    mma_ss<T, 128>(acc[2 * h], desc(sa + h * 8192 + kk * 32), desc(sb + kk * 32), 1);
                } else if constexpr (AK) {
                    const uint64_t da = desc(sa + h * 8192 + kk * 32);
                    mma_ss_t<T, 64>(acc[2 * h], da, desc(sb + kk * 2048), 1);
                    mma_ss_t<T, 64>(acc[2 * h + 1], da, desc(sb + 8192 + kk * 2048), 1);
                } else {
                    const uint64_t da = desc(sa + h * 8192 + kk * 2048);
                    mma_ss_tt<T, 64>(acc[2 * h], da, desc(sb + kk * 2048), 1);
                    mma_ss_tt<T, 64>(acc[2 * h + 1], da, desc(sb + 8192 + kk * 2048), 1);
                }
            }
        commit();
#pragma unroll
        for (int i = 0; i < 4; i++) pin<32>(acc[i]);
        wait<1>();  // slice kt - 1's wgmmas done (this warp's share)
    }
    wait<0>();
#pragma unroll
    for (int i = 0; i < 4; i++) pin<32>(acc[i]);
    mma::cp_async_wait_all();  // (the empty groups committed past the last slice)

    // d[4j + e] of half h: row 64h + 16w + q4 (+ 8 for e >= 2), column 8j + 2q (+ 1 for odd e)
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, q4 = lane >> 2, q = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int col = n0 + 8 * j + 2 * q;
            if (col >= N) continue;
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = m0 + 64 * h + 16 * w + q4 + 8 * hh;
                const float *d = acc[2 * h + j / 8] + 4 * (j % 8) + 2 * hh;
                if (row < M) mma::gg_store2(C + (long long)row * p.ldc + col, d[0], d[1], p.beta);
            }
        }
}

}  // namespace wg
