/* core/gemm_grouped.c — many GEMMs at once (core/ops.h ms_gemm_grouped_):
 * one launch of kernels/grouped_gemm.cu on CUDA where its layout rules
 * hold, else (and on the CPU, the reference) ms_gemm_ a group. */
#include "internal.h"
#include "ops.h"

#include <stdint.h>
#include <stdio.h>

#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

static int grouped_mode = MS_GROUPED_AUTO;

int ms_gemm_grouped_set_kernel(int mode) {
    int was = grouped_mode;
    if (mode >= MS_GROUPED_LOOP && mode <= MS_GROUPED_MMA) grouped_mode = mode;
    return was;
}

#ifdef MS_WITH_CUDA
/* MS_GROUPED_AUTO's choice: measured on an H200 (docs/moe.md), the
 * grouped kernel (250-450 TFLOP/s) beats a cuBLASLt GEMM a group (~780 on
 * large shapes, much less on small ones, plus a launch each) only while
 * the groups are small: 64 experts of 1024 x 352 x 2048 (1.5 GFLOP each)
 * and of 1024 x 704 x 2048 (a gate-and-up product, 3.0), not 16 of
 * 2048 x 704 x 2048 (5.9, about even) or 8 of 2048 x 1408 x 2048. */
#define MS_GROUPED_AUTO_FLOPS 4.5e9
static int kernel_pays(ms_tensor **c, ms_tensor **a, int G, int transa) {
    double flops = 0;
    int busy = 0;
    for (int g = 0; g < G; g++) {
        const double M = (double)c[g]->sizes[0], N = (double)c[g]->sizes[1];
        const double K = (double)a[g]->sizes[transa ? 0 : 1];
        if (M * N * K == 0) continue;
        flops += 2 * M * N * K;
        busy++;
    }
    return busy > 0 && flops / busy < MS_GROUPED_AUTO_FLOPS;
}

/* whether the groups, each already checked by ms_gemm_check, fit the
 * kernel's layout rules (kernels/kernels.h) */
static int kernel_fits(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb) {
    if (grouped_mode == MS_GROUPED_LOOP || (transa && transb)) return 0;
    const int dt = a[0]->dtype_id, ct = c[0]->dtype_id;
    if ((dt != MS_BF16 && dt != MS_F16) || c[0]->device_id < 0) return 0;
    const size_t ce = ms_dtype_size(ct);
    for (int g = 0; g < G; g++) {
        const ms_tensor *x = a[g], *y = b[g], *z = c[g];
        if (x->dtype_id != dt || z->dtype_id != ct || z->device_id != c[0]->device_id) return 0;
        if (z->sizes[1] != c[0]->sizes[1] || z->sizes[0] > 65535LL * 128) return 0;  /* (one launch's m-tiles) */
        if (x->strides[1] != 1 || y->strides[1] != 1 || z->strides[1] != 1) return 0;
        if (x->strides[0] != a[0]->strides[0] || y->strides[0] != b[0]->strides[0] || z->strides[0] != c[0]->strides[0])
            return 0;
        /* 16-byte chunks of the operands' rows; pairs of C's */
        if (x->sizes[1] % 8 || y->sizes[1] % 8 || x->strides[0] % 8 || y->strides[0] % 8 || z->sizes[1] % 2 ||
            z->strides[0] % 2)
            return 0;
        if (x->strides[0] < x->sizes[1] || y->strides[0] < y->sizes[1] || z->strides[0] < z->sizes[1]) return 0;
        if ((uintptr_t)ms_tensor_data(x) % 16 || (uintptr_t)ms_tensor_data(y) % 16 ||
            (uintptr_t)ms_tensor_data(z) % (2 * ce))
            return 0;
    }
    return 1;
}
#endif

int ms_gemm_grouped_(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb, double beta) {
    if (G < 0 || (G > 0 && (!c || !a || !b)))
        return ms_errorf("gemm_grouped_: %d groups, or their tensors missing", G);
    if (beta != 0.0 && beta != 1.0) return ms_errorf("gemm_grouped_: beta must be 0 or 1, got %g", beta);
    for (int g = 0; g < G; g++)
        if (ms_gemm_check(c[g], a[g], b[g], transa, transb)) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", ms_last_error());
            return ms_errorf("gemm_grouped_: group %d of %d (counted from 0): %s", g, G, msg);
        }
    if (G == 0) return 0;
#ifdef MS_WITH_CUDA
    if (kernel_fits(c, a, b, G, transa, transb) && (grouped_mode != MS_GROUPED_AUTO || kernel_pays(c, a, G, transa)))
        return ms_cuda_gemm_grouped(c, a, b, G, transa, transb, beta, grouped_mode == MS_GROUPED_MMA ? 2 : 1);
#endif
    for (int g = 0; g < G; g++) {
        /* an empty inner dimension: C = beta C (BLAS's rule) */
        if (a[g]->sizes[transa ? 0 : 1] == 0) {
            if (beta == 0.0 && ms_fill_(c[g], 0)) return -1;
            continue;
        }
        if (ms_gemm_(c[g], a[g], b[g], transa, transb, 1.0, beta)) return -1;
    }
    return 0;
}
