/* core/jsd.c — the fused linear JSD's row pass (core/flce.h ms_jsd_rows):
 * the argument checks, the CPU reference (f64 math, a row a thread) and the
 * dispatch to CUDA (kernels/jsd.cu). */
#include <math.h>
#include <stdint.h>

#include "flce.h"
#include "internal.h"
#include "tensor.h"
#ifdef MS_WITH_CUDA
#include "../kernels/flce.h"
#endif

#define DESC 160

static int64_t label_at(const ms_tensor *lb, int64_t i) {
    const char *p = ms_tensor_data(lb);
    return lb->dtype_id == MS_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

// log(exp(a) + exp(b)), stably
static double logaddexp(double a, double b) {
    double m = a > b ? a : b;
    if (m == -INFINITY) return -INFINITY;
    return m + log(exp(a - m) + exp(b - m));
}

// the log-sum-exp of a row of n values of dtype dt
static double row_lse(const char *r, int dt, int64_t n, size_t es) {
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        double v = ms_load(r + j * es, dt);
        if (v > m) m = v;
    }
    if (m == -INFINITY) return m;
    double s = 0;
    for (int64_t j = 0; j < n; j++) s += exp(ms_load(r + j * es, dt) - m);
    return m + log(s);
}

static void cpu_row(double *loss, char *gr, int gdt, size_t ges, const char *sr, const char *tr, int dt, size_t es,
                    int64_t V, double beta, double scale) {
    double lse_s = row_lse(sr, dt, V, es), lse_t = row_lse(tr, dt, V, es);
    double lb = beta > 0 ? log(beta) : 0, l1b = beta < 1 ? log1p(-beta) : 0;
    // the row's loss and Σ q h
    double L = 0, qh = 0;
    for (int64_t j = 0; j < V; j++) {
        double ls = ms_load(sr + j * es, dt) - lse_s, lt = ms_load(tr + j * es, dt) - lse_t;
        double q = exp(ls), p = exp(lt);
        if (beta == 0) {
            L += p * (lt - ls);
        } else if (beta == 1) {
            L += q * (ls - lt);
        } else {
            double lm = logaddexp(ls + l1b, lt + lb);
            L += beta * p * (lt - lm) + (1 - beta) * q * (ls - lm);
            qh += q * (1 - beta) * (ls - lm);
        }
    }
    if (beta == 1) qh = L;
    *loss = L;
    if (!gr) return;
    for (int64_t j = 0; j < V; j++) {
        double ls = ms_load(sr + j * es, dt) - lse_s, lt = ms_load(tr + j * es, dt) - lse_t;
        double q = exp(ls), d;
        if (beta == 0) {
            d = q - exp(lt);
        } else {
            double h = beta == 1 ? ls - lt : (1 - beta) * (ls - logaddexp(ls + l1b, lt + lb));
            d = q * (h - qh);
        }
        ms_store(gr + j * ges, gdt, d * scale);
    }
}

int ms_jsd_rows(ms_tensor *g, ms_tensor *loss, const ms_tensor *s, const ms_tensor *t, const ms_tensor *labels,
                int64_t ignore_index, double beta, double scale) {
    char a[DESC], b[DESC], c[DESC], d[DESC];
    if (ms_tensor_check_live(s, "jsd_rows") || ms_tensor_check_live(t, "jsd_rows") ||
        ms_tensor_check_live(loss, "jsd_rows") || (g && ms_tensor_check_live(g, "jsd_rows")) ||
        (labels && ms_tensor_check_live(labels, "jsd_rows")))
        return -1;
    if (s->ndim != 2 || t->ndim != 2 || s->sizes[0] != t->sizes[0] || s->sizes[1] != t->sizes[1] ||
        s->dtype_id != t->dtype_id || !ms_is_float(s->dtype_id) || !ms_tensor_is_contiguous(s) ||
        !ms_tensor_is_contiguous(t) || s->device_id != t->device_id)
        return ms_errorf("jsd_rows: s and t must be contiguous (n, V) float logits of one dtype and device, "
                         "got %s and %s", ms_desc(s, a, sizeof a), ms_desc(t, b, sizeof b));
    int64_t n = s->sizes[0], V = s->sizes[1];
    const int ldt = s->dtype_id == MS_F64 ? MS_F64 : MS_F32;   // the loss's dtype
    if (loss->ndim != 1 || loss->sizes[0] != n || loss->dtype_id != ldt || loss->device_id != s->device_id ||
        !ms_tensor_is_contiguous(loss))
        return ms_errorf("jsd_rows: loss must be (%lld) %s on the logits' device, got %s", (long long)n,
                         ms_dtype_name(ldt), ms_desc(loss, c, sizeof c));
    if (g && (g->ndim != 2 || g->sizes[0] != n || g->sizes[1] != V || !ms_is_float(g->dtype_id) ||
              g->device_id != s->device_id || !ms_tensor_is_contiguous(g)))
        return ms_errorf("jsd_rows: g must be a contiguous float (%lld, %lld) on the logits' device, got %s",
                         (long long)n, (long long)V, ms_desc(g, d, sizeof d));
    // g may be s itself (written in place), of s's dtype; it may not share t
    if (g && n * V > 0 &&
        (ms_tensor_data(g) == ms_tensor_data(t) || (ms_tensor_data(g) == ms_tensor_data(s) && g->dtype_id != s->dtype_id)))
        return ms_errorf("jsd_rows: g %s may only be s itself (%s), written in place, not t (%s)",
                         ms_desc(g, d, sizeof d), ms_desc(s, a, sizeof a), ms_desc(t, b, sizeof b));
    if (labels && (labels->ndim != 1 || labels->sizes[0] != n || (labels->dtype_id != MS_I64 && labels->dtype_id != MS_I32) ||
                   labels->device_id != s->device_id || !ms_tensor_is_contiguous(labels)))
        return ms_errorf("jsd_rows: labels must be (%lld) i64/i32 on the logits' device, got %s", (long long)n,
                         ms_desc(labels, d, sizeof d));
    if (!(beta >= 0 && beta <= 1)) return ms_errorf("jsd_rows: beta must be in [0, 1], got %g", beta);
    if (n == 0) return 0;
#ifdef MS_WITH_CUDA
    if (s->device_id >= 0) {
        if (s->dtype_id == MS_F64) return ms_errorf("jsd_rows: cuda logits must be f32, bf16 or f16, got %s", ms_desc(s, a, sizeof a));
        return ms_cuda_jsd_rows(g, loss, s, t, labels, ignore_index, beta, scale);
    }
#else
    if (s->device_id >= 0) return ms_errorf("jsd_rows: cuda tensors need a build with CUDA");
#endif
    int dt = s->dtype_id, gdt = g ? g->dtype_id : MS_F32;
    size_t es = ms_dtype_size(dt), ges = ms_dtype_size(gdt);
    const char *sp = ms_tensor_data(s), *tp = ms_tensor_data(t);
    char *gp = g ? ms_tensor_data(g) : NULL, *lp = ms_tensor_data(loss);
    size_t les = ms_dtype_size(ldt);
#pragma omp parallel for schedule(static) if (n > 1 && n * V > 32768)
    for (int64_t i = 0; i < n; i++) {
        char *gr = gp ? gp + (size_t)(i * V) * ges : NULL;
        double L = 0;
        if (labels && label_at(labels, i) == ignore_index) {
            if (gr)
                for (int64_t j = 0; j < V; j++) ms_store(gr + j * ges, gdt, 0);
        } else {
            cpu_row(&L, gr, gdt, ges, sp + (size_t)(i * V) * es, tp + (size_t)(i * V) * es, dt, es, V, beta, scale);
        }
        ms_store(lp + i * les, ldt, L);
    }
    return 0;
}
