/* core/moe.c — the experts of a mixture-of-experts layer (core/ops.h,
 * moonshard.nn.moe): each expert's run of rows through its SwiGLU MLP, the
 * loop over the experts in C so that a layer costs one call from Lua
 * instead of a dozen ops an expert. Every product is ms_gemm_ (cuBLASLt on
 * CUDA, OpenBLAS on the CPU) into a view of the outputs; the activations
 * are ms_binary's SwiGLU and SiLU-backward passes. */
#include "internal.h"
#include "ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DESC 160

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

/* each expert's (gate, up) (I, H) and down (H, I) tensors; kind names them
 * ("weight", "gradient") */
static int check_experts(const char *op, const char *kind, ms_tensor **a1, ms_tensor **a3, ms_tensor **a2, int E,
                         int64_t I, int64_t H, const ms_tensor *xs) {
    if (!a1 || !a3 || !a2) return ms_errorf("%s: the experts' %ss are missing", op, kind);
    for (int e = 0; e < E; e++) {
        char what[64];
        snprintf(what, sizeof what, "expert %d's gate %s", e, kind);
        if (check_2d(op, what, a1[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's up %s", e, kind);
        if (check_2d(op, what, a3[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's down %s", e, kind);
        if (check_2d(op, what, a2[e], H, I, xs)) return -1;
    }
    return 0;
}

/* the shapes every call shares: xs (M, H), rows summing to M, the weights */
static int check_common(const char *op, const ms_tensor *xs, ms_tensor **w1, ms_tensor **w3, ms_tensor **w2,
                        const int64_t *rows, int E, int64_t *I_out) {
    char x[DESC];
    if (!xs || xs->ndim != 2) return ms_errorf("%s: xs must be 2-D (rows, hidden), got %s", op, xs ? ms_desc(xs, x, sizeof x) : "NULL");
    if (E < 1 || !rows || !w1 || !w2 || !w3) return ms_errorf("%s: %d experts, or their rows or weights missing", op, E);
    int64_t M = xs->sizes[0], H = xs->sizes[1], sum = 0;
    for (int e = 0; e < E; e++) {
        if (rows[e] < 0) return ms_errorf("%s: expert %d has %lld rows", op, e, (long long)rows[e]);
        sum += rows[e];
    }
    if (sum != M) return ms_errorf("%s: the experts' rows sum to %lld, but xs has %lld", op, (long long)sum, (long long)M);
    if (!w1[0] || w1[0]->ndim != 2) return ms_errorf("%s: expert 0's gate weight must be 2-D", op);
    int64_t I = w1[0]->sizes[0];
    if (check_experts(op, "weight", w1, w3, w2, E, I, H, xs)) return -1;
    for (int e = 0; e < E; e++) {
        if (w1[e]->dtype_id != xs->dtype_id || w3[e]->dtype_id != xs->dtype_id || w2[e]->dtype_id != xs->dtype_id)
            return ms_errorf("%s: expert %d's weights must have the rows' dtype (%s)", op, e, ms_desc(xs, x, sizeof x));
    }
    *I_out = I;
    return 0;
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

/* the groups of experts with rows: c[j], a[j], b[j] for j < *G (2 lists
 * when c2 is given: the first list's experts, then the second's) */
static void busy_groups(ms_tensor **c, ms_tensor **a, ms_tensor **b, int *G, ms_tensor **c1, ms_tensor **a1,
                        ms_tensor **b1, ms_tensor **c2, ms_tensor **a2, ms_tensor **b2, const int64_t *rows, int E) {
    int j = 0;
    for (int pass = 0; pass < (c2 ? 2 : 1); pass++)
        for (int e = 0; e < E; e++) {
            if (rows[e] == 0) continue;
            c[j] = pass ? c2[e] : c1[e];
            a[j] = pass ? a2[e] : a1[e];
            b[j] = pass ? b2[e] : b1[e];
            j++;
        }
    *G = j;
}

int ms_moe_experts_forward(ms_tensor *ys, ms_tensor *g, ms_tensor *u, const ms_tensor *xs, ms_tensor **w1,
                           ms_tensor **w3, ms_tensor **w2, const int64_t *rows, int E) {
    const char *op = "moe_experts_forward";
    int64_t I = 0;
    if (check_common(op, xs, w1, w3, w2, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "ys", ys, M, H, xs) || check_2d(op, "g", g, M, I, xs) || check_2d(op, "u", u, M, I, xs)) return -1;
    ms_tensor *h = NULL;
    ms_tensor **c = (ms_tensor **)calloc(6 * (size_t)E, sizeof(ms_tensor *)), **a = c + 2 * E, **b = a + 2 * E;
    expert_views ev, hv;
    memset(&ev, 0, sizeof ev);
    memset(&hv, 0, sizeof hv);
    const ms_tensor *ts[4] = {xs, g, u, ys};
    int rc = !c ? ms_errorf("%s: out of host memory", op) : views_of(&ev, ts, 4, rows, E), G = 0;
    /* gate and up in one grouped GEMM: g_e = x_e W1_e^T, u_e = x_e W3_e^T */
    if (!rc) {
        busy_groups(c, a, b, &G, ev.v[1], ev.v[0], w1, ev.v[2], ev.v[0], w3, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 1, 0.0);
    }
    /* h = silu(g) u over every row at once (padding rows: zeros), then y_e = h_e W2_e^T */
    if (!rc) rc = ms_binary(&h, MS_OP_SWIGLU, g, u);
    const ms_tensor *hs[1] = {h};
    if (!rc) rc = views_of(&hv, hs, 1, rows, E);
    if (!rc) {
        busy_groups(c, a, b, &G, ev.v[3], hv.v[0], w2, NULL, NULL, NULL, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 1, 0.0);
    }
    views_free(&hv, E);
    views_free(&ev, E);
    ms_tensor_free(h);
    free(c);
    return rc ? -1 : 0;
}

int ms_moe_experts_backward(ms_tensor *dxs, ms_tensor **dw1, ms_tensor **dw3, ms_tensor **dw2, const ms_tensor *gy,
                            const ms_tensor *xs, const ms_tensor *g, const ms_tensor *u, ms_tensor **w1,
                            ms_tensor **w3, ms_tensor **w2, const int64_t *rows, int E) {
    const char *op = "moe_experts_backward";
    int64_t I = 0;
    if (check_common(op, xs, w1, w3, w2, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "dxs", dxs, M, H, xs) || check_2d(op, "gy", gy, M, H, xs) || check_2d(op, "g", g, M, I, xs) ||
        check_2d(op, "u", u, M, I, xs))
        return -1;
    if (check_experts(op, "gradient", dw1, dw3, dw2, E, I, H, xs)) return -1;
    ms_tensor *h = NULL, *dh = NULL, *dup = NULL, *t = NULL, *dgate = NULL;
    ms_tensor **c = (ms_tensor **)calloc(6 * (size_t)E, sizeof(ms_tensor *)), **a = c + 2 * E, **b = a + 2 * E;
    expert_views ev, av;
    memset(&ev, 0, sizeof ev);
    memset(&av, 0, sizeof av);
    const ms_tensor *ts[2] = {xs, gy};
    int rc = !c ? ms_errorf("%s: out of host memory", op) : views_of(&ev, ts, 2, rows, E), G = 0;
    ms_tensor **xv = ev.v[0], **dyv = ev.v[1];
    /* down: dW2_e = dy_e^T h_e (every expert: zeros without rows) */
    if (!rc) rc = ms_binary(&h, MS_OP_SWIGLU, g, u);
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
        busy_groups(c, a, b, &G, av.v[0], dyv, w2, NULL, NULL, NULL, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 0, 0.0);
    }
    views_free(&av, E);
    /* SwiGLU over every row: d up = silu(g) dh; d gate = silu'(g) (dh u) */
    if (!rc) rc = ms_binary(&dup, MS_OP_SWIGLU, g, dh);
    if (!rc) rc = ms_binary(&t, MS_OP_MUL, dh, u);
    if (!rc) rc = ms_binary(&dgate, MS_OP_SILU_BWD, g, t);
    ms_tensor_free(t);
    ms_tensor_free(dh);
    /* gate and up: dW1_e = dgate_e^T x_e, dW3_e = dup_e^T x_e (one grouped
     * GEMM, every expert); dx_e = dgate_e W1_e + dup_e W3_e */
    const ms_tensor *ds[2] = {dgate, dup};
    if (!rc) rc = views_of(&av, ds, 2, rows, E);
    if (!rc) {
        for (int e = 0; e < E; e++) {
            c[e] = dw1[e], a[e] = av.v[0][e], b[e] = xv[e];
            c[E + e] = dw3[e], a[E + e] = av.v[1][e], b[E + e] = xv[e];
        }
        rc = ms_gemm_grouped_(c, a, b, 2 * E, 1, 0, 0.0);
    }
    ms_tensor *dxv_t[1] = {dxs};
    expert_views dv;
    memset(&dv, 0, sizeof dv);
    if (!rc) rc = views_of(&dv, (const ms_tensor **)dxv_t, 1, rows, E);
    if (!rc) {
        busy_groups(c, a, b, &G, dv.v[0], av.v[0], w1, NULL, NULL, NULL, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 0, 0.0);
    }
    if (!rc) {
        busy_groups(c, a, b, &G, dv.v[0], av.v[1], w3, NULL, NULL, NULL, rows, E);
        rc = ms_gemm_grouped_(c, a, b, G, 0, 0, 1.0);
    }
    views_free(&dv, E);
    views_free(&av, E);
    views_free(&ev, E);
    ms_tensor_free(dup);
    ms_tensor_free(dgate);
    free(c);
    return rc ? -1 : 0;
}

/* ------------------------------------------------------------ the rows' moves */

#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

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
