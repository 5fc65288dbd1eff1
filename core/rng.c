/* core/rng.c — counter-based random numbers: Philox4x32-10 and the CPU
 * kernels of rand_/randn_.
 *
 * Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11; the Random123 reference) maps a 128-bit counter and a 64-bit key to
 * 128 random bits. moonshard keys it with the seed (lo, hi 32-bit words) and
 * puts a 64-bit counter in the low two counter words (the high two are 0).
 *
 * Element i of a tensor (row-major order) filled at `offset` takes lane
 * (offset + i) % 4 of counter (offset + i) / 4, so a value depends only on
 * (seed, offset + i): not on the device, the layout of the tensor or the
 * number of threads, and a stream can be continued by advancing the offset.
 *
 *   uniform: u = ((x >> 8) + 0.5) * 2^-24, in (0, 1) (24 bits, never 0 or 1)
 *   normal:  Box-Muller on the lane pairs (0,1) and (2,3) of one counter:
 *            r = sqrt(-2 log u_even), theta = 2 pi u_odd;
 *            even lanes give r cos(theta), odd lanes r sin(theta).
 *
 * Note: u is exact in double; storing lo + u*(hi-lo) into a narrow float can
 * round up to hi (f32: only u = 1 - 2^-25; bf16: u > 1 - 2^-9).
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu.h"

enum { PHILOX_ROUNDS = 10 };
static const uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
static const uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;

/* the Random123 round function and key schedule (bump between rounds) */
static void philox4x32_10(const uint32_t ctr_in[4], const uint32_t key_in[2], uint32_t out[4]) {
    uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
    uint32_t k0 = key_in[0], k1 = key_in[1];
    for (int r = 0; r < PHILOX_ROUNDS; r++) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

void ms_philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    philox4x32_10(ctr, key, out);
}

/* 24 random bits centred in their bucket: a uniform in (0, 1) */
static double philox_uniform(uint32_t x) {
    return ((double)(x >> 8) + 0.5) * (1.0 / 16777216.0);
}

/* the 4 values of one counter: uniforms, or normals by Box-Muller pairs */
static void philox_values(uint64_t seed, uint64_t counter, int normal, double v[4]) {
    uint32_t x[4];
    ms_philox(seed, counter, x);
    for (int k = 0; k < 4; k++) v[k] = philox_uniform(x[k]);
    if (!normal) return;
    for (int k = 0; k < 4; k += 2) {
        double r = sqrt(-2.0 * log(v[k]));
        double theta = 2.0 * M_PI * v[k + 1];
        v[k] = r * cos(theta);
        v[k + 1] = r * sin(theta);
    }
}

/* fill n contiguous elements of dtype at data with a*v + b, v per counter lane */
static void fill_random_contig(char *data, int dtype, int64_t n, uint64_t seed, uint64_t offset,
                               int normal, double scale, double shift) {
    if (n == 0) return;
    int es = ms_dtype_size(dtype);
    uint64_t first = offset / 4, last = (offset + (uint64_t)n - 1) / 4;
    int64_t ncounters = (int64_t)(last - first + 1);
#pragma omp parallel for schedule(static) if (n > 4096)
    for (int64_t c = 0; c < ncounters; c++) {
        uint64_t counter = first + (uint64_t)c;
        double v[4];
        philox_values(seed, counter, normal, v);
        for (int k = 0; k < 4; k++) {
            uint64_t e = counter * 4 + (uint64_t)k; /* offset + i */
            if (e < offset || e - offset >= (uint64_t)n) continue;
            int64_t i = (int64_t)(e - offset);
            double x = shift + scale * v[k];
            if (dtype == MS_F32) ((float *)data)[i] = (float)x;
            else ms_store(data + i * es, dtype, x);
        }
    }
}

/* non-contiguous t: generate row-major into a contiguous temporary, copy in */
static int fill_random(ms_tensor *t, uint64_t seed, uint64_t offset, int normal, double scale,
                       double shift) {
    if (ms_tensor_is_contiguous(t)) {
        fill_random_contig(ms_tensor_data(t), t->dtype_id, ms_tensor_numel(t), seed, offset, normal, scale,
                           shift);
        return 0;
    }
    ms_tensor *tmp = NULL;
    if (ms_tensor_empty(&tmp, t->ndim, t->sizes, t->dtype_id, t->device_id)) return -1;
    fill_random_contig(ms_tensor_data(tmp), tmp->dtype_id, ms_tensor_numel(tmp), seed, offset, normal, scale,
                       shift);
    int rc = ms_tensor_copy_(t, tmp);
    ms_tensor_free(tmp);
    return rc;
}

// https://pytorch.org/docs/stable/generated/torch.Tensor.uniform_.html
// t: any shape; t = lo + (hi - lo) * u
int ms_cpu_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
    return fill_random(t, seed, offset, 0, hi - lo, lo);
}

// https://pytorch.org/docs/stable/generated/torch.Tensor.normal_.html
// t: any shape; t = mean + std * z
int ms_cpu_randn_(ms_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
    return fill_random(t, seed, offset, 1, std, mean);
}
