// kernels/attention_tc.cuh — the tensor-core path of kernels/attention.cu:
// the same FlashAttention-2 algorithm with every tile product on the MMA
// units (WMMA 16x16x16, bf16/f16 operands, f32 accumulation), for head dims
// that are multiples of 16 up to 128. Four warps per block; each owns 16 rows
// of the 64-row tile (queries in the forward and dq passes, keys in the dk/dv
// pass). Scores and probabilities pass through a per-warp shared-memory tile
// for the row-wise softmax; the forward keeps its output rows in shared
// memory (rescaled per row), dk/dv/dq stay in accumulator fragments.
// Since attention_mma.cuh it runs the head dims mma does not take (16, 32),
// rows that are not 16-byte aligned, and MS_ATTENTION_IMPL=wmma.
// Included by attention.cu only (it uses that file's helpers).
namespace tc {

using namespace nvcuda;

template <int D>
struct dims {
    static const int LDT = D + 8;      // bf16 tiles (64 x D), ld in elements
    static const int LDS = 64 + 4;     // f32 score tile (16 x 64 per warp)
    static const int LDP = 64 + 8;     // bf16 probability tile (16 x 64 per warp)
    static const int LDO = D + 4;      // f32 (16 x D per warp)
};

// rows [t0, t0+64) of (b, h) into s (64 x LDT, T), zero past Tn
template <typename T, int D>
__device__ void load64(T *s, const T *src, const qkv_layout &l, long long b, long long h, long long t0, long long Tn) {
    const int LDT = dims<D>::LDT;
    for (int e = threadIdx.x; e < 64 * D; e += 128) {
        int r = e / D, d = e - r * D;
        long long t = t0 + r;
        s[r * LDT + d] = t < Tn ? src[at(l, b, h, t) + d] : T(0.f);
    }
}

// dst (16 x 64 f32, ld LDS) = A . B^T over D, with A the 16 rows at a and B
// the 64 rows at b (both 64 x LDT bf16/f16 tiles): S = Q K^T, S^T = K Q^T,
// dP = dO V^T and dP^T = V dO^T are all this product
template <typename T, int D>
__device__ __forceinline__ void rows_times_rows_t(float *dst, const T *a, const T *b) {
    typedef dims<D> S;
    for (int n = 0; n < 4; n++) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < D / 16; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
            wmma::load_matrix_sync(fa, a + kk * 16, S::LDT);
            wmma::load_matrix_sync(fb, b + n * 16 * S::LDT + kk * 16, S::LDT);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(dst + n * 16, acc, S::LDS, wmma::mem_row_major);
    }
}

template <typename T, int D>
size_t fwd_smem() {
    typedef dims<D> S;
    return 3 * 64 * S::LDT * sizeof(T) + 4 * 16 * S::LDS * 4 + 4 * 16 * S::LDP * sizeof(T) + 2 * 4 * 16 * S::LDO * 4;
}

template <typename T, int D>
__global__ void __launch_bounds__(128) fwd_kernel(T *out, float *lse, const T *q, const T *k, const T *v, qkv_layout lq,
                                                  qkv_layout lk, qkv_layout lv, qkv_layout lo, int H, int Hkv,
                                                  long long Tq, long long Tk, float scale, int causal) {
    typedef dims<D> S;
    extern __shared__ __align__(128) unsigned char sm[];
    T *Qs = (T *)sm, *Ks = Qs + 64 * S::LDT, *Vs = Ks + 64 * S::LDT;
    float *Sall = (float *)(Vs + 64 * S::LDT);
    T *Pall = (T *)(Sall + 4 * 16 * S::LDS);
    float *Oall = (float *)(Pall + 4 * 16 * S::LDP);
    float *Tall = Oall + 4 * 16 * S::LDO;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *Sw = Sall + warp * 16 * S::LDS, *Ow = Oall + warp * 16 * S::LDO, *Tw = Tall + warp * 16 * S::LDO;
    T *Pw = Pall + warp * 16 * S::LDP;
    const long long i0 = (long long)blockIdx.x * 64;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const int r = lane >> 1, half = lane & 1;
    const long long i = i0 + warp * 16 + r, off = Tk - Tq;
    load64<T, D>(Qs, q, lq, b, h, i0, Tq);
    for (int e = lane; e < 16 * D; e += 32) Ow[(e / D) * S::LDO + e % D] = 0.f;
    float m = -INFINITY, l = 0.f;
    const float sl = scale * kLog2e;
    long long kend = causal ? max(0ll, min(Tk, i0 + 64 + off)) : Tk;
    for (long long j0 = 0; j0 < kend; j0 += 64) {
        __syncthreads();
        load64<T, D>(Ks, k, lk, b, g, j0, Tk);
        load64<T, D>(Vs, v, lv, b, g, j0, Tk);
        __syncthreads();
        rows_times_rows_t<T, D>(Sw, Qs + warp * 16 * S::LDT, Ks);
        __syncwarp();
        float sv[32], tmax = -INFINITY;
#pragma unroll
        for (int cc = 0; cc < 32; cc++) {
            int c = half * 32 + cc;
            long long j = j0 + c;
            float s = (i < Tq && j < Tk && (!causal || j <= i + off)) ? Sw[r * S::LDS + c] * sl : -INFINITY;
            sv[cc] = s;
            tmax = fmaxf(tmax, s);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        float mnew = fmaxf(m, tmax);
        float alpha = mnew == -INFINITY ? 1.f : exp2f(m - mnew);
        float psum = 0.f;
#pragma unroll
        for (int cc = 0; cc < 32; cc++) {
            float p = mnew == -INFINITY ? 0.f : exp2f(sv[cc] - mnew);
            psum += p;  // the f32 row sum (as FlashAttention-2): lse stays exact for backward
            Pw[r * S::LDP + half * 32 + cc] = T(p);
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        l = l * alpha + psum;
        m = mnew;
        __syncwarp();
        for (int dn = 0; dn < D / 16; dn++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
            for (int kk = 0; kk < 4; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
                wmma::load_matrix_sync(fa, Pw + kk * 16, S::LDP);
                wmma::load_matrix_sync(fb, Vs + kk * 16 * S::LDT + dn * 16, S::LDT);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(Tw + dn * 16, acc, S::LDO, wmma::mem_row_major);
        }
        __syncwarp();
        for (int d = half * (D / 2); d < (half + 1) * (D / 2); d++)
            Ow[r * S::LDO + d] = Ow[r * S::LDO + d] * alpha + Tw[r * S::LDO + d];
        __syncwarp();
    }
    if (i < Tq) {
        float inv = l > 0.f ? 1.f / l : 0.f;
        T *dst = out + at(lo, b, h, i);
        for (int d = half * (D / 2); d < (half + 1) * (D / 2); d++) dst[d] = T(Ow[r * S::LDO + d] * inv);
        if (half == 0) lse[((long long)b * H + h) * Tq + i] = l > 0.f ? (m + log2f(l)) / kLog2e : -INFINITY;
    }
}

template <typename T, int D>
size_t dkdv_smem() {
    typedef dims<D> S;
    return 4 * 64 * S::LDT * sizeof(T) + 4 * 16 * S::LDS * 4 + 2 * 4 * 16 * S::LDP * sizeof(T) + 2 * 64 * 4;
}

// dk, dv for 64 keys of one (b, kv head); warps own 16 keys each
template <typename T, int D>
__global__ void __launch_bounds__(128) dkdv_kernel(T *dk, T *dv, const T *q, const T *k, const T *v, const T *dout,
                                                   const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                   qkv_layout lv, qkv_layout lg, qkv_layout ldk, qkv_layout ldv, int H,
                                                   int Hkv, long long Tq, long long Tk, float scale, int causal) {
    typedef dims<D> S;
    extern __shared__ __align__(128) unsigned char sm[];
    T *Ks = (T *)sm, *Vs = Ks + 64 * S::LDT, *Qs = Vs + 64 * S::LDT, *Gs = Qs + 64 * S::LDT;
    float *Sall = (float *)(Gs + 64 * S::LDT);
    T *Pall = (T *)(Sall + 4 * 16 * S::LDS), *Dall = Pall + 4 * 16 * S::LDP;
    float *Ls = (float *)(Dall + 4 * 16 * S::LDP), *Ds = Ls + 64;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *Sw = Sall + warp * 16 * S::LDS;
    T *Pw = Pall + warp * 16 * S::LDP, *Dw = Dall + warp * 16 * S::LDP;
    const long long j0 = (long long)blockIdx.x * 64;
    const int bg = blockIdx.y, b = bg / Hkv, g = bg % Hkv, rep = H / Hkv;
    const int r = lane >> 1, half = lane & 1;
    const long long j = j0 + warp * 16 + r, off = Tk - Tq;
    load64<T, D>(Ks, k, lk, b, g, j0, Tk);
    load64<T, D>(Vs, v, lv, b, g, j0, Tk);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dkf[D / 16], dvf[D / 16];
#pragma unroll
    for (int x = 0; x < D / 16; x++) {
        wmma::fill_fragment(dkf[x], 0.f);
        wmma::fill_fragment(dvf[x], 0.f);
    }
    const long long istart = causal ? max(0ll, (j0 - off) / 64 * 64) : 0;
    for (int h = g * rep; h < (g + 1) * rep; h++) {
        for (long long i0 = istart; i0 < Tq; i0 += 64) {
            __syncthreads();
            load64<T, D>(Qs, q, lq, b, h, i0, Tq);
            load64<T, D>(Gs, dout, lg, b, h, i0, Tq);
            for (int e = threadIdx.x; e < 64; e += 128) {
                long long ii = i0 + e;
                Ls[e] = ii < Tq ? lse[((long long)b * H + h) * Tq + ii] : INFINITY;
                Ds[e] = ii < Tq ? delta[((long long)b * H + h) * Tq + ii] : 0.f;
            }
            __syncthreads();
            // S^T (16 keys x 64 queries) = K_w Q^T
            rows_times_rows_t<T, D>(Sw, Ks + warp * 16 * S::LDT, Qs);
            __syncwarp();
            float p[32];
#pragma unroll
            for (int cc = 0; cc < 32; cc++) {
                int c = half * 32 + cc;
                long long ii = i0 + c;
                bool vis = ii < Tq && j < Tk && (!causal || j <= ii + off) && Ls[c] != -INFINITY;
                p[cc] = vis ? expf(Sw[r * S::LDS + c] * scale - Ls[c]) : 0.f;
                Pw[r * S::LDP + c] = T(p[cc]);
            }
            __syncwarp();
            // dP^T (16 x 64) = V_w dO^T
            rows_times_rows_t<T, D>(Sw, Vs + warp * 16 * S::LDT, Gs);
            __syncwarp();
#pragma unroll
            for (int cc = 0; cc < 32; cc++) {
                int c = half * 32 + cc;
                Dw[r * S::LDP + c] = T(p[cc] * (Sw[r * S::LDS + c] - Ds[c]));
            }
            __syncwarp();
            // dV_w += P^T dO ; dK_w += dS^T Q
            for (int dn = 0; dn < D / 16; dn++) {
                for (int kk = 0; kk < 4; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp, fd;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fg, fq;
                    wmma::load_matrix_sync(fp, Pw + kk * 16, S::LDP);
                    wmma::load_matrix_sync(fg, Gs + kk * 16 * S::LDT + dn * 16, S::LDT);
                    wmma::mma_sync(dvf[dn], fp, fg, dvf[dn]);
                    wmma::load_matrix_sync(fd, Dw + kk * 16, S::LDP);
                    wmma::load_matrix_sync(fq, Qs + kk * 16 * S::LDT + dn * 16, S::LDT);
                    wmma::mma_sync(dkf[dn], fd, fq, dkf[dn]);
                }
            }
        }
    }
    // out through the warp's f32 tile (16 x 16 at a time)
    for (int dn = 0; dn < D / 16; dn++) {
        for (int which = 0; which < 2; which++) {
            __syncwarp();
            wmma::store_matrix_sync(Sw, which ? dvf[dn] : dkf[dn], S::LDS, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                int rr = e >> 4, cc = e & 15;
                long long jj = j0 + warp * 16 + rr;
                if (jj < Tk) {
                    if (which) dv[at(ldv, b, g, jj) + dn * 16 + cc] = T(Sw[rr * S::LDS + cc]);
                    else dk[at(ldk, b, g, jj) + dn * 16 + cc] = T(Sw[rr * S::LDS + cc] * scale);
                }
            }
        }
    }
}

template <typename T, int D>
size_t dq_smem() {
    typedef dims<D> S;
    return 4 * 64 * S::LDT * sizeof(T) + 4 * 16 * S::LDS * 4 + 4 * 16 * S::LDP * sizeof(T);
}

// dq for 64 queries of one (b, h); warps own 16 queries each
template <typename T, int D>
__global__ void __launch_bounds__(128) dq_kernel(T *dq, const T *q, const T *k, const T *v, const T *dout,
                                                 const float *lse, const float *delta, qkv_layout lq, qkv_layout lk,
                                                 qkv_layout lv, qkv_layout lg, qkv_layout ldq, int H, int Hkv,
                                                 long long Tq, long long Tk, float scale, int causal) {
    typedef dims<D> S;
    extern __shared__ __align__(128) unsigned char sm[];
    T *Qs = (T *)sm, *Gs = Qs + 64 * S::LDT, *Ks = Gs + 64 * S::LDT, *Vs = Ks + 64 * S::LDT;
    float *Sall = (float *)(Vs + 64 * S::LDT);
    T *Dall = (T *)(Sall + 4 * 16 * S::LDS);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *Sw = Sall + warp * 16 * S::LDS;
    T *Dw = Dall + warp * 16 * S::LDP;
    const long long i0 = (long long)blockIdx.x * 64;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, g = h / (H / Hkv);
    const int r = lane >> 1, half = lane & 1;
    const long long i = i0 + warp * 16 + r, off = Tk - Tq;
    load64<T, D>(Qs, q, lq, b, h, i0, Tq);
    load64<T, D>(Gs, dout, lg, b, h, i0, Tq);
    const float L = i < Tq ? lse[((long long)b * H + h) * Tq + i] : -INFINITY;
    const float Dl = i < Tq ? delta[((long long)b * H + h) * Tq + i] : 0.f;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> dqf[D / 16];
#pragma unroll
    for (int x = 0; x < D / 16; x++) wmma::fill_fragment(dqf[x], 0.f);
    long long kend = causal ? max(0ll, min(Tk, i0 + 64 + off)) : Tk;
    for (long long j0 = 0; j0 < kend; j0 += 64) {
        __syncthreads();
        load64<T, D>(Ks, k, lk, b, g, j0, Tk);
        load64<T, D>(Vs, v, lv, b, g, j0, Tk);
        __syncthreads();
        rows_times_rows_t<T, D>(Sw, Qs + warp * 16 * S::LDT, Ks);
        __syncwarp();
        float p[32];
#pragma unroll
        for (int cc = 0; cc < 32; cc++) {
            int c = half * 32 + cc;
            long long j = j0 + c;
            bool vis = i < Tq && j < Tk && (!causal || j <= i + off) && L != -INFINITY;
            p[cc] = vis ? expf(Sw[r * S::LDS + c] * scale - L) : 0.f;
        }
        __syncwarp();
        rows_times_rows_t<T, D>(Sw, Gs + warp * 16 * S::LDT, Vs);
        __syncwarp();
#pragma unroll
        for (int cc = 0; cc < 32; cc++) {
            int c = half * 32 + cc;
            Dw[r * S::LDP + c] = T(p[cc] * (Sw[r * S::LDS + c] - Dl));
        }
        __syncwarp();
        for (int dn = 0; dn < D / 16; dn++) {
            for (int kk = 0; kk < 4; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fd;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fk;
                wmma::load_matrix_sync(fd, Dw + kk * 16, S::LDP);
                wmma::load_matrix_sync(fk, Ks + kk * 16 * S::LDT + dn * 16, S::LDT);
                wmma::mma_sync(dqf[dn], fd, fk, dqf[dn]);
            }
        }
    }
    for (int dn = 0; dn < D / 16; dn++) {
        __syncwarp();
        wmma::store_matrix_sync(Sw, dqf[dn], S::LDS, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            int rr = e >> 4, cc = e & 15;
            long long ii = i0 + warp * 16 + rr;
            if (ii < Tq) dq[at(ldq, b, h, ii) + dn * 16 + cc] = T(Sw[rr * S::LDS + cc] * scale);
        }
    }
}

}  // namespace tc
