/* core/f8many.h — the indexing of the blockwise "many" ops (core/ops.h
 * ms_float8_amax_blockwise_many, ms_float8_cast_blockwise_many,
 * ms_float8_scales_blockwise_many), shared by the CPU (core/float8.c) and
 * the CUDA kernels (kernels/float8.cu), so both walk the same work items.
 *
 * A piece (n elements of a row-major (R, C) matrix from offset) is cut into
 * work items of 16 rows of one 128-column block (a warp on the GPU): the
 * items of the 16-row groups from the piece's first row to its last, times
 * the column blocks. The items of many pieces are numbered one after the
 * other (first[i]: piece i's first item; first[count]: the total); item w
 * belongs to the last piece i with first[i] <= w (a piece of no item has
 * first[i] == first[i + 1] and is never found). The scales' work is counted
 * the same way in grid slots (ms_f8p_slots). Not part of the FFI. */
#ifndef MS_F8MANY_H
#define MS_F8MANY_H

#include <stdint.h>

#include "fp8.h"

#ifdef __CUDACC__
#define MS_F8P_HD __host__ __device__
#else
#define MS_F8P_HD
#endif

#define MS_F8P_ROWS 16   /* rows a work item */
#define MS_F8P_BLK 128   /* the blocks' side */

/* the work items of a piece (0 when n == 0) and its first 16-row group */
MS_F8P_HD static inline int64_t ms_f8p_items(int64_t n, int64_t C, int64_t offset, int64_t *g0) {
    *g0 = 0;
    if (n <= 0 || C <= 0) return 0;
    const int64_t nbc = (C + MS_F8P_BLK - 1) / MS_F8P_BLK;
    *g0 = offset / C / MS_F8P_ROWS;
    const int64_t g1 = (offset + n - 1) / C / MS_F8P_ROWS;
    return (g1 - *g0 + 1) * nbc;
}

/* the slots of a (nbr, nbc) grid's scales work: every entry of inv (nbr,
 * pad4(nbc)) and of inv_t (nbc, pad4(nbr)), the padding included (written
 * 0), the larger of the two counts */
MS_F8P_HD static inline int64_t ms_f8p_slots(int64_t nbr, int64_t nbc) {
    const int64_t a = nbr * ((nbc + 3) / 4 * 4), b = nbc * ((nbr + 3) / 4 * 4);
    return a > b ? a : b;
}

/* the last i < count with first[i] <= w (first ascending, first[0] <= w) */
MS_F8P_HD static inline int ms_f8p_find(const int64_t *first, int count, int64_t w) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= w) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* slot s of a (nbr, nbc) grid's scales work (ms_f8p_slots) from its block
 * maxima m: inv's entry s (and the block's scale) when s is inside inv,
 * inv_t's entry s when inside inv_t, the padding columns written 0; NULL
 * outputs skipped. The bits of ms_float8_scales_blockwise. */
MS_F8P_HD static inline void ms_f8p_scales_slot(const float *m, float *ps, float *pi, float *pt, int64_t nbr,
                                                int64_t nbc, int64_t s, int e5, int pow2) {
    const int64_t ld = (nbc + 3) / 4 * 4, ld_t = (nbr + 3) / 4 * 4;
    if (s < nbr * ld) {
        const int64_t rb = s / ld, cb = s % ld;
        if (cb < nbc) {
            const float sc = ms_fp8_scale(m[rb * nbc + cb], e5, pow2);
            if (ps) ps[rb * nbc + cb] = sc;
            if (pi) pi[s] = 1.0f / sc;
        } else if (pi) {
            pi[s] = 0.0f;
        }
    }
    if (pt && s < nbc * ld_t) {
        const int64_t cb = s / ld_t, rb = s % ld_t;
        pt[s] = rb < nbr ? 1.0f / ms_fp8_scale(m[rb * nbc + cb], e5, pow2) : 0.0f;
    }
}

#endif
