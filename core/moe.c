/* core/moe.c — the experts of a mixture-of-experts layer (core/ops.h,
 * moonshard.nn.moe): each expert's run of rows through its SwiGLU MLP, the
 * loop over the experts in C so that a layer costs one call from Lua
 * instead of a dozen ops an expert. Every product is ms_gemm_ (cuBLASLt on
 * CUDA, OpenBLAS on the CPU) into a view of the outputs; the activations
 * are ms_binary's SwiGLU and SiLU-backward passes. */
#include "internal.h"
#include "prof.h"
#include "ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DESC 160

static int check_rows(const char *op, const char *what, const ms_tensor *t, int64_t r, int64_t h, const ms_tensor *like);

/* rows [off, off + n) of t (a view), or NULL with the error set */
static ms_tensor *rows_of(const ms_tensor *t, int64_t off, int64_t n) {
    ms_tensor *v = NULL;
    if (ms_tensor_narrow(&v, t, 0, off, n)) return NULL;
    return v;
}

static int check_2d(const char *op, const char *what, const ms_tensor *t, int64_t r, int64_t c, const ms_tensor *like) {
    char x[DESC];
    if (!t) return ms_errorf("%s: %s is missing", op, what);
    if (t->ndim != 2 || (r >= 0 && t->sizes[0] != r) || (c >= 0 && t->sizes[1] != c))
        return ms_errorf("%s: %s must be (%lld, %lld), got %s", op, what, (long long)r, (long long)c,
                         ms_desc(t, x, sizeof x));
    if (like && (t->device_id != like->device_id))
        return ms_errorf("%s: %s is on another device than the rows: %s", op, what, ms_desc(t, x, sizeof x));
    return 0;
}

/* the experts' weights in one flat tensor: expert e's gate w1 (I, H), up
 * w3 (I, H) and down w2 (H, I) in turn at e x 3 I H, as ms_cast_flat lays
 * out [w1, w3, w2, ...] */
static int check_flat(const char *op, const ms_tensor *f, int E, int64_t I, int64_t H, const ms_tensor *xs) {
    char x[DESC];
    if (!f) return ms_errorf("%s: the experts' weights are missing", op);
    if (ms_tensor_check_live(f, op)) return -1;
    if (!ms_tensor_is_contiguous(f) || ms_tensor_numel(f) != (int64_t)E * 3 * I * H)
        return ms_errorf("%s: the experts' weights must be one contiguous tensor of %d x 3 x %lld x %lld elements "
                         "(each expert's gate, up and down in turn), got %s", op, E, (long long)I, (long long)H,
                         ms_desc(f, x, sizeof x));
    if (f->device_id != xs->device_id)
        return ms_errorf("%s: the experts' weights are on another device than the rows: %s", op,
                         ms_desc(f, x, sizeof x));
    return 0;
}

/* each expert's gate and up (I, H) and down (H, I) gradients, on the rows'
 * device */
static int check_grads(const char *op, ms_tensor **d1, ms_tensor **d3, ms_tensor **d2, int E, int64_t I, int64_t H,
                       const ms_tensor *xs) {
    if (!d1 || !d3 || !d2) return ms_errorf("%s: the experts' gradients are missing", op);
    for (int e = 0; e < E; e++) {
        char what[64];
        snprintf(what, sizeof what, "expert %d's gate gradient", e);
        if (check_2d(op, what, d1[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's up gradient", e);
        if (check_2d(op, what, d3[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's down gradient", e);
        if (check_2d(op, what, d2[e], H, I, xs)) return -1;
    }
    return 0;
}

/* the shapes every call shares: xs (M, H), rows summing to M, gu (M, 2 I),
 * the flat weights in the rows' dtype */
static int check_common(const char *op, const ms_tensor *xs, const ms_tensor *gu, const ms_tensor *wf,
                        const int64_t *rows, int E, int64_t *I_out) {
    char x[DESC];
    if (!xs || xs->ndim != 2) return ms_errorf("%s: xs must be 2-D (rows, hidden), got %s", op, xs ? ms_desc(xs, x, sizeof x) : "NULL");
    if (ms_tensor_check_live(xs, op)) return -1;
    if (E < 1 || !rows) return ms_errorf("%s: %d experts, or their rows missing", op, E);
    int64_t M = xs->sizes[0], H = xs->sizes[1], sum = 0;
    for (int e = 0; e < E; e++) {
        if (rows[e] < 0) return ms_errorf("%s: expert %d has %lld rows", op, e, (long long)rows[e]);
        sum += rows[e];
    }
    if (sum != M) return ms_errorf("%s: the experts' rows sum to %lld, but xs has %lld", op, (long long)sum, (long long)M);
    if (!gu || gu->ndim != 2 || gu->sizes[1] % 2 || gu->sizes[1] == 0)
        return ms_errorf("%s: gu must be (rows, 2 x hidden of an expert), got %s", op, gu ? ms_desc(gu, x, sizeof x) : "NULL");
    int64_t I = gu->sizes[1] / 2;
    if (check_2d(op, "gu", gu, M, 2 * I, xs) || check_flat(op, wf, E, I, H, xs)) return -1;
    if (wf->dtype_id != xs->dtype_id || gu->dtype_id != xs->dtype_id)
        return ms_errorf("%s: the weights (%s) and gu must have the rows' dtype (%s)", op, ms_dtype_name(wf->dtype_id),
                         ms_desc(xs, x, sizeof x));
    *I_out = I;
    return 0;
}

/* each expert's gate-and-up block [w1; w3] (2 I, H) and down w2 (H, I) of a
 * flat tensor, as views */
typedef struct {
    ms_tensor **w13, **w2;
} flat_views;

static int flat_views_of(flat_views *fv, const ms_tensor *f, int E, int64_t I, int64_t H) {
    fv->w13 = (ms_tensor **)calloc(2 * (size_t)E, sizeof(ms_tensor *));
    fv->w2 = fv->w13 ? fv->w13 + E : NULL;
    if (!fv->w13) return ms_errorf("moe experts: out of host memory");
    for (int e = 0; e < E; e++) {
        int64_t base = f->offset + (int64_t)e * 3 * I * H;
        if (ms_tensor_as_strided(&fv->w13[e], f, 2, (int64_t[]){2 * I, H}, (int64_t[]){H, 1}, base) ||
            ms_tensor_as_strided(&fv->w2[e], f, 2, (int64_t[]){H, I}, (int64_t[]){I, 1}, base + 2 * I * H))
            return -1;
    }
    return 0;
}

static void flat_views_free(flat_views *fv, int E) {
    if (fv->w13)
        for (int e = 0; e < 2 * E; e++) ms_tensor_free(fv->w13[e]);
    free(fv->w13);
    fv->w13 = fv->w2 = NULL;
}

/* each expert's rows [off_e, off_e + rows[e]) of up to four (M, .) tensors
 * as views, into v[i][e]; experts without rows get empty views (their
 * weight gradients still need a group) */
typedef struct {
    ms_tensor **v[4];
    int n;
} expert_views;

static int views_of(expert_views *ev, const ms_tensor **ts, int n, const int64_t *rows, int E) {
    memset(ev, 0, sizeof *ev);
    ev->n = n;
    for (int i = 0; i < n; i++) {
        ev->v[i] = (ms_tensor **)calloc((size_t)E, sizeof(ms_tensor *));
        if (!ev->v[i]) return ms_errorf("moe experts: out of host memory");
        int64_t off = 0;
        for (int e = 0; e < E; e++) {
            if (!(ev->v[i][e] = rows_of(ts[i], off, rows[e]))) return -1;
            off += rows[e];
        }
    }
    return 0;
}

/* frees the views and leaves ev empty (ready for views_of or another free) */
static void views_free(expert_views *ev, int E) {
    for (int i = 0; i < ev->n; i++) {
        if (!ev->v[i]) continue;
        for (int e = 0; e < E; e++) ms_tensor_free(ev->v[i][e]);
        free(ev->v[i]);
    }
    memset(ev, 0, sizeof *ev);
}

/* the groups of experts with rows: c[j], a[j], b[j] for j < *G */
static void busy_groups(ms_tensor **c, ms_tensor **a, ms_tensor **b, int *G, ms_tensor **c1, ms_tensor **a1,
                        ms_tensor **b1, const int64_t *rows, int E) {
    int j = 0;
    for (int e = 0; e < E; e++) {
        if (rows[e] == 0) continue;
        c[j] = c1[e], a[j] = a1[e], b[j] = b1[e];
        j++;
    }
    *G = j;
}

#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

/* the SwiGLU of a gate-and-up product: CPU loops in f64, every float dtype
 * through ms_load/ms_store */
static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

static int check_swiglu(const char *op, const ms_tensor *gu, const ms_tensor *h, const char *hname, int64_t *I) {
    char x[DESC];
    if (!gu || gu->ndim != 2 || gu->sizes[1] % 2)
        return ms_errorf("%s: gu must be (rows, 2 I), got %s", op, gu ? ms_desc(gu, x, sizeof x) : "NULL");
    if (ms_tensor_check_live(gu, op)) return -1;
    if (!ms_tensor_is_contiguous(gu)) return ms_errorf("%s: gu must be contiguous, got %s", op, ms_desc(gu, x, sizeof x));
    if (gu->dtype_id > MS_F16) return ms_errorf("%s: gu must be a float tensor, got %s", op, ms_desc(gu, x, sizeof x));
    *I = gu->sizes[1] / 2;
    return check_rows(op, hname, h, gu->sizes[0], *I, gu);
}

int ms_moe_swiglu(ms_tensor *h, const ms_tensor *gu) {
    MS_PROF_NOTE("moe_swiglu", h);
    const char *op = "moe_swiglu";
    int64_t I = 0;
    if (check_swiglu(op, gu, h, "h", &I)) return -1;
    if (h->storage == gu->storage) {
        char x[DESC];
        return ms_errorf("%s: h shares its storage with gu: %s", op, ms_desc(h, x, sizeof x));
    }
#ifdef MS_WITH_CUDA
    if (gu->device_id >= 0) return ms_cuda_moe_swiglu(h, gu);
#endif
    const int64_t M = gu->sizes[0];
    const int dt = gu->dtype_id;
    const size_t es = ms_dtype_size(dt);
    const char *src = (const char *)ms_tensor_data(gu);
    char *dst = (char *)ms_tensor_data(h);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const char *g = src + (size_t)r * 2 * I * es, *u = g + (size_t)I * es;
        char *o = dst + (size_t)r * I * es;
        for (int64_t c = 0; c < I; c++) {
            double x = ms_load(g + c * es, dt);
            ms_store(o + c * es, dt, x * sigmoid_d(x) * ms_load(u + c * es, dt));
        }
    }
    return 0;
}

int ms_moe_swiglu_backward(ms_tensor *d13, const ms_tensor *gu, const ms_tensor *dh) {
    MS_PROF_NOTE("moe_swiglu_backward", d13);
    const char *op = "moe_swiglu_backward";
    int64_t I = 0;
    char x[DESC];
    if (check_swiglu(op, gu, dh, "dh", &I)) return -1;
    if (check_rows(op, "d13", d13, gu->sizes[0], 2 * I, gu)) return -1;
    if (d13->storage == gu->storage || d13->storage == dh->storage)
        return ms_errorf("%s: d13 shares its storage with an input: %s", op, ms_desc(d13, x, sizeof x));
#ifdef MS_WITH_CUDA
    if (gu->device_id >= 0) return ms_cuda_moe_swiglu_backward(d13, gu, dh);
#endif
    const int64_t M = gu->sizes[0];
    const int dt = gu->dtype_id;
    const size_t es = ms_dtype_size(dt);
    const char *src = (const char *)ms_tensor_data(gu), *dsrc = (const char *)ms_tensor_data(dh);
    char *dst = (char *)ms_tensor_data(d13);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const char *g = src + (size_t)r * 2 * I * es, *u = g + (size_t)I * es, *d = dsrc + (size_t)r * I * es;
        char *dg = dst + (size_t)r * 2 * I * es, *du = dg + (size_t)I * es;
        for (int64_t c = 0; c < I; c++) {
            double xv = ms_load(g + c * es, dt), y = ms_load(d + c * es, dt), s = sigmoid_d(xv);
            ms_store(du + c * es, dt, xv * s * y);
            ms_store(dg + c * es, dt, y * ms_load(u + c * es, dt) * s * (1.0 + xv * (1.0 - s)));
        }
    }
    return 0;
}

int ms_moe_experts_forward(ms_tensor *ys, ms_tensor *gu, const ms_tensor *xs, const ms_tensor *wf,
                           const int64_t *rows, int E) {
    MS_PROF_NOTE("moe_experts_forward", ys);
    const char *op = "moe_experts_forward";
    int64_t I = 0;
    if (check_common(op, xs, gu, wf, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "ys", ys, M, H, xs)) return -1;
    ms_tensor *h = NULL;
    ms_tensor **c = (ms_tensor **)calloc(3 * (size_t)E, sizeof(ms_tensor *)), **a = c + E, **b = a + E;
    expert_views ev, hv;
    flat_views wv = {0};
    memset(&ev, 0, sizeof ev);
    memset(&hv, 0, sizeof hv);
    const ms_tensor *ts[3] = {xs, gu, ys};
    int rc = !c ? ms_errorf("%s: out of host memory", op) : views_of(&ev, ts, 3, rows, E), G = 0;
    if (!rc) rc = flat_views_of(&wv, wf, E, I, H);
    /* gate and up as one product an expert: gu_e = x_e [W1_e; W3_e]^T */
    if (!rc) {
        busy_groups(c, a, b, &G, ev.v[1], ev.v[0], wv.w13, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 1, 0.0);
    }
    /* h = silu(gate) up over every row at once (padding rows: zeros), then y_e = h_e W2_e^T */
    if (!rc) rc = ms_tensor_empty(&h, 2, (int64_t[]){M, I}, xs->dtype_id, xs->device_id);
    if (!rc) rc = ms_moe_swiglu(h, gu);
    const ms_tensor *hs[1] = {h};
    if (!rc) rc = views_of(&hv, hs, 1, rows, E);
    if (!rc) {
        busy_groups(c, a, b, &G, ev.v[2], hv.v[0], wv.w2, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 1, 0.0);
    }
    views_free(&hv, E);
    views_free(&ev, E);
    flat_views_free(&wv, E);
    ms_tensor_free(h);
    free(c);
    return rc ? -1 : 0;
}

int ms_moe_experts_backward(ms_tensor *dxs, ms_tensor **dw1, ms_tensor **dw3, ms_tensor **dw2, const ms_tensor *gy,
                            const ms_tensor *xs, const ms_tensor *gu, const ms_tensor *wf, const int64_t *rows, int E) {
    MS_PROF_NOTE("moe_experts_backward", dxs);
    const char *op = "moe_experts_backward";
    int64_t I = 0;
    if (check_common(op, xs, gu, wf, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "dxs", dxs, M, H, xs) || check_2d(op, "gy", gy, M, H, xs) ||
        check_grads(op, dw1, dw3, dw2, E, I, H, xs))
        return -1;
    ms_tensor *h = NULL, *dh = NULL, *d13 = NULL;
    ms_tensor **c = (ms_tensor **)calloc(6 * (size_t)E, sizeof(ms_tensor *)), **a = c + 2 * E, **b = a + 2 * E;
    expert_views ev, av;
    flat_views wv = {0};
    memset(&ev, 0, sizeof ev);
    memset(&av, 0, sizeof av);
    const ms_tensor *ts[3] = {xs, gy, dxs};
    int rc = !c ? ms_errorf("%s: out of host memory", op) : views_of(&ev, ts, 3, rows, E), G = 0;
    if (!rc) rc = flat_views_of(&wv, wf, E, I, H);
    ms_tensor **xv = ev.v[0], **dyv = ev.v[1], **dxv = ev.v[2];
    /* down: dW2_e = dy_e^T h_e (every expert: zeros without rows) */
    if (!rc) rc = ms_tensor_empty(&h, 2, (int64_t[]){M, I}, xs->dtype_id, xs->device_id);
    if (!rc) rc = ms_moe_swiglu(h, gu);
    const ms_tensor *hs[1] = {h};
    if (!rc) rc = views_of(&av, hs, 1, rows, E);
    if (!rc) rc = ms_gemm_grouped_(dw2, dyv, av.v[0], E, 1, 0, 0.0);
    views_free(&av, E);
    ms_tensor_free(h);
    /* dh_e = dy_e W2_e */
    if (!rc) rc = ms_tensor_empty(&dh, 2, (int64_t[]){M, I}, xs->dtype_id, xs->device_id);
    const ms_tensor *dhs[1] = {dh};
    if (!rc) rc = views_of(&av, dhs, 1, rows, E);
    if (!rc) {
        busy_groups(c, a, b, &G, av.v[0], dyv, wv.w2, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 0, 0.0);
    }
    views_free(&av, E);
    /* the SwiGLU's backward over every row, into d13 (M, 2 I): d gate =
     * silu'(gate) dh up, d up = silu(gate) dh, one pass */
    if (!rc) rc = ms_tensor_empty(&d13, 2, (int64_t[]){M, 2 * I}, xs->dtype_id, xs->device_id);
    if (!rc) rc = ms_moe_swiglu_backward(d13, gu, dh);
    ms_tensor_free(dh);
    /* gate and up: dW1_e = dgate_e^T x_e, dW3_e = dup_e^T x_e (the halves of
     * d13, one grouped GEMM, every expert; the gradients stay tensors of
     * their own, so autograd hands them on without a copy); dx_e = d13_e
     * [W1_e; W3_e] (one product of inner size 2 I) */
    ms_tensor *dg = NULL, *du = NULL;
    if (!rc) rc = ms_tensor_narrow(&dg, d13, 1, 0, I);
    if (!rc) rc = ms_tensor_narrow(&du, d13, 1, I, I);
    const ms_tensor *ds[3] = {d13, dg, du};
    if (!rc) rc = views_of(&av, ds, 3, rows, E);
    ms_tensor_free(dg);
    ms_tensor_free(du);
    if (!rc) {
        for (int e = 0; e < E; e++) {
            c[e] = dw1[e], a[e] = av.v[1][e], b[e] = xv[e];
            c[E + e] = dw3[e], a[E + e] = av.v[2][e], b[E + e] = xv[e];
        }
        rc = ms_gemm_grouped_(c, a, b, 2 * E, 1, 0, 0.0);
    }
    if (!rc) {
        busy_groups(c, a, b, &G, dxv, av.v[0], wv.w13, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 0, 0.0);
    }
    views_free(&av, E);
    views_free(&ev, E);
    flat_views_free(&wv, E);
    ms_tensor_free(d13);
    free(c);
    return rc ? -1 : 0;
}

/* ------------------------------------------------------------ the rows' moves */


static int check_ids(const char *op, const char *what, const ms_tensor *ids, int64_t n, const ms_tensor *like) {
    char x[DESC];
    if (!ids || ids->dtype_id != MS_I64 || ids->ndim != 1 || ids->sizes[0] != n || !ms_tensor_is_contiguous(ids))
        return ms_errorf("%s: %s must be contiguous i64 (%lld), got %s", op, what, (long long)n,
                         ids ? ms_desc(ids, x, sizeof x) : "NULL");
    if (ids->device_id != like->device_id)
        return ms_errorf("%s: %s is on another device than the rows: %s", op, what, ms_desc(ids, x, sizeof x));
    return 0;
}

static int check_rows(const char *op, const char *what, const ms_tensor *t, int64_t r, int64_t h, const ms_tensor *like) {
    char x[DESC];
    if (check_2d(op, what, t, r, h, like)) return -1;
    if (!ms_tensor_is_contiguous(t)) return ms_errorf("%s: %s must be contiguous, got %s", op, what, ms_desc(t, x, sizeof x));
    if (like && t->dtype_id != like->dtype_id)
        return ms_errorf("%s: %s must have the rows' dtype, got %s", op, what, ms_desc(t, x, sizeof x));
    if (t->dtype_id > MS_F16) return ms_errorf("%s: %s must be a float tensor, got %s", op, what, ms_desc(t, x, sizeof x));
    return 0;
}

static int bad_id(const char *op, const char *what, int64_t pos, int64_t v, int64_t lim) {
    return ms_errorf("%s: %s[%lld] = %lld is outside [0, %lld]", op, what, (long long)pos, (long long)v, (long long)lim);
}

int ms_moe_gather_rows(ms_tensor *out, const ms_tensor *x, const ms_tensor *idx) {
    MS_PROF_NOTE("moe_gather_rows", out);
    const char *op = "moe_gather_rows";
    char d[DESC];
    if (!x || x->ndim != 2) return ms_errorf("%s: x must be 2-D, got %s", op, x ? ms_desc(x, d, sizeof d) : "NULL");
    int64_t N = x->sizes[0], H = x->sizes[1];
    if (check_rows(op, "x", x, N, H, x)) return -1;
    if (!out || out->ndim != 2) return ms_errorf("%s: out must be 2-D", op);
    int64_t M = out->sizes[0];
    if (check_rows(op, "out", out, M, H, x) || check_ids(op, "idx", idx, M, x)) return -1;
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_moe_gather_rows(out, x, idx);
#endif
    const int64_t *id = (const int64_t *)ms_tensor_data(idx);
    for (int64_t r = 0; r < M; r++)
        if (id[r] < 0 || id[r] > N) return bad_id(op, "idx", r, id[r], N);
    size_t es = ms_dtype_size(x->dtype_id);
    const char *src = (const char *)ms_tensor_data(x);
    char *dst = (char *)ms_tensor_data(out);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        if (id[r] == N) memset(dst + (size_t)r * H * es, 0, (size_t)H * es);
        else memcpy(dst + (size_t)r * H * es, src + (size_t)id[r] * H * es, (size_t)H * es);
    }
    return 0;
}

int ms_moe_combine(ms_tensor *out, const ms_tensor *ys, const ms_tensor *inv, const ms_tensor *w, int k) {
    MS_PROF_NOTE("moe_combine", out);
    const char *op = "moe_combine";
    char d[DESC];
    if (!ys || ys->ndim != 2) return ms_errorf("%s: ys must be 2-D, got %s", op, ys ? ms_desc(ys, d, sizeof d) : "NULL");
    int64_t M = ys->sizes[0], H = ys->sizes[1];
    if (k < 1) return ms_errorf("%s: k must be positive, got %d", op, k);
    if (!out || out->ndim != 2) return ms_errorf("%s: out must be 2-D", op);
    int64_t N = out->sizes[0];
    if (check_rows(op, "ys", ys, M, H, ys) || check_rows(op, "out", out, N, H, ys) ||
        check_ids(op, "inv", inv, N * k, ys))
        return -1;
    if (w && (w->ndim != 1 || w->sizes[0] != N * k || w->dtype_id != ys->dtype_id || !ms_tensor_is_contiguous(w) ||
              w->device_id != ys->device_id))
        return ms_errorf("%s: w must be contiguous (%lld) of the rows' dtype and device, got %s", op,
                         (long long)(N * k), ms_desc(w, d, sizeof d));
#ifdef MS_WITH_CUDA
    if (ys->device_id >= 0) return ms_cuda_moe_combine(out, ys, inv, w, k);
#endif
    const int64_t *iv = (const int64_t *)ms_tensor_data(inv);
    for (int64_t s = 0; s < N * k; s++)
        if (iv[s] < 0 || iv[s] >= M) return bad_id(op, "inv", s, iv[s], M - 1);
    int dt = ys->dtype_id;
    size_t es = ms_dtype_size(dt);
    const char *src = (const char *)ms_tensor_data(ys);
    char *dst = (char *)ms_tensor_data(out);
    const char *wp = w ? (const char *)ms_tensor_data(w) : NULL;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t h = 0; h < H; h++) {
            double acc = 0;
            for (int j = 0; j < k; j++) {
                int64_t s = n * k + j;
                double wv = wp ? ms_load(wp + s * es, dt) : 1.0;
                acc += wv * ms_load(src + ((size_t)iv[s] * H + h) * es, dt);
            }
            ms_store(dst + ((size_t)n * H + h) * es, dt, acc);
        }
    }
    return 0;
}

int ms_moe_combine_backward(ms_tensor *gys, ms_tensor *gw, const ms_tensor *g, const ms_tensor *ys,
                            const ms_tensor *back, const ms_tensor *w, int k) {
    MS_PROF_NOTE("moe_combine_backward", gys);
    const char *op = "moe_combine_backward";
    char d[DESC];
    if (!ys || ys->ndim != 2) return ms_errorf("%s: ys must be 2-D, got %s", op, ys ? ms_desc(ys, d, sizeof d) : "NULL");
    if (!g || g->ndim != 2) return ms_errorf("%s: g must be 2-D, got %s", op, g ? ms_desc(g, d, sizeof d) : "NULL");
    int64_t M = ys->sizes[0], H = ys->sizes[1], N = g->sizes[0];
    if (k < 1) return ms_errorf("%s: k must be positive, got %d", op, k);
    if (check_rows(op, "ys", ys, M, H, ys) || check_rows(op, "g", g, N, H, ys) || check_rows(op, "gys", gys, M, H, ys) ||
        check_ids(op, "back", back, M, ys))
        return -1;
    if (!w || w->ndim != 1 || w->sizes[0] != N * k || w->dtype_id != ys->dtype_id || !ms_tensor_is_contiguous(w) ||
        w->device_id != ys->device_id)
        return ms_errorf("%s: w must be contiguous (%lld) of the rows' dtype and device, got %s", op,
                         (long long)(N * k), w ? ms_desc(w, d, sizeof d) : "NULL");
    if (gw && (gw->ndim != 1 || gw->sizes[0] != N * k || gw->dtype_id != ys->dtype_id ||
               !ms_tensor_is_contiguous(gw) || gw->device_id != ys->device_id))
        return ms_errorf("%s: gw must be contiguous (%lld) of the rows' dtype and device, got %s", op,
                         (long long)(N * k), ms_desc(gw, d, sizeof d));
#ifdef MS_WITH_CUDA
    if (ys->device_id >= 0) return ms_cuda_moe_combine_backward(gys, gw, g, ys, back, w, k);
#endif
    const int64_t *bk = (const int64_t *)ms_tensor_data(back);
    for (int64_t r = 0; r < M; r++)
        if (bk[r] < 0 || bk[r] > N * k) return bad_id(op, "back", r, bk[r], N * k);
    int dt = ys->dtype_id;
    size_t es = ms_dtype_size(dt);
    const char *yp = (const char *)ms_tensor_data(ys), *gp = (const char *)ms_tensor_data(g);
    const char *wp = (const char *)ms_tensor_data(w);
    char *op_ = (char *)ms_tensor_data(gys);
    char *gwp = gw ? (char *)ms_tensor_data(gw) : NULL;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        int64_t s = bk[r];
        if (s == N * k) {
            memset(op_ + (size_t)r * H * es, 0, (size_t)H * es);
            continue;
        }
        int64_t n = s / k;
        double wv = ms_load(wp + s * es, dt), dot = 0;
        for (int64_t h = 0; h < H; h++) {
            double gv = ms_load(gp + ((size_t)n * H + h) * es, dt);
            ms_store(op_ + ((size_t)r * H + h) * es, dt, wv * gv);
            dot += gv * ms_load(yp + ((size_t)r * H + h) * es, dt);
        }
        if (gwp) ms_store(gwp + s * es, dt, dot);
    }
    return 0;
}

int ms_moe_sort_slots(const int64_t *ids, int64_t n, int k, int E, int64_t align, int64_t cap, int64_t *order,
                      int64_t *inv, int64_t *tok, int64_t *back, int64_t *counts, int64_t *rows, int64_t *M) {
    const char *op = "moe_sort_slots";
    if (k < 1 || E < 1 || align < 1 || n % k != 0)
        return ms_errorf("%s: %lld slots, k %d, %d experts, align %lld", op, (long long)n, k, E, (long long)align);
    int64_t N = n / k;
    for (int e = 0; e < E; e++) counts[e] = 0;
    for (int64_t s = 0; s < n; s++) {
        if (ids[s] < 0 || ids[s] >= E)
            return ms_errorf("moe: expert id %lld at slot %lld is outside [0, %d)", (long long)ids[s], (long long)s, E);
        counts[ids[s]]++;
    }
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)E);
    if (!start) return ms_errorf("%s: out of host memory", op);
    int64_t *rstart = start + E, acc = 0, racc = 0;
    for (int e = 0; e < E; e++) {
        rows[e] = (counts[e] + align - 1) / align * align;
        start[e] = acc;
        rstart[e] = racc;
        acc += counts[e];
        racc += rows[e];
    }
    if (racc > cap) {
        free(start);
        return ms_errorf("%s: %lld rows do not fit the %lld given", op, (long long)racc, (long long)cap);
    }
    *M = racc;
    for (int64_t r = 0; r < racc; r++) {
        tok[r] = N;
        back[r] = n;
    }
    for (int64_t s = 0; s < n; s++) {
        int64_t e = ids[s], j = start[e]++, r = rstart[e]++;
        order[j] = s;
        inv[s] = r;
        tok[r] = s / k;
        back[r] = s;
    }
    free(start);
    return 0;
}

/* an i64 tensor of the sort (ms_moe_sort): contiguous, at least n
 * elements, on the ids' device */
static int check_sort_out(const char *op, const char *what, const ms_tensor *t, int64_t n, const ms_tensor *ids) {
    char x[DESC];
    if (!t || t->dtype_id != MS_I64 || !ms_tensor_is_contiguous(t) || ms_tensor_numel(t) < n)
        return ms_errorf("%s: %s must be contiguous i64 of %lld elements or more, got %s", op, what, (long long)n,
                         t ? ms_desc(t, x, sizeof x) : "NULL");
    if (t->device_id != ids->device_id)
        return ms_errorf("%s: %s is on another device than the ids: %s", op, what, ms_desc(t, x, sizeof x));
    return ms_tensor_check_live(t, op);
}

int ms_moe_sort(const ms_tensor *ids, int k, int E, int64_t align, ms_tensor *order, ms_tensor *inv, ms_tensor *tok,
                ms_tensor *back, ms_tensor *info) {
    const char *op = "moe_sort";
    char d[DESC];
    if (!ids || ids->dtype_id != MS_I64 || !ms_tensor_is_contiguous(ids))
        return ms_errorf("%s: ids must be contiguous i64, got %s", op, ids ? ms_desc(ids, d, sizeof d) : "NULL");
    if (ms_tensor_check_live(ids, op)) return -1;
    int64_t n = ms_tensor_numel(ids);
    if (k < 1 || E < 1 || align < 1 || n % k != 0)
        return ms_errorf("%s: %lld slots, k %d, %d experts, align %lld", op, (long long)n, k, E, (long long)align);
    int64_t cap = n + (int64_t)E * (align - 1);
    if (check_sort_out(op, "order", order, n, ids) || check_sort_out(op, "inv", inv, n, ids) ||
        check_sort_out(op, "tok", tok, cap, ids) || check_sort_out(op, "back", back, cap, ids) ||
        check_sort_out(op, "info", info, 2 * (int64_t)E + 3, ids))
        return -1;
#ifdef MS_WITH_CUDA
    if (ids->device_id >= 0) {
        if (E > MS_MOE_SORT_MAX_E || cap >= ((int64_t)1 << 31))
            return ms_errorf("%s: %d experts, %lld slots padded to %lld rows: the CUDA sort takes %d experts and "
                             "2^31 rows at most", op, E, (long long)n, (long long)cap, MS_MOE_SORT_MAX_E);
        return ms_cuda_moe_sort(ids, k, E, align, order, inv, tok, back, info);
    }
#endif
    const int64_t *id = (const int64_t *)ms_tensor_data(ids);
    int64_t *in = (int64_t *)ms_tensor_data(info);
    for (int64_t i = 0; i < 2 * (int64_t)E + 3; i++) in[i] = 0;
    in[2 * E + 1] = -1;
    for (int64_t s = 0; s < n; s++)
        if (id[s] < 0 || id[s] >= E) {
            in[2 * E + 1] = s;
            in[2 * E + 2] = id[s];
            return 0;
        }
    return ms_moe_sort_slots(id, n, k, E, align, cap, (int64_t *)ms_tensor_data(order), (int64_t *)ms_tensor_data(inv),
                             (int64_t *)ms_tensor_data(tok), (int64_t *)ms_tensor_data(back), in, in + E, in + 2 * E);
}

/* ------------------------------------------------------------- the routing choice */

/* (value, index) a before b: the higher value, then the lower index */
static int sel_before(double va, int64_t ia, double vb, int64_t ib) { return va > vb || (va == vb && ia < ib); }

/* inserts (v, i) into the n best so far (sorted best first, at most cap):
 * returns the new count */
static int sel_insert(double *bv, int64_t *bi, int n, int cap, double v, int64_t i) {
    if (n == cap && !sel_before(v, i, bv[n - 1], bi[n - 1])) return n;
    int at = n < cap ? n : cap - 1;
    while (at > 0 && sel_before(v, i, bv[at - 1], bi[at - 1])) {
        bv[at] = bv[at - 1];
        bi[at] = bi[at - 1];
        at--;
    }
    bv[at] = v;
    bi[at] = i;
    return n < cap ? n + 1 : n;
}

int ms_moe_select(ms_tensor *ids, const ms_tensor *scores, const ms_tensor *bias, int G, int TG, int how, int k) {
    const char *op = "moe_select";
    char d[DESC];
    if (!scores || scores->ndim != 2 || (scores->dtype_id != MS_F32 && scores->dtype_id != MS_F64) ||
        !ms_tensor_is_contiguous(scores))
        return ms_errorf("%s: scores must be contiguous f32 or f64 (N, E), got %s", op,
                         scores ? ms_desc(scores, d, sizeof d) : "NULL");
    int64_t N = scores->sizes[0], E = scores->sizes[1];
    if (G < 1 || E % G != 0 || G > MS_MOE_SELECT_MAX || TG < 1 || TG > G || (how != 0 && how != 1) ||
        (how == 0 && G > 1 && E / G < 2))
        return ms_errorf("%s: %lld experts in G = %d groups, TG = %d kept, how = %d: not a grouping it takes (G <= %d "
                         "dividing E, 1 <= TG <= G, how 0 (two best, groups of 2 or more) or 1)", op, (long long)E, G,
                         TG, how, MS_MOE_SELECT_MAX);
    if (k < 1 || k > MS_MOE_SELECT_MAX || (int64_t)k > (int64_t)TG * (E / G))
        return ms_errorf("%s: k = %d of the %lld experts of TG = %d groups (k <= %d)", op, k,
                         (long long)(TG * (E / G)), TG, MS_MOE_SELECT_MAX);
    if (!ids || ids->ndim != 2 || ids->sizes[0] != N || ids->sizes[1] != k || ids->dtype_id != MS_I64 ||
        !ms_tensor_is_contiguous(ids) || ids->device_id != scores->device_id)
        return ms_errorf("%s: ids must be contiguous i64 (%lld, %d) on the scores' device, got %s", op, (long long)N, k,
                         ids ? ms_desc(ids, d, sizeof d) : "NULL");
    if (bias && (bias->ndim != 1 || bias->sizes[0] != E || bias->dtype_id != scores->dtype_id ||
                 !ms_tensor_is_contiguous(bias) || bias->device_id != scores->device_id))
        return ms_errorf("%s: bias must be contiguous (%lld) of the scores' dtype and device, got %s", op, (long long)E,
                         ms_desc(bias, d, sizeof d));
    if (N == 0) return 0;
#ifdef MS_WITH_CUDA
    if (scores->device_id >= 0) return ms_cuda_moe_select(ids, scores, bias, G, TG, how, k);
#endif
    const int f32 = scores->dtype_id == MS_F32;
    const void *sp = ms_tensor_data(scores), *bp = bias ? ms_tensor_data(bias) : NULL;
    int64_t *out = (int64_t *)ms_tensor_data(ids);
    const int64_t per = E / G;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        /* the choice score of expert e, rounded to the scores' dtype */
#define CHOICE(e)                                                                                                      \
    (f32 ? (double)((const float *)sp)[n * E + (e)] + (bp ? (double)((const float *)bp)[e] : 0.0)                       \
         : ((const double *)sp)[n * E + (e)] + (bp ? ((const double *)bp)[e] : 0.0))
#define ROUND(x) (f32 ? (double)(float)(x) : (x))
        uint64_t keep = ~0ull;
        if (G > 1) {
            double gv[MS_MOE_SELECT_MAX];
            int64_t gi[MS_MOE_SELECT_MAX];
            int ng = 0;
            for (int g = 0; g < G; g++) {
                double b1 = -INFINITY, b2 = -INFINITY;
                for (int64_t j = 0; j < per; j++) {
                    double v = ROUND(CHOICE(g * per + j));
                    if (v > b1) b2 = b1, b1 = v;
                    else if (v > b2) b2 = v;
                }
                ng = sel_insert(gv, gi, ng, TG, how == 0 ? ROUND(b1 + b2) : b1, g);
            }
            keep = 0;
            for (int t = 0; t < ng; t++) keep |= 1ull << gi[t];
        }
        double bv[MS_MOE_SELECT_MAX];
        int64_t bi[MS_MOE_SELECT_MAX];
        int nb = 0;
        for (int64_t e = 0; e < E; e++)
            if (keep >> (e / per) & 1) nb = sel_insert(bv, bi, nb, k, ROUND(CHOICE(e)), e);
        for (int j = 0; j < k; j++) out[n * k + j] = j < nb ? bi[j] : 0;
#undef CHOICE
#undef ROUND
    }
    return 0;
}
