/* core/adamw_cpu.c — CPU references of the fused AdamW step and of the sum
 * of squares behind the global grad norm (core/ops.h ms_adamw_multi_,
 * ms_sum_squares; the CUDA kernels are kernels/adamw.cu).
 *
 *   AdamW  https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
 *          (the update of torch.optim.AdamW, decoupled weight decay):
 *     p <- p·(1 - lr·wd)
 *     m <- β1·m + (1 - β1)·g
 *     v <- β2·v + (1 - β2)·g²
 *     p <- p - lr/(1 - β1^t) · m / (sqrt(v)/sqrt(1 - β2^t) + eps)
 *   each tensor i: p[i], g[i], m[i], v[i] (numel_i), contiguous. The math
 *   is in f64 here whatever the dtypes (p and the moments rounded once on
 *   store), so this is at least as exact as the CUDA kernel's f32.
 *
 *   sum of squares  Σ_i Σ_j t_i[j]²  (torch.nn.utils.clip_grad_norm_'s
 *   total norm, squared), into a 0-dim f64 tensor. Each tensor is cut into
 *   fixed blocks of SUM_BLOCK elements whose f64 partial sums are added in
 *   order, so the result does not depend on the number of threads.
 */
#include "internal.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "fused_cpu.h"

enum { GRAIN = 16384, SUM_BLOCK = 65536 };

static double ld(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case MS_F64: return ((const double *)p)[i];
    case MS_F32: return ((const float *)p)[i];
    case MS_BF16: return ms_bf16_to_f32(((const uint16_t *)p)[i]);
    case MS_F16: return ms_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ms_load((const char *)p + i * ms_dtype_size(dtype), dtype);
    }
}

static void st(void *p, int dtype, int64_t i, double v) {
    switch (dtype) {
    case MS_F64: ((double *)p)[i] = v; break;
    case MS_F32: ((float *)p)[i] = (float)v; break;
    case MS_BF16: ((uint16_t *)p)[i] = ms_f32_to_bf16((float)v); break;
    case MS_F16: ((uint16_t *)p)[i] = ms_f32_to_f16((float)v); break;
    default: ms_store((char *)p + i * ms_dtype_size(dtype), dtype, v);
    }
}

/* v rounded to dtype's precision (f64: itself) */
static double round_to(double v, int dtype) {
    switch (dtype) {
    case MS_F32: return (double)(float)v;
    case MS_BF16: return (double)ms_bf16_to_f32(ms_f32_to_bf16((float)v));
    case MS_F16: return (double)ms_f16_to_f32(ms_f32_to_f16((float)v));
    default: return v;
    }
}

/* p, g, m, v: n tensors each, w NULL or n masters (each NULL or the f32
 * master of p[t]: read and written instead of p, p stored as its rounding);
 * with scaled, each gradient element enters as round_g(g·round_g(grad_scale)),
 * round_g the gradient dtype's rounding; checked by core/ops.c */
int ms_cpu_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m, ms_tensor *const *v,
                 double beta1, double beta2, double eps, const double k[3], ms_tensor *const *w,
                 double grad_scale, int scaled) {
    const double decay = k[0], step_size = k[1], bc2_sqrt = k[2];
    for (int t = 0; t < n; t++) {
        int64_t numel = ms_tensor_numel(p[t]);
        void *pp = ms_tensor_data(p[t]), *mp = ms_tensor_data(m[t]), *vp = ms_tensor_data(v[t]);
        const void *gp = ms_tensor_data(g[t]);
        int pd = p[t]->dtype_id, gd = g[t]->dtype_id, md = m[t]->dtype_id, vd = v[t]->dtype_id;
        void *wp = w && w[t] ? ms_tensor_data(w[t]) : NULL;
        int wd = wp ? w[t]->dtype_id : pd;
        const double sc = scaled ? round_to(grad_scale, gd) : 1.0;
#pragma omp parallel for schedule(static) if (numel > GRAIN)
        for (int64_t i = 0; i < numel; i++) {
            double gi = ld(gp, gd, i);
            if (scaled) gi = round_to(gi * sc, gd);
            double mi = beta1 * ld(mp, md, i) + (1.0 - beta1) * gi;
            double vi = beta2 * ld(vp, vd, i) + (1.0 - beta2) * gi * gi;
            double pi = ld(wp ? wp : pp, wd, i) * decay;
            pi -= step_size * mi / (sqrt(vi) / bc2_sqrt + eps);
            st(mp, md, i, mi);
            st(vp, vd, i, vi);
            if (wp) {
                st(wp, wd, i, pi);
                pi = ld(wp, wd, i);   /* p: the rounding of the stored master */
            }
            st(pp, pd, i, pi);
        }
    }
    return 0;
}

/* out (0-dim f64) = Σ over the n tensors of their squared elements */
int ms_cpu_sum_squares(ms_tensor *out, int n, ms_tensor *const *ts) {
    double total = 0;
    for (int t = 0; t < n; t++) {
        int64_t numel = ms_tensor_numel(ts[t]);
        if (numel == 0) continue;
        int64_t nb = (numel + SUM_BLOCK - 1) / SUM_BLOCK;
        double *part = malloc(sizeof(double) * (size_t)nb);
        if (!part) return ms_errorf("sum_squares: cannot allocate %lld partial sums", (long long)nb);
        const void *p = ms_tensor_data(ts[t]);
        int dt = ts[t]->dtype_id;
#pragma omp parallel for schedule(static) if (nb > 1)
        for (int64_t b = 0; b < nb; b++) {
            int64_t lo = b * SUM_BLOCK, hi = lo + SUM_BLOCK < numel ? lo + SUM_BLOCK : numel;
            double s = 0;
            for (int64_t i = lo; i < hi; i++) {
                double x = ld(p, dt, i);
                s += x * x;
            }
            part[b] = s;
        }
        for (int64_t b = 0; b < nb; b++) total += part[b];
        free(part);
    }
    *(double *)ms_tensor_data(out) = total;
    return 0;
}
