// kernels/attention_wgmma.cuh — the sm_90a path of kernels/attention.cu for
// bf16/f16 at head dims 64 and 128 (q, k, v alike; the template parameter
// D, 64 by default) and q/k 192 with v 128 or 192 (DeepSeek's MLA: v's
// width the template parameter DV, D by default): the same FlashAttention-2
// algorithm and the same three kernels as attention_mma.cuh (forward; dk/dv
// per key block; dq per query block, no atomics), with every tile product
// on Hopper's warpgroup MMA (wgmma.mma_async, f32 accumulation) instead of
// mma.sync. (The one-pass backward, dkdv_kernel<T, true>, is D = 64 only;
// at D = DV = 192 attention.cu runs only the forward here: dK and dV would
// take 192 registers a thread.)
//
// A block is one warpgroup (128 threads, 4 warps) owning 64 rows (queries in
// the forward and dq kernels, keys in dk/dv): wgmma's M = 64. Several blocks
// share an SM (2-5 at D = 64, 2 at D = 128 and 192, by registers and shared
// memory), so one block's softmax runs while another's wgmmas do.
// (fwd_ws_kernel, opt-in: three warpgroups and 128 queries a block, one
// block an SM, its two consumer warpgroups sharing each K/V tile.)
//
// Shared-memory tiles are rows of 64 16-bit elements (128 bytes) with the
// 128-byte swizzle: the 16-byte chunk c of row r lies at r*128 + ((c ^ (r&7))
// << 4), in tiles aligned to 1024 bytes (cp.async writes them in that order,
// zero-filled past the sequence's end). wgmma reads them through matrix
// descriptors (desc below), as
//   K-major   the tile is M x K or N x K with K (= D) along the row: Q, K in
//             S = Q.K^T; K, Q in S^T = K.Q^T; V, dO in dP^T = V.dO^T; dO, V in
//             dP = dO.V^T. 8-row groups 1024 bytes apart (SBO); a k16 step
//             is +32 bytes into the row (the swizzle is a function of the
//             address, so the offset start composes with it).
//   MN-major  the tile is K x N with N (= D) along the row: V in P.V, dO in
//             dV = P^T.dO, Q in dK = dS^T.Q, K in dQ = dS.K ("transposed B",
//             imm-trans-b = 1). 8-row (k) groups 1024 bytes apart (SBO), one
//             64-wide atom along N; a k16 step is +2048 bytes.
// At D = 128 a tile of R rows is two such 64-column sub-tiles, columns 0-63
// then 64-127, R*128 bytes apart: K-major k16 steps 4-7 start in the second
// (kstep), and MN-major reads (N = 128: m64n128k16) see the two as atoms
// along N, the leading byte offset (LBO) R*128 apart (desc_mn). At D = 192
// three sub-tiles (k16 steps 8-11 in the third; m64n192k16), and v's tiles
// (V, dO) have DV columns, their sub-tiles R*128 bytes apart as q's.
// The second operand of P.V, dV, dK, dQ comes from registers: wgmma's A
// fragment for m64k16 is mma.sync's m16k16 A fragment per warp (rows 16w..),
// and its f32 accumulator for m64nN is mma.sync's C fragment per warp and
// n8 block (d[4j..4j+3]: rows g, g+8, columns 8j+2t, +1), so the same
// identity as attention_mma.cuh turns S into P's A fragment in place.
// Included by attention.cu (it uses mma:: helpers and qkv_layout), and by
// kernels/attention_mma_emu.cpp, which defines MS_ATTENTION_MMA_EMU and its
// own stand-ins for the PTX of wgmma_ops.cuh (wgmma reading the swizzled
// tiles through the descriptors, the register fragments exchanged across the
// warpgroup).
#include "wgmma_ops.cuh"

namespace wg {

// ------------------------------------------------------------ helpers

// One thread's share of copying R-row tiles (D elements a row: D / 64
// swizzled sub-tiles of R rows x 64, R*128 bytes apart, the j-th holding
// columns 64j..) of one batch index into the swizzled layout, by cp.async,
// 16 bytes at a time: rows r0 + 16i of a tile (r0 = thread / 8), chunk c =
// thread % 8 of each sub-tile. The thread's address is computed once; a
// tile then costs one offset and a bound (the per-row 64-bit index
// arithmetic of a tile was ~170 instructions a warp, as many as the tile's
// softmax). tid: the thread's index among the 128 that copy a tile
// (threadIdx.x; fwd_ws_kernel's producer warpgroup: its own).
template <typename T, int D = 64>
struct sw_src {
    const T *p;  // row r0 at t = 0 of head 0, chunk c
    long long sh, st;
    __device__ __forceinline__ sw_src(const T *src, const qkv_layout &l, long long b, unsigned tid = threadIdx.x)
        : p(src + b * l.sb + (long long)(tid >> 3) * l.st + (tid & 7) * 8), sh(l.sh), st(l.st) {}
    // rows [t0, t0 + R) of head h into the tile s, zero from Tn on (base:
    // any valid address, the source of the zero-length copies). The rows'
    // addresses one 64-bit add apart, their bounds one 32-bit compare.
    template <int R>
    __device__ __forceinline__ void load(T *s, long long h, long long t0, long long Tn, const T *base,
                                         unsigned tid = threadIdx.x) const {
        const int r0 = tid >> 3, c = tid & 7;
        unsigned char *d = (unsigned char *)s + r0 * 128 + ((c ^ (r0 & 7)) << 4);
        const T *a = p + h * sh + t0 * st;
        const long long step = 16 * st, left = Tn - t0 - r0;  // row r0 + 16i exists while 16i < left
        const int n = left <= 0 ? 0 : left >= R ? R : (int)left;
#pragma unroll
        for (int i = 0; i < R / 16; i++) {
            const bool ok = 16 * i < n;
#pragma unroll
            for (int j = 0; j < D / 64; j++) mma::cp_async16(d + j * R * 128 + 2048 * i, ok ? a + 64 * j : base, ok);
            a += step;
        }
    }
};

// rows [t0, t0+R) of (b, h) into the swizzled tile s, zero past Tn
template <typename T, int R, int D = 64>
__device__ __forceinline__ void load_sw(T *s, const T *src, const qkv_layout &l, long long b, long long h,
                                        long long t0, long long Tn) {
    sw_src<T, D>(src, l, b).template load<R>(s, h, t0, Tn, src);
}

// the descriptor of k16 step kk of a K-major tile of R rows (d: the tile's
// desc): +32 bytes a step inside a 64-column sub-tile, the next sub-tile
// R*128 bytes on (D = 64: d + 2kk)
template <int R>
__device__ __forceinline__ uint64_t kstep(uint64_t d, int kk) {
    return d + (uint64_t)((kk >> 2) * (R * 128 >> 4) + 2 * (kk & 3));
}

// the descriptor of an R-row tile of D columns read MN-major (D along N):
// D = 64 one atom along N (desc's); wider, the 64-column sub-tiles R*128
// bytes apart as the leading byte offset (the PTX ISA's 128-byte-swizzle
// MN-major layout: atoms along MN LBO apart, 8-row groups along K SBO apart)
template <int D, int R>
__device__ __forceinline__ uint64_t desc_mn(const void *p) {
    return D == 64 ? desc(p) : desc(p, R * 128);
}

// the A fragment (k16 block kk) of the 64 x N accumulators c, rounded to T
template <typename T>
__device__ __forceinline__ void c_to_a(unsigned a[4], const float *c, int kk) {
    a[0] = mma::op<T>::pack(c[8 * kk + 0], c[8 * kk + 1]);
    a[1] = mma::op<T>::pack(c[8 * kk + 2], c[8 * kk + 3]);
    a[2] = mma::op<T>::pack(c[8 * kk + 4], c[8 * kk + 5]);
    a[3] = mma::op<T>::pack(c[8 * kk + 6], c[8 * kk + 7]);
}

// the A fragments a[kk] (k16 blocks kk of a 64 x 64 tile, this warp's rows
// 16w..: c_to_a's a[0] row g, columns 16kk + 2t, +1; a[1] row g + 8; a[2],
// a[3] the same 8 columns on) into the swizzled tile s as they are (rows of
// 64 elements, the 16-byte chunk c of row r at r*128 + ((c ^ (r&7)) << 4))
template <typename T>
__device__ __forceinline__ void a_to_sw(T *s, const unsigned a[4][4]) {
    const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * 16 + (lane >> 2), t4 = lane & 3;
    unsigned char *p = (unsigned char *)s;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + 8 * (i & 1), c = 2 * kk + (i >> 1);
            *reinterpret_cast<unsigned *>(p + r * 128 + ((c ^ (r & 7)) << 4) + t4 * 4) = a[kk][i];
        }
}

// the 64 x D accumulators c (this warp's 16 rows) times mul[r] into rows
// warp*16.. of s (padded [64][D + 8] tile), then to global rows t0.. of (b, h)
template <typename T, int D = 64>
__device__ __forceinline__ void store_acc(T *dst, const qkv_layout &l, long long b, long long h, long long t0,
                                          long long Tn, T *s, const float *c, float mul0, float mul1) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    mma::frag_to_smem<T, D>(s, reinterpret_cast<const float(*)[4]>(c), warp * 16, lane, mul0, mul1);
    __syncwarp();
    mma::store_rows<T, D, 1>(dst, l, b, h, t0, Tn, s, warp * 16, lane);
}

const int kD = 64;

// part (or NULL): the column sums of the tile s ([64][D + 8]) as stored
// (rounded to T) over its rows t0 + r < Tn, into part[0 .. D): the bias
// gradient of a fused qkv projection, a block's share (attention.cu adds the
// blocks' rows in a fixed order). Every thread of the block calls it (a
// barrier: the warps' rows). D = 64: two threads a column, 32 rows each in
// four independent sums (a serial chain of 64 shared-memory reads and adds
// on 64 threads cost 1.3 µs a dk/dv block), the upper half's total handed
// over through `upper` (fixed order: the same bits every run); D = 128: a
// thread a column, its 64 rows in four sums.
template <typename T, int D = 64>
__device__ __forceinline__ void tile_colsum(const T *s, long long t0, long long Tn, float *part) {
    if constexpr (D > 128) {
        // D = 192: a thread a column (threads 0-63 a second, 128 on), its
        // 64 rows in four sums
        __syncthreads();
        const long long left = Tn - t0;
        const int nr = left < 64 ? (int)left : 64;
        for (int c = threadIdx.x; c < D; c += 128) {
            float a[4] = {0.f, 0.f, 0.f, 0.f};
            int r = 0;
            for (; r + 3 < nr; r += 4)
#pragma unroll
                for (int u = 0; u < 4; u++) a[u] += mma::op<T>::to_float(s[(r + u) * (D + 8) + c]);
            for (; r < nr; r++) a[0] += mma::op<T>::to_float(s[r * (D + 8) + c]);
            part[c] = (a[0] + a[1]) + (a[2] + a[3]);
        }
        return;
    }
    constexpr int NH = D > 128 ? 1 : 128 / D, RH = 64 / NH;   // threads a column, rows each
    __syncthreads();
    const int c = threadIdx.x & (D - 1), h = threadIdx.x / D;   // 128 threads: h < NH
    const long long left = Tn - t0;
    const int nr = left < 64 ? (int)left : 64, r1 = min(nr, RH * h + RH);
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int r = RH * h;
    for (; r + 3 < r1; r += 4)
#pragma unroll
        for (int u = 0; u < 4; u++) a[u] += mma::op<T>::to_float(s[(r + u) * (D + 8) + c]);
    for (; r < r1; r++) a[0] += mma::op<T>::to_float(s[r * (D + 8) + c]);
    const float acc = (a[0] + a[1]) + (a[2] + a[3]);
    if constexpr (NH == 1) {
        part[c] = acc;
    } else {
        static_assert(NH == 2, "head dims 64 and 128");
        static __shared__ float upper[D];
        if (h == 1) upper[c] = acc;
        __syncthreads();
        if (h == 0) part[c] = acc + upper[c];
    }
}

// --------------------------------------------------------------- forward
// 64 query rows a block, BN-key tiles of K and V double-buffered. (FA3's
// in-warpgroup pipelining, S_{t+1} issued before P_t.V_t with O rescaled
// after it, was measured slower here: 0.106 against 0.074 ms at GPT-2's
// shape, B = 8; its registers cost a block per SM.)
// how far (log2) a row's scores may exceed its running max before the max
// moves (FA4's conditional rescaling): p stays <= 256, exact in f32 and
// rounded to bf16/f16 as any p is
constexpr float kStale = 8.f;

// The online softmax of one BN-key tile of scores s (this thread's
// accumulators of rows row0 and row0 + 8), in place: on an edge tile
// (past Tk, or causal past the diagonal) the masked scores to -inf; the row
// max taken over the raw scores and scaled after (sl = scale * log2 e > 0:
// attention.cu sends other scales to the mma.sync kernel), so each p is one
// FFMA and an ex2, scale and shift rounded once; s <- p = 2^(s sl - m), l <-
// l alpha + rowsum(p), alpha: O's rescale for each row.
template <int BN>
__device__ __forceinline__ void softmax_tile(float *s, float m[2], float l[2], float alpha[2], long long j0,
                                             long long Tk, long long row0, long long off, int causal, bool edge,
                                             float sl, int t4) {
    constexpr int NS = BN / 8;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int cmax = (int)min((long long)BN, Tk - j0) - 1;  // the last key column row r sees (-1: none)
        if (causal) cmax = (int)min((long long)cmax, max(-1ll, row0 + 8 * r + off - j0));
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float x = s[4 * n + 2 * r + e];
                if (edge && n * 8 + 2 * t4 + e > cmax) x = -INFINITY;
                s[4 * n + 2 * r + e] = x;
                mx = fmaxf(mx, x);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx *= sl;
        // the running max moves only when the tile's exceeds it by more
        // than kStale (p <= 2^kStale until then; the row's 4 threads
        // agree): O's rescale is then skipped by whole warps (rescale)
        const float mnew = mx > m[r] + kStale ? mx : m[r];
        const float mu = mnew == -INFINITY ? 0.f : mnew;  // a row with no key yet: p = 0
        alpha[r] = mnew == m[r] ? 1.f : mma::fast_exp2(m[r] - mu);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float p = mma::fast_exp2(fmaf(s[4 * n + 2 * r + e], sl, -mu));
                s[4 * n + 2 * r + e] = p;
                sum += p;
            }
        l[r] = l[r] * alpha[r] + sum;
        m[r] = mnew;
    }
}

// the end of a forward's rows: this thread's rows row0 and row0 + 8, their
// sum-exp l (each thread's share, summed over its quad here) and max m (log2
// units) -> inv[r] = 1 / sum (0 for a row that saw no key), and lse_bh[i] =
// the natural log-sum-exp (-inf for none) written by the quad's first thread
// (t4 == 0) for the rows below Tq; lse_bh: the (b, h) row of lse
__device__ __forceinline__ void finish_rows(float inv[2], const float l[2], const float m[2], long long row0, int t4,
                                            long long Tq, float *lse_bh) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        inv[r] = lt > 0.f ? 1.f / lt : 0.f;
        const long long i = row0 + 8 * r;
        if (t4 == 0 && i < Tq) lse_bh[i] = lt > 0.f ? (m[r] + log2f(lt)) / kLog2e : -INFINITY;
    }
}

// O (64 x DV accumulators, this thread's rows row0, row0 + 8) times alpha,
// skipped by warps whose rows all kept their max
template <int DV>
__device__ __forceinline__ void rescale(float *o, const float alpha[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < DV / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[4 * n + e] *= alpha[e >> 1];
    }
}

// D = 128: 64 registers of O a thread (and 32 of S at BN = 64); Q, K, V
// tiles of 256-byte rows (two 64-column sub-tiles each): 81 KB, 2 blocks an
// SM (docs/perf-notes.md, "wgmma attention at D = 128"). D = 192, DV = 128:
// O 64 registers, 105 KB; DV = 192: O 96 registers, and V single-buffered
// (fwd_v1: the next tile's V loads once P.V is done) for 97 KB, 2 blocks
// an SM (121 KB double-buffered: one)
template <int D, int DV>
constexpr bool fwd_v1 = DV > 128;
template <int BN, int D = 64, int DV = D>
size_t fwd_smem() {
    return 1024 + (size_t)(64 * D + 2 * BN * D + (fwd_v1<D, DV> ? 1 : 2) * BN * DV) * 2;
}

template <typename T, int BN, int D = 64, int DV = D>
__global__ void __launch_bounds__(128, D == 64 ? (BN == 64 ? 5 : 1) : 2) fwd_kernel(T *out, float *lse, const T *q, const T *k, const T *v,
                                                  qkv_layout lq, qkv_layout lk, qkv_layout lv, qkv_layout lo, int H,
                                                  int Hkv, long long Tq, long long Tk, float scale, int causal) {
    constexpr int NA = BN / 16, NK = D / 16, NO = DV / 2;  // NO: O's accumulators a thread
    constexpr bool V1 = fwd_v1<D, DV>;
    WG_SMEM;
    unsigned char *sm = align1024(wg_smem);
    T *Qs = (T *)sm, *Ks = Qs + 64 * D, *Vs = Ks + 2 * BN * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * 64;  // longest causal rows first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;
    const long long kend = causal ? max(0ll, min(Tk, i0 + 64 + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const float sl = scale * kLog2e;
    const long long row0 = i0 + warp * 16 + g8;  // this thread's rows row0, row0 + 8

    const sw_src<T, D> ksrc(k, lk, b);
    const sw_src<T, DV> vsrc(v, lv, b);
    load_sw<T, 64, D>(Qs, q, lq, b, h, i0, Tq);
    if (ntiles > 0) {
        ksrc.template load<BN>(Ks, g, 0, Tk, k);
        vsrc.template load<BN>(Vs, g, 0, Tk, v);
    }
    mma::cp_async_commit();
    float o[NO], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NO; i++) o[i] = 0.f;
    const uint64_t dq = desc(Qs);

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1;
        __syncthreads();  // every wgmma on tile t-1 (buffer buf ^ 1) has completed
        if (t + 1 < ntiles) {
            ksrc.template load<BN>(Ks + (buf ^ 1) * BN * D, g, (long long)(t + 1) * BN, Tk, k);
            if (!V1) vsrc.template load<BN>(Vs + (buf ^ 1) * BN * DV, g, (long long)(t + 1) * BN, Tk, v);
        }
        mma::cp_async_commit();
        cp_async_wait<1>();  // tile t (and Q) landed: this thread's copies ...
        fence_proxy();
        __syncthreads();     // ... and everyone's
        const long long j0 = (long long)t * BN;
        const T *Kb = Ks + buf * BN * D, *Vb = V1 ? Vs : Vs + buf * BN * DV;

        // S = Q K^T
        float s[BN / 2];
        fence();
        const uint64_t dk = desc(Kb);
#pragma unroll
        for (int kk = 0; kk < NK; kk++) mma_ss<T, BN>(s, kstep<64>(dq, kk), kstep<BN>(dk, kk), kk);
        commit();
        wait<0>();
        pin<BN / 2>(s);

        // online softmax in the exp2 domain; masks only on edge/diagonal
        // tiles
        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0 + off);
        float alpha[2];
        softmax_tile<BN>(s, m, l, alpha, j0, Tk, row0, off, causal, edge, sl, t4);
        rescale<DV>(o, alpha);

        // O += P V, P from the S registers
        unsigned pa[NA][4];
#pragma unroll
        for (int kk = 0; kk < NA; kk++) c_to_a<T>(pa[kk], s, kk);
        pin<NO>(o);
        fence();
        const uint64_t dv = desc_mn<DV, BN>(Vb);
#pragma unroll
        for (int kk = 0; kk < NA; kk++) mma_rs_t<T, DV>(o, pa[kk], dv + kk * (2048 >> 4), 1);
        commit();
        wait<0>();
        pin<NO>(o);
        pin_u<NA * 4>(&pa[0][0]);
        if constexpr (V1) {
            // V's one buffer free once every warp's P.V is done: the next tile's
            // (waited for with K's at the top of the next step)
            if (t + 1 < ntiles) {
                __syncthreads();
                vsrc.template load<BN>(Vs, g, (long long)(t + 1) * BN, Tk, v);
            }
            mma::cp_async_commit();
        }
    }

    mma::cp_async_wait_all();
    __syncthreads();  // K/V buffers free for the output
    float inv[2];
    finish_rows(inv, l, m, row0, t4, Tq, lse + ((long long)b * H + h) * Tq);
    store_acc<T, DV>(out, lo, b, h, i0, Tq, Ks, o, inv[0], inv[1]);
}

// ------------------------------------------- forward, overlapped (opt-in)
// MS_ATTENTION_WG_FWD=ovl|ovlq (attention.cu): FA3's intra-warpgroup
// overlap at q/k 128 or 192 with v 128. Step t issues S_t = Q.K_t^T and then
// O += P_{t-1}.V_{t-1} as two commit groups, waits for the first only
// (wait_group 1), and runs S_t's softmax while P_{t-1}.V_{t-1} is on the
// tensor cores; then waits for it, rescales O by S_t's alpha and turns S_t
// into P_t's A fragments. (fwd_kernel runs the two products and the softmax
// one after another, and leaves the overlap to the other blocks of the SM.)
// The schedule of step t, after a barrier (every wgmma of step t-1 done):
// K_{t+1} into K's other buffer (S_{t-1}'s), V_t into V's buffer t & 1
// (P_{t-2}.V_{t-2}'s), one cp.async group; then K_t and V_{t-1}, the group
// of step t-1, waited for. The last P.V after the loop. QR (ovlq): Q's A
// fragments in registers (NK x 4 a thread, loaded once), S = Q.K^T through
// mma_rs: the product reads only K from shared memory (SS m64n64k16 reads
// A and B, 4 KB for 32 tensor-core cycles: shared memory's 128 bytes a
// cycle). Shared memory as fwd_kernel at DV = 128 (81 / 105 KB), 2 blocks
// an SM; the registers (S and O, P's fragments, QR: Q's) fit 2 blocks.
template <bool B>
struct bool_c {
    static constexpr bool value = B;
};
template <int D, int DV>
size_t fwd_ovl_smem() {
    return 1024 + (size_t)(64 * D + 2 * 64 * D + 2 * 64 * DV) * 2;
}

template <typename T, int D, int DV, bool QR>
__global__ void __launch_bounds__(128, 2) fwd_ovl_kernel(T *out, float *lse, const T *q, const T *k, const T *v,
                                                         qkv_layout lq, qkv_layout lk, qkv_layout lv, qkv_layout lo,
                                                         int H, int Hkv, long long Tq, long long Tk, float scale,
                                                         int causal) {
    constexpr int BN = 64, NA = BN / 16, NK = D / 16, NO = DV / 2;
    static_assert(DV <= 128, "O, S, P and Q's fragments in registers: v at most 128 wide");
    WG_SMEM;
    unsigned char *sm = align1024(wg_smem);
    T *Qs = (T *)sm, *Ks = Qs + 64 * D, *Vs = Ks + 2 * BN * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * 64;  // longest causal rows first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;
    const long long kend = causal ? max(0ll, min(Tk, i0 + 64 + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const float sl = scale * kLog2e;
    const long long row0 = i0 + warp * 16 + g8;  // this thread's rows row0, row0 + 8

    const sw_src<T, D> ksrc(k, lk, b);
    const sw_src<T, DV> vsrc(v, lv, b);
    load_sw<T, 64, D>(Qs, q, lq, b, h, i0, Tq);
    if (ntiles > 0) ksrc.template load<BN>(Ks, g, 0, Tk, k);
    mma::cp_async_commit();  // Q, K_0
    float o[NO], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NO; i++) o[i] = 0.f;
    unsigned pa[NA][4];                        // P_{t-1}'s A fragments
    [[maybe_unused]] unsigned qa[QR ? NK : 1][4];  // QR: Q's
    [[maybe_unused]] const uint64_t dq = desc(Qs);

    // step t; PV: with P_{t-1}.V_{t-1} (t > 0). The first step is its own
    // copy, so that the loop's has no branch around a product (ptxas then
    // keeps O and P's fragments in place across it)
    auto step = [&](int t, auto pv) {
        constexpr bool PV = decltype(pv)::value;
        const int buf = t & 1;
        __syncthreads();  // every wgmma of step t-1 has completed (S_{t-1}: K buffer buf ^ 1; P_{t-2}.V_{t-2}: V buffer buf)
        if (t + 1 < ntiles) ksrc.template load<BN>(Ks + (buf ^ 1) * BN * D, g, (long long)(t + 1) * BN, Tk, k);
        vsrc.template load<BN>(Vs + buf * BN * DV, g, (long long)t * BN, Tk, v);
        mma::cp_async_commit();  // K_{t+1}, V_t
        cp_async_wait<1>();      // K_t, V_{t-1} (and Q) landed: this thread's copies ...
        fence_proxy();
        __syncthreads();         // ... and everyone's
        if constexpr (QR && !PV) {
            // Q's A fragments (warp w's rows 16w + g8, + 8; k16 block kk: columns
            // 16kk + 2t4, + 8) from the swizzled tile, as a_to_sw stores them
            const unsigned char *p = (const unsigned char *)Qs;
            const int r0 = warp * 16 + g8;
#pragma unroll
            for (int kk = 0; kk < NK; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + 8 * (i & 1), c = 2 * (kk & 3) + (i >> 1);
                    qa[kk][i] = *reinterpret_cast<const unsigned *>(p + (kk >> 2) * 64 * 128 + r * 128 +
                                                                     ((c ^ (r & 7)) << 4) + t4 * 4);
                }
        }
        const long long j0 = (long long)t * BN;

        // S_t = Q K_t^T, then O += P_{t-1} V_{t-1}: two groups
        float s[BN / 2];
        fence();
        const uint64_t dk = desc(Ks + buf * BN * D);
#pragma unroll
        for (int kk = 0; kk < NK; kk++) {
            if constexpr (QR) mma_rs<T, BN>(s, qa[kk], kstep<BN>(dk, kk), kk);
            else mma_ss<T, BN>(s, kstep<64>(dq, kk), kstep<BN>(dk, kk), kk);
        }
        commit();
        if constexpr (PV) {
            const uint64_t dv = desc_mn<DV, BN>(Vs + (buf ^ 1) * BN * DV);
#pragma unroll
            for (int kk = 0; kk < NA; kk++) mma_rs_t<T, DV>(o, pa[kk], dv + kk * (2048 >> 4), 1);
            commit();
            wait<1>();  // S_t (P_{t-1} V_{t-1} may still run)
        } else {
            wait<0>();
        }
        pin<BN / 2>(s);

        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0 + off);
        float alpha[2];
        softmax_tile<BN>(s, m, l, alpha, j0, Tk, row0, off, causal, edge, sl, t4);

        if constexpr (PV) {
            wait<0>();  // P_{t-1} V_{t-1}: O and P's fragments free
            pin<NO>(o);
            pin_u<NA * 4>(&pa[0][0]);
        }
        rescale<DV>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < NA; kk++) c_to_a<T>(pa[kk], s, kk);
    };
    if (ntiles > 0) step(0, bool_c<false>());
    for (int t = 1; t < ntiles; t++) step(t, bool_c<true>());
    mma::cp_async_wait_all();  // V_{ntiles-1}
    fence_proxy();
    __syncthreads();
    if (ntiles > 0) {
        // O += P_{n-1} V_{n-1}
        pin<NO>(o);
        fence();
        const uint64_t dv = desc_mn<DV, BN>(Vs + ((ntiles - 1) & 1) * BN * DV);
#pragma unroll
        for (int kk = 0; kk < NA; kk++) mma_rs_t<T, DV>(o, pa[kk], dv + kk * (2048 >> 4), 1);
        commit();
        wait<0>();
        pin<NO>(o);
        pin_u<NA * 4>(&pa[0][0]);
    }
    // (K's buffers stage the output: free since the barrier above, every
    // warp's S products waited for)
    float inv[2];
    finish_rows(inv, l, m, row0, t4, Tq, lse + ((long long)b * H + h) * Tq);
    store_acc<T, DV>(out, lo, b, h, i0, Tq, Ks, o, inv[0], inv[1]);
}

// ------------------------- forward, two consumer warpgroups (opt-in)
// MS_ATTENTION_WG_FWD=ws (attention.cu): FA3's block structure at q/k 128 or
// 192 with v 128. A block is three warpgroups and 128 queries: consumers 0
// and 1 (threads 0-255) own queries i0 + 64c.., each running ovlq's step
// (Q's fragments in registers, S_t's softmax under P_{t-1}.V_{t-1}); the
// producer (threads 256-383) copies each 64-key tile of K and V once for
// both, by cp.async, into one of three stages (ovl's blocks copied each tile
// twice an SM, one block each). Hand-offs by named barriers, no block barrier
// after the start:
//   full[c][s] (kWsFull + 3c + s, 256 threads): the producer's 128 arrive
//            once tile t (stage s = t % 3; at t = 0 with Q) has landed,
//            consumer c syncs before its products read it (one barrier a
//            consumer: a sync counts as an arrival, so a shared one would
//            hold the leading consumer until the other came, and end the
//            ping-pong);
//   empty[s] (kWsEmpty + s, 384): both consumers arrive once P_t.V_t is done
//            (their step t + 1: S_t's K long waited for), the producer syncs
//            before copying tile t + 3 into the stage (so arrivals only for
//            the tiles t + 3 < ntiles: no barrier is left half-arrived).
//   turn[c]  (kWsTurn + c, 256): ping-pong. Consumer c syncs on turn[c]
//            before issuing step t's products and arrives on turn[c ^ 1]
//            after them, so the two warpgroups issue in turns and one's
//            softmax runs while the other's products hold the tensor cores
//            (consumer 0's first turn arrived by itself; consumer 1's last
//            arrival left out: the counts match).
// The producer copies one tile at a time (waits for tile t before issuing
// t + 1) and runs up to three tiles ahead of the consumers. Registers by
// setmaxnreg: the block starts at 168 a thread (384 threads, one block an
// SM), the producer drops to 24, the consumers rise to 240 (168 x 384 =
// 24 x 128 + 240 x 256). Shared memory: each consumer's Q tile (64 x D,
// reused to stage its output: at least 64 x (DV + 8)), three stages of K and
// V: 131 KB at 128, 169 KB at (192, 128). Causal: a block's key range is its
// last row's; consumer 0's rows see one tile more than they need (masked).
constexpr int kWsStages = 3, kWsFull = 1, kWsEmpty = kWsFull + 2 * kWsStages, kWsTurn = kWsEmpty + kWsStages;
template <int D, int DV>
constexpr int ws_qe = 64 * D > 64 * (DV + 8) ? 64 * D : 64 * (DV + 8);  // elements of a consumer's Q tile / output stage
template <int D, int DV>
size_t fwd_ws_smem() {
    return 1024 + (size_t)(2 * ws_qe<D, DV> + kWsStages * 64 * (D + DV)) * 2;
}

template <typename T, int D, int DV>
__global__ void __launch_bounds__(384, 1) fwd_ws_kernel(T *out, float *lse, const T *q, const T *k, const T *v,
                                                        qkv_layout lq, qkv_layout lk, qkv_layout lv, qkv_layout lo,
                                                        int H, int Hkv, long long Tq, long long Tk, float scale,
                                                        int causal) {
    constexpr int BN = 64, NA = BN / 16, NK = D / 16, NO = DV / 2, QE = ws_qe<D, DV>, NS = kWsStages;
    static_assert(DV <= 128, "O, S, P and Q's fragments in registers: v at most 128 wide");
    static_assert(QE * 2 % 1024 == 0, "each consumer's Q tile 1024-byte aligned");
    WG_SMEM;
    unsigned char *sm = align1024(wg_smem);
    T *Qs = (T *)sm, *Ks = Qs + 2 * QE, *Vs = Ks + NS * BN * D;
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * 128;  // longest causal rows first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;
    const long long kend = causal ? max(0ll, min(Tk, i0 + 128 + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const int wgi = threadIdx.x >> 7;

    if (wgi == 2) {
        // the producer: tile t into stage t % 3 once tile t - 3 is free
        setmaxnreg_dec<24>();
        const unsigned tid = threadIdx.x - 256;
        if (ntiles == 0) return;
        const sw_src<T, D> ksrc(k, lk, b, tid);
        const sw_src<T, DV> vsrc(v, lv, b, tid);
        sw_src<T, D>(q, lq, b, tid).template load<64>(Qs, h, i0, Tq, q, tid);
        sw_src<T, D>(q, lq, b, tid).template load<64>(Qs + QE, h, i0 + 64, Tq, q, tid);
        ksrc.template load<BN>(Ks, g, 0, Tk, k, tid);
        vsrc.template load<BN>(Vs, g, 0, Tk, v, tid);
        mma::cp_async_commit();
        for (int t = 1; t <= ntiles; t++) {
            cp_async_wait<0>();  // tile t - 1 (and Q) landed: this thread's copies
            fence_proxy();
            bar_arrive(kWsFull + (t - 1) % NS, 256);  // ... everyone's, at each consumer's sync
            bar_arrive(kWsFull + NS + (t - 1) % NS, 256);
            if (t == ntiles) break;
            const int s = t % NS;
            if (t >= NS) bar_sync(kWsEmpty + s, 384);  // tile t - 3's products done
            ksrc.template load<BN>(Ks + s * BN * D, g, (long long)t * BN, Tk, k, tid);
            vsrc.template load<BN>(Vs + s * BN * DV, g, (long long)t * BN, Tk, v, tid);
            mma::cp_async_commit();
        }
        return;
    }

    // a consumer: queries i0c.. (warp w4 of the warpgroup: rows 16 w4 + g8, + 8)
    setmaxnreg_inc<240>();
    const int c = wgi, w4 = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const long long i0c = i0 + 64 * c, row0 = i0c + w4 * 16 + g8;
    T *Qc = Qs + c * QE;
    const float sl = scale * kLog2e;
    float o[NO], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NO; i++) o[i] = 0.f;
    unsigned pa[NA][4];  // P_{t-1}'s A fragments
    unsigned qa[NK][4];  // Q's
    if (c == 0 && ntiles > 0) bar_arrive(kWsTurn, 256);  // consumer 0's first turn

    // step t; PV: with P_{t-1}.V_{t-1} (t > 0), as fwd_ovl_kernel's
    auto step = [&](int t, auto pv) {
        constexpr bool PV = decltype(pv)::value;
        const int s = t % NS;
        bar_sync(kWsFull + NS * c + s, 256);  // K_t, V_t (and Q) landed
        if constexpr (!PV) {
            // Q's A fragments from the swizzled tile (fwd_ovl_kernel's)
            const unsigned char *p = (const unsigned char *)Qc;
            const int r0 = w4 * 16 + g8;
#pragma unroll
            for (int kk = 0; kk < NK; kk++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + 8 * (i & 1), cc = 2 * (kk & 3) + (i >> 1);
                    qa[kk][i] = *reinterpret_cast<const unsigned *>(p + (kk >> 2) * 64 * 128 + r * 128 +
                                                                     ((cc ^ (r & 7)) << 4) + t4 * 4);
                }
        }
        const long long j0 = (long long)t * BN;

        // this consumer's turn: S_t = Q K_t^T, then O += P_{t-1} V_{t-1}, two groups
        bar_sync(kWsTurn + c, 256);
        float sc[BN / 2];
        fence();
        const uint64_t dk = desc(Ks + s * BN * D);
#pragma unroll
        for (int kk = 0; kk < NK; kk++) mma_rs<T, BN>(sc, qa[kk], kstep<BN>(dk, kk), kk);
        commit();
        if constexpr (PV) {
            const uint64_t dv = desc_mn<DV, BN>(Vs + ((t - 1) % NS) * BN * DV);
#pragma unroll
            for (int kk = 0; kk < NA; kk++) mma_rs_t<T, DV>(o, pa[kk], dv + kk * (2048 >> 4), 1);
            commit();
        }
        if (c == 0 || t + 1 < ntiles) bar_arrive(kWsTurn + (c ^ 1), 256);  // the other's turn
        if constexpr (PV) wait<1>();  // S_t (P_{t-1} V_{t-1} may still run)
        else wait<0>();
        pin<BN / 2>(sc);

        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0c + off);
        float alpha[2];
        softmax_tile<BN>(sc, m, l, alpha, j0, Tk, row0, off, causal, edge, sl, t4);

        if constexpr (PV) {
            wait<0>();  // P_{t-1} V_{t-1}: O and P's fragments free, and tile t - 1's stage
            pin<NO>(o);
            pin_u<NA * 4>(&pa[0][0]);
            if (t - 1 + NS < ntiles) bar_arrive(kWsEmpty + (t - 1) % NS, 384);
        }
        rescale<DV>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < NA; kk++) c_to_a<T>(pa[kk], sc, kk);
    };
    if (ntiles > 0) step(0, bool_c<false>());
    for (int t = 1; t < ntiles; t++) step(t, bool_c<true>());
    if (ntiles > 0) {
        // O += P_{n-1} V_{n-1} (its stage landed: synced at step n - 1)
        pin<NO>(o);
        fence();
        const uint64_t dv = desc_mn<DV, BN>(Vs + ((ntiles - 1) % NS) * BN * DV);
#pragma unroll
        for (int kk = 0; kk < NA; kk++) mma_rs_t<T, DV>(o, pa[kk], dv + kk * (2048 >> 4), 1);
        commit();
        wait<0>();
        pin<NO>(o);
        pin_u<NA * 4>(&pa[0][0]);
    }
    float inv[2];
    finish_rows(inv, l, m, row0, t4, Tq, lse + ((long long)b * H + h) * Tq);
    // the output through this consumer's Q tile: every warp of it read its
    // Q fragments at step 0, before its first turn's sync, which completes
    // only once all its 128 threads are there (no tiles: Q never copied)
    mma::frag_to_smem<T, DV>(Qc, reinterpret_cast<const float(*)[4]>(o), w4 * 16, lane, inv[0], inv[1]);
    __syncwarp();
    mma::store_rows<T, DV, 1>(out, lo, b, h, i0c, Tq, Qc, w4 * 16, lane);
}

// -------------------------------------------------------------- backward
// dk, dv for 64 keys of one (b, kv head), over the query heads of its group
// and their 64-query tiles (Q, dO double-buffered; lse, delta per tile).
//
// OP (the one-pass backward, MS_ATTENTION_WG_BWD=onepass): dq too, from the
// dS^T already in registers (dQ = dS.K: dS^T through the shared tile Ss, read
// back as a transposed A operand; K is the block's own tile), so dq_kernel's
// recomputation of S and dP goes (5 tile products a (key tile, query tile)
// instead of 7). The blocks' 64 x 64 f32 shares of a dq tile are added in a
// fixed order, the last key block that sees the tile first (jlast, .., 1, 0:
// the same bits every run): block j waits until the tile's counter reads
// jlast - j, adds its share to the f32 sums in dqacc (jlast writes them),
// and block 0 rounds the sum times scale into dq instead. The query tiles
// run in ascending order from the block's diagonal (heads minor), so block
// j reaches a tile a step (rep steps with GQA) after block j + 1 did: in the
// steady state the counter is already there. Deadlock-free as the blocks
// take their (key block, b, kv head) from a ticket in the order they start,
// the key blocks of a (b, kv head) last first: a block waits only on blocks
// of smaller tickets, which have started and wait only on smaller ones.
// dqacc: (B, H, Tq, 64) f32; sem: 1 + B*H*ceil(Tq/64) ints, zero (sem[0]
// the ticket, then a counter a (b, h, dq tile)). Causal with Tk >= Tq only
// (attention.cu checks): key block 0 then sees every query tile, and block j
// every tile from its diagonal on.
// D = 128: the two-kernel backward only (OP at D = 64); dK and dV take 128
// registers a thread, S^T and dP^T 64 more; tiles of 256-byte rows: 97 KB,
// 2 blocks an SM. D = 192, DV = 128: dK and dV take 160 registers, so the
// steps are BQ = 32 queries (dkdv_bq): S^T and dP^T (m64n32k16) 32 more;
// 82 KB, 2 blocks an SM. (DV = 192: dK and dV alone 192 registers; not
// built, attention.cu's backward runs the mma kernels there.)
template <int D>
constexpr int dkdv_bq() {
    return D > 128 ? 32 : 64;
}
template <int D = 64, int DV = D, int BQ = 64>
size_t dkdv_smem(bool op = false) {
    return 1024 + (size_t)(64 * D + 64 * DV + 2 * BQ * (D + DV) + (op ? 64 * D : 0)) * 2 + 4 * BQ * sizeof(float);
}

// OP: this block's share c (64 x 64 accumulators, queries i0.. of (b, h) x
// D) of a dq tile, the n-th in the order of the tile's counter cnt (n = 0:
// the first, writes the sums; last: rounds them into dq); c is summed in
// place
template <typename T>
__device__ __forceinline__ void dq_add(T *dq, const qkv_layout &l, float *dqacc, int *cnt, float *c, long long b,
                                       int h, int H, long long i0, long long Tq, int n, bool last, float scale) {
    const int lane = threadIdx.x & 31, t4 = lane & 3;
    const long long row0 = i0 + (threadIdx.x >> 5) * 16 + (lane >> 2);
    if (n > 0) {
        if (threadIdx.x == 0) spin_until(cnt, n);
        __syncthreads();  // the n blocks before this one have added theirs
    }
    if (n > 0) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long i = row0 + 8 * r;
            if (i >= Tq) continue;
            const float2 *src = reinterpret_cast<const float2 *>(dqacc + (((long long)b * H + h) * Tq + i) * kD);
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const float2 x = __ldcg(src + 4 * n + t4);  // L2: another SM's writes
                c[4 * n + 2 * r] += x.x;
                c[4 * n + 2 * r + 1] += x.y;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = row0 + 8 * r;
        if (i >= Tq) continue;
        if (last) {
            T *dst = dq + at(l, b, h, i) + 2 * t4;
#pragma unroll
            for (int n = 0; n < 8; n++)
                *reinterpret_cast<unsigned *>(dst + 8 * n) =
                    mma::op<T>::pack(c[4 * n + 2 * r] * scale, c[4 * n + 2 * r + 1] * scale);
        } else {
            float2 *dst = reinterpret_cast<float2 *>(dqacc + (((long long)b * H + h) * Tq + i) * kD);
#pragma unroll
            for (int n = 0; n < 8; n++) __stcg(dst + 4 * n + t4, make_float2(c[4 * n + 2 * r], c[4 * n + 2 * r + 1]));
        }
    }
    if (!last) {
        // the block's sums visible at gpu scope before the counter moves on:
        // the barrier, then thread 0's fence and increment (a release,
        // cumulative over the writes the barrier ordered before it)
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(cnt, 1);
        }
    }
}

// (OP: at most 168 registers, 3 blocks an SM as the two-pass kernel; ptxas
// left alone takes 187)
template <typename T, bool OP = false, int D = 64, int DV = D, int BQ = 64>
__global__ void __launch_bounds__(128, OP ? 3 : 0) dkdv_kernel(T *dk, T *dv, const T *q, const T *k, const T *v, const T *dout,
                                                   const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                   qkv_layout lv, qkv_layout lg, qkv_layout ldk, qkv_layout ldv, int H,
                                                   int Hkv, long long Tq, long long Tk, float scale, int causal,
                                                   float *part = nullptr, T *dq = nullptr, qkv_layout ldq = qkv_layout{},
                                                   float *dqacc = nullptr, int *sem = nullptr) {
    // NA, NV: dK's, dV's accumulators a thread; NS: S^T's (dP^T's); NQ: the step's k16 blocks of queries
    constexpr int NK = D / 16, NKV = DV / 16, NA = D / 2, NV = DV / 2, NS = BQ / 2, NQ = BQ / 16;
    static_assert(!OP || (D == 64 && DV == 64 && BQ == 64), "the one-pass backward: head dim 64");
    static_assert(BQ == 64 || BQ == 32, "64- or 32-query steps");
    WG_SMEM;
    unsigned char *sm = align1024(wg_smem);
    T *Ks = (T *)sm, *Vs = Ks + 64 * D, *Qs = Vs + 64 * DV, *Gs = Qs + 2 * BQ * D;
    float *Ls = (float *)(Gs + 2 * BQ * DV), *Ds = Ls + 2 * BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    int jb = blockIdx.x, bg = blockIdx.y;  // key block, (b, kv head)
    if constexpr (OP) {
        static __shared__ int ticket;
        if (threadIdx.x == 0) ticket = atomicAdd(sem, 1);
        __syncthreads();
        jb = gridDim.x - 1 - ticket % gridDim.x;   // a (b, kv head)'s last key block first
        bg = ticket / gridDim.x;
    }
    const long long j0 = (long long)jb * 64;
    const int b = bg / Hkv, g = bg % Hkv, rep = H / Hkv;
    const long long off = Tk - Tq;
    const long long istart = causal && j0 - off > 0 ? (j0 - off) / BQ * BQ : 0;
    const long long nq = istart < Tq ? (Tq - istart + BQ - 1) / BQ : 0;
    const long long total = rep * nq;
    const float sl = scale * kLog2e;
    const long long key0 = j0 + warp * 16 + g8;  // this thread's keys key0, key0 + 8
    // the steps' query heads and tiles: tiles ascending, heads major (OP:
    // minor, so that every head's tile t comes a step after block j+1's),
    // counted along as the steps are issued (no division a step)
    int nh = 0, hlast = g * rep;         // the next step's head g*rep + nh; the last issued step's
    long long nt = 0, ilast = istart;    // the next step's tile istart + nt*BQ; the last issued step's
    const sw_src<T, D> qsrc(q, lq, b);
    const sw_src<T, DV> gsrc(dout, lg, b);
    float Lv = INFINITY, Dv = 0.f;
    auto issue = [&](int buf) {
        const int hq = g * rep + nh;
        const long long ib = istart + nt * BQ;
        qsrc.template load<BQ>(Qs + buf * BQ * D, hq, ib, Tq, q);
        gsrc.template load<BQ>(Gs + buf * BQ * DV, hq, ib, Tq, dout);
        const long long i = ib + threadIdx.x, row = ((long long)b * H + hq) * Tq + i;
        if (threadIdx.x < BQ && i < Tq) {
            Lv = lse[row];
            Dv = delta[row];
        } else {
            Lv = INFINITY;
            Dv = 0.f;
        }
        hlast = hq;
        ilast = ib;
        if (OP) {
            if (++nh == rep) nh = 0, nt++;
        } else {
            if (++nt == nq) nt = 0, nh++;
        }
    };
    load_sw<T, 64, D>(Ks, k, lk, b, g, j0, Tk);
    load_sw<T, 64, DV>(Vs, v, lv, b, g, j0, Tk);
    if (total > 0) issue(0);
    mma::cp_async_commit();

    float dka[NA], dva[NV];
#pragma unroll
    for (int i = 0; i < NA; i++) dka[i] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; i++) dva[i] = 0.f;
    const uint64_t dK = desc(Ks), dV = desc(Vs);

    for (long long it = 0; it < total; it++) {
        const int buf = (int)(it & 1);
        mma::cp_async_wait_all();
        if (threadIdx.x < BQ) {  // buffer buf was last read two steps ago
            Ls[buf * BQ + threadIdx.x] = Lv == -INFINITY ? INFINITY : Lv * kLog2e;
            Ds[buf * BQ + threadIdx.x] = Dv;
        }
        fence_proxy();
        __syncthreads();  // step it's tiles visible; step it-1's wgmmas (buffer buf ^ 1) completed
        const long long i0 = ilast;  // step it's tile and head, before step it + 1 is issued
        const int hq = hlast;
        if (it + 1 < total) issue(buf ^ 1);
        mma::cp_async_commit();
        // every key after every query of the tile; never with OP (its tiles
        // start at istart, and istart + 63 + off >= j0), which must not skip
        // a tile's turn
        if (!OP && causal && j0 > i0 + BQ - 1 + off) continue;
        const T *Qb = Qs + buf * BQ * D, *Gb = Gs + buf * BQ * DV;
        const float *Lb = Ls + buf * BQ, *Db = Ds + buf * BQ;

        // S^T = K Q^T, dP^T = V dO^T: 64 keys x BQ queries
        float st[NS], dpt[NS];
        fence();
        const uint64_t dQb = desc(Qb), dGb = desc(Gb);
#pragma unroll
        for (int kk = 0; kk < NK; kk++) mma_ss<T, BQ>(st, kstep<64>(dK, kk), kstep<BQ>(dQb, kk), kk);
#pragma unroll
        for (int kk = 0; kk < NKV; kk++) mma_ss<T, BQ>(dpt, kstep<64>(dV, kk), kstep<BQ>(dGb, kk), kk);
        commit();
        wait<0>();
        pin<NS>(st);
        pin<NS>(dpt);

        const bool edge = i0 + BQ > Tq || j0 + 64 > Tk || (causal && j0 + 63 > i0 + off);
        int cmin[2], cmax[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long j = key0 + 8 * r;
            cmin[r] = causal ? (int)min((long long)BQ, max(0ll, j - off - i0)) : 0;
            cmax[r] = j < Tk ? (int)min((long long)BQ, Tq - i0) : 0;
        }
#pragma unroll
        for (int n = 0; n < BQ / 8; n++) {
            // the two queries' lse and Delta of columns c0, c0 + 1 in one 8-byte load each
            const int c0 = n * 8 + 2 * t4;
            const float2 L2 = *reinterpret_cast<const float2 *>(Lb + c0);
            const float2 D2 = *reinterpret_cast<const float2 *>(Db + c0);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = c0 + (e & 1);
                float p = mma::fast_exp2(st[4 * n + e] * sl - ((e & 1) ? L2.y : L2.x));
                if (edge && (c < cmin[e >> 1] || c >= cmax[e >> 1])) p = 0.f;
                st[4 * n + e] = p;
                dpt[4 * n + e] = p * (dpt[4 * n + e] - ((e & 1) ? D2.y : D2.x));
            }
        }
        unsigned pa[NQ][4], da[NQ][4];
#pragma unroll
        for (int kk = 0; kk < NQ; kk++) {
            c_to_a<T>(pa[kk], st, kk);
            c_to_a<T>(da[kk], dpt, kk);
        }
        // dV += P^T dO, dK += dS^T Q (dO, Q MN-major: DV, D along N)
        const uint64_t dQt = desc_mn<D, BQ>(Qb), dGt = desc_mn<DV, BQ>(Gb);
        auto mma_dvdk = [&] {
#pragma unroll
            for (int kk = 0; kk < NQ; kk++) mma_rs_t<T, DV>(dva, pa[kk], dGt + kk * (2048 >> 4), 1);
#pragma unroll
            for (int kk = 0; kk < NQ; kk++) mma_rs_t<T, D>(dka, da[kk], dQt + kk * (2048 >> 4), 1);
        };
        if constexpr (OP) {
            // dS^T (keys x queries) into Ss as rounded for dK; dQ = dS K with
            // dS read from it transposed, K MN-major (as V in P V)
            T *Ss = (T *)(Ds + 2 * BQ);
            a_to_sw<T>(Ss, da);
            fence_proxy();
            __syncthreads();  // every warp's rows of Ss (step it-1's dQ wgmmas completed before)
            float dqa[32];
            pin<32>(dva);
            pin<32>(dka);
            fence();
            mma_dvdk();
            const uint64_t dS = desc(Ss);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) mma_ss_tt<T, 64>(dqa, dS + kk * (2048 >> 4), dK + kk * (2048 >> 4), kk);
            commit();
            wait<0>();
            pin<32>(dva);
            pin<32>(dka);
            pin<32>(dqa);
            pin_u<16>(&pa[0][0]);
            pin_u<16>(&da[0][0]);
            const int nkb = (int)gridDim.x, nqt = (int)((Tq + BQ - 1) / BQ);
            const int jlast = (int)min((long long)nkb - 1, (i0 + BQ - 1 + off) / 64);
            dq_add<T>(dq, ldq, dqacc, sem + 1 + ((long long)b * H + hq) * nqt + i0 / BQ, dqa, b, hq, H, i0, Tq,
                      jlast - jb, jb == 0, scale);
        } else {
            pin<NV>(dva);
            pin<NA>(dka);
            fence();
            mma_dvdk();
            commit();
            wait<0>();
            pin<NV>(dva);
            pin<NA>(dka);
            pin_u<NQ * 4>(&pa[0][0]);
            pin_u<NQ * 4>(&da[0][0]);
        }
    }

    mma::cp_async_wait_all();
    __syncthreads();  // Q/dO buffers free for the outputs (D = 128: dv's tile runs on into dO's)
    // the staging tiles ([64][D + 8], [64][DV + 8]): from Qs on; D = 192
    // (32-query steps: Q/dO's buffers 40 KB), dk's in K/V's and dv's in Q/dO's
    T *sk = D > 128 ? Ks : Qs, *sv = D > 128 ? Qs : Qs + 64 * (D + 8);
    store_acc<T, D>(dk, ldk, b, g, j0, Tk, sk, dka, scale, scale);
    store_acc<T, DV>(dv, ldv, b, g, j0, Tk, sv, dva, 1.f, 1.f);
    if (part) {   // dk's rows of part, then dv's: (B x key tiles) x (Hkv x D), then x (Hkv x DV)
        const long long row = (long long)b * gridDim.x + jb, rows = (long long)(gridDim.y / Hkv) * gridDim.x;
        tile_colsum<T, D>(sk, j0, Tk, part + row * Hkv * D + g * D);
        // (DV = D: the expression as before the v width was its own, the same PTX)
        float *pv = DV == D ? part + (rows + row) * Hkv * D + g * D : part + rows * Hkv * D + row * Hkv * DV + g * DV;
        tile_colsum<T, DV>(sv, j0, Tk, pv);
    }
}

// dq for 64 queries of one (b, h), 64-key tiles of K and V double-buffered.
// With delta_out (and out, lo) it computes the rows' Delta itself and
// stores it there, so it runs before dkdv_kernel and no delta kernel runs
// (attention.cu); with delta it reads them. D = 128: dQ takes 64 registers
// a thread, S and dP 64; tiles of 256-byte rows: 97 KB, 2 blocks an SM.
// D = 192, DV = 128: dQ 96 registers; V single-buffered (dq_v1: the next
// tile's V loads once dP is done, K's buffers still double as dQ = dS K
// reads them last) for 105 KB, 2 blocks an SM (121 KB double-buffered).
template <int D>
constexpr bool dq_v1 = D > 128;
template <int D = 64, int DV = D>
size_t dq_smem() {
    return 1024 + (size_t)(64 * D + 64 * DV + 2 * 64 * D + (dq_v1<D> ? 1 : 2) * 64 * DV) * 2;
}

// (__launch_bounds__(128, 4) gives 128 registers without spills and 4
// blocks an SM instead of 3: measured the same, 0.177 against 0.179 ms)
template <typename T, int D = 64, int DV = D>
__global__ void __launch_bounds__(128) dq_kernel(T *dq, const T *q, const T *k, const T *v, const T *dout,
                                                 const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                 qkv_layout lv, qkv_layout lg, qkv_layout ldq, int H, int Hkv,
                                                 long long Tq, long long Tk, float scale, int causal,
                                                 float *part = nullptr, const T *out = nullptr,
                                                 qkv_layout lo = qkv_layout{}, float *delta_out = nullptr) {
    // NA: dQ's accumulators, CW: Delta's columns a thread
    constexpr int BN = 64, NK = D / 16, NKV = DV / 16, NA = D / 2, CW = DV / 4;
    constexpr bool V1 = dq_v1<D>;
    WG_SMEM;
    unsigned char *sm = align1024(wg_smem);
    T *Qs = (T *)sm, *Gs = Qs + 64 * D, *Ks = Gs + 64 * DV, *Vs = Ks + 2 * BN * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
    const long long i0 = (long long)(gridDim.x - 1 - blockIdx.x) * 64;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const long long off = Tk - Tq;
    const long long kend = causal ? max(0ll, min(Tk, i0 + 64 + off)) : Tk;
    const int ntiles = (int)((kend + BN - 1) / BN);
    const float sl = scale * kLog2e;
    const long long row0 = i0 + warp * 16 + g8;

    // the first tiles in flight while the rows' lse and Delta load
    const sw_src<T, D> ksrc(k, lk, b);
    const sw_src<T, DV> vsrc(v, lv, b);
    load_sw<T, 64, D>(Qs, q, lq, b, h, i0, Tq);
    load_sw<T, 64, DV>(Gs, dout, lg, b, h, i0, Tq);
    if (ntiles > 0) {
        ksrc.template load<BN>(Ks, g, 0, Tk, k);
        vsrc.template load<BN>(Vs, g, 0, Tk, v);
    }
    mma::cp_async_commit();
    // The rows' lse and Delta. With delta_out, Delta_i = out_i . dout_i here
    // (the delta kernel's work): the row's 4 threads take D/4 columns each
    // (D/32 16-byte loads of each tensor), summed in a fixed order; lane t4 =
    // 0 stores it for the dk/dv kernel that runs after this one. Every load
    // of both rows is issued before any is used (one trip to device memory,
    // not one a row: the loads were 21% of the kernel's stall samples at B =
    // 32 with a trip a row).
    float Lr[2], Dr[2];
    long long rowi[2];
    uint4 va[2][CW / 8], vg[2][CW / 8];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long i = row0 + 8 * r;
        rowi[r] = ((long long)b * H + h) * Tq + i;
        Lr[r] = i < Tq ? lse[rowi[r]] : INFINITY;
        if (delta_out) {
            if (i < Tq) {
                const T *o = out + at(lo, b, h, i) + CW * t4, *gg = dout + at(lg, b, h, i) + CW * t4;
#pragma unroll
                for (int hh = 0; hh < CW / 8; hh++) {
                    va[r][hh] = *reinterpret_cast<const uint4 *>(o + 8 * hh);
                    vg[r][hh] = *reinterpret_cast<const uint4 *>(gg + 8 * hh);
                }
            } else {
#pragma unroll
                for (int hh = 0; hh < CW / 8; hh++) va[r][hh] = vg[r][hh] = uint4{0u, 0u, 0u, 0u};
            }
        } else {
            Dr[r] = i < Tq ? delta[rowi[r]] : 0.f;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        Lr[r] = Lr[r] == -INFINITY ? INFINITY : Lr[r] * kLog2e;
        if (delta_out) {
            float acc = 0.f;
#pragma unroll
            for (int hh = 0; hh < CW / 8; hh++) {
                T ea[8], eg[8];   // (memcpy: no type punning through pointers)
                memcpy(ea, &va[r][hh], sizeof ea);
                memcpy(eg, &vg[r][hh], sizeof eg);
#pragma unroll
                for (int e = 0; e < 8; e++) acc = fmaf(mma::op<T>::to_float(ea[e]), mma::op<T>::to_float(eg[e]), acc);
            }
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            Dr[r] = acc;
            if (t4 == 0 && row0 + 8 * r < Tq) delta_out[rowi[r]] = acc;
        }
    }
    float dqa[NA];
#pragma unroll
    for (int i = 0; i < NA; i++) dqa[i] = 0.f;
    const uint64_t dQ = desc(Qs), dG = desc(Gs);

    for (int t = 0; t < ntiles; t++) {
        const int buf = t & 1;
        __syncthreads();
        if (t + 1 < ntiles) {
            ksrc.template load<BN>(Ks + (buf ^ 1) * BN * D, g, (long long)(t + 1) * BN, Tk, k);
            if (!V1) vsrc.template load<BN>(Vs + (buf ^ 1) * BN * DV, g, (long long)(t + 1) * BN, Tk, v);
        }
        mma::cp_async_commit();
        cp_async_wait<1>();
        fence_proxy();
        __syncthreads();
        const long long j0 = (long long)t * BN;
        const T *Kb = Ks + buf * BN * D, *Vb = V1 ? Vs : Vs + buf * BN * DV;
        const uint64_t dKb = desc(Kb), dVb = desc(Vb);

        float s[32], dp[32];
        fence();
#pragma unroll
        for (int kk = 0; kk < NK; kk++) mma_ss<T, 64>(s, kstep<64>(dQ, kk), kstep<BN>(dKb, kk), kk);
#pragma unroll
        for (int kk = 0; kk < NKV; kk++) mma_ss<T, 64>(dp, kstep<64>(dG, kk), kstep<BN>(dVb, kk), kk);
        commit();
        wait<0>();
        pin<32>(s);
        pin<32>(dp);
        if constexpr (V1) {
            // V's one buffer free once every warp's dP is done: the next tile's
            // (waited for with K's at the top of the next step)
            if (t + 1 < ntiles) {
                __syncthreads();
                vsrc.template load<BN>(Vs, g, (long long)(t + 1) * BN, Tk, v);
            }
            mma::cp_async_commit();
        }

        const bool edge = j0 + BN > Tk || (causal && j0 + BN - 1 > i0 + off);
        int cmax[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            cmax[r] = (int)min((long long)BN, Tk - j0) - 1;
            if (causal) cmax[r] = (int)min((long long)cmax[r], max(-1ll, row0 + 8 * r + off - j0));
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                float p = mma::fast_exp2(s[4 * n + e] * sl - Lr[r]);
                if (edge && n * 8 + 2 * t4 + (e & 1) > cmax[r]) p = 0.f;
                s[4 * n + e] = p * (dp[4 * n + e] - Dr[r]);
            }
        unsigned da[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) c_to_a<T>(da[kk], s, kk);
        pin<NA>(dqa);
        fence();
        const uint64_t dKt = desc_mn<D, BN>(Kb);  // K MN-major: D along N
#pragma unroll
        for (int kk = 0; kk < 4; kk++) mma_rs_t<T, D>(dqa, da[kk], dKt + kk * (2048 >> 4), 1);
        commit();
        wait<0>();
        pin<NA>(dqa);
        pin_u<16>(&da[0][0]);
    }

    mma::cp_async_wait_all();
    __syncthreads();
    store_acc<T, D>(dq, ldq, b, h, i0, Tq, Ks, dqa, scale, scale);
    if (part)   // (B x query tiles) x (H x D)
        tile_colsum<T, D>(Ks, i0, Tq, part + ((long long)b * gridDim.x + blockIdx.x) * H * D + h * D);
}

}  // namespace wg
