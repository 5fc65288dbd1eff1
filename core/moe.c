/* core/moe.c — the experts of a mixture-of-experts layer (core/ops.h,
 * moonshard.nn.moe): each expert's run of rows through its SwiGLU MLP, the
 * loop over the experts in C so that a layer costs one call from Lua
 * instead of a dozen ops an expert. Every product is ms_gemm_ (cuBLASLt on
 * CUDA, OpenBLAS on the CPU) into a view of the outputs; the activations
 * are ms_binary's SwiGLU and SiLU-backward passes. */
#include "internal.h"
#include "ops.h"

#include <stdio.h>

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
    for (int e = 0; e < E; e++) {
        char what[64];
        snprintf(what, sizeof what, "expert %d's gate weight", e);
        if (check_2d(op, what, w1[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's up weight", e);
        if (check_2d(op, what, w3[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's down weight", e);
        if (check_2d(op, what, w2[e], H, I, xs)) return -1;
        if (w1[e]->dtype_id != xs->dtype_id || w3[e]->dtype_id != xs->dtype_id || w2[e]->dtype_id != xs->dtype_id)
            return ms_errorf("%s: expert %d's weights must have the rows' dtype (%s)", op, e, ms_desc(xs, x, sizeof x));
    }
    *I_out = I;
    return 0;
}

int ms_moe_experts_forward(ms_tensor *ys, ms_tensor *g, ms_tensor *u, const ms_tensor *xs, ms_tensor **w1,
                           ms_tensor **w3, ms_tensor **w2, const int64_t *rows, int E) {
    const char *op = "moe_experts_forward";
    int64_t I;
    if (check_common(op, xs, w1, w3, w2, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "ys", ys, M, H, xs) || check_2d(op, "g", g, M, I, xs) || check_2d(op, "u", u, M, I, xs)) return -1;
    int64_t off = 0;
    for (int e = 0; e < E; e++) {
        int64_t n = rows[e];
        if (n == 0) continue;
        ms_tensor *r = rows_of(xs, off, n), *ge = rows_of(g, off, n), *ue = rows_of(u, off, n), *ye = rows_of(ys, off, n);
        ms_tensor *h = NULL;
        int rc = !r || !ge || !ue || !ye;
        if (!rc) rc = ms_gemm_(ge, r, w1[e], 0, 1, 1.0, 0.0);
        if (!rc) rc = ms_gemm_(ue, r, w3[e], 0, 1, 1.0, 0.0);
        if (!rc) rc = ms_binary(&h, MS_OP_SWIGLU, ge, ue);
        if (!rc) rc = ms_gemm_(ye, h, w2[e], 0, 1, 1.0, 0.0);
        ms_tensor_free(h);
        ms_tensor_free(r);
        ms_tensor_free(ge);
        ms_tensor_free(ue);
        ms_tensor_free(ye);
        if (rc) return -1;
        off += n;
    }
    return 0;
}

int ms_moe_experts_backward(ms_tensor *dxs, ms_tensor **dw1, ms_tensor **dw3, ms_tensor **dw2, const ms_tensor *gy,
                            const ms_tensor *xs, const ms_tensor *g, const ms_tensor *u, ms_tensor **w1,
                            ms_tensor **w3, ms_tensor **w2, const int64_t *rows, int E) {
    const char *op = "moe_experts_backward";
    int64_t I;
    if (check_common(op, xs, w1, w3, w2, rows, E, &I)) return -1;
    int64_t M = xs->sizes[0], H = xs->sizes[1];
    if (check_2d(op, "dxs", dxs, M, H, xs) || check_2d(op, "gy", gy, M, H, xs) || check_2d(op, "g", g, M, I, xs) ||
        check_2d(op, "u", u, M, I, xs))
        return -1;
    if (!dw1 || !dw2 || !dw3) return ms_errorf("%s: the weight gradients are missing", op);
    for (int e = 0; e < E; e++) {
        char what[64];
        snprintf(what, sizeof what, "expert %d's gate gradient", e);
        if (check_2d(op, what, dw1[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's up gradient", e);
        if (check_2d(op, what, dw3[e], I, H, xs)) return -1;
        snprintf(what, sizeof what, "expert %d's down gradient", e);
        if (check_2d(op, what, dw2[e], H, I, xs)) return -1;
    }
    int64_t off = 0;
    for (int e = 0; e < E; e++) {
        int64_t n = rows[e];
        if (n == 0) {
            if (ms_fill_(dw1[e], 0) || ms_fill_(dw3[e], 0) || ms_fill_(dw2[e], 0)) return -1;
            continue;
        }
        ms_tensor *r = rows_of(xs, off, n), *ge = rows_of(g, off, n), *ue = rows_of(u, off, n);
        ms_tensor *dy = rows_of(gy, off, n), *dx = rows_of(dxs, off, n);
        ms_tensor *h = NULL, *dh = NULL, *dup = NULL, *t = NULL, *dgate = NULL;
        int rc = !r || !ge || !ue || !dy || !dx;
        /* down: dW2 = dy^T h, dh = dy W2 */
        if (!rc) rc = ms_binary(&h, MS_OP_SWIGLU, ge, ue);
        if (!rc) rc = ms_gemm_(dw2[e], dy, h, 1, 0, 1.0, 0.0);
        if (!rc) rc = ms_matmul(&dh, dy, w2[e], 0, 0);
        /* SwiGLU: d up = silu(g) dh; d gate = silu'(g) (dh u) */
        if (!rc) rc = ms_binary(&dup, MS_OP_SWIGLU, ge, dh);
        if (!rc) rc = ms_binary(&t, MS_OP_MUL, dh, ue);
        if (!rc) rc = ms_binary(&dgate, MS_OP_SILU_BWD, ge, t);
        /* gate and up: dW = d^T rows, dx = dgate W1 + dup W3 */
        if (!rc) rc = ms_gemm_(dw1[e], dgate, r, 1, 0, 1.0, 0.0);
        if (!rc) rc = ms_gemm_(dw3[e], dup, r, 1, 0, 1.0, 0.0);
        if (!rc) rc = ms_gemm_(dx, dgate, w1[e], 0, 0, 1.0, 0.0);
        if (!rc) rc = ms_gemm_(dx, dup, w3[e], 0, 0, 1.0, 1.0);
        ms_tensor_free(h);
        ms_tensor_free(dh);
        ms_tensor_free(dup);
        ms_tensor_free(t);
        ms_tensor_free(dgate);
        ms_tensor_free(r);
        ms_tensor_free(ge);
        ms_tensor_free(ue);
        ms_tensor_free(dy);
        ms_tensor_free(dx);
        if (rc) return -1;
        off += n;
    }
    return 0;
}
