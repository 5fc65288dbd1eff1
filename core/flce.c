/* core/flce.c — fused linear cross-entropy (core/flce.h): argument checks,
 * the chunk loop shared by both devices, and the CPU reference of the
 * per-device steps.
 *
 * One loop drives CPU and CUDA tensors alike: per chunk of rows a GEMM
 * writes the logits into a reused (rows, V) buffer, the fused row pass turns
 * them into d loss / d logits in place (and leaves per-row ce, z-loss and
 * hit in `rows`), and GEMMs take grad_x's rows and add into grad_W. The
 * steps that differ by device are the dev_* functions below: CPU ones are
 * here (with shape comments), CUDA ones in kernels/flce.cu; the GEMMs are
 * the production ones (ms_gemm_ / OpenBLAS on the CPU, ms_cuda_gemm /
 * cuBLASLt on CUDA).
 *
 * Reference: https://pytorch.org/docs/stable/generated/torch.nn.functional.cross_entropy.html
 * (weight, ignore_index, label_smoothing, reduction), plus the z-loss and
 * logit softcap of Liger Kernel's LigerFusedLinearCrossEntropyLoss.
 *
 * Vocabulary-parallel (o->group): the row pass is split in two around the
 * collectives. vp_rows: the statistics of this rank's classes (dev_vp_stats)
 * go into st (7, n): max, argmax value, sum-exp, target logit, Σ w z,
 * target weight, argmax index; (max, argmax value) are all-reduced with
 * MAX into mx (2, n), each rank rescales its sum-exp to the global max and
 * keeps its argmax index only if it holds the global best (dev_vp_fix), the
 * next four rows are all-reduced with SUM and the index with MIN (the first
 * maximal class, as torch.argmax); dev_vp_grad then computes rows and the
 * gradient of the local classes from the global statistics.
 *
 * Threads: the row pass runs rows in parallel (each row by one thread, in
 * index order), the bias column sums run columns in parallel (rows in
 * order), the GEMMs are thread-count independent (core/ops_cpu.c), and the
 * final sums run in row order: the bits do not depend on the thread count.
 */
#include "internal.h"
#include "prof.h"
#include "flce.h"
#include "dist/comm.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MS_WITH_CUDA
#include "../kernels/flce.h"
#include "../kernels/kernels.h"
#include "cuda.h"
/* kernels/gemm.cu defines this once ms_cuda_gemm takes an f32 output with
 * bf16/f16 operands (f32 accumulation of grad_W across chunks); until then
 * the weak reference is NULL and flce falls back to f32 operand copies */
extern int ms_cuda_gemm_mixed_ok(void) __attribute__((weak));
#endif

static const char *const OP = "fused_linear_cross_entropy";
enum { DESC = 200 };

void ms_flce_opts_init(ms_flce_opts *o) {
    memset(o, 0, sizeof *o);
    o->ignore_index = -100;
    o->reduction = MS_FLCE_MEAN;
    o->accum_dtype = -1;
    o->grad_dtype = -1;
}

/* dtype the logits are stored and multiplied in: CUDA keeps the input dtype
 * (bf16 logits, as x@Wᵀ in bf16 gives); the CPU computes bf16/f16 in f32 */
static int logits_dtype(int dtype, int device) {
    if (device >= 0) return dtype;
    return dtype == MS_F64 ? MS_F64 : MS_F32;
}

int64_t ms_flce_chunk_rows(const ms_flce_opts *o, int64_t bt, int64_t h, int64_t v, int dtype, int device) {
    if (bt <= 0) return 1;
    if (o && o->chunk_size > 0) return o->chunk_size < bt ? o->chunk_size : bt;
    int64_t es = ms_dtype_size(logits_dtype(dtype, device));
    int64_t budget = (o && o->memory_budget > 0) ? o->memory_budget : bt * (h > 0 ? h : 1) * es;
    /* on the GPU at least 512 MiB of logits: fewer chunks mean fewer passes
     * over the f32 grad_W accumulator (2·V·H·4 bytes each; measured on an
     * H100 at BT=8192, V=128256: 2048-row chunks 41.6 ms, 1024-row 46.4) */
    if (device >= 0 && !(o && o->memory_budget > 0) && budget < ((int64_t)512 << 20)) budget = (int64_t)512 << 20;
    int64_t rows = budget / ((v > 0 ? v : 1) * es);
    if (rows < 1) rows = 1;
    if (rows >= bt) return bt;
    if (device >= 0 && rows > 128) {
        /* as many chunks as the budget needs, of equal size (a multiple of
         * 128 rows, within the budget): no short last chunk paying a whole
         * pass over the accumulator */
        int64_t n = (bt + rows - 1) / rows;
        int64_t even = (bt + n - 1) / n;
        even = (even + 127) / 128 * 128;
        rows = even <= rows ? even : rows - rows % 128;
    }
    return rows;
}

/* ================================================================ side stream
 * On the GPU the grad_W GEMM of a chunk (and its bias column sum) runs on a
 * side stream while grad_x's GEMM runs on the current one: both only read the
 * chunk's dlogits, and the f32 accumulator's read-modify-write of the one
 * overlaps the other's math. The next chunk's logits GEMM, which overwrites
 * the buffer, waits for the side stream's event. */
#ifdef MS_WITH_CUDA
typedef struct flce_side {
    ms_cuda_stream *stream;
    ms_cuda_event *rows_done, *gw_done;
} flce_side;
static flce_side g_side[64];

static flce_side *side_of(int device) {
    if (device < 0 || device >= 64 || getenv("MS_FLCE_ONE_STREAM")) return NULL;
    flce_side *s = &g_side[device];
    if (!s->stream && ms_cuda_stream_new(&s->stream, device, 0)) return NULL;
    if (!s->rows_done && ms_cuda_event_new(&s->rows_done, device, 0)) return NULL;
    if (!s->gw_done && ms_cuda_event_new(&s->gw_done, device, 0)) return NULL;
    return s;
}
#endif

/* ================================================================ job */

/* Everything one call needs, in the form the device steps read it. */
typedef struct flce_job {
    const ms_flce_opts *o;
    int64_t bt, h, v;
    int device;
    int ldt;                 /* dtype of the logits buffer and GEMM operands */
    const ms_tensor *x, *w;  /* (BT, H), (V, H) in ldt */
    const ms_tensor *bias;   /* (V) contiguous, in ldt, or NULL */
    const ms_tensor *cew;    /* (V) contiguous ce_weight (f64 CPU, f32 CUDA) or NULL */
    const ms_tensor *tg;     /* (BT) contiguous targets, i64/i32 */
    const ms_tensor *gs;     /* (1) or (BT) contiguous grad_scale (f64 CPU, f32 CUDA) or NULL */
    ms_tensor *scal;         /* f64 (3) on x's device: D = Σ_valid w_y, Σw, N = #valid */
    double D, N, wsum;       /* CPU: the same, on the host */
    ms_tensor *rows;         /* (BT, 3): ce_i, zl_i, hit_i (f64 CPU, f32 CUDA) */
    int want_grad;
    /* vocabulary-parallel: this rank holds classes [v0, v0 + v) of vtot
     * (v0 = 0, vtot = v otherwise); vst (7·chunk), vmx (2·chunk): the
     * per-chunk statistics (f64 CPU, f32 CUDA) */
    struct ms_comm *comm;
    int64_t v0, vtot;
    ms_tensor *vst, *vmx;
} flce_job;

void ms_flce_vocab_shard(int64_t v, int rank, int size, int64_t *start, int64_t *rows) {
    int64_t per = size > 0 ? (v + size - 1) / size : v;
    int64_t a = per * rank, b = a + per;
    if (a > v) a = v;
    if (b > v) b = v;
    if (start) *start = a;
    if (rows) *rows = b - a;
}

/* ============================================================ CPU steps */

static int64_t target_at(const ms_tensor *tg, int64_t i) {
    const char *p = ms_tensor_data(tg);
    return tg->dtype_id == MS_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

// targets (BT); ce_weight (V) or none: every target valid or ignored, then
// scal = (D, Σw, N): D = Σ_valid w_y (N without weights), Σw (V without
// weights), N = #valid. With a vocabulary split, D and Σw are this rank's
// parts (targets and classes it holds), summed over the group afterwards.
static int cpu_prep(flce_job *j) {
    const double *w = j->cew ? (const double *)ms_tensor_data(j->cew) : NULL;
    double n = 0, d = 0, ws = 0;
    for (int64_t i = 0; i < j->bt; i++) {
        int64_t y = target_at(j->tg, i);
        if (y == j->o->ignore_index) continue;
        if (y < 0 || y >= j->vtot)
            return ms_errorf("%s: target %lld at position %lld is out of range for %lld classes (and is not "
                             "ignore_index = %lld)", OP, (long long)y, (long long)i, (long long)j->vtot,
                             (long long)j->o->ignore_index);
        n += 1;
        if (y >= j->v0 && y < j->v0 + j->v) d += w ? w[y - j->v0] : 1.0;
    }
    if (w)
        for (int64_t k = 0; k < j->v; k++) ws += w[k];
    else
        ws = (double)j->v;
    double *sc = ms_tensor_data(j->scal);
    sc[0] = d;
    sc[1] = ws;
    sc[2] = n;
    return 0;
}

static double row_value(const void *p, int dtype, int64_t k) {
    return dtype == MS_F64 ? ((const double *)p)[k] : (double)((const float *)p)[k];
}

// One token: lg (V) holds x_i·Wᵀ on entry and d(scaled loss)/d logits on
// exit (when grads are wanted); out[0..2] = ce_i, zl_i, hit_i. z (V) is
// scratch. Math in f64.
static void cpu_row(const flce_job *j, int64_t i, void *lg, double *z, double *out) {
    const ms_flce_opts *o = j->o;
    int64_t V = j->v, y = target_at(j->tg, i);
    int dt = j->ldt;
    const void *b = j->bias ? ms_tensor_data(j->bias) : NULL;
    const double *w = j->cew ? (const double *)ms_tensor_data(j->cew) : NULL;
    double s = o->softcap, eps = o->label_smoothing;
    out[0] = out[1] = out[2] = 0;
    if (y == o->ignore_index) {
        if (j->want_grad) memset(lg, 0, (size_t)(V * ms_dtype_size(dt)));
        return;
    }
    // logits with bias and softcap; max and first argmax
    double m = -INFINITY;
    int64_t am = 0;
    for (int64_t k = 0; k < V; k++) {
        double v = row_value(lg, dt, k) + (b ? row_value(b, dt, k) : 0.0);
        if (s > 0) v = s * tanh(v / s);
        z[k] = v;
        if (v > m) { m = v; am = k; }
    }
    double se = 0;
    for (int64_t k = 0; k < V; k++) se += exp(z[k] - m);
    double lse = m + log(se);
    double wy = w ? w[y] : 1.0;
    // grad_scale and the reduction's divisor
    double g = 1.0;
    if (j->gs) {
        const double *gp = ms_tensor_data(j->gs);
        g = ms_tensor_numel(j->gs) == 1 ? gp[0] : gp[i];
    }
    double c = g, cz = g;
    if (o->reduction == MS_FLCE_MEAN) {
        c = j->D > 0 ? g / j->D : 0.0;
        cz = j->N > 0 ? g / j->N : 0.0;
    }
    double zs = o->lse_square_scale;
    double coef_a = c * ((1 - eps) * wy + (eps / (double)j->vtot) * j->wsum) + cz * 2 * zs * lse;
    double coef_y = c * (1 - eps) * wy, coef_s = c * eps / (double)j->vtot;
    double smooth = 0;
    for (int64_t k = 0; k < V; k++) {
        double wk = w ? w[k] : 1.0;
        if (eps > 0) smooth += wk * (lse - z[k]);
        if (!j->want_grad) continue;
        double d = coef_a * exp(z[k] - lse) - coef_s * wk - (k == y ? coef_y : 0.0);
        if (s > 0) {
            double t = z[k] / s;
            d *= 1 - t * t;
        }
        if (dt == MS_F64) ((double *)lg)[k] = d;
        else ((float *)lg)[k] = (float)d;
    }
    out[0] = (1 - eps) * wy * (lse - z[y]) + (eps / (double)j->vtot) * smooth;
    out[1] = zs * lse * lse;
    out[2] = am == y ? 1.0 : 0.0;
}

// lg (n, V) contiguous: the chunk of rows [row0, row0 + n)
static int cpu_rows(flce_job *j, ms_tensor *lg, int64_t row0, int64_t n) {
    int64_t V = j->v;
    int es = ms_dtype_size(j->ldt);
    char *base = ms_tensor_data(lg);
    double *rows = (double *)ms_tensor_data(j->rows);
    int failed = 0;
#pragma omp parallel if (n > 1 && n * V > 32768)
    {
        double *z = malloc((size_t)V * sizeof(double));
        if (!z) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            if (z) cpu_row(j, row0 + r, base + r * V * es, z, rows + (row0 + r) * 3);
        free(z);
    }
    if (failed) return ms_errorf("%s: out of host memory for a row of %lld logits", OP, (long long)V);
    return 0;
}

// acc (V) f64 += column sums of dl (n, V), rows in order
static void cpu_colsum(double *acc, const ms_tensor *dl, int dt) {
    int64_t n = dl->sizes[0], V = dl->sizes[1];
    const char *p = ms_tensor_data(dl);
    int es = ms_dtype_size(dt);
#pragma omp parallel for schedule(static) if (n * V > 32768)
    for (int64_t k = 0; k < V; k++) {
        double a = acc[k];
        for (int64_t r = 0; r < n; r++) a += row_value(p + r * V * es, dt, k);
        acc[k] = a;
    }
}

/* rows of the vocabulary-parallel statistics st (7, n) */
enum { ST_M = 0, ST_BEST, ST_S, ST_ZY, ST_SWZ, ST_WY, ST_IDX, ST_ROWS };

// z (V) = this rank's logits of row lg with bias and softcap (f64)
static void cpu_capped(const flce_job *j, const void *lg, double *z) {
    const void *b = j->bias ? ms_tensor_data(j->bias) : NULL;
    double s = j->o->softcap;
    for (int64_t k = 0; k < j->v; k++) {
        double v = row_value(lg, j->ldt, k) + (b ? row_value(b, j->ldt, k) : 0.0);
        z[k] = s > 0 ? s * tanh(v / s) : v;
    }
}

// this rank's part of token i: lg (V) raw logits -> column r of st (7, n):
// max, best (the same value on the CPU), Σ exp(z - max), z_y, Σ w z, w_y
// (0 where this rank does not hold y), global index of the first max
static void cpu_vp_stats_row(const flce_job *j, int64_t i, const void *lg, double *z, double *st, int64_t n,
                             int64_t r) {
    const double *w = j->cew ? (const double *)ms_tensor_data(j->cew) : NULL;
    int64_t y = target_at(j->tg, i), yl = y - j->v0;
    double v[ST_ROWS] = {0, 0, 0, 0, 0, 0, INFINITY};
    if (y != j->o->ignore_index) {
        cpu_capped(j, lg, z);
        double m = -INFINITY, se = 0, swz = 0;
        int64_t am = -1;
        for (int64_t k = 0; k < j->v; k++)
            if (z[k] > m) { m = z[k]; am = k; }
        for (int64_t k = 0; k < j->v; k++) {
            se += exp(z[k] - m);
            swz += (w ? w[k] : 1.0) * z[k];
        }
        int local = yl >= 0 && yl < j->v;
        v[ST_M] = v[ST_BEST] = m;
        v[ST_S] = se;
        v[ST_ZY] = local ? z[yl] : 0.0;
        v[ST_SWZ] = swz;
        v[ST_WY] = local ? (w ? w[yl] : 1.0) : 0.0;
        v[ST_IDX] = am >= 0 ? (double)(j->v0 + am) : INFINITY;
    }
    for (int k = 0; k < ST_ROWS; k++) st[k * n + r] = v[k];
}

static int cpu_vp_stats(const flce_job *j, const ms_tensor *lg, ms_tensor *st, int64_t row0, int64_t n) {
    int64_t V = j->v;
    int es = ms_dtype_size(j->ldt);
    const char *base = ms_tensor_data(lg);
    double *sp = ms_tensor_data(st);
    int failed = 0;
#pragma omp parallel if (n > 1 && n * V > 32768)
    {
        double *z = malloc((size_t)(V > 0 ? V : 1) * sizeof(double));
        if (!z) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            if (z) cpu_vp_stats_row(j, row0 + r, base + r * V * es, z, sp, n, r);
        free(z);
    }
    if (failed) return ms_errorf("%s: out of host memory for a row of %lld logits", OP, (long long)V);
    return 0;
}

// mx (2, n): the group's max of (max, best); each rank's sum-exp moves to
// the global max, and its index stays only where it holds the global best
static void cpu_vp_fix(ms_tensor *st, const ms_tensor *mx, int64_t n) {
    double *sp = ms_tensor_data(st);
    const double *mp = ms_tensor_data(mx);
    for (int64_t r = 0; r < n; r++) {
        double m = sp[ST_M * n + r];
        sp[ST_S * n + r] = m == -INFINITY ? 0.0 : sp[ST_S * n + r] * exp(m - mp[r]);
        if (sp[ST_BEST * n + r] != mp[n + r]) sp[ST_IDX * n + r] = INFINITY;
    }
}

// token i from the group's statistics: rows (ce, zl, hit) and, in lg (this
// rank's V logits), d(g·loss)/d logits
static void cpu_vp_grad_row(const flce_job *j, int64_t i, void *lg, double *z, const double *st, const double *mx,
                            int64_t n, int64_t r, double *out) {
    const ms_flce_opts *o = j->o;
    const double *w = j->cew ? (const double *)ms_tensor_data(j->cew) : NULL;
    int64_t y = target_at(j->tg, i);
    int dt = j->ldt;
    out[0] = out[1] = out[2] = 0;
    if (y == o->ignore_index) {
        if (j->want_grad) memset(lg, 0, (size_t)(j->v * ms_dtype_size(dt)));
        return;
    }
    double eps = o->label_smoothing, zs = o->lse_square_scale, s = o->softcap;
    double lse = mx[r] + log(st[ST_S * n + r]);
    double wy = st[ST_WY * n + r];
    out[0] = (1 - eps) * wy * (lse - st[ST_ZY * n + r]) +
             (eps / (double)j->vtot) * (j->wsum * lse - st[ST_SWZ * n + r]);
    out[1] = zs * lse * lse;
    out[2] = st[ST_IDX * n + r] == (double)y ? 1.0 : 0.0;
    if (!j->want_grad) return;
    double g = 1.0;
    if (j->gs) {
        const double *gp = ms_tensor_data(j->gs);
        g = ms_tensor_numel(j->gs) == 1 ? gp[0] : gp[i];
    }
    double c = g, cz = g;
    if (o->reduction == MS_FLCE_MEAN) {
        c = j->D > 0 ? g / j->D : 0.0;
        cz = j->N > 0 ? g / j->N : 0.0;
    }
    double coef_a = c * ((1 - eps) * wy + (eps / (double)j->vtot) * j->wsum) + cz * 2 * zs * lse;
    double coef_y = c * (1 - eps) * wy, coef_s = c * eps / (double)j->vtot;
    cpu_capped(j, lg, z);
    for (int64_t k = 0; k < j->v; k++) {
        double d = coef_a * exp(z[k] - lse) - coef_s * (w ? w[k] : 1.0) - (k + j->v0 == y ? coef_y : 0.0);
        if (s > 0) {
            double t = z[k] / s;
            d *= 1 - t * t;
        }
        if (dt == MS_F64) ((double *)lg)[k] = d;
        else ((float *)lg)[k] = (float)d;
    }
}

static int cpu_vp_grad(const flce_job *j, ms_tensor *lg, const ms_tensor *st, const ms_tensor *mx, int64_t row0,
                       int64_t n) {
    int64_t V = j->v;
    int es = ms_dtype_size(j->ldt);
    char *base = ms_tensor_data(lg);
    const double *sp = ms_tensor_data(st), *mp = ms_tensor_data(mx);
    double *rows = (double *)ms_tensor_data(j->rows);
    int failed = 0;
#pragma omp parallel if (n > 1 && n * V > 32768)
    {
        double *z = malloc((size_t)(V > 0 ? V : 1) * sizeof(double));
        if (!z) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++)
            if (z) cpu_vp_grad_row(j, row0 + r, base + r * V * es, z, sp, mp, n, r, rows + (row0 + r) * 3);
        free(z);
    }
    if (failed) return ms_errorf("%s: out of host memory for a row of %lld logits", OP, (long long)V);
    return 0;
}

// rows (BT, 3) -> loss, z_loss (scalars, or (BT) for 'none'), accuracy
static int cpu_finish(const flce_job *j, ms_tensor *loss, ms_tensor *z_loss, ms_tensor *acc) {
    const double *rows = ms_tensor_data(j->rows);
    int red = j->o->reduction;
    double ce = 0, zl = 0, hit = 0;
    for (int64_t i = 0; i < j->bt; i++) {
        ce += rows[3 * i];
        zl += rows[3 * i + 1];
        hit += rows[3 * i + 2];
        if (red == MS_FLCE_NONE) {
            if (loss) ms_store((char *)ms_tensor_data(loss) + i * loss->strides[0] * ms_dtype_size(loss->dtype_id),
                               loss->dtype_id, rows[3 * i] + rows[3 * i + 1]);
            if (z_loss)
                ms_store((char *)ms_tensor_data(z_loss) + i * z_loss->strides[0] * ms_dtype_size(z_loss->dtype_id),
                         z_loss->dtype_id, rows[3 * i + 1]);
        }
    }
    if (red == MS_FLCE_MEAN) {
        ce = j->D > 0 ? ce / j->D : 0.0;
        zl = j->N > 0 ? zl / j->N : 0.0;
    }
    if (red != MS_FLCE_NONE) {
        if (loss) ms_store(ms_tensor_data(loss), loss->dtype_id, ce + zl);
        if (z_loss) ms_store(ms_tensor_data(z_loss), z_loss->dtype_id, zl);
    }
    if (acc) ms_store(ms_tensor_data(acc), acc->dtype_id, j->N > 0 ? hit / j->N : 0.0);
    return 0;
}

/* ========================================================= device steps */

static int dev_prep(flce_job *j) {
#ifdef MS_WITH_CUDA
    if (j->device >= 0)
        return ms_cuda_flce_prep(j->tg, j->cew, j->v0, j->v, j->vtot, j->o->ignore_index, j->scal);
#endif
    return cpu_prep(j);
}

#ifdef MS_WITH_CUDA
static ms_flce_params cuda_params(const flce_job *j, int64_t row0, int64_t n) {
    ms_flce_params p = {.n = n,
                        .row0 = row0,
                        .v = j->v,
                        .ignore_index = j->o->ignore_index,
                        .label_smoothing = (float)j->o->label_smoothing,
                        .lse_square_scale = (float)j->o->lse_square_scale,
                        .softcap = (float)j->o->softcap,
                        .reduction = j->o->reduction,
                        .want_grad = j->want_grad,
                        .v0 = j->v0,
                        .vtot = j->vtot};
    return p;
}
#endif

static int dev_rows(flce_job *j, ms_tensor *lg, int64_t row0, int64_t n) {
#ifdef MS_WITH_CUDA
    if (j->device >= 0) {
        ms_flce_params p = cuda_params(j, row0, n);
        return ms_cuda_flce_rows(lg, j->bias, j->cew, j->tg, j->gs, j->scal, j->rows, &p);
    }
#endif
    return cpu_rows(j, lg, row0, n);
}

static int dev_vp_stats(flce_job *j, const ms_tensor *lg, ms_tensor *st, int64_t row0, int64_t n) {
#ifdef MS_WITH_CUDA
    if (j->device >= 0) {
        ms_flce_params p = cuda_params(j, row0, n);
        return ms_cuda_flce_vp_stats(lg, j->bias, j->cew, j->tg, st, &p);
    }
#endif
    return cpu_vp_stats(j, lg, st, row0, n);
}

static int dev_vp_fix(ms_tensor *st, const ms_tensor *mx, int64_t n) {
#ifdef MS_WITH_CUDA
    if (st->device_id >= 0) return ms_cuda_flce_vp_fix(st, mx);
#endif
    cpu_vp_fix(st, mx, n);
    return 0;
}

static int dev_vp_grad(flce_job *j, ms_tensor *lg, const ms_tensor *st, const ms_tensor *mx, int64_t row0, int64_t n) {
#ifdef MS_WITH_CUDA
    if (j->device >= 0) {
        ms_flce_params p = cuda_params(j, row0, n);
        return ms_cuda_flce_vp_grad(lg, j->bias, j->cew, j->tg, j->gs, j->scal, st, mx, j->rows, &p);
    }
#endif
    return cpu_vp_grad(j, lg, st, mx, row0, n);
}

/* the vocabulary-parallel row pass of one chunk (see the top of this file):
 * local statistics, three all-reduces of a few values per token, gradient */
static int vp_rows(flce_job *j, ms_tensor *lg, int64_t row0, int64_t n) {
    ms_tensor *st = NULL, *mx = NULL, *top = NULL, *sums = NULL, *idx = NULL;
    int64_t s7[2] = {ST_ROWS, n}, s2[2] = {2, n}, stride[2] = {n, 1};
    int rc = ms_tensor_as_strided(&st, j->vst, 2, s7, stride, j->vst->offset);
    if (!rc) rc = ms_tensor_as_strided(&mx, j->vmx, 2, s2, stride, j->vmx->offset);
    if (!rc) rc = ms_tensor_narrow(&top, st, 0, ST_M, 2);
    if (!rc) rc = ms_tensor_narrow(&sums, st, 0, ST_S, 4);
    if (!rc) rc = ms_tensor_narrow(&idx, st, 0, ST_IDX, 1);
    if (!rc) rc = dev_vp_stats(j, lg, st, row0, n);
    if (!rc) rc = ms_tensor_copy_(mx, top);
    if (!rc) rc = ms_comm_all_reduce(NULL, j->comm, mx, MS_REDUCE_MAX);
    if (!rc) rc = dev_vp_fix(st, mx, n);
    if (!rc) rc = ms_comm_all_reduce(NULL, j->comm, sums, MS_REDUCE_SUM);
    if (!rc) rc = ms_comm_all_reduce(NULL, j->comm, idx, MS_REDUCE_MIN);
    if (!rc) rc = dev_vp_grad(j, lg, st, mx, row0, n);
    ms_tensor_free(st);
    ms_tensor_free(mx);
    ms_tensor_free(top);
    ms_tensor_free(sums);
    ms_tensor_free(idx);
    return rc;
}

/* out = alpha·op(a)@op(b) + beta·out; out may be f32 with bf16/f16
 * operands on CUDA (grad_W's f32 accumulation) */
static int dev_gemm(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb, double beta) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) {
        if (out->dtype_id == a->dtype_id || (ms_cuda_gemm_mixed_ok && ms_cuda_gemm_mixed_ok()))
            return ms_cuda_gemm(out, a, b, transa, transb, 1.0, beta);
        /* no mixed-dtype GEMM yet: f32 copies of the operands (slow, exact) */
        ms_tensor *a32 = NULL, *b32 = NULL;
        int rc = ms_tensor_to(&a32, a, out->dtype_id, a->device_id);
        if (!rc) rc = ms_tensor_to(&b32, b, out->dtype_id, b->device_id);
        if (!rc) rc = ms_cuda_gemm(out, a32, b32, transa, transb, 1.0, beta);
        ms_tensor_free(a32);
        ms_tensor_free(b32);
        return rc;
    }
#endif
    return ms_gemm_(out, a, b, transa, transb, 1.0, beta);
}

/* ============================================================== checks */

static int same_device(const ms_tensor *x, const ms_tensor *t, const char *what) {
    char a[DESC], b[DESC];
    if (!t) return 0;
    if (ms_tensor_check_live(t, OP)) return -1;
    if (t->device_id != x->device_id)
        return ms_errorf("%s: %s %s is not on the device of x %s", OP, what, ms_desc(t, a, sizeof a),
                         ms_desc(x, b, sizeof b));
    return 0;
}

static int check_args(const ms_flce_opts *o, const ms_tensor *x, const ms_tensor *w, const ms_tensor *tg,
                      const ms_tensor *bias, const ms_tensor *cew, const ms_tensor *gs) {
    char a[DESC], b[DESC];
    if (!x || !w || !tg) return ms_errorf("%s: x, W and targets are required", OP);
    if (ms_tensor_check_live(x, OP) || same_device(x, w, "W") || same_device(x, tg, "targets") ||
        same_device(x, bias, "bias") || same_device(x, cew, "ce_weight") || same_device(x, gs, "grad_scale"))
        return -1;
#ifndef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", OP);
#endif
    if (x->ndim != 2) return ms_errorf("%s: x must be 2-D (BT, H), got %s", OP, ms_desc(x, a, sizeof a));
    if (w->ndim != 2) return ms_errorf("%s: W must be 2-D (V, H), got %s", OP, ms_desc(w, a, sizeof a));
    if (!ms_is_float(x->dtype_id)) return ms_errorf("%s: x must be a float tensor, got %s", OP, ms_desc(x, a, sizeof a));
    if (w->dtype_id != x->dtype_id)
        return ms_errorf("%s: x %s and W %s differ in dtype", OP, ms_desc(x, a, sizeof a), ms_desc(w, b, sizeof b));
    if (x->device_id >= 0 && x->dtype_id == MS_F64)
        return ms_errorf("%s: f64 is not supported on cuda (x %s); use f32, bf16 or f16", OP, ms_desc(x, a, sizeof a));
    if (w->sizes[1] != x->sizes[1])
        return ms_errorf("%s: x %s and W %s differ in the hidden size (%lld vs %lld)", OP, ms_desc(x, a, sizeof a),
                         ms_desc(w, b, sizeof b), (long long)x->sizes[1], (long long)w->sizes[1]);
    if (o->group) {
        int gdev = ms_comm_device(o->group);
        if (gdev != x->device_id)
            return ms_errorf("%s: the group's collectives run on %s but x is %s (MPI groups take CPU tensors, NCCL "
                             "groups those of their GPU)", OP, gdev < 0 ? "the CPU" : "a GPU", ms_desc(x, a, sizeof a));
        if (o->vocab_size < 1 || o->vocab_start < 0 || o->vocab_start + w->sizes[0] > o->vocab_size)
            return ms_errorf("%s: W %s holds classes [%lld, %lld), not within a vocabulary of %lld", OP,
                             ms_desc(w, a, sizeof a), (long long)o->vocab_start,
                             (long long)(o->vocab_start + w->sizes[0]), (long long)o->vocab_size);
        if (x->device_id >= 0 && o->vocab_size >= ((int64_t)1 << 24))
            return ms_errorf("%s: a vocabulary of %lld classes is too large for the vocabulary-parallel mode on "
                             "cuda (class ids travel as f32)", OP, (long long)o->vocab_size);
    } else if (w->sizes[0] < 1) {
        return ms_errorf("%s: W %s has no classes", OP, ms_desc(w, a, sizeof a));
    }
    if (o->grad_x_partial && !o->group)
        return ms_errorf("%s: grad_x_partial needs the vocabulary-parallel mode (a group)", OP);
    if (tg->dtype_id != MS_I64 && tg->dtype_id != MS_I32)
        return ms_errorf("%s: targets must be i64 or i32 class ids, got %s", OP, ms_desc(tg, a, sizeof a));
    if (tg->ndim != 1 || tg->sizes[0] != x->sizes[0])
        return ms_errorf("%s: targets %s must be 1-D with one id per row of x %s", OP, ms_desc(tg, a, sizeof a),
                         ms_desc(x, b, sizeof b));
    int64_t V = w->sizes[0];
    if (bias && (bias->ndim != 1 || bias->sizes[0] != V || bias->dtype_id != x->dtype_id))
        return ms_errorf("%s: bias %s must be (%lld) and of x's dtype %s", OP, ms_desc(bias, a, sizeof a),
                         (long long)V, ms_dtype_name(x->dtype_id));
    if (cew && (cew->ndim != 1 || cew->sizes[0] != V || !ms_is_float(cew->dtype_id)))
        return ms_errorf("%s: ce_weight %s must be a float tensor of shape (%lld), one weight per class", OP,
                         ms_desc(cew, a, sizeof a), (long long)V);
    if (gs && (!ms_is_float(gs->dtype_id) ||
               !(ms_tensor_numel(gs) == 1 || (gs->ndim == 1 && gs->sizes[0] == x->sizes[0]))))
        return ms_errorf("%s: grad_scale %s must be a float tensor of one element or of shape (%lld)", OP,
                         ms_desc(gs, a, sizeof a), (long long)x->sizes[0]);
    if (o->reduction != MS_FLCE_MEAN && o->reduction != MS_FLCE_SUM && o->reduction != MS_FLCE_NONE)
        return ms_errorf("%s: reduction %d is not one of mean (0), sum (1), none (2)", OP, (int)o->reduction);
    if (!(o->label_smoothing >= 0 && o->label_smoothing <= 1))
        return ms_errorf("%s: label_smoothing must be in [0, 1], got %g", OP, o->label_smoothing);
    if (!(o->softcap >= 0) || isinf(o->softcap))
        return ms_errorf("%s: softcap must be a finite number >= 0 (0: off), got %g", OP, o->softcap);
    if (!isfinite(o->lse_square_scale))
        return ms_errorf("%s: lse_square_scale must be finite, got %g", OP, o->lse_square_scale);
    if (o->chunk_size < 0 || o->memory_budget < 0)
        return ms_errorf("%s: chunk_size (%lld) and memory_budget (%lld) must be >= 0", OP, (long long)o->chunk_size,
                         (long long)o->memory_budget);
    if (o->accum_dtype != -1 && o->accum_dtype != w->dtype_id && o->accum_dtype != MS_F32 &&
        !(o->accum_dtype == MS_F64 && w->dtype_id == MS_F64))
        return ms_errorf("%s: accum_dtype must be f32 or W's dtype %s, got %s", OP, ms_dtype_name(w->dtype_id),
                         o->accum_dtype >= 0 && o->accum_dtype < MS_NUM_DTYPES ? ms_dtype_name(o->accum_dtype) : "?");
    if (o->grad_dtype != -1 && o->grad_dtype != w->dtype_id && o->grad_dtype != MS_F32 &&
        !(o->grad_dtype == MS_F64 && w->dtype_id == MS_F64))
        return ms_errorf("%s: grad_dtype must be f32 or W's dtype %s, got %s", OP, ms_dtype_name(w->dtype_id),
                         o->grad_dtype >= 0 && o->grad_dtype < MS_NUM_DTYPES ? ms_dtype_name(o->grad_dtype) : "?");
    return 0;
}

/* a contiguous copy of t in dtype (t itself when it already is one) */
static int as_dense(const ms_tensor *t, int dtype, ms_tensor **tmp, const ms_tensor **use) {
    *tmp = NULL;
    *use = t;
    if (!t) return 0;
    if (t->dtype_id == dtype && ms_tensor_is_contiguous(t)) return 0;
    if (t->dtype_id == dtype) {
        if (ms_tensor_contiguous(tmp, t)) return -1;
    } else if (ms_tensor_to(tmp, t, dtype, t->device_id)) {
        return -1;
    }
    *use = *tmp;
    return 0;
}

/* allocate *slot (when it holds NULL) or check the given tensor */
static int prepare(ms_tensor **slot, int ndim, const int64_t *shape, int dtype, int device, int *allocated) {
    *allocated = 0;
    if (!slot) return 0;
    *allocated = *slot == NULL;
    return ms_prepare_more(slot, OP, ndim, shape, dtype, device);   /* (the call counted at entry) */
}

/* ================================================================ entry */

int ms_flce(const ms_flce_opts *opts, const ms_tensor *x, const ms_tensor *w, const ms_tensor *targets,
            const ms_tensor *bias, const ms_tensor *ce_weight, const ms_tensor *grad_scale, ms_tensor **loss,
            ms_tensor **z_loss, ms_tensor **accuracy, ms_tensor **grad_x, ms_tensor **grad_w,
            ms_tensor **grad_bias) {
    if (ms_prof_on && x) ms_prof_note("flce", x->device_id, 1, 0, 0);   /* (its outputs count as prepared) */
    ms_flce_opts defaults;
    if (!opts) {
        ms_flce_opts_init(&defaults);
        opts = &defaults;
    }
    if (check_args(opts, x, w, targets, bias, ce_weight, grad_scale)) return -1;

    const int64_t BT = x->sizes[0], H = x->sizes[1], V = w->sizes[0];
    const int device = x->device_id, xdt = x->dtype_id;
    const int ldt = logits_dtype(xdt, device);
    const int sdt = device >= 0 ? MS_F32 : MS_F64;     /* per-row statistics */
    const int odt = xdt == MS_F64 ? MS_F64 : MS_F32;   /* loss outputs */
    const int red = opts->reduction;
    int acc_dt = opts->accum_dtype < 0 ? (ldt == MS_F64 ? MS_F64 : MS_F32) : opts->accum_dtype;
    if (device < 0) acc_dt = ldt; /* the CPU computes bf16/f16 in f32 anyway */
    const int want_grad = grad_x || grad_w || grad_bias;

    flce_job j = {.o = opts, .bt = BT, .h = H, .v = V, .device = device, .ldt = ldt, .want_grad = want_grad,
                  .comm = opts->group, .v0 = opts->group ? opts->vocab_start : 0,
                  .vtot = opts->group ? opts->vocab_size : V};
    ms_tensor *owned[20] = {NULL};
    int nowned = 0;
#define OWN(t) (owned[nowned++] = (t))
    ms_tensor *tmp = NULL, *lbuf = NULL, *gx = NULL, *gw_acc = NULL, *gb_acc = NULL;
    const ms_tensor *use = NULL;
    int al[6] = {0};
    ms_tensor **outs[6] = {loss, z_loss, accuracy, grad_x, grad_w, grad_bias};
    int rc = -1;

    /* outputs: loss-like ones now, gradients now too (a given one is checked
     * before any work; grad_W/grad_bias are written only at the end) */
    int64_t bt_shape[1] = {BT};
    int lnd = red == MS_FLCE_NONE ? 1 : 0;
    if (grad_bias && !bias) {
        ms_errorf("%s: grad_bias asked for without a bias", OP);
        goto done;
    }
    /* grad_W / grad_bias accumulated apart from the output: a new output is
     * allocated only after the chunk buffer is given back (a lower peak) */
    /* the gradients' dtypes: W's and bias's, or opts->grad_dtype */
    const int gdt = opts->grad_dtype < 0 ? w->dtype_id : opts->grad_dtype;
    const int gbdt = !bias ? gdt : (opts->grad_dtype < 0 ? bias->dtype_id : opts->grad_dtype);
    const int late_w = grad_w && !*grad_w && acc_dt != gdt;
    const int late_b = grad_bias && !*grad_bias && (device < 0 || acc_dt != gbdt);
    if (prepare(loss, lnd, bt_shape, odt, device, &al[0]) || prepare(z_loss, lnd, bt_shape, odt, device, &al[1]) ||
        prepare(accuracy, 0, bt_shape, odt, device, &al[2]) || prepare(grad_x, 2, x->sizes, xdt, device, &al[3]) ||
        prepare(late_w ? NULL : grad_w, 2, w->sizes, gdt, device, &al[4]) ||
        (bias && prepare(late_b ? NULL : grad_bias, 1, w->sizes, gbdt, device, &al[5])))
        goto done;

    /* inputs in the form the steps read */
    if (as_dense(x, ldt, &tmp, &use)) goto done;
    if (tmp) OWN(tmp);
    j.x = use;
    if (ldt != xdt) { /* CPU bf16/f16: W in f32 too (x was converted above) */
        if (ms_tensor_to(&tmp, w, ldt, device)) goto done;
        OWN(tmp);
        j.w = tmp;
    } else {
        j.w = w;
    }
    if (as_dense(bias, ldt, &tmp, &use)) goto done;
    if (tmp) OWN(tmp);
    j.bias = use;
    if (as_dense(ce_weight, sdt, &tmp, &use)) goto done;
    if (tmp) OWN(tmp);
    j.cew = use;
    if (as_dense(targets, targets->dtype_id, &tmp, &use)) goto done;
    if (tmp) OWN(tmp);
    j.tg = use;
    if (grad_scale) {
        int64_t n1 = ms_tensor_numel(grad_scale);
        ms_tensor *flat = NULL;
        if (ms_tensor_reshape(&flat, grad_scale, 1, &n1)) goto done;
        OWN(flat);
        if (as_dense(flat, sdt, &tmp, &use)) goto done;
        if (tmp) OWN(tmp);
        j.gs = use;
    }
    int64_t rshape[2] = {BT, 3};
    if (ms_tensor_empty(&j.rows, 2, rshape, sdt, device)) goto done;
    OWN(j.rows);
    int64_t three = 3;
    if (ms_tensor_empty(&j.scal, 1, &three, MS_F64, device)) goto done;
    OWN(j.scal);
    if (dev_prep(&j)) goto done;
    if (j.comm) { /* D and Σw from every rank's classes */
        ms_tensor *part = NULL;
        int r = ms_tensor_narrow(&part, j.scal, 0, 0, 2);
        if (!r) r = ms_comm_all_reduce(NULL, j.comm, part, MS_REDUCE_SUM);
        ms_tensor_free(part);
        if (r) goto done;
    }
    if (device < 0) {
        const double *sc = ms_tensor_data(j.scal);
        j.D = sc[0];
        j.wsum = sc[1];
        j.N = sc[2];
    }

    /* gradient destinations: grad_x rows are written chunk by chunk (in the
     * logits dtype when that differs: CPU bf16/f16); grad_W and grad_bias
     * accumulate in acc_dt, into the output itself when the dtypes agree */
    if (grad_x) {
        if (ldt == xdt) {
            gx = *grad_x;
        } else {
            if (ms_tensor_empty(&gx, 2, x->sizes, ldt, device)) goto done;
            OWN(gx);
        }
    }
    if (grad_w) {
        if (acc_dt == gdt) {
            gw_acc = *grad_w;
        } else {
            if (ms_tensor_empty(&gw_acc, 2, w->sizes, acc_dt, device)) goto done;
            OWN(gw_acc);
        }
    }
    double *gb_host = NULL; /* CPU grad_bias accumulator (f64) */
    if (grad_bias) {
        if (device < 0) {
            if (ms_tensor_empty(&gb_acc, 1, w->sizes, MS_F64, device)) goto done;
            OWN(gb_acc);
            gb_host = ms_tensor_data(gb_acc);
            memset(gb_host, 0, (size_t)V * sizeof(double));
        } else if (acc_dt == gbdt) {
            gb_acc = *grad_bias;
        } else {
            if (ms_tensor_empty(&gb_acc, 1, w->sizes, acc_dt, device)) goto done;
            OWN(gb_acc);
        }
    }

    /* the chunk loop */
    /* the same chunks on every rank of a group (their collectives must
     * match): from the classes per rank, not from this rank's count */
    int64_t vchunk = j.comm ? (j.vtot + ms_comm_size(j.comm) - 1) / ms_comm_size(j.comm) : V;
    int64_t chunk = ms_flce_chunk_rows(opts, BT, H, vchunk, xdt, device);
    int64_t bshape[2] = {chunk, V};
    if (BT > 0 && ms_tensor_empty(&lbuf, 2, bshape, ldt, device)) goto done;
    if (lbuf) OWN(lbuf);
    if (j.comm && BT > 0) {
        int64_t n7 = ST_ROWS * chunk, n2 = 2 * chunk;
        if (ms_tensor_empty(&j.vst, 1, &n7, sdt, device)) goto done;
        OWN(j.vst);
        if (ms_tensor_empty(&j.vmx, 1, &n2, sdt, device)) goto done;
        OWN(j.vmx);
    }
    if (BT == 0 && grad_w && ms_fill_(gw_acc, 0.0)) goto done;
    if (BT == 0 && gb_acc && device >= 0 && ms_fill_(gb_acc, 0.0)) goto done;
    for (int64_t r0 = 0; r0 < BT; r0 += chunk) {
        int64_t n = BT - r0 < chunk ? BT - r0 : chunk;
        ms_tensor *lg = NULL, *xc = NULL, *gxc = NULL;
        rc = ms_tensor_narrow(&lg, lbuf, 0, 0, n);
        if (!rc) rc = ms_tensor_narrow(&xc, j.x, 0, r0, n);
        if (!rc) rc = dev_gemm(lg, xc, j.w, 0, 1, 0.0);                 /* logits (n, V) = x_c Wᵀ */
        if (!rc) rc = j.comm ? vp_rows(&j, lg, r0, n) : dev_rows(&j, lg, r0, n); /* -> dlogits, rows */
#ifdef MS_WITH_CUDA
        ms_cuda_stream *prev = NULL;
        flce_side *sd = (!rc && device >= 0 && !j.comm && gx && (gw_acc || gb_acc)) ? side_of(device) : NULL;
        /* grad_x's and grad_W's GEMMs run side by side: not tuned (a GEMM
         * timed alone ranks differently beside another; docs/tensors.md) */
        int tune_was = sd ? ms_cuda_gemm_set_tune(0) : -1;
        if (sd) { /* grad_W (and grad_bias) on the side stream, after the row pass */
            prev = ms_cuda_current_stream(device);
            rc = ms_cuda_event_record(sd->rows_done, prev);
            if (!rc) rc = ms_cuda_stream_wait_event(sd->stream, sd->rows_done);
            if (!rc) rc = ms_cuda_set_current_stream(sd->stream);
            if (!rc) {
                if (gw_acc) rc = dev_gemm(gw_acc, lg, xc, 1, 0, r0 == 0 ? 0.0 : 1.0);
                if (!rc && gb_acc) rc = ms_cuda_flce_colsum(gb_acc, lg, r0 > 0);
                if (!rc) rc = ms_cuda_event_record(sd->gw_done, sd->stream);
                if (ms_cuda_set_current_stream(prev) && !rc) rc = -1;
            }
        }
#else
        void *sd = NULL;
#endif
        if (!rc && gx) {
            rc = ms_tensor_narrow(&gxc, gx, 0, r0, n);
            if (!rc) rc = dev_gemm(gxc, lg, j.w, 0, 0, 0.0);            /* grad_x (n, H) = dl W */
        }
#ifdef MS_WITH_CUDA
        if (tune_was >= 0) ms_cuda_gemm_set_tune(tune_was);
#endif
        if (!sd) {
            if (!rc && gw_acc) rc = dev_gemm(gw_acc, lg, xc, 1, 0, r0 == 0 ? 0.0 : 1.0); /* grad_W += dlᵀ x_c */
            if (!rc && gb_acc) {
#ifdef MS_WITH_CUDA
                if (device >= 0) rc = ms_cuda_flce_colsum(gb_acc, lg, r0 > 0);
                else
#endif
                    cpu_colsum(gb_host, lg, ldt);
            }
        }
#ifdef MS_WITH_CUDA
        /* the next chunk's GEMM overwrites the buffer the side stream reads */
        if (sd && ms_cuda_stream_wait_event(prev, sd->gw_done) && !rc) rc = -1;
        if (prev) ms_cuda_stream_free(prev); /* the handle only: not an owned stream */
#endif
        ms_tensor_free(lg);
        ms_tensor_free(xc);
        ms_tensor_free(gxc);
        if (rc) goto done;
    }
    rc = -1;
    if (lbuf) { /* give the chunk's memory back before the casts below */
        ms_tensor_release(lbuf);
    }

    /* outputs */
#ifdef MS_WITH_CUDA
    if (device >= 0) {
        if (ms_cuda_flce_finish(j.rows, j.scal, red, loss ? *loss : NULL, z_loss ? *z_loss : NULL,
                                accuracy ? *accuracy : NULL))
            goto done;
    } else
#endif
        if (cpu_finish(&j, loss ? *loss : NULL, z_loss ? *z_loss : NULL, accuracy ? *accuracy : NULL))
        goto done;
    if (j.comm && gx && !opts->grad_x_partial) { /* every rank's classes' part of grad_x */
        if (!ms_tensor_is_contiguous(gx)) {
            ms_errorf("%s: grad_x must be contiguous in the vocabulary-parallel mode", OP);
            goto done;
        }
        if (ms_comm_all_reduce(NULL, j.comm, gx, MS_REDUCE_SUM)) goto done;
    }
    if (grad_x && gx != *grad_x && ms_tensor_copy_(*grad_x, gx)) goto done;
    if (late_w && prepare(grad_w, 2, w->sizes, gdt, device, &al[4])) goto done;
    if (grad_w && gw_acc != *grad_w && ms_tensor_copy_(*grad_w, gw_acc)) goto done;
    if (gw_acc && gw_acc != *grad_w) ms_tensor_release(gw_acc); /* before grad_bias: a lower peak */
    if (late_b && prepare(grad_bias, 1, w->sizes, gbdt, device, &al[5])) goto done;
    if (grad_bias && gb_acc != *grad_bias && ms_tensor_copy_(*grad_bias, gb_acc)) goto done;
    rc = 0;
done:
#undef OWN
    for (int k = 0; k < nowned; k++) ms_tensor_free(owned[k]);
    if (rc)
        for (int k = 0; k < 6; k++)
            if (al[k] && outs[k] && *outs[k]) {
                ms_tensor_free(*outs[k]);
                *outs[k] = NULL;
            }
    return rc;
}

/* ================================================================ scale */

int ms_flce_scale_(ms_tensor *t, const ms_tensor *g) {
    char a[DESC], b[DESC];
    if (ms_tensor_check_live(t, "flce_scale_") || ms_tensor_check_live(g, "flce_scale_")) return -1;
    if (t->device_id != g->device_id || ms_tensor_numel(g) != 1 || !ms_is_float(g->dtype_id) ||
        !ms_is_float(t->dtype_id))
        return ms_errorf("flce_scale_: needs a float tensor and a float scale of one element on its device, got %s "
                         "and %s", ms_desc(t, a, sizeof a), ms_desc(g, b, sizeof b));
#ifdef MS_WITH_CUDA
    if (t->device_id >= 0) return ms_cuda_flce_scale(t, g);
#else
    if (t->device_id >= 0) return ms_errorf("flce_scale_: cuda tensors need a build with CUDA");
#endif
    double s = ms_load(ms_tensor_data(g), g->dtype_id);
    if (s == 1.0) return 0;
    return ms_binary_scalar(&t, MS_OP_MUL, t, s, 0);
}
