/* core/norm_cpu.c — CPU references of the fused LayerNorm and RMSNorm
 * (core/ops.h ms_layer_norm, ms_rms_norm and their backwards; the CUDA
 * kernels are kernels/norm.cu).
 *
 *   LayerNorm  https://pytorch.org/docs/stable/generated/torch.nn.functional.layer_norm.html
 *   RMSNorm    https://pytorch.org/docs/stable/generated/torch.nn.functional.rms_norm.html
 *              with Hugging Face LlamaRMSNorm's rounding: the normalised x is
 *              cast back to x's dtype before the weight multiplies it.
 *
 * x: (N, C), the rows of (..., C); everything contiguous (core/ops.c saw
 * to it), w and b (C) and the saved statistics already in the compute dtype
 * (f64 for f64 x, f32 otherwise). Each row is read into an f64 buffer, so
 * this reference accumulates in f64 whatever the storage dtype; results are
 * rounded once on store.
 *
 * Backward, with xhat = (x - mean)·rstd (LayerNorm) or x·rstd (RMSNorm),
 * dxhat = g·w (g without w):
 *   LayerNorm  dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat))
 *   RMSNorm    dx = rstd·(dxhat - xhat·mean(dxhat·xhat))
 *   dw = Σ_rows g·xhat (RMSNorm: xhat rounded as in the forward), db = Σ_rows g
 * Threads: rows in parallel for y and dx; dw and db in parallel over
 * column chunks, each column summed over the rows in order — results do not
 * depend on the number of threads.
 */
#include "internal.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "fused_cpu.h"

enum { COL_CHUNK = 64 };  /* columns per parallel chunk of dw/db */

/* n elements of dtype at p into dst (f64) */
static void load_row(double *dst, const void *p, int dtype, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F64: for (i = 0; i < n; i++) dst[i] = ((const double *)p)[i]; break;
    case MS_F32: for (i = 0; i < n; i++) dst[i] = ((const float *)p)[i]; break;
    case MS_BF16: for (i = 0; i < n; i++) dst[i] = ms_bf16_to_f32(((const uint16_t *)p)[i]); break;
    case MS_F16: for (i = 0; i < n; i++) dst[i] = ms_f16_to_f32(((const uint16_t *)p)[i]); break;
    default: for (i = 0; i < n; i++) dst[i] = ms_load((const char *)p + i * ms_dtype_size(dtype), dtype);
    }
}

/* n f64 values into dtype at p, rounding once (bf16/f16 through f32, as
 * every other store in the core) */
static void store_row(void *p, int dtype, const double *src, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F64: for (i = 0; i < n; i++) ((double *)p)[i] = src[i]; break;
    case MS_F32: for (i = 0; i < n; i++) ((float *)p)[i] = (float)src[i]; break;
    case MS_BF16: for (i = 0; i < n; i++) ((uint16_t *)p)[i] = ms_f32_to_bf16((float)src[i]); break;
    case MS_F16: for (i = 0; i < n; i++) ((uint16_t *)p)[i] = ms_f32_to_f16((float)src[i]); break;
    default: for (i = 0; i < n; i++) ms_store((char *)p + i * ms_dtype_size(dtype), dtype, src[i]);
    }
}

/* v rounded to dtype and back (the cast Hugging Face's RMSNorm applies) */
static double round_to(double v, int dtype) {
    switch (dtype) {
    case MS_F32: return (float)v;
    case MS_BF16: return ms_bf16_to_f32(ms_f32_to_bf16((float)v));
    case MS_F16: return ms_f16_to_f32(ms_f32_to_f16((float)v));
    default: return v;
    }
}

/* element i of a (C) or (N) tensor in the compute dtype */
static double at(const ms_tensor *t, int64_t i) {
    const void *p = ms_tensor_data(t);
    return t->dtype_id == MS_F64 ? ((const double *)p)[i] : ((const float *)p)[i];
}

static void put(ms_tensor *t, int64_t i, double v) {
    void *p = ms_tensor_data(t);
    if (t->dtype_id == MS_F64) ((double *)p)[i] = v;
    else ((float *)p)[i] = (float)v;
}

static void rows_of(const ms_tensor *x, int64_t *N, int64_t *C) {
    *C = x->ndim ? x->sizes[x->ndim - 1] : 1;
    *N = *C ? ms_tensor_numel(x) / *C : 0;
}

static int oom(const char *op, int64_t n) {
    return ms_errorf("%s: cannot allocate %lld bytes of row buffers", op, (long long)n);
}

/* ====================================================== shared row loops */

/* the forward of both norms, a row at a time: rms = 0, LayerNorm (y =
 * (x - mean)·rstd·w + b, mean and rstd saved when given); rms = 1, RMSNorm
 * (y = round_x(x·rstd)·w, mean unused, b NULL) */
static int norm_forward(const char *op, int rms, ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x,
                        const ms_tensor *w, const ms_tensor *b, double eps) {
    int64_t N, C;
    rows_of(x, &N, &C);
    if (N == 0 || C == 0) return 0;
    int xs = ms_dtype_size(x->dtype_id), ys = ms_dtype_size(y->dtype_id);
    const char *xp = ms_tensor_data(x);
    char *yp = ms_tensor_data(y);
    int failed = 0;
#pragma omp parallel
    {
        double *row = malloc(sizeof(double) * (size_t)C);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++) {
            if (!row) continue;
            load_row(row, xp + r * C * xs, x->dtype_id, C);
            double mu = 0, ss = 0;
            if (!rms) {
                double s = 0;
                for (int64_t c = 0; c < C; c++) s += row[c];
                mu = s / (double)C;
            }
            for (int64_t c = 0; c < C; c++) ss += (row[c] - mu) * (row[c] - mu);
            double rs = 1.0 / sqrt(ss / (double)C + eps);
            for (int64_t c = 0; c < C; c++) {
                double v = (row[c] - mu) * rs;
                if (rms) v = round_to(v, x->dtype_id);
                if (w) v *= at(w, c);
                if (b) v += at(b, c);
                row[c] = v;
            }
            store_row(yp + r * C * ys, y->dtype_id, row, C);
            if (mean) put(mean, r, mu);
            if (rstd) put(rstd, r, rs);
        }
        free(row);
    }
    return failed ? oom(op, (int64_t)sizeof(double) * C) : 0;
}

/* dx of both norms, a row at a time, with xhat = (x - mean)·rstd and
 * dxhat = g·w: LayerNorm dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat));
 * RMSNorm (mean NULL) the same without the mean(dxhat) term */
static int norm_input_grad(const char *op, ms_tensor *dx, const ms_tensor *g, const ms_tensor *x,
                           const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, int64_t N, int64_t C) {
    int gs = ms_dtype_size(g->dtype_id), xs = ms_dtype_size(x->dtype_id), ds = ms_dtype_size(dx->dtype_id);
    const char *gp = ms_tensor_data(g), *xp = ms_tensor_data(x);
    char *dp = ms_tensor_data(dx);
    int failed = 0;
#pragma omp parallel
    {
        double *buf = malloc(sizeof(double) * 2 * (size_t)C);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < N; r++) {
            if (!buf) continue;
            double *gr = buf, *xr = buf + C;
            load_row(gr, gp + r * C * gs, g->dtype_id, C);
            load_row(xr, xp + r * C * xs, x->dtype_id, C);
            double mu = mean ? at(mean, r) : 0, rs = at(rstd, r), a = 0, bsum = 0;
            for (int64_t c = 0; c < C; c++) {
                double xh = (xr[c] - mu) * rs, dxh = w ? gr[c] * at(w, c) : gr[c];
                xr[c] = xh;
                gr[c] = dxh;
                a += dxh;
                bsum += dxh * xh;
            }
            a = mean ? a / (double)C : 0;
            bsum /= (double)C;
            for (int64_t c = 0; c < C; c++) gr[c] = rs * (gr[c] - a - xr[c] * bsum);
            store_row(dp + r * C * ds, dx->dtype_id, gr, C);
        }
        free(buf);
    }
    return failed ? oom(op, (int64_t)sizeof(double) * 2 * C) : 0;
}

/* ============================================================ LayerNorm */

/* x (N, C) -> y (N, C) = (x - mean)·rstd·w + b; mean, rstd (N) */
int ms_cpu_layer_norm(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
                      const ms_tensor *b, double eps) {
    return norm_forward("layer_norm", 0, y, mean, rstd, x, w, b, eps);
}

/* column sums over rows for columns [c0, c1): dw += g·xhat, db += g, with
 * xhat from x and the row statistics (rms: mean NULL, xhat rounded to
 * rdtype) */
static void column_sums(double *dw, double *db, const ms_tensor *g, const ms_tensor *x, const ms_tensor *mean,
                        const ms_tensor *rstd, int rdtype, int64_t N, int64_t C, int64_t c0, int64_t c1,
                        double *gbuf, double *xbuf) {
    int gs = ms_dtype_size(g->dtype_id), xs = ms_dtype_size(x->dtype_id);
    const char *gp = ms_tensor_data(g), *xp = ms_tensor_data(x);
    int64_t n = c1 - c0;
    for (int64_t c = 0; c < n; c++) {
        if (dw) dw[c] = 0;
        if (db) db[c] = 0;
    }
    for (int64_t r = 0; r < N; r++) {
        load_row(gbuf, gp + (r * C + c0) * gs, g->dtype_id, n);
        if (db)
            for (int64_t c = 0; c < n; c++) db[c] += gbuf[c];
        if (dw) {
            load_row(xbuf, xp + (r * C + c0) * xs, x->dtype_id, n);
            double mu = mean ? at(mean, r) : 0, rs = at(rstd, r);
            for (int64_t c = 0; c < n; c++) {
                double xh = (xbuf[c] - mu) * rs;
                if (!mean) xh = round_to(xh, rdtype);
                dw[c] += gbuf[c] * xh;
            }
        }
    }
}

/* dw, db over column chunks in parallel; dwt/dbt (C) in the compute dtype */
static int param_grads(const char *op, ms_tensor *dwt, ms_tensor *dbt, const ms_tensor *g, const ms_tensor *x,
                       const ms_tensor *mean, const ms_tensor *rstd, int64_t N, int64_t C) {
    int64_t nchunks = (C + COL_CHUNK - 1) / COL_CHUNK;
    int failed = 0;
#pragma omp parallel
    {
        double *buf = malloc(sizeof(double) * 4 * COL_CHUNK);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t k = 0; k < nchunks; k++) {
            if (!buf) continue;
            int64_t c0 = k * COL_CHUNK, c1 = c0 + COL_CHUNK < C ? c0 + COL_CHUNK : C;
            double *dw = dwt ? buf : NULL, *db = dbt ? buf + COL_CHUNK : NULL;
            column_sums(dw, db, g, x, mean, rstd, x->dtype_id, N, C, c0, c1, buf + 2 * COL_CHUNK,
                        buf + 3 * COL_CHUNK);
            for (int64_t c = c0; c < c1; c++) {
                if (dwt) put(dwt, c, dw[c - c0]);
                if (dbt) put(dbt, c, db[c - c0]);
            }
        }
        free(buf);
    }
    return failed ? oom(op, (int64_t)sizeof(double) * 4 * COL_CHUNK) : 0;
}

/* g, x (N, C); mean, rstd (N) -> dx (N, C), dw, db (C) */
int ms_cpu_layer_norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                               const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w) {
    int64_t N, C;
    rows_of(x, &N, &C);
    if (C == 0) return 0;
    if (N == 0) {
        for (int64_t c = 0; c < C; c++) {
            if (dw) put(dw, c, 0);
            if (db) put(db, c, 0);
        }
        return 0;
    }
    if (dx) {
        int rc = norm_input_grad("layer_norm_backward", dx, g, x, mean, rstd, w, N, C);
        if (rc) return rc;
    }
    if (dw || db) return param_grads("layer_norm_backward", dw, db, g, x, mean, rstd, N, C);
    return 0;
}

/* ============================================================== RMSNorm */

/* x (N, C) -> y (N, C) = round_x(x·rstd)·w; rstd (N) */
int ms_cpu_rms_norm(ms_tensor *y, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w, double eps) {
    return norm_forward("rms_norm", 1, y, NULL, rstd, x, w, NULL, eps);
}

/* g, x (N, C); rstd (N) -> dx (N, C), dw (C) */
int ms_cpu_rms_norm_backward(ms_tensor *dx, ms_tensor *dw, const ms_tensor *g, const ms_tensor *x,
                             const ms_tensor *rstd, const ms_tensor *w) {
    int64_t N, C;
    rows_of(x, &N, &C);
    if (C == 0) return 0;
    if (N == 0) {
        for (int64_t c = 0; c < C && dw; c++) put(dw, c, 0);
        return 0;
    }
    if (dx) {
        int rc = norm_input_grad("rms_norm_backward", dx, g, x, NULL, rstd, w, N, C);
        if (rc) return rc;
    }
    if (dw) return param_grads("rms_norm_backward", dw, NULL, g, x, NULL, rstd, N, C);
    return 0;
}
