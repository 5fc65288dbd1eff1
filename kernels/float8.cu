// kernels/float8.cu — the float8 casts of core/float8.c on the GPU: the
// absolute maximum of a tensor (the dynamic scale's input) and the scaled,
// saturating cast to f8e4m3 / f8e5m2 in both layouts at once (the row-major
// copy for one product, the transposed one for the other: cuBLASLt's FP8
// GEMMs take K-major operands only), and the blockwise casts (DeepSeek-V3's
// 1 x 128 and 128 x 128 blocks, one scale a block).
//
// Bytes: amax reads x once; the cast reads x once and writes one byte per
// element per layout. The rounding is core/fp8.h's (the CPU reference's);
// on sm_89+ the hardware cvt.rn.satfinite gives the same bits (x * scale is
// clamped first, so the two differ only in the sign of a NaN).
#include "common.cuh"
#include "kernels.h"
#include "ops.h"
#include "vec.cuh"
#include "f8many.h"

#include <cooperative_groups.h>
#include <cuda_fp8.h>

namespace {

// ---------------------------------------------------------------- amax
// Each thread keeps the max of |x| over a grid-stride walk (16-byte packs
// when the tensor is aligned, then the tail) as f32 bits (non-negative
// floats order as their bits; NaN's bits are above infinity's, so a NaN
// wins); the block reduces them, and the blocks fold together by an
// atomicMax (amax_kernel) or through a grid sync (amax_cast_kernel). The
// result does not depend on the order: max is exact.
// (thread i0 of step threads: the grid's by default, a block's for the
// many-piece kernel's chunks)
template <typename T>
__device__ __forceinline__ unsigned int thread_amax_bits(const T *__restrict__ x, long long n, bool vec,
                                                         long long i0, long long step) {
    const int V = 16 / sizeof(T);
    float m = 0.f;
    bool nan = false;
    const long long nv = vec ? n / V : 0;
    for (long long i = i0; i < nv; i += step) {
        vpack<T, V> q = reinterpret_cast<const vpack<T, V> *>(x)[i];
#pragma unroll
        for (int k = 0; k < V; k++) {
            float a = fabsf((float)conv<T>::load(q.v[k]));
            nan |= a != a;
            m = fmaxf(m, a);
        }
    }
    for (long long i = nv * V + i0; i < n; i += step) {
        float a = fabsf((float)conv<T>::load(x[i]));
        nan |= a != a;
        m = fmaxf(m, a);
    }
    return nan ? 0x7fc00000u : __float_as_uint(m);
}

__device__ __forceinline__ long long grid_thread() { return (long long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long long grid_threads() { return (long long)gridDim.x * blockDim.x; }

// the max of b over the block, in thread 0 (red: 32 words of shared memory;
// the block's threads all call it)
__device__ __forceinline__ unsigned int block_max(unsigned int b, unsigned int *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
    __syncthreads();   // (red may be in use from a previous call)
    if (lane == 0) red[warp] = b;
    __syncthreads();
    unsigned int t = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) t = max(t, red[w]);
    return t;
}

template <typename T>
__global__ void amax_kernel(const T *__restrict__ x, long long n, bool vec, unsigned int *__restrict__ out) {
    __shared__ unsigned int red[32];
    const unsigned int b = block_max(thread_amax_bits<T>(x, n, vec, grid_thread(), grid_threads()), red);
    if (threadIdx.x == 0 && b) atomicMax(out, b);
}

// ---------------------------------------------------------------- cast
// One 64 x 64 tile a block of 256 threads: thread t converts 16 elements of
// row t / 4 (columns (t % 4) * 16 ...), writes them to the row-major copy
// and into a shared tile, and after the barrier writes 16 elements of a
// column of the tile as a row of the transposed copy (4 threads a row, so
// a warp stores 8 whole 64-byte rows). Partial tiles and unaligned rows
// take the same steps element by element.
const int kTile = 64;
const int kPitch = kTile + 4;   // bytes a shared row: 2-way bank conflicts at most in the transposed read

__device__ __forceinline__ uint8_t to_fp8(float v, bool e5) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5 ? __NV_E5M2 : __NV_E4M3);
#else
    return ms_fp8_from_f32(v, e5, 1);
#endif
}

// One 64 x 64 tile (rows r0.., columns c0..) of the cast: thread t converts
// 16 elements of row t / 4 (columns (t % 4) * 16 ...), writes them to the
// row-major copy and into the shared tile, and after the barrier writes 16
// elements of a column of the tile as a row of the transposed copy (4
// threads a row, so a warp stores 8 whole 64-byte rows). Partial tiles and
// unaligned rows take the same steps element by element (the axiswise
// casts' tiles: rc_cast_kernel).
template <typename T>
__device__ __forceinline__ void cast_tile(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                                          uint8_t *__restrict__ out_t, float s, bool e5, bool al, long long r0,
                                          long long c0, uint8_t *tile) {
    const int tr = threadIdx.x >> 2, tc = (threadIdx.x & 3) * 16;
    const long long r = r0 + tr, c = c0 + tc;
    const bool full = al && r0 + kTile <= R && c0 + kTile <= C && (C % 16) == 0;
    union {
        uint4 u;
        uint8_t b[16];
    } pk;
    uint8_t *v = pk.b;
    if (full) {
        const int V = 16 / sizeof(T);   // elements a 16-byte load
        const T *p = x + r * C + c;
#pragma unroll
        for (int j = 0; j < 16; j += V) {
            float f[V];
            load_v<float, T, V>(f, p + j);
#pragma unroll
            for (int k = 0; k < V; k++) v[j + k] = to_fp8(__fmul_rn(f[k], s), e5);
        }
        if (out) *reinterpret_cast<uint4 *>(out + r * C + c) = pk.u;
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) {
            v[k] = 0;
            if (r < R && c + k < C) {
                v[k] = to_fp8(__fmul_rn((float)conv<T>::load(x[r * C + c + k]), s), e5);
                if (out) out[r * C + c + k] = v[k];
            }
        }
    }
    if (!out_t) return;
#pragma unroll
    for (int k = 0; k < 16; k++) tile[tr * kPitch + tc + k] = v[k];
    __syncthreads();
    // the transposed copy: row c0 + tr of out_t, columns r0 + tc ... + 15
    const long long orow = c0 + tr, ocol = r0 + tc;
    union {
        uint4 u;
        uint8_t b[16];
    } pt;
    uint8_t *w = pt.b;
#pragma unroll
    for (int k = 0; k < 16; k++) w[k] = tile[(tc + k) * kPitch + tr];
    if (full && (R % 16) == 0) {
        *reinterpret_cast<uint4 *>(out_t + orow * R + ocol) = pt.u;
    } else if (orow < C) {
#pragma unroll
        for (int k = 0; k < 16; k++)
            if (ocol + k < R) out_t[orow * R + ocol + k] = w[k];
    }
}

// the cast with a given amax: one tile a block
template <typename T>
__global__ void cast_kernel(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                            uint8_t *__restrict__ out_t, float *__restrict__ inv, const float *__restrict__ amax,
                            bool e5, bool pow2, bool al) {
    __shared__ float s_scale;
    __shared__ __align__(16) uint8_t tile[kTile * kPitch];
    if (threadIdx.x == 0) {
        float s = ms_fp8_scale(*amax, e5, pow2);
        s_scale = s;
        if (inv && blockIdx.x == 0 && blockIdx.y == 0) *inv = 1.0f / s;
    }
    __syncthreads();
    const long long r0 = (long long)blockIdx.y * kTile, c0 = (long long)blockIdx.x * kTile;
    if (r0 >= R || c0 >= C) return;   // (the scale-only launch)
    cast_tile<T>(x, R, C, out, out_t, s_scale, e5, al, r0, c0, tile);
}

// amax and the cast in one cooperative launch (every block resident): the
// blocks' partial maxima (each over a grid-stride walk, 16-byte packs when
// aligned) go to part[], the grid synchronises, every block folds part[]
// into the amax (the same order everywhere: exact), and the blocks then
// walk the 64 x 64 tiles. x is read twice, the second time largely from
// L2 when it fits there; one launch instead of a memset and two kernels.
template <typename T>
__global__ void amax_cast_kernel(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                                 uint8_t *__restrict__ out_t, float *__restrict__ inv, float *__restrict__ amax_out,
                                 unsigned int *__restrict__ part, bool e5, bool pow2, bool al) {
    __shared__ unsigned int red[32];
    __shared__ float s_scale;
    __shared__ __align__(16) uint8_t tile[kTile * kPitch];
    {
        const unsigned int t = block_max(thread_amax_bits<T>(x, R * C, al, grid_thread(), grid_threads()), red);
        if (threadIdx.x == 0) part[blockIdx.x] = t;
    }
    cooperative_groups::this_grid().sync();
    {
        unsigned int b = 0;
        for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) b = max(b, __ldcg(part + i));
        const unsigned int t = block_max(b, red);
        if (threadIdx.x == 0) {
            const float a = __uint_as_float(t);
            const float s = ms_fp8_scale(a, e5, pow2);
            s_scale = s;
            if (blockIdx.x == 0) {
                if (amax_out) *amax_out = a;
                if (inv) *inv = 1.0f / s;
            }
        }
        __syncthreads();
    }
    const float s = s_scale;
    const long long tx = (C + kTile - 1) / kTile, nt = tx * ((R + kTile - 1) / kTile);
    for (long long t = blockIdx.x; t < nt; t += gridDim.x) {
        cast_tile<T>(x, R, C, out, out_t, s, e5, al, (t / tx) * kTile, (t % tx) * kTile, tile);
        __syncthreads();   // the tile is rewritten by the next one
    }
}

// ------------------------------------------------------------ axiswise
// Rows: one warp a row. The warp finds the row's amax (16-byte loads when
// the row is aligned), its scale, then reads the row again (from L1/L2) and
// writes the bytes; inv_rows[r] = 1 / scale. NaN wins the max as in amax.
// given: the rows' amaxes (f32 bits) to scale by instead of finding them;
// amax_out: the rows' amaxes written there, and nothing cast (out NULL).
template <typename T>
__global__ void row_cast_kernel(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                                float *__restrict__ inv, bool e5, bool pow2, bool al,
                                const unsigned int *__restrict__ given, unsigned int *__restrict__ amax_out) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= R) return;
    const T *p = x + r * C;
    uint8_t *o = out ? out + r * C : nullptr;
    const int V = 16 / sizeof(T);
    const bool vec = al && (C % 16) == 0;   // rows 16-byte aligned in x and in out
    float m = 0.f;
    bool nan = false;
    if (given) {
    } else if (vec) {
        for (long long j = (long long)lane * V; j < C; j += 32LL * V) {
            float f[V];
            load_v<float, T, V>(f, p + j);
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float a = fabsf(f[k]);
                nan |= a != a;
                m = fmaxf(m, a);
            }
        }
    } else {
        for (long long j = lane; j < C; j += 32) {
            const float a = fabsf((float)conv<T>::load(p[j]));
            nan |= a != a;
            m = fmaxf(m, a);
        }
    }
    unsigned int b = nan ? 0x7fc00000u : __float_as_uint(m);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, off));
    if (given) b = given[r];
    if (amax_out) {
        if (lane == 0) amax_out[r] = b;
        return;
    }
    const float s = ms_fp8_scale(__uint_as_float(b), e5, pow2);
    if (lane == 0 && inv) inv[r] = 1.0f / s;
    if (vec) {
        for (long long j = (long long)lane * V; j < C; j += 32LL * V) {
            float f[V];
            load_v<float, T, V>(f, p + j);
            union {
                uint4 u;
                uint8_t b[16];
            } pk;
#pragma unroll
            for (int k = 0; k < V; k++) pk.b[k] = to_fp8(__fmul_rn(f[k], s), e5);
            if (V == 16) *reinterpret_cast<uint4 *>(o + j) = pk.u;
            else if (V == 8) *reinterpret_cast<uint2 *>(o + j) = make_uint2(pk.u.x, pk.u.y);
            else if (V == 4) *reinterpret_cast<unsigned int *>(o + j) = pk.u.x;
            else
#pragma unroll
                for (int k = 0; k < V; k++) o[j + k] = pk.b[k];
        }
    } else {
        for (long long j = lane; j < C; j += 32) o[j] = to_fp8(__fmul_rn((float)conv<T>::load(p[j]), s), e5);
    }
}

const int kColRows = 256;   // (the rows a block of rc_amax_kernel walks)

// ------------------------------------------------------------ transpose
// An 8-bit tensor's transpose (the other layout of an FSDP-gathered f8
// weight): the tiles of cast_kernel without the conversion, 16-byte loads
// and stores where the tile is whole and aligned.
__global__ void transpose8_kernel(const uint8_t *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                                  bool al) {
    __shared__ __align__(16) uint8_t tile[kTile * kPitch];
    const long long r0 = (long long)blockIdx.y * kTile, c0 = (long long)blockIdx.x * kTile;
    const int tr = threadIdx.x >> 2, tc = (threadIdx.x & 3) * 16;
    const long long r = r0 + tr, c = c0 + tc;
    const bool full = al && r0 + kTile <= R && c0 + kTile <= C && (C % 16) == 0 && (R % 16) == 0;
    union {
        uint4 u;
        uint8_t b[16];
    } pk;
    if (full) {
        pk.u = *reinterpret_cast<const uint4 *>(x + r * C + c);
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) pk.b[k] = (r < R && c + k < C) ? x[r * C + c + k] : 0;
    }
#pragma unroll
    for (int k = 0; k < 16; k++) tile[tr * kPitch + tc + k] = pk.b[k];
    __syncthreads();
    const long long orow = c0 + tr, ocol = r0 + tc;
#pragma unroll
    for (int k = 0; k < 16; k++) pk.b[k] = tile[(tc + k) * kPitch + tr];
    if (full) {
        *reinterpret_cast<uint4 *>(out + orow * R + ocol) = pk.u;
    } else if (orow < C) {
#pragma unroll
        for (int k = 0; k < 16; k++)
            if (ocol + k < R) out[orow * R + ocol + k] = pk.b[k];
    }
}

// The column-scaled layout, with or without the row-scaled one (ROWS: the
// output gradient's two casts, a weight's). One pass for the maxima: a
// block of 256 threads takes 64 columns of kColRows rows; thread t keeps
// the max of 16 columns ((t % 4) * 16 ...) over rows t / 4, t / 4 + 64,
// ...; the block folds its 64 partial rows in shared memory and each
// column's max goes to cbits[c] by an atomicMax (f32 bits, as amax); with
// ROWS each row's max over its 16 elements is folded across the 4 threads
// of the row and atomicMax'ed to rbits a tile. Then one pass of tiles that
// writes out_t with the columns' scales (and out with the rows'). With both
// layouts x is read twice instead of four times (the row kernel's second
// read, the column amax, the column cast).
template <typename T, bool ROWS>
__global__ void rc_amax_kernel(const T *__restrict__ x, long long R, long long C, unsigned int *__restrict__ rbits,
                               unsigned int *__restrict__ cbits, bool al) {
    __shared__ unsigned int part[kTile][kTile + 1];
    const int tr = threadIdx.x >> 2, tc = (threadIdx.x & 3) * 16;
    const long long c0 = (long long)blockIdx.x * kTile, rb = (long long)blockIdx.y * kColRows;
    const long long c = c0 + tc;
    unsigned int m[16];
#pragma unroll
    for (int k = 0; k < 16; k++) m[k] = 0;
    const bool full = al && c0 + kTile <= C && (C % 16) == 0;
    for (long long r0 = rb; r0 < R && r0 < rb + kColRows; r0 += kTile) {
        const long long r = r0 + tr;
        unsigned int rm = 0;
        if (r < R) {
            if (full) {
                const int V = 16 / sizeof(T);
#pragma unroll
                for (int j = 0; j < 16; j += V) {
                    float f[V];
                    load_v<float, T, V>(f, x + r * C + c + j);
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        const float a = fabsf(f[k]);
                        const unsigned int b = a != a ? 0x7fc00000u : __float_as_uint(a);
                        m[j + k] = max(m[j + k], b);
                        rm = max(rm, b);
                    }
                }
            } else {
#pragma unroll
                for (int k = 0; k < 16; k++)
                    if (c + k < C) {
                        const float a = fabsf((float)conv<T>::load(x[r * C + c + k]));
                        const unsigned int b = a != a ? 0x7fc00000u : __float_as_uint(a);
                        m[k] = max(m[k], b);
                        rm = max(rm, b);
                    }
            }
        }
        if (ROWS) {
            // the row's 4 threads are 4 neighbouring lanes
            rm = max(rm, __shfl_xor_sync(0xffffffffu, rm, 1));
            rm = max(rm, __shfl_xor_sync(0xffffffffu, rm, 2));
            if ((threadIdx.x & 3) == 0 && r < R && rm) atomicMax(rbits + r, rm);
        }
    }
#pragma unroll
    for (int k = 0; k < 16; k++) part[tr][tc + k] = m[k];
    __syncthreads();
    if (threadIdx.x < kTile && c0 + threadIdx.x < C) {
        unsigned int b = 0;
        for (int i = 0; i < kTile; i++) b = max(b, part[i][threadIdx.x]);
        if (b) atomicMax(cbits + c0 + threadIdx.x, b);
    }
}

// (R == 0 launches one tile row for the columns' scales)
template <typename T, bool ROWS>
__global__ void rc_cast_kernel(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                               uint8_t *__restrict__ out_t, float *__restrict__ inv_r, float *__restrict__ inv_c,
                               const unsigned int *__restrict__ rbits, const unsigned int *__restrict__ cbits, bool e5,
                               bool pow2, bool al) {
    __shared__ float rs[kTile], cs[kTile];
    __shared__ __align__(16) uint8_t tile[kTile * kPitch];
    const long long r0 = (long long)blockIdx.y * kTile, c0 = (long long)blockIdx.x * kTile;
    if (threadIdx.x < kTile) {
        const long long c = c0 + threadIdx.x;
        const float s = c < C ? ms_fp8_scale(__uint_as_float(cbits[c]), e5, pow2) : 1.f;
        cs[threadIdx.x] = s;
        if (inv_c && blockIdx.y == 0 && c < C) inv_c[c] = 1.0f / s;
    } else if (ROWS && threadIdx.x < 2 * kTile) {
        const int i = threadIdx.x - kTile;
        const long long r = r0 + i;
        const float s = r < R ? ms_fp8_scale(__uint_as_float(rbits[r]), e5, pow2) : 1.f;
        rs[i] = s;
        if (inv_r && blockIdx.x == 0 && r < R) inv_r[r] = 1.0f / s;
    }
    __syncthreads();
    const int tr = threadIdx.x >> 2, tc = (threadIdx.x & 3) * 16;
    const long long r = r0 + tr, c = c0 + tc;
    const bool full = al && r0 + kTile <= R && c0 + kTile <= C && (C % 16) == 0;
    union {
        uint4 u;
        uint8_t b[16];
    } pk;
    uint8_t v[16];   // the column-scaled bytes, for the transposed copy
    const float sr = ROWS ? rs[tr] : 0.f;
    if (full) {
        const int V = 16 / sizeof(T);
        const T *p = x + r * C + c;
#pragma unroll
        for (int j = 0; j < 16; j += V) {
            float f[V];
            load_v<float, T, V>(f, p + j);
#pragma unroll
            for (int k = 0; k < V; k++) {
                if (ROWS) pk.b[j + k] = to_fp8(__fmul_rn(f[k], sr), e5);
                v[j + k] = to_fp8(__fmul_rn(f[k], cs[tc + j + k]), e5);
            }
        }
        if (ROWS) *reinterpret_cast<uint4 *>(out + r * C + c) = pk.u;
    } else {
#pragma unroll
        for (int k = 0; k < 16; k++) {
            v[k] = 0;
            if (r < R && c + k < C) {
                const float f = (float)conv<T>::load(x[r * C + c + k]);
                if (ROWS) out[r * C + c + k] = to_fp8(__fmul_rn(f, sr), e5);
                v[k] = to_fp8(__fmul_rn(f, cs[tc + k]), e5);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 16; k++) tile[tr * kPitch + tc + k] = v[k];
    __syncthreads();
    const long long orow = c0 + tr, ocol = r0 + tc;
#pragma unroll
    for (int k = 0; k < 16; k++) pk.b[k] = tile[(tc + k) * kPitch + tr];
    if (full && (R % 16) == 0) {
        *reinterpret_cast<uint4 *>(out_t + orow * R + ocol) = pk.u;
    } else if (orow < C) {
#pragma unroll
        for (int k = 0; k < 16; k++)
            if (ocol + k < R) out_t[orow * R + ocol + k] = pk.b[k];
    }
}

bool fused_on();   // (below: MS_FLOAT8_FUSED)

// the amaxes' f32 bits (non-negative floats order as their bits; a NaN is
// 0x7fc00000, above every number) of a given amax vector, or NULL
static const unsigned int *amax_bits(const ms_tensor *a) {
    return a ? (const unsigned int *)ms_tensor_data(a) : nullptr;
}

// (ra, ca: the rows' and columns' amaxes given, each NULL unless the
// layout is asked: the kernels read them instead of finding x's own; a
// layout asked without one finds its own)
template <typename T>
int launch_axiswise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv_r, ms_tensor *inv_c, const ms_tensor *x,
                    const ms_tensor *ra, const ms_tensor *ca, bool e5, bool pow2, cudaStream_t st) {
    const long long R = x->sizes[0], C = x->sizes[1];
    const T *p = (const T *)ms_tensor_data(x);
    const bool given = ra || ca;
    if (out && out_t && R > 0 && C > 0 && (fused_on() || given)) {
        // both layouts: the maxima in one pass, the casts in another
        const long long tx = (C + kTile - 1) / kTile, ty = (R + kTile - 1) / kTile, ay = (R + kColRows - 1) / kColRows;
        if (tx > 0x7fffffffLL || ty > 65535 || ay > 65535)
            return ms_errorf("float8_cast_axiswise: (%lld, %lld) has too many rows for the kernels' grid (at most %d)",
                             R, C, 65535 * kTile);
        ms_tmp bits;
        const unsigned int *pr = amax_bits(ra), *pc = amax_bits(ca);
        if (!pr || !pc) {   // x's own where none is given: one pass for both, or the one missing
            int64_t nb = R + C;
            if (ms_tensor_empty(&bits.t, 1, &nb, MS_I32, x->device_id)) return -1;
            unsigned int *b = (unsigned int *)ms_tensor_data(bits.t);
            if (!pc) CUDA_CHECK(cudaMemsetAsync(b + R, 0, sizeof(unsigned int) * (size_t)C, st));
            if (!pr && !pc) {
                CUDA_CHECK(cudaMemsetAsync(b, 0, sizeof(unsigned int) * (size_t)R, st));
                rc_amax_kernel<T, true>
                    <<<dim3((unsigned)tx, (unsigned)ay), 256, 0, st>>>(p, R, C, b, b + R, ms_aligned16(p));
                LAUNCH_CHECK("rc_amax_kernel");
            } else if (!pc) {
                rc_amax_kernel<T, false>
                    <<<dim3((unsigned)tx, (unsigned)ay), 256, 0, st>>>(p, R, C, nullptr, b + R, ms_aligned16(p));
                LAUNCH_CHECK("rc_amax_kernel (columns)");
            } else {
                row_cast_kernel<T><<<(unsigned)((R + 7) / 8), 256, 0, st>>>(p, R, C, nullptr, nullptr, false, false,
                                                                          ms_aligned16(p), nullptr, b);
                LAUNCH_CHECK("row_cast_kernel (amax)");
            }
            if (!pr) pr = b;
            if (!pc) pc = b + R;
        }
        const bool al = ms_aligned16(p) && ms_aligned16(ms_tensor_data(out)) && ms_aligned16(ms_tensor_data(out_t));
        rc_cast_kernel<T, true><<<dim3((unsigned)tx, (unsigned)ty), 256, 0, st>>>(
            p, R, C, (uint8_t *)ms_tensor_data(out), (uint8_t *)ms_tensor_data(out_t),
            inv_r ? (float *)ms_tensor_data(inv_r) : nullptr, inv_c ? (float *)ms_tensor_data(inv_c) : nullptr, pr, pc,
            e5, pow2, al);
        LAUNCH_CHECK("rc_cast_kernel");
        return 0;
    }
    if (out && R > 0) {
        const bool al = ms_aligned16(p) && ms_aligned16(ms_tensor_data(out));
        const long long blocks = (R + 7) / 8;
        if (blocks > 0x7fffffffLL) return ms_errorf("float8_cast_axiswise: %lld rows are too many for the grid", R);
        row_cast_kernel<T><<<(unsigned)blocks, 256, 0, st>>>(p, R, C, (uint8_t *)ms_tensor_data(out),
                                                             inv_r ? (float *)ms_tensor_data(inv_r) : nullptr, e5,
                                                             pow2, al, amax_bits(ra), nullptr);
        LAUNCH_CHECK("row_cast_kernel");
    }
    if (out_t && C > 0) {
        const long long tx = (C + kTile - 1) / kTile, ty = (R + kTile - 1) / kTile, ay = (R + kColRows - 1) / kColRows;
        if (tx > 0x7fffffffLL || ty > 65535 || ay > 65535)
            return ms_errorf("float8_cast_axiswise: (%lld, %lld) has too many rows for the kernels' grid (at most %d)",
                             R, C, 65535 * kTile);
        ms_tmp bits;
        const unsigned int *pb = amax_bits(ca);
        const bool al = ms_aligned16(p) && ms_aligned16(ms_tensor_data(out_t));
        if (!pb) {
            int64_t nc = C;
            if (ms_tensor_empty(&bits.t, 1, &nc, MS_I32, x->device_id)) return -1;
            unsigned int *b = (unsigned int *)ms_tensor_data(bits.t);
            CUDA_CHECK(cudaMemsetAsync(b, 0, sizeof(unsigned int) * (size_t)C, st));
            if (R > 0) {
                rc_amax_kernel<T, false>
                    <<<dim3((unsigned)tx, (unsigned)ay), 256, 0, st>>>(p, R, C, nullptr, b, ms_aligned16(p));
                LAUNCH_CHECK("rc_amax_kernel (columns)");
            }
            pb = b;
        }
        rc_cast_kernel<T, false><<<dim3((unsigned)tx, (unsigned)(ty > 0 ? ty : 1)), 256, 0, st>>>(
            p, R, C, nullptr, (uint8_t *)ms_tensor_data(out_t), nullptr, inv_c ? (float *)ms_tensor_data(inv_c) : nullptr,
            nullptr, pb, e5, pow2, al);
        LAUNCH_CHECK("rc_cast_kernel (columns)");
    }
    return 0;
}

// ------------------------------------------------------------ blockwise
// DeepSeek-V3's scaling (core/ops.h ms_float8_cast_blockwise). One block of
// 256 threads a 128 x 128 tile of x, read once into registers: thread t
// holds an 8 x 8 square, rows 8 (t / 16) ... of columns 8 (t % 16) ...,
// read by 16-byte loads where x's rows allow (a half-warp reads a row's
// 128 columns) and kept as read (bf16 / f16: 32 registers, their |x| maxima
// taken two at a time on the 16-bit patterns) or as f32 (f32, f64: 64).
// The maxima, 1x128: a row's is its 16 threads' (a butterfly that leaves
// each pair of lanes one row's, so that each row's scale is computed once),
// a column's is its 16 threads' (the two half-warps by a shuffle, the
// eight warps through shared memory, 128 threads finishing a column each);
// 128x128: the tile's (the warps' through shared memory). The scales (an
// f64 division each) go through shared memory. Then out: a row's 8 bytes
// in one store (a half-warp writes a 128-byte line of out); out_t: a
// column's 8 bytes (the thread's 8 rows) into a shared byte tile, XOR-
// swizzled by 8-byte chunk so that neither these stores nor the 16-byte
// loads of out_t's rows meet a bank conflict, then 16-byte stores (8
// threads a 128-byte row of out_t). 1x128: out by the rows' scales, out_t
// by the columns' (x's 128 x 1 blocks: out_t's 1 x 128 along R); 128x128:
// both by the tile's, out_t's bytes being out's transposed in registers
// (byte permutes) rather than converted again. Edge tiles treat the
// missing elements as zero (|0| changes no max) and write nothing there;
// unaligned rows take the same steps element by element. x is read once,
// out and out_t written once: ~(sizeof(T) + 2) bytes an element. 2-byte x
// fits 4 blocks an SM (at most 64 registers a thread), f32 / f64 x 2.
const int kBlk = 128;

// the fp8 bytes of a (low byte) and b: the bits of two to_fp8 calls (the
// hardware converts in pairs)
template <bool E5>
__device__ __forceinline__ unsigned int to_fp8x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, E5 ? __NV_E5M2 : __NV_E4M3);
#else
    return ms_fp8_from_f32(a, E5, 1) | (unsigned int)ms_fp8_from_f32(b, E5, 1) << 8;
#endif
}

// the fp8 bytes of (a, b, c, d) * s, a in the low byte
template <bool E5>
__device__ __forceinline__ unsigned int fp8x4(float a, float b, float c, float d, float s) {
    return to_fp8x2<E5>(__fmul_rn(a, s), __fmul_rn(b, s)) | to_fp8x2<E5>(__fmul_rn(c, s), __fmul_rn(d, s)) << 16;
}

// a 16-bit float's pattern h as f32 (bf16: the high half; f16: converted,
// exactly; both order non-negative patterns as their values, NaN's above)
template <typename T> __device__ __forceinline__ float half_f32(unsigned int h);
template <> __device__ __forceinline__ float half_f32<__nv_bfloat16>(unsigned int h) { return __uint_as_float(h << 16); }
template <> __device__ __forceinline__ float half_f32<__half>(unsigned int h) {
    return __half2float(__ushort_as_half((unsigned short)h));
}

// A thread's 8 x 8 square of x (row i: 8 consecutive columns k) as the
// kernel keeps it between the read and the casts. Its |x| maxima are f32
// bits (non-negative floats order as their bits; a NaN's are above
// infinity's, so a NaN wins): amax gives row i's in rowb[i] and keeps the
// columns' (over the square's 8 rows) for col_max4, which takes them over
// the two half-warps too (lanes l and l ^ 16: the warp's 16 rows) and
// returns columns 4 h ... 4 h + 3 (h = lane / 16).
template <typename T, bool Half = sizeof(T) == 2>
struct blk_square;

template <typename T>
struct blk_square<T, true> {
    unsigned int w[8][4];   // row i: columns 2k (low half) and 2k + 1 (high)
    unsigned int cp[4];     // the columns' maxima as 16-bit patterns, paired as in w
    __device__ __forceinline__ void zero(int i) {
#pragma unroll
        for (int k = 0; k < 4; k++) w[i][k] = 0;
    }
    __device__ __forceinline__ void load8(int i, const T *p) {
        const uint4 q = *reinterpret_cast<const uint4 *>(p);
        w[i][0] = q.x, w[i][1] = q.y, w[i][2] = q.z, w[i][3] = q.w;
    }
    __device__ __forceinline__ void load1(int i, int k, const T *p) {
        w[i][k >> 1] |= (unsigned int)*reinterpret_cast<const unsigned short *>(p) << (16 * (k & 1));
    }
    __device__ __forceinline__ float get(int i, int k) const {
        return half_f32<T>((k & 1) ? w[i][k >> 1] >> 16 : w[i][k >> 1] & 0xffffu);
    }
    // (two elements at once: the 16-bit patterns' max, |.| by the sign bits)
    __device__ __forceinline__ void amax(unsigned int rowb[8]) {
#pragma unroll
        for (int k = 0; k < 4; k++) cp[k] = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned int rp = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const unsigned int a = w[i][k] & 0x7fff7fffu;
                rp = __vmaxu2(rp, a);
                cp[k] = __vmaxu2(cp[k], a);
            }
            rowb[i] = __float_as_uint(half_f32<T>(max(rp & 0xffffu, rp >> 16)));
        }
    }
    __device__ __forceinline__ void col_max4(bool h, unsigned int cm[4]) const {
        const unsigned int a = __vmaxu2(h ? cp[2] : cp[0], __shfl_xor_sync(0xffffffffu, h ? cp[0] : cp[2], 16));
        const unsigned int b = __vmaxu2(h ? cp[3] : cp[1], __shfl_xor_sync(0xffffffffu, h ? cp[1] : cp[3], 16));
        cm[0] = __float_as_uint(half_f32<T>(a & 0xffffu)), cm[1] = __float_as_uint(half_f32<T>(a >> 16));
        cm[2] = __float_as_uint(half_f32<T>(b & 0xffffu)), cm[3] = __float_as_uint(half_f32<T>(b >> 16));
    }
};

template <typename T>
struct blk_square<T, false> {
    float f[8][8];          // (f64 rounded to f32 on the read, as the CPU reference does)
    unsigned int cb[8];     // the columns' maxima
    __device__ __forceinline__ void zero(int i) {
#pragma unroll
        for (int k = 0; k < 8; k++) f[i][k] = 0.f;
    }
    __device__ __forceinline__ void load8(int i, const T *p) {
        const int V = 16 / sizeof(T);
#pragma unroll
        for (int j = 0; j < 8; j += V) load_v<float, T, V>(&f[i][j], p + j);
    }
    __device__ __forceinline__ void load1(int i, int k, const T *p) { f[i][k] = (float)conv<T>::load(*p); }
    __device__ __forceinline__ float get(int i, int k) const { return f[i][k]; }
    __device__ __forceinline__ void amax(unsigned int rowb[8]) {
#pragma unroll
        for (int k = 0; k < 8; k++) cb[k] = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            rowb[i] = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const unsigned int b = __float_as_uint(fabsf(f[i][k]));
                rowb[i] = max(rowb[i], b);
                cb[k] = max(cb[k], b);
            }
        }
    }
    __device__ __forceinline__ void col_max4(bool h, unsigned int cm[4]) const {
#pragma unroll
        for (int j = 0; j < 4; j++)
            cm[j] = max(h ? cb[j + 4] : cb[j], __shfl_xor_sync(0xffffffffu, h ? cb[j] : cb[j + 4], 16));
    }
};

// the max of b[i] over the 16 lanes of a half-warp (lane bits 0-3: g), for
// each i: lane g ends with row i = g / 2's (each step a lane sends the half
// of its rows that its partner keeps: 8 shuffles, not 32)
__device__ __forceinline__ unsigned int blk_row_max(const unsigned int b[8], int g) {
    const bool h3 = g & 8, h2 = g & 4, h1 = g & 2;
    unsigned int v4[4], v2[2];
#pragma unroll
    for (int k = 0; k < 4; k++)   // v4[k]: row k + 4 h3
        v4[k] = max(h3 ? b[k + 4] : b[k], __shfl_xor_sync(0xffffffffu, h3 ? b[k] : b[k + 4], 8));
#pragma unroll
    for (int k = 0; k < 2; k++)   // v2[k]: row k + 2 h2 + 4 h3
        v2[k] = max(h2 ? v4[k + 2] : v4[k], __shfl_xor_sync(0xffffffffu, h2 ? v4[k] : v4[k + 2], 4));
    const unsigned int v = max(h1 ? v2[1] : v2[0], __shfl_xor_sync(0xffffffffu, h1 ? v2[0] : v2[1], 2));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 1));
}

// a[i]'s byte k (row i, column k of a 4 x 4 byte square) to b[k]'s byte i
__device__ __forceinline__ void blk_transpose4(const unsigned int a[4], unsigned int b[4]) {
    const unsigned int t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
    const unsigned int t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
    b[0] = __byte_perm(t0, t2, 0x5410), b[1] = __byte_perm(t0, t2, 0x7632);
    b[2] = __byte_perm(t1, t3, 0x5410), b[3] = __byte_perm(t1, t3, 0x7632);
}

// the shared byte tile: byte (j, i) = out_t's row c0 + j, column r0 + i,
// at j * 128 + 8 ((i / 8) ^ (j / 8)) + i % 8
__device__ __forceinline__ int blk_swz(int j, int chunk) { return j * kBlk + 8 * (chunk ^ (j >> 3)); }

template <typename T, bool E5>
__global__ void __launch_bounds__(256, sizeof(T) == 2 ? 4 : 2)
    blk_cast_kernel(const T *__restrict__ x, long long R, long long C, uint8_t *__restrict__ out,
                    uint8_t *__restrict__ out_t, float *__restrict__ inv, float *__restrict__ inv_t, bool tile,
                    bool pow2, bool vx, bool vo, bool vt) {
    __shared__ __align__(16) uint8_t bytes[kBlk * kBlk];
    __shared__ __align__(16) unsigned int colred[8][kBlk];
    __shared__ __align__(16) float rowsc[kBlk];
    __shared__ __align__(16) float colsc[kBlk];
    __shared__ unsigned int tilered[8];
    __shared__ float tilesc;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, s = t >> 4, g = t & 15;
    const long long r0 = (long long)blockIdx.y * kBlk, c0 = (long long)blockIdx.x * kBlk;
    const long long rs = r0 + 8 * s, c = c0 + 8 * g;   // the square's first row and column
    // its rows and columns inside x (0 ... 8; vx: C % 8 == 0, so nc is 0 or 8)
    const int nr = (int)max(min(R - rs, 8LL), 0LL), nc = (int)max(min(C - c, 8LL), 0LL);
    blk_square<T> v;
    const T *p = x + rs * C + c;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v.zero(i);
        if (i < nr) {
            if (vx) {
                if (nc > 0) v.load8(i, p + i * C);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++)
                    if (k < nc) v.load1(i, k, p + i * C + k);
            }
        }
    }
    unsigned int rowb[8];
    v.amax(rowb);
    if (tile) {
        unsigned int m = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) m = max(m, rowb[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) tilered[warp] = m;
    } else {
        if (out_t) {   // columns 8 g + 4 h ... + 3 over the warp's 16 rows
            const bool h = lane >> 4;
            unsigned int cm[4];
            v.col_max4(h, cm);
            *reinterpret_cast<uint4 *>(&colred[warp][8 * g + 4 * h]) = make_uint4(cm[0], cm[1], cm[2], cm[3]);
        }
        if (out) {   // row 8 s + g / 2's scale, by the even lanes
            const unsigned int m = blk_row_max(rowb, g);
            const int rl = 8 * s + (g >> 1);
            if (!(g & 1)) {
                const float sc = ms_fp8_scale(__uint_as_float(m), E5, pow2);
                rowsc[rl] = sc;
                if (inv && r0 + rl < R) inv[blockIdx.x * R + r0 + rl] = 1.0f / sc;
            }
        }
    }
    __syncthreads();
    if (tile) {
        if (t == 0) {
            unsigned int m = 0;
#pragma unroll
            for (int w = 0; w < 8; w++) m = max(m, tilered[w]);
            const float sc = ms_fp8_scale(__uint_as_float(m), E5, pow2);
            tilesc = sc;
            const long long ld = ((C + kBlk - 1) / kBlk + 3) / 4 * 4, ld_t = ((R + kBlk - 1) / kBlk + 3) / 4 * 4;
            if (inv) inv[blockIdx.y * ld + blockIdx.x] = 1.0f / sc;
            if (inv_t) inv_t[blockIdx.x * ld_t + blockIdx.y] = 1.0f / sc;
        }
    } else if (out_t && t < kBlk) {   // column t's scale
        unsigned int m = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) m = max(m, colred[w][t]);
        const float sc = ms_fp8_scale(__uint_as_float(m), E5, pow2);
        colsc[t] = sc;
        if (inv_t && c0 + t < C) inv_t[blockIdx.y * C + c0 + t] = 1.0f / sc;
    }
    __syncthreads();
    // out's row rs + i, columns c ... c + 7: bytes w0 (the first 4), w1
    auto store_row = [&](int i, unsigned int w0, unsigned int w1) {
        if (i >= nr) return;
        uint8_t *o = out + (rs + i) * C + c;
        if (vo) {
            if (nc > 0) *reinterpret_cast<uint2 *>(o) = make_uint2(w0, w1);
        } else {
#pragma unroll 1
            for (int k = 0; k < nc; k++) o[k] = (uint8_t)((k < 4 ? w0 : w1) >> (8 * (k & 3)));
        }
    };
    if (tile && out) {
        const float sc = tilesc;
        unsigned int rp[8][2], cp[8][2];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            rp[i][0] = fp8x4<E5>(v.get(i, 0), v.get(i, 1), v.get(i, 2), v.get(i, 3), sc);
            rp[i][1] = fp8x4<E5>(v.get(i, 4), v.get(i, 5), v.get(i, 6), v.get(i, 7), sc);
            store_row(i, rp[i][0], rp[i][1]);
        }
        if (!out_t) return;
#pragma unroll
        for (int a = 0; a < 2; a++)   // rows 4 a ..., columns 4 b ...
#pragma unroll
            for (int b = 0; b < 2; b++) {
                const unsigned int in[4] = {rp[4 * a][b], rp[4 * a + 1][b], rp[4 * a + 2][b], rp[4 * a + 3][b]};
                unsigned int o4[4];
                blk_transpose4(in, o4);
#pragma unroll
                for (int k = 0; k < 4; k++) cp[4 * b + k][a] = o4[k];
            }
#pragma unroll
        for (int k = 0; k < 8; k++)
            *reinterpret_cast<uint2 *>(bytes + blk_swz(8 * g + k, s)) = make_uint2(cp[k][0], cp[k][1]);
    } else {
        if (out) {
            const float4 a = *reinterpret_cast<const float4 *>(&rowsc[8 * s]);
            const float4 b = *reinterpret_cast<const float4 *>(&rowsc[8 * s + 4]);
            const float sr[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 8; i++)
                store_row(i, fp8x4<E5>(v.get(i, 0), v.get(i, 1), v.get(i, 2), v.get(i, 3), sr[i]),
                          fp8x4<E5>(v.get(i, 4), v.get(i, 5), v.get(i, 6), v.get(i, 7), sr[i]));
        }
        if (!out_t) return;
        float scol[8];
        if (tile) {
#pragma unroll
            for (int k = 0; k < 8; k++) scol[k] = tilesc;
        } else {
            const float4 a = *reinterpret_cast<const float4 *>(&colsc[8 * g]);
            const float4 b = *reinterpret_cast<const float4 *>(&colsc[8 * g + 4]);
            scol[0] = a.x, scol[1] = a.y, scol[2] = a.z, scol[3] = a.w;
            scol[4] = b.x, scol[5] = b.y, scol[6] = b.z, scol[7] = b.w;
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const unsigned int w0 = fp8x4<E5>(v.get(0, k), v.get(1, k), v.get(2, k), v.get(3, k), scol[k]);
            const unsigned int w1 = fp8x4<E5>(v.get(4, k), v.get(5, k), v.get(6, k), v.get(7, k), scol[k]);
            *reinterpret_cast<uint2 *>(bytes + blk_swz(8 * g + k, s)) = make_uint2(w0, w1);
        }
    }
    __syncthreads();
    // out_t's row c0 + j, columns r0 + 16 q ... + 15 (chunks 2 q, 2 q + 1:
    // one 16-byte unit of the tile, its halves swapped when j / 8 is odd)
#pragma unroll
    for (int pass = 0; pass < 4; pass++) {
        const int j = 32 * pass + (t >> 3), q = t & 7;
        if (c0 + j >= C) break;
        uint4 u = *reinterpret_cast<const uint4 *>(bytes + j * kBlk + 16 * (q ^ (j >> 4)));
        if ((j >> 3) & 1) u = make_uint4(u.z, u.w, u.x, u.y);
        const long long rq = r0 + 16 * q;
        uint8_t *d = out_t + (c0 + j) * R + rq;
        if (vt) {   // (R % 16 == 0: the 16 columns are all in or all out)
            if (rq < R) *reinterpret_cast<uint4 *>(d) = u;
        } else {
            const int n = (int)max(min(R - rq, 16LL), 0LL);
#pragma unroll 1
            for (int b = 0; b < n; b++) d[b] = (uint8_t)((b < 8 ? (b < 4 ? u.x : u.y) : (b < 12 ? u.z : u.w)) >> (8 * (b & 3)));
        }
    }
}

template <typename T>
int launch_amax(ms_tensor *out, const ms_tensor *x, cudaStream_t st) {
    const long long n = ms_tensor_numel(x);
    const T *p = (const T *)ms_tensor_data(x);
    const bool vec = ms_aligned16(p);
    const long long V = 16 / sizeof(T);
    long long blocks = ((vec ? n / V : n) + 255) / 256;
    const long long cap = (long long)ms_sm_count(x->device_id) * 8;
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    amax_kernel<T><<<(int)blocks, 256, 0, st>>>(p, n, vec, (unsigned int *)ms_tensor_data(out));
    LAUNCH_CHECK("amax_kernel");
    return 0;
}

template <typename T>
int launch_cast(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, const ms_tensor *x, const ms_tensor *amax,
                bool e5, bool pow2, cudaStream_t st) {
    const long long R = x->sizes[0], C = x->sizes[1];
    if (R == 0 || C == 0) {   // no tile to run, but the scale is still wanted
        if (inv) {
            dim3 one(1, 1);
            cast_kernel<T><<<one, 256, 0, st>>>(nullptr, 0, 0, nullptr, nullptr, (float *)ms_tensor_data(inv),
                                                (const float *)ms_tensor_data(amax), e5, pow2, false);
            LAUNCH_CHECK("cast_kernel");
        }
        return 0;
    }
    if ((C + kTile - 1) / kTile > 0x7fffffffLL || (R + kTile - 1) / kTile > 65535)
        return ms_errorf("float8_cast: (%lld, %lld) has too many rows for the kernel's grid (at most %d)", R, C,
                         65535 * kTile);
    dim3 grid((unsigned)((C + kTile - 1) / kTile), (unsigned)((R + kTile - 1) / kTile));
    const T *p = (const T *)ms_tensor_data(x);
    // the 16-byte path needs every base aligned (rows then are: its tiles ask C % 16 == 0)
    const bool al = ms_aligned16(p) && (!out || ms_aligned16(ms_tensor_data(out))) &&
                    (!out_t || ms_aligned16(ms_tensor_data(out_t)));
    cast_kernel<T><<<grid, 256, 0, st>>>(p, R, C, out ? (uint8_t *)ms_tensor_data(out) : nullptr,
                                         out_t ? (uint8_t *)ms_tensor_data(out_t) : nullptr,
                                         inv ? (float *)ms_tensor_data(inv) : nullptr,
                                         (const float *)ms_tensor_data(amax), e5, pow2, al);
    LAUNCH_CHECK("cast_kernel");
    return 0;
}

template <typename T>
int launch_blockwise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *inv_t, const ms_tensor *x,
                     bool tile, bool e5, bool pow2, cudaStream_t st) {
    const long long R = x->sizes[0], C = x->sizes[1];
    // (128x128: the scales' padding columns, which no tile writes)
    if (tile && inv) CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(inv), 0, sizeof(float) * (size_t)ms_tensor_numel(inv), st));
    if (tile && inv_t)
        CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(inv_t), 0, sizeof(float) * (size_t)ms_tensor_numel(inv_t), st));
    if (R == 0 || C == 0) return 0;
    const long long gx = (C + kBlk - 1) / kBlk, gy = (R + kBlk - 1) / kBlk;
    if (gx > 0x7fffffffLL || gy > 65535)
        return ms_errorf("float8_cast_blockwise: (%lld, %lld) has too many rows for the kernel's grid (at most %d)", R,
                         C, 65535 * kBlk);
    const T *p = (const T *)ms_tensor_data(x);
    uint8_t *o = out ? (uint8_t *)ms_tensor_data(out) : nullptr, *ot = out_t ? (uint8_t *)ms_tensor_data(out_t) : nullptr;
    float *iv = inv ? (float *)ms_tensor_data(inv) : nullptr, *ivt = inv_t ? (float *)ms_tensor_data(inv_t) : nullptr;
    // the vector paths: x's rows in 16-byte loads of 8 elements, out's in
    // 8-byte stores, out_t's in 16-byte ones (every row start aligned)
    const bool vx = ms_aligned16(p) && C % 8 == 0;
    const bool vo = o && ((uintptr_t)o & 7) == 0 && C % 8 == 0;
    const bool vt = ot && ms_aligned16(ot) && R % 16 == 0;
    const dim3 grid((unsigned)gx, (unsigned)gy);
    if (e5)
        blk_cast_kernel<T, true><<<grid, 256, 0, st>>>(p, R, C, o, ot, iv, ivt, tile, pow2, vx, vo, vt);
    else
        blk_cast_kernel<T, false><<<grid, 256, 0, st>>>(p, R, C, o, ot, iv, ivt, tile, pow2, vx, vo, vt);
    LAUNCH_CHECK("blk_cast_kernel");
    return 0;
}

// blocks a device keeps resident of amax_cast_kernel<T> (cached per device and T)
template <typename T>
int resident_blocks(int dev, int *blocks) {
    static int cache[64];
    if (dev >= 0 && dev < 64 && cache[dev] > 0) {
        *blocks = cache[dev];
        return 0;
    }
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, amax_cast_kernel<T>, 256, 0));
    int b = per_sm * ms_sm_count(dev);
    if (b < 1) return ms_errorf("float8_cast: the fused amax + cast kernel fits no block on cuda:%d", dev);
    if (dev >= 0 && dev < 64) cache[dev] = b;
    *blocks = b;
    return 0;
}

template <typename T>
int launch_amax_cast(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *amax, const ms_tensor *x, bool e5,
                     bool pow2, cudaStream_t st) {
    long long R = x->sizes[0], C = x->sizes[1];
    const int dev = x->device_id;
    int cap = 0;
    if (resident_blocks<T>(dev, &cap)) return -1;
    // enough blocks for the tiles and the walk, at most the resident ones
    const long long tiles = ((R + kTile - 1) / kTile) * ((C + kTile - 1) / kTile);
    long long want = tiles > (R * C + 4095) / 4096 ? tiles : (R * C + 4095) / 4096;
    int blocks = (int)(want < cap ? (want < 1 ? 1 : want) : cap);
    ms_tmp part;
    int64_t np = blocks;
    if (ms_tensor_empty(&part.t, 1, &np, MS_I32, dev)) return -1;
    const T *p = (const T *)ms_tensor_data(x);
    bool al = ms_aligned16(p) && (!out || ms_aligned16(ms_tensor_data(out))) &&
              (!out_t || ms_aligned16(ms_tensor_data(out_t)));
    uint8_t *po = out ? (uint8_t *)ms_tensor_data(out) : nullptr;
    uint8_t *pt = out_t ? (uint8_t *)ms_tensor_data(out_t) : nullptr;
    float *pi = inv ? (float *)ms_tensor_data(inv) : nullptr;
    float *pa = amax ? (float *)ms_tensor_data(amax) : nullptr;
    unsigned int *pp = (unsigned int *)ms_tensor_data(part.t);
    void *args[] = {(void *)&p, (void *)&R, (void *)&C, (void *)&po, (void *)&pt, (void *)&pi, (void *)&pa,
                    (void *)&pp, (void *)&e5, (void *)&pow2, (void *)&al};
    CUDA_CHECK(cudaLaunchCooperativeKernel((const void *)amax_cast_kernel<T>, dim3(blocks), dim3(256), args, 0, st));
    LAUNCH_CHECK("amax_cast_kernel");
    return 0;
}

// 0: amax, then the cast (two kernels and a memset; MS_FLOAT8_FUSED=0 or
// ms_cuda_float8_set_fused(0)), 1: one cooperative kernel (the default)
int g_fused = -1;
bool fused_on() {
    if (g_fused < 0) {
        const char *e = getenv("MS_FLOAT8_FUSED");
        g_fused = !(e && e[0] == '0');
    }
    return g_fused != 0;
}


// ------------------------------------------------ blockwise pieces (FSDP)
// A flat piece x (n) of a row-major (R, C) weight, its elements [offset,
// offset + n): an FSDP shard's part of a blockwise weight, cut at any
// element. A warp takes 16 rows of one 128-column block (lane l columns
// l, l + 32, l + 64, l + 96 of it: each load a warp's 32 consecutive
// elements), skipping what is outside the piece: blk_piece_amax_kernel
// folds their |x| into the block's maximum (f32 bits: a NaN's are above
// infinity's, so it wins; one atomicMax a warp into the grid, zeroed
// first), blk_piece_cast_kernel casts them with the block's scale. The
// rounding is the blockwise cast's (fp8x4's __fmul_rn then the
// conversion), so the bytes are those of blk_cast_kernel on the whole
// weight when the scales are. Bytes: the piece read once (and one byte an
// element written by the cast); once a step, on 1/W of the weights.
const int kPieceRows = 16;

// item (rg, cb) of a piece, a warp's: the max of |x| over the piece's
// elements in it, as f32 bits, in every lane (the warp's lanes all call it)
template <typename T>
__device__ __forceinline__ unsigned int piece_item_amax(const T *__restrict__ x, long long n, long long C,
                                                        long long offset, long long rg, long long cb) {
    const int lane = threadIdx.x & 31;
    const long long end = offset + n;
    unsigned int m = 0;
    for (int rr = 0; rr < kPieceRows; rr++) {
        const long long re = (rg * kPieceRows + rr) * C;   // the row's first element
        if (re >= end) break;
        if (re + C <= offset) continue;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            const long long j = cb * kBlk + lane + 32 * t, e = re + j;
            if (j < C && e >= offset && e < end) {
                const float a = fabsf((float)conv<T>::load(x[e - offset]));
                m = max(m, a != a ? 0x7fc00000u : __float_as_uint(a));
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

// item (rg, cb) of a piece, a warp's: its elements cast with the block's
// scale sc into out (the piece's bytes)
template <typename T, bool E5>
__device__ __forceinline__ void piece_item_cast(const T *__restrict__ x, long long n, long long C, long long offset,
                                                long long rg, long long cb, float sc, uint8_t *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long end = offset + n;
    for (int rr = 0; rr < kPieceRows; rr++) {
        const long long re = (rg * kPieceRows + rr) * C;
        if (re >= end) break;
        if (re + C <= offset) continue;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            const long long j = cb * kBlk + lane + 32 * t, e = re + j;
            if (j < C && e >= offset && e < end)
                out[e - offset] = to_fp8(__fmul_rn((float)conv<T>::load(x[e - offset]), sc), E5);
        }
    }
}

template <typename T>
__global__ void blk_piece_amax_kernel(const T *__restrict__ x, long long n, long long C, long long offset,
                                      long long g0, long long items, long long nbc, unsigned int *__restrict__ out) {
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= items) return;   // (a whole warp: w is the warp's)
    const long long rg = g0 + w / nbc, cb = w % nbc;
    const unsigned int m = piece_item_amax<T>(x, n, C, offset, rg, cb);
    if ((threadIdx.x & 31) == 0 && m) atomicMax(out + (rg * kPieceRows / kBlk) * nbc + cb, m);
}

template <typename T, bool E5>
__global__ void blk_piece_cast_kernel(const T *__restrict__ x, long long n, long long C, long long offset,
                                      long long g0, long long items, long long nbc, const float *__restrict__ scale,
                                      uint8_t *__restrict__ out) {
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= items) return;
    const long long rg = g0 + w / nbc, cb = w % nbc;
    piece_item_cast<T, E5>(x, n, C, offset, rg, cb, scale[(rg * kPieceRows / kBlk) * nbc + cb], out);
}

// scale[b] = ms_fp8_scale(amax[b]), inv / inv_t = 1 / scale at (rb, cb) and
// (cb, rb) of their padded grids (zeroed first), a thread a block
__global__ void blk_scales_kernel(const float *__restrict__ amax, long long nbr, long long nbc, float *__restrict__ scale,
                                  float *__restrict__ inv, float *__restrict__ inv_t, bool e5, bool pow2) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nbr * nbc) return;
    const long long rb = b / nbc, cb = b % nbc;
    const float sc = ms_fp8_scale(amax[b], e5, pow2);
    if (scale) scale[b] = sc;
    if (inv) inv[rb * ((nbc + 3) / 4 * 4) + cb] = 1.0f / sc;
    if (inv_t) inv_t[cb * ((nbr + 3) / 4 * 4) + rb] = 1.0f / sc;
}

// the warps of a piece: the 16-row groups from the piece's first row to
// its last, times the column blocks (g0: the first group); false when the
// grid would be too large
bool piece_grid(long long n, long long C, long long offset, long long *g0, long long *items, long long *blocks) {
    const long long nbc = (C + kBlk - 1) / kBlk;
    *g0 = offset / C / kPieceRows;
    const long long g1 = (offset + n - 1) / C / kPieceRows;
    *items = (g1 - *g0 + 1) * nbc;
    *blocks = (*items * 32 + 255) / 256;
    return *blocks <= 0x7fffffffLL;
}

template <typename T>
int launch_piece(ms_tensor *amax, ms_tensor *out, const ms_tensor *x, const ms_tensor *scale, long long R, long long C,
                 long long offset, bool e5, cudaStream_t st) {
    const char *op = amax ? "float8_amax_blockwise_piece" : "float8_cast_blockwise_piece";
    const long long n = x->sizes[0], nbc = (C + kBlk - 1) / kBlk;
    if (amax) CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(amax), 0, sizeof(float) * (size_t)(((R + kBlk - 1) / kBlk) * nbc), st));
    if (n == 0) return 0;
    long long g0, items, blocks;
    if (!piece_grid(n, C, offset, &g0, &items, &blocks))
        return ms_errorf("%s: a (%lld) piece of a (%lld, %lld) matrix needs too many blocks for the grid", op, n, R, C);
    const T *p = (const T *)ms_tensor_data(x);
    if (amax) {
        blk_piece_amax_kernel<T><<<(unsigned)blocks, 256, 0, st>>>(p, n, C, offset, g0, items, nbc,
                                                                   (unsigned int *)ms_tensor_data(amax));
        LAUNCH_CHECK("blk_piece_amax_kernel");
    } else {
        const float *s = (const float *)ms_tensor_data(scale);
        uint8_t *o = (uint8_t *)ms_tensor_data(out);
        if (e5) blk_piece_cast_kernel<T, true><<<(unsigned)blocks, 256, 0, st>>>(p, n, C, offset, g0, items, nbc, s, o);
        else blk_piece_cast_kernel<T, false><<<(unsigned)blocks, 256, 0, st>>>(p, n, C, offset, g0, items, nbc, s, o);
        LAUNCH_CHECK("blk_piece_cast_kernel");
    }
    return 0;
}

// ------------------------------------- many blockwise pieces (FSDP)
// The per-piece kernels' work for up to kManyMax pieces a launch (FSDP's
// precompute: every blockwise weight of a model at once, instead of three
// launches a weight). The table travels as the kernel's parameter (8 KB;
// CUDA 12.1+ takes up to 32 KB on Volta and later); the items of the pieces
// are numbered in turn (core/f8many.h, which the CPU walks the same way),
// and a warp finds its piece by binary search over their first items, then
// does what the per-piece kernel's warp does for that item.
const int kManyMax = 128;

struct piece_many_args {
    const void *x[kManyMax];
    void *out[kManyMax];            // amax: the piece's grid (f32 bits); cast: its f8 bytes
    const float *scale[kManyMax];   // cast: the grid of scales
    int64_t n[kManyMax], C[kManyMax], offset[kManyMax], g0[kManyMax];
    int64_t first[kManyMax + 1];    // piece i's first item; first[count]: the items
    int count;
};

// MODE 0: block maxima (atomicMax into the zeroed grids); 1: cast to
// e4m3; 2: cast to e5m2
template <typename T, int MODE>
__global__ void blk_piece_many_kernel(const __grid_constant__ piece_many_args a) {
    const int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= a.first[a.count]) return;   // (a whole warp)
    const int i = ms_f8p_find(a.first, a.count, w);
    const long long item = w - a.first[i], C = a.C[i], nbc = (C + kBlk - 1) / kBlk;
    const long long rg = a.g0[i] + item / nbc, cb = item % nbc, blk = (rg * kPieceRows / kBlk) * nbc + cb;
    const T *x = (const T *)a.x[i];
    if (MODE == 0) {
        const unsigned int m = piece_item_amax<T>(x, a.n[i], C, a.offset[i], rg, cb);
        if ((threadIdx.x & 31) == 0 && m) atomicMax((unsigned int *)a.out[i] + blk, m);
    } else {
        piece_item_cast<T, MODE == 2>(x, a.n[i], C, a.offset[i], rg, cb, a.scale[i][blk], (uint8_t *)a.out[i]);
    }
}

// the launches over the pieces whose x is of dtype dt (T), kManyMax a
// launch: mode 0 amax (outs the grids), 1 / 2 the casts (outs the bytes)
template <typename T>
int launch_piece_many(ms_tensor **outs, ms_tensor **x, ms_tensor **scale, const int64_t *geom, int n, int dt,
                      int mode, cudaStream_t st) {
    piece_many_args a;
    int i = 0;
    while (i < n) {
        a.count = 0;
        int64_t items = 0;
        for (; i < n && a.count < kManyMax; i++) {
            if (!x[i] || x[i]->dtype_id != dt || x[i]->sizes[0] == 0) continue;
            const int k = a.count;
            int64_t g0;
            const int64_t m = ms_f8p_items(x[i]->sizes[0], geom[3 * i + 1], geom[3 * i + 2], &g0);
            a.x[k] = ms_tensor_data(x[i]);
            a.out[k] = ms_tensor_data(outs[i]);
            a.scale[k] = mode ? (const float *)ms_tensor_data(scale[i]) : nullptr;
            a.n[k] = x[i]->sizes[0];
            a.C[k] = geom[3 * i + 1];
            a.offset[k] = geom[3 * i + 2];
            a.g0[k] = g0;
            a.first[k] = items;
            items += m;
            a.count++;
        }
        if (a.count == 0) continue;
        a.first[a.count] = items;
        const long long blocks = (items * 32 + 255) / 256;
        if (blocks > 0x7fffffffLL)
            return ms_errorf("float8_%s_blockwise_many: %lld work items in one launch", mode ? "cast" : "amax",
                             (long long)items);
        if (mode == 0) blk_piece_many_kernel<T, 0><<<(unsigned)blocks, 256, 0, st>>>(a);
        else if (mode == 1) blk_piece_many_kernel<T, 1><<<(unsigned)blocks, 256, 0, st>>>(a);
        else blk_piece_many_kernel<T, 2><<<(unsigned)blocks, 256, 0, st>>>(a);
        LAUNCH_CHECK("blk_piece_many_kernel");
    }
    return 0;
}

// every x dtype's launches (one dtype in practice: the gather source's)
int piece_many(ms_tensor **outs, ms_tensor **x, ms_tensor **scale, const int64_t *geom, int n, int mode, int dev) {
    if (!x) return 0;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const int dts[4] = {MS_F64, MS_F32, MS_BF16, MS_F16};
    for (int d = 0; d < 4; d++) {
        int rc = 0;
        switch (dts[d]) {
        case MS_F64: rc = launch_piece_many<double>(outs, x, scale, geom, n, dts[d], mode, st); break;
        case MS_F32: rc = launch_piece_many<float>(outs, x, scale, geom, n, dts[d], mode, st); break;
        case MS_BF16: rc = launch_piece_many<__nv_bfloat16>(outs, x, scale, geom, n, dts[d], mode, st); break;
        case MS_F16: rc = launch_piece_many<__half>(outs, x, scale, geom, n, dts[d], mode, st); break;
        }
        if (rc) return rc;
    }
    return 0;
}

struct byte_run {
    char *p;
    size_t n;
};

int byte_run_cmp(const void *a, const void *b) {
    const char *x = ((const byte_run *)a)->p, *y = ((const byte_run *)b)->p;
    return x < y ? -1 : x > y ? 1 : 0;
}

// the n f32 tensors t[i] zeroed on st, one memset a run of adjacent ones
int zero_runs(ms_tensor **t, int n, cudaStream_t st, const char *op) {
    byte_run *runs = (byte_run *)malloc(sizeof(byte_run) * (size_t)(n > 0 ? n : 1));
    if (!runs) return ms_errorf("%s: out of host memory", op);
    int nr = 0;
    for (int i = 0; i < n; i++) {
        const size_t b = sizeof(float) * (size_t)ms_tensor_numel(t[i]);
        if (b) runs[nr++] = {(char *)ms_tensor_data(t[i]), b};
    }
    qsort(runs, (size_t)nr, sizeof *runs, byte_run_cmp);
    for (int r = 0; r < nr;) {
        char *p = runs[r].p, *e = p + runs[r].n;
        for (r++; r < nr && runs[r].p == e; r++) e += runs[r].n;
        const cudaError_t err = cudaMemsetAsync(p, 0, (size_t)(e - p), st);
        if (err != cudaSuccess) {
            free(runs);
            return ms_errorf("%s: cudaMemsetAsync: %s", op, cudaGetErrorString(err));
        }
    }
    free(runs);
    return 0;
}

struct scales_many_args {
    const float *amax[kManyMax];
    float *scale[kManyMax], *inv[kManyMax], *inv_t[kManyMax];
    int64_t nbr[kManyMax], nbc[kManyMax];
    int64_t first[kManyMax + 1];    // grid i's first slot (core/f8many.h ms_f8p_slots)
    int pow2[kManyMax];
    int count;
};

// a thread a slot: ms_f8p_scales_slot, the CPU's code
__global__ void blk_scales_many_kernel(const __grid_constant__ scales_many_args a, int e5) {
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= a.first[a.count]) return;
    const int i = ms_f8p_find(a.first, a.count, s);
    ms_f8p_scales_slot(a.amax[i], a.scale[i], a.inv[i], a.inv_t[i], a.nbr[i], a.nbc[i], s - a.first[i], e5, a.pow2[i]);
}

// ------------------------------------ many tensorwise pieces (FSDP)
// Every tensorwise weight's shard part in one launch (FSDP's precompute),
// instead of an amax and a cast (or two) a weight. The pieces are cut into
// chunks of kTwChunk elements, a block a chunk, numbered in turn (first[i]:
// piece i's first block); a block finds its piece by binary search, as
// blk_piece_many_kernel's warps do. amax: the chunk's max folded into the
// piece's amax by atomicMax (the f32 bits, zeroed first; NaN wins, as in
// amax_kernel); cast: the piece's scale from its amax (ms_fp8_scale, the
// per-weight cast_kernel's), 8 elements a thread a step, and the first
// block of the piece writes its inverse scale (a piece with no element but
// an inv wanted gets a block of its own for that). Max and the element-wise
// cast do not depend on the order: the bits of amax_kernel and cast_kernel.
const long long kTwChunk = 16384;

struct tw_many_args {
    const void *x[kManyMax];
    void *out[kManyMax];            // amax: the piece's amax (f32 bits); cast: its f8 bytes
    const float *amax[kManyMax];    // cast: the piece's amax
    float *inv[kManyMax];           // cast: its inverse scale (or nullptr)
    int64_t n[kManyMax];
    int64_t first[kManyMax + 1];    // piece i's first block; first[count]: the grid
    int pow2[kManyMax];
    int count;
};

template <typename T>
__global__ void tw_amax_many_kernel(const __grid_constant__ tw_many_args a) {
    __shared__ unsigned int red[32];
    const int i = ms_f8p_find(a.first, a.count, (int64_t)blockIdx.x);
    const long long s = ((long long)blockIdx.x - a.first[i]) * kTwChunk, len = min(a.n[i] - s, kTwChunk);
    const T *x = (const T *)a.x[i] + s;
    const unsigned int b = block_max(thread_amax_bits<T>(x, len, ((uintptr_t)x & 15) == 0, threadIdx.x, blockDim.x), red);
    if (threadIdx.x == 0 && b) atomicMax((unsigned int *)a.out[i], b);
}

template <typename T, bool E5>
__global__ void tw_cast_many_kernel(const __grid_constant__ tw_many_args a) {
    __shared__ float s_scale;
    const int i = ms_f8p_find(a.first, a.count, (int64_t)blockIdx.x);
    if (threadIdx.x == 0) {
        const float sc = ms_fp8_scale(*a.amax[i], E5, a.pow2[i]);
        s_scale = sc;
        if (a.inv[i] && (int64_t)blockIdx.x == a.first[i]) *a.inv[i] = 1.0f / sc;
    }
    __syncthreads();
    const float sc = s_scale;
    const long long s = ((long long)blockIdx.x - a.first[i]) * kTwChunk, len = min(a.n[i] - s, kTwChunk);
    if (len <= 0) return;   // (the inverse scale alone)
    const T *x = (const T *)a.x[i] + s;
    uint8_t *o = (uint8_t *)a.out[i] + s;
    long long j = 0;
    if (((uintptr_t)x & 15) == 0 && ((uintptr_t)o & 7) == 0) {   // 16-byte loads, 8-byte stores
        constexpr int V = 16 / sizeof(T) < 8 ? 16 / sizeof(T) : 8;
        for (j = 8 * (long long)threadIdx.x; j + 8 <= len; j += 8 * (long long)blockDim.x) {
            union {
                uint2 u;
                uint8_t b[8];
            } pk;
#pragma unroll
            for (int h = 0; h < 8; h += V) {
                float f[V];
                load_v<float, T, V>(f, x + j + h);
#pragma unroll
                for (int k = 0; k < V; k++) pk.b[h + k] = to_fp8(__fmul_rn(f[k], sc), E5);
            }
            *reinterpret_cast<uint2 *>(o + j) = pk.u;
        }
        // the one thread whose 8 run past the end takes what is left
        for (long long k = j; k < len && k < j + 8; k++) o[k] = to_fp8(__fmul_rn((float)conv<T>::load(x[k]), sc), E5);
    } else {
        for (j = threadIdx.x; j < len; j += blockDim.x) o[j] = to_fp8(__fmul_rn((float)conv<T>::load(x[j]), sc), E5);
    }
}

// the launches over the pieces whose x is of dtype dt (T; the pieces with
// no element go with the first dtype's launch: rest), kManyMax a launch:
// mode 0 amax, 1 / 2 the casts to e4m3 / e5m2
template <typename T>
int launch_tw_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax, const int *pow2, int n, int dt,
                   bool rest, int mode, cudaStream_t st) {
    tw_many_args a;
    int i = 0;
    while (i < n) {
        a.count = 0;
        int64_t blocks = 0;
        for (; i < n && a.count < kManyMax; i++) {
            const int64_t m = x && x[i] ? x[i]->sizes[0] : 0;
            if (m > 0 ? x[i]->dtype_id != dt : !(rest && mode && inv && inv[i])) continue;
            const int k = a.count;
            a.x[k] = m > 0 ? ms_tensor_data(x[i]) : nullptr;
            a.out[k] = mode == 0 ? ms_tensor_data(amax[i]) : m > 0 ? ms_tensor_data(out[i]) : nullptr;
            a.amax[k] = (const float *)ms_tensor_data(amax[i]);
            a.inv[k] = mode && inv && inv[i] ? (float *)ms_tensor_data(inv[i]) : nullptr;
            a.n[k] = m;
            a.pow2[k] = pow2 ? pow2[i] : 0;
            a.first[k] = blocks;
            blocks += m > 0 ? (m + kTwChunk - 1) / kTwChunk : 1;
            a.count++;
        }
        if (a.count == 0) continue;
        a.first[a.count] = blocks;
        if (blocks > 0x7fffffffLL)
            return ms_errorf("float8_%s_many: %lld blocks in one launch", mode ? "cast" : "amax", (long long)blocks);
        if (mode == 0) tw_amax_many_kernel<T><<<(unsigned)blocks, 256, 0, st>>>(a);
        else if (mode == 1) tw_cast_many_kernel<T, false><<<(unsigned)blocks, 256, 0, st>>>(a);
        else tw_cast_many_kernel<T, true><<<(unsigned)blocks, 256, 0, st>>>(a);
        LAUNCH_CHECK(mode ? "tw_cast_many_kernel" : "tw_amax_many_kernel");
    }
    return 0;
}

// every x dtype's launches (one in practice: the gather source's)
int tw_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax, const int *pow2, int n, int mode,
            int dev) {
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    int first_dt = -1;
    for (int i = 0; i < n && first_dt < 0; i++)
        if (x && x[i] && x[i]->sizes[0] > 0) first_dt = x[i]->dtype_id;
    if (first_dt < 0) first_dt = MS_F32;   // (no element at all: the inverse scales alone)
    const int dts[4] = {MS_F64, MS_F32, MS_BF16, MS_F16};
    for (int d = 0; d < 4; d++) {
        const bool rest = dts[d] == first_dt;
        int rc = 0;
        switch (dts[d]) {
        case MS_F64: rc = launch_tw_many<double>(out, inv, x, amax, pow2, n, dts[d], rest, mode, st); break;
        case MS_F32: rc = launch_tw_many<float>(out, inv, x, amax, pow2, n, dts[d], rest, mode, st); break;
        case MS_BF16: rc = launch_tw_many<__nv_bfloat16>(out, inv, x, amax, pow2, n, dts[d], rest, mode, st); break;
        case MS_F16: rc = launch_tw_many<__half>(out, inv, x, amax, pow2, n, dts[d], rest, mode, st); break;
        }
        if (rc) return rc;
    }
    return 0;
}

}  // namespace

extern "C" int ms_cuda_float8_set_fused(int on) {
    int old = fused_on() ? 1 : 0;
    if (on >= 0) g_fused = on != 0;
    return old;
}

// the cast of x with its own amax (written to amax when given): one
// cooperative kernel, or ms_cuda_amax then ms_cuda_float8_cast
extern "C" int ms_cuda_float8_cast_dyn(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *amax,
                                       const ms_tensor *x, int dtype, int pow2) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const bool e5 = dtype == MS_F8E5M2, p2 = pow2 != 0;
    if (!fused_on() || ms_tensor_numel(x) == 0) {
        ms_tmp a;
        ms_tensor *am = amax;
        if (!am) {
            if (ms_tensor_empty(&a.t, 0, nullptr, MS_F32, dev)) return -1;
            am = a.t;
        }
        if (ms_cuda_amax(am, x)) return -1;
        return ms_cuda_float8_cast(out, out_t, inv, x, am, dtype, pow2);
    }
    switch (x->dtype_id) {
    case MS_F64: return launch_amax_cast<double>(out, out_t, inv, amax, x, e5, p2, st);
    case MS_F32: return launch_amax_cast<float>(out, out_t, inv, amax, x, e5, p2, st);
    case MS_BF16: return launch_amax_cast<__nv_bfloat16>(out, out_t, inv, amax, x, e5, p2, st);
    case MS_F16: return launch_amax_cast<__half>(out, out_t, inv, amax, x, e5, p2, st);
    }
    return ms_errorf("float8_cast: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_amax(ms_tensor *out, const ms_tensor *x) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(out), 0, sizeof(float), st));
    if (ms_tensor_numel(x) == 0) return 0;
    switch (x->dtype_id) {
    case MS_F64: return launch_amax<double>(out, x, st);
    case MS_F32: return launch_amax<float>(out, x, st);
    case MS_BF16: return launch_amax<__nv_bfloat16>(out, x, st);
    case MS_F16: return launch_amax<__half>(out, x, st);
    }
    return ms_errorf("amax: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_float8_cast(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, const ms_tensor *x,
                                   const ms_tensor *amax, int dtype, int pow2) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const bool e5 = dtype == MS_F8E5M2, p2 = pow2 != 0;
    switch (x->dtype_id) {
    case MS_F64: return launch_cast<double>(out, out_t, inv, x, amax, e5, p2, st);
    case MS_F32: return launch_cast<float>(out, out_t, inv, x, amax, e5, p2, st);
    case MS_BF16: return launch_cast<__nv_bfloat16>(out, out_t, inv, x, amax, e5, p2, st);
    case MS_F16: return launch_cast<__half>(out, out_t, inv, x, amax, e5, p2, st);
    }
    return ms_errorf("float8_cast: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_float8_cast_axiswise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv_rows,
                                            ms_tensor *inv_cols, const ms_tensor *x, const ms_tensor *row_amax,
                                            const ms_tensor *col_amax, int dtype, int pow2) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const bool e5 = dtype == MS_F8E5M2, p2 = pow2 != 0;
    const ms_tensor *ra = row_amax, *ca = col_amax;
    switch (x->dtype_id) {
    case MS_F64: return launch_axiswise<double>(out, out_t, inv_rows, inv_cols, x, ra, ca, e5, p2, st);
    case MS_F32: return launch_axiswise<float>(out, out_t, inv_rows, inv_cols, x, ra, ca, e5, p2, st);
    case MS_BF16: return launch_axiswise<__nv_bfloat16>(out, out_t, inv_rows, inv_cols, x, ra, ca, e5, p2, st);
    case MS_F16: return launch_axiswise<__half>(out, out_t, inv_rows, inv_cols, x, ra, ca, e5, p2, st);
    }
    return ms_errorf("float8_cast_axiswise: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

// the rows' amaxes by the row kernel (a warp a row, nothing cast), the
// columns' (and the rows' with them) by rc_amax_kernel: f32 bits written
// into the f32 vectors
template <typename T>
int launch_amax_axiswise(ms_tensor *ra, ms_tensor *ca, const ms_tensor *x, cudaStream_t st) {
    const long long R = x->sizes[0], C = x->sizes[1];
    const T *p = (const T *)ms_tensor_data(x);
    unsigned int *pr = ra ? (unsigned int *)ms_tensor_data(ra) : nullptr;
    unsigned int *pc = ca ? (unsigned int *)ms_tensor_data(ca) : nullptr;
    if (pr && R > 0) CUDA_CHECK(cudaMemsetAsync(pr, 0, sizeof(unsigned int) * (size_t)R, st));
    if (pc && C > 0) CUDA_CHECK(cudaMemsetAsync(pc, 0, sizeof(unsigned int) * (size_t)C, st));
    if (R == 0 || C == 0) return 0;
    if (pc) {
        const long long tx = (C + kTile - 1) / kTile, ay = (R + kColRows - 1) / kColRows;
        if (tx > 0x7fffffffLL || ay > 65535)
            return ms_errorf("float8_amax_axiswise: (%lld, %lld) has too many rows for the kernel's grid (at most %d)",
                             R, C, 65535 * kColRows);
        if (pr) rc_amax_kernel<T, true><<<dim3((unsigned)tx, (unsigned)ay), 256, 0, st>>>(p, R, C, pr, pc, ms_aligned16(p));
        else rc_amax_kernel<T, false><<<dim3((unsigned)tx, (unsigned)ay), 256, 0, st>>>(p, R, C, nullptr, pc, ms_aligned16(p));
        LAUNCH_CHECK("rc_amax_kernel");
    } else if (pr) {
        const long long blocks = (R + 7) / 8;
        if (blocks > 0x7fffffffLL) return ms_errorf("float8_amax_axiswise: %lld rows are too many for the grid", R);
        row_cast_kernel<T><<<(unsigned)blocks, 256, 0, st>>>(p, R, C, nullptr, nullptr, false, false, ms_aligned16(p),
                                                             nullptr, pr);
        LAUNCH_CHECK("row_cast_kernel (amax)");
    }
    return 0;
}

extern "C" int ms_cuda_float8_amax_axiswise(ms_tensor *row_amax, ms_tensor *col_amax, const ms_tensor *x) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    switch (x->dtype_id) {
    case MS_F64: return launch_amax_axiswise<double>(row_amax, col_amax, x, st);
    case MS_F32: return launch_amax_axiswise<float>(row_amax, col_amax, x, st);
    case MS_BF16: return launch_amax_axiswise<__nv_bfloat16>(row_amax, col_amax, x, st);
    case MS_F16: return launch_amax_axiswise<__half>(row_amax, col_amax, x, st);
    }
    return ms_errorf("float8_amax_axiswise: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_float8_cast_blockwise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *inv_t,
                                             const ms_tensor *x, int blocks, int dtype, int pow2) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const bool e5 = dtype == MS_F8E5M2, p2 = pow2 != 0, tile = blocks == MS_FLOAT8_128X128;
    switch (x->dtype_id) {
    case MS_F64: return launch_blockwise<double>(out, out_t, inv, inv_t, x, tile, e5, p2, st);
    case MS_F32: return launch_blockwise<float>(out, out_t, inv, inv_t, x, tile, e5, p2, st);
    case MS_BF16: return launch_blockwise<__nv_bfloat16>(out, out_t, inv, inv_t, x, tile, e5, p2, st);
    case MS_F16: return launch_blockwise<__half>(out, out_t, inv, inv_t, x, tile, e5, p2, st);
    }
    return ms_errorf("float8_cast_blockwise: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

// out (C, R) = x (R, C) transposed, 8-bit elements, both contiguous
extern "C" int ms_cuda_transpose8(ms_tensor *out, const ms_tensor *x) {
    const int dev = x->device_id;
    const long long R = x->sizes[0], C = x->sizes[1];
    if (R == 0 || C == 0) return 0;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    if ((C + kTile - 1) / kTile > 0x7fffffffLL || (R + kTile - 1) / kTile > 65535)
        return ms_errorf("float8_transpose: (%lld, %lld) has too many rows for the kernel's grid (at most %d)", R, C,
                         65535 * kTile);
    const uint8_t *p = (const uint8_t *)ms_tensor_data(x);
    uint8_t *o = (uint8_t *)ms_tensor_data(out);
    dim3 grid((unsigned)((C + kTile - 1) / kTile), (unsigned)((R + kTile - 1) / kTile));
    transpose8_kernel<<<grid, 256, 0, st>>>(p, R, C, o, ms_aligned16(p) && ms_aligned16(o));
    LAUNCH_CHECK("transpose8_kernel");
    return 0;
}

extern "C" int ms_cuda_float8_amax_blockwise_piece(ms_tensor *out, const ms_tensor *x, long long R, long long C,
                                                   long long offset) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    switch (x->dtype_id) {
    case MS_F64: return launch_piece<double>(out, nullptr, x, nullptr, R, C, offset, false, st);
    case MS_F32: return launch_piece<float>(out, nullptr, x, nullptr, R, C, offset, false, st);
    case MS_BF16: return launch_piece<__nv_bfloat16>(out, nullptr, x, nullptr, R, C, offset, false, st);
    case MS_F16: return launch_piece<__half>(out, nullptr, x, nullptr, R, C, offset, false, st);
    }
    return ms_errorf("float8_amax_blockwise_piece: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_float8_cast_blockwise_piece(ms_tensor *out, const ms_tensor *x, const ms_tensor *scale,
                                                   long long R, long long C, long long offset, int dtype) {
    const int dev = x->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const bool e5 = dtype == MS_F8E5M2;
    switch (x->dtype_id) {
    case MS_F64: return launch_piece<double>(nullptr, out, x, scale, R, C, offset, e5, st);
    case MS_F32: return launch_piece<float>(nullptr, out, x, scale, R, C, offset, e5, st);
    case MS_BF16: return launch_piece<__nv_bfloat16>(nullptr, out, x, scale, R, C, offset, e5, st);
    case MS_F16: return launch_piece<__half>(nullptr, out, x, scale, R, C, offset, e5, st);
    }
    return ms_errorf("float8_cast_blockwise_piece: dtype %s is not supported by the kernel", ms_dtype_name(x->dtype_id));
}

extern "C" int ms_cuda_float8_scales_blockwise(ms_tensor *scale, ms_tensor *inv, ms_tensor *inv_t, const ms_tensor *amax,
                                               int dtype, int pow2) {
    const int dev = amax->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    const long long nbr = amax->sizes[0], nbc = amax->sizes[1];
    float *pi = inv ? (float *)ms_tensor_data(inv) : nullptr, *pt = inv_t ? (float *)ms_tensor_data(inv_t) : nullptr;
    if (pi) CUDA_CHECK(cudaMemsetAsync(pi, 0, sizeof(float) * (size_t)(nbr * ((nbc + 3) / 4 * 4)), st));
    if (pt) CUDA_CHECK(cudaMemsetAsync(pt, 0, sizeof(float) * (size_t)(nbc * ((nbr + 3) / 4 * 4)), st));
    if (nbr * nbc == 0) return 0;
    const long long blocks = (nbr * nbc + 255) / 256;
    if (blocks > 0x7fffffffLL) return ms_errorf("float8_scales_blockwise: a (%lld, %lld) grid is too large", nbr, nbc);
    blk_scales_kernel<<<(unsigned)blocks, 256, 0, st>>>((const float *)ms_tensor_data(amax), nbr, nbc,
                                                         scale ? (float *)ms_tensor_data(scale) : nullptr, pi, pt,
                                                         dtype == MS_F8E5M2, pow2 != 0);
    LAUNCH_CHECK("blk_scales_kernel");
    return 0;
}

// the grids zeroed (one memset a run of adjacent grids: FSDP's are one
// vector), then the pieces' maxima folded in
extern "C" int ms_cuda_float8_amax_blockwise_many(ms_tensor **amax, ms_tensor **x, const int64_t *geom, int n,
                                                  int dev) {
    if (ms_cuda_activate(dev)) return -1;
    if (zero_runs(amax, n, ms_cuda_stream_of(dev), "float8_amax_blockwise_many")) return -1;
    return piece_many(amax, x, nullptr, geom, n, 0, dev);
}

extern "C" int ms_cuda_float8_cast_blockwise_many(ms_tensor **out, ms_tensor **x, ms_tensor **scale,
                                                  const int64_t *geom, int n, int dtype, int dev) {
    return piece_many(out, x, scale, geom, n, dtype == MS_F8E5M2 ? 2 : 1, dev);
}

extern "C" int ms_cuda_float8_scales_blockwise_many(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t,
                                                    ms_tensor **amax, const int *pow2, int n, int dtype, int dev) {
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    scales_many_args a;
    int i = 0;
    while (i < n) {
        a.count = 0;
        int64_t slots = 0;
        for (; i < n && a.count < kManyMax; i++) {
            const int64_t nbr = amax[i]->sizes[0], nbc = amax[i]->sizes[1], m = ms_f8p_slots(nbr, nbc);
            if (m == 0) continue;
            const int k = a.count;
            a.amax[k] = (const float *)ms_tensor_data(amax[i]);
            a.scale[k] = scale && scale[i] ? (float *)ms_tensor_data(scale[i]) : nullptr;
            a.inv[k] = inv && inv[i] ? (float *)ms_tensor_data(inv[i]) : nullptr;
            a.inv_t[k] = inv_t && inv_t[i] ? (float *)ms_tensor_data(inv_t[i]) : nullptr;
            a.nbr[k] = nbr;
            a.nbc[k] = nbc;
            a.pow2[k] = pow2 ? pow2[i] : 0;
            a.first[k] = slots;
            slots += m;
            a.count++;
        }
        if (a.count == 0) continue;
        a.first[a.count] = slots;
        const long long blocks = (slots + 255) / 256;
        if (blocks > 0x7fffffffLL)
            return ms_errorf("float8_scales_blockwise_many: %lld grid slots in one launch", (long long)slots);
        blk_scales_many_kernel<<<(unsigned)blocks, 256, 0, st>>>(a, dtype == MS_F8E5M2);
        LAUNCH_CHECK("blk_scales_many_kernel");
    }
    return 0;
}

// the amaxes zeroed (one memset a run of adjacent ones: FSDP's are one
// vector), then the pieces' maxima folded in
extern "C" int ms_cuda_float8_amax_many(ms_tensor **amax, ms_tensor **x, int n, int dev) {
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    if (zero_runs(amax, n, st, "float8_amax_many")) return -1;
    return tw_many(nullptr, nullptr, x, amax, nullptr, n, 0, dev);
}

extern "C" int ms_cuda_float8_cast_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax,
                                        const int *pow2, int n, int dtype, int dev) {
    return tw_many(out, inv, x, amax, pow2, n, dtype == MS_F8E5M2 ? 2 : 1, dev);
}
