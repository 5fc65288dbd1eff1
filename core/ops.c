/* core/ops.c — the entry points of core/ops.h: argument checks, output
 * allocation, dtype promotion, then the kernel of the tensors' device.
 *
 * Every entry point checks that its tensors are live and on one device,
 * that shapes and dtypes fit, and prepares *out (ms_prepare_out) before any
 * kernel runs; an error leaves *out as it was (an output allocated here is
 * freed again). Messages name the op and the shapes, dtypes and devices:
 *   "add: shapes (2,3) and (4,3) cannot be broadcast"
 * An output given by the caller (in-place and out= forms) must have the
 * shape, dtype and device the op would allocate, and may not overlap an
 * input except as the very same view in elementwise ops.
 * CPU tensors go to core/ops_cpu.c (rand_/randn_: core/rng.c), CUDA tensors
 * to kernels/ (the dev_* functions below; builds without CUDA refuse them).
 */
#include "internal.h"
#include "cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu.h"
#include "prof.h"
#include "fused_cpu.h"

/* Device dispatch: CUDA tensors go to kernels/ (declared in kernels/kernels.h),
 * CPU tensors to core/ops_cpu.c. Arguments are checked before these run. */
#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

static int dev_unary(ms_tensor *out, int op, const ms_tensor *a) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_unary(out, op, a);
#endif
    return ms_cpu_unary(out, op, a);
}

static int dev_binary(ms_tensor *out, int op, const ms_tensor *a, const ms_tensor *b) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_binary(out, op, a, b);
#endif
    return ms_cpu_binary(out, op, a, b);
}

static int dev_binary_scalar(ms_tensor *out, int op, const ms_tensor *a, double s, int reverse) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_binary_scalar(out, op, a, s, reverse);
#endif
    return ms_cpu_binary_scalar(out, op, a, s, reverse);
}

static int dev_clamp(ms_tensor *out, const ms_tensor *a, double lo, double hi) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_clamp(out, a, lo, hi);
#endif
    return ms_cpu_clamp(out, a, lo, hi);
}

static int dev_where(ms_tensor *out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_where(out, cond, a, b);
#endif
    return ms_cpu_where(out, cond, a, b);
}

/* dim -1: all elements */
static int dev_reduce(ms_tensor *out, int op, const ms_tensor *a, int dim, int keepdim) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_reduce(out, op, a, dim < 0 ? MS_ALL_DIMS : dim);
#endif
    return ms_cpu_reduce(out, op, a, dim, keepdim);
}

static int dev_softmax(ms_tensor *out, const ms_tensor *a, int dim, int log) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_softmax(out, a, dim, log);
#endif
    return ms_cpu_softmax(out, a, dim, log);
}

static int dev_softmax_backward(ms_tensor *out, const ms_tensor *y, const ms_tensor *g, int dim, int log) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) {
        /* the kernel reads y and g in out's dtype */
        ms_tensor *yc = NULL, *gc = NULL;
        int rc = 0;
        if (y->dtype_id != out->dtype_id) rc = ms_tensor_to(&yc, y, out->dtype_id, out->device_id);
        if (!rc && g->dtype_id != out->dtype_id) rc = ms_tensor_to(&gc, g, out->dtype_id, out->device_id);
        if (!rc) rc = ms_cuda_softmax_backward(out, yc ? yc : y, gc ? gc : g, dim, log);
        ms_tensor_free(yc);
        ms_tensor_free(gc);
        return rc;
    }
#endif
    return ms_cpu_softmax_backward(out, y, g, dim, log);
}

/* c3, a3, b3: views with transposes applied and batch dims broadcast */
static int dev_matmul(ms_tensor *c, const ms_tensor *a, const ms_tensor *b) {
#ifdef MS_WITH_CUDA
    if (c->device_id >= 0) return ms_cuda_gemm(c, a, b, 0, 0, 1.0, 0.0);
#endif
    return ms_cpu_matmul(c, a, b);
}

#ifdef MS_WITH_CUDA
extern int ms_cuda_gemm_mixed_ok(void) __attribute__((weak));
#endif
/* whether gemm_ on `device` takes an f32 out with bf16/f16 operands: the CPU
 * always (it widens the operands), CUDA where kernels/gemm.cu has it */
static int gemm_mixed_ok(int device) {
#ifdef MS_WITH_CUDA
    if (device >= 0) return ms_cuda_gemm_mixed_ok && ms_cuda_gemm_mixed_ok();
#endif
    return device < 0;
}

static int dev_gemm_(ms_tensor *c, const ms_tensor *a, const ms_tensor *b, double alpha, double beta) {
#ifdef MS_WITH_CUDA
    if (c->device_id >= 0) return ms_cuda_gemm(c, a, b, 0, 0, alpha, beta);
#endif
    return ms_cpu_gemm_(c, a, b, alpha, beta);
}

static int dev_index_select(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_index_select(out, a, dim, idx);
#endif
    return ms_cpu_index_select(out, a, dim, idx);
}

static int dev_index_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
#ifdef MS_WITH_CUDA
    if (dst->device_id >= 0) return ms_cuda_index_add(dst, dim, idx, src);
#endif
    return ms_cpu_index_add_(dst, dim, idx, src);
}

static int dev_gather(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_gather(out, a, dim, idx);
#endif
    return ms_cpu_gather(out, a, dim, idx);
}

static int dev_scatter_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
#ifdef MS_WITH_CUDA
    if (dst->device_id >= 0) return ms_cuda_scatter_add(dst, dim, idx, src);
#endif
    return ms_cpu_scatter_add_(dst, dim, idx, src);
}

static int dev_fill_(ms_tensor *t, double value) {
#ifdef MS_WITH_CUDA
    if (t->device_id >= 0) return ms_cuda_fill(t, value);
#endif
    return ms_cpu_fill_(t, value);
}

static int dev_arange_(ms_tensor *t, double start, double step) {
#ifdef MS_WITH_CUDA
    if (t->device_id >= 0) return ms_cuda_arange(t, start, step);
#endif
    return ms_cpu_arange_(t, start, step);
}

static int dev_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal) {
#ifdef MS_WITH_CUDA
    if (t->device_id >= 0) return ms_cuda_rand(t, seed, offset, a, b, normal);
#endif
    return normal ? ms_cpu_randn_(t, seed, offset, a, b) : ms_cpu_rand_(t, seed, offset, a, b);
}

enum { DESC = 200 }; /* room for ms_desc/ms_shape_str text */

static const char *const g_unary_names[MS_OP_UNARY_END] = {
    "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "abs",
    "sin", "cos", "square", "reciprocal", "sign"};
static const char *const g_binary_names[MS_OP_BINARY_END] = {
    "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
    "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "relu_backward", "swiglu"};
static const char *const g_reduce_names[MS_RED_END] = {
    "sum", "mean", "max", "min", "argmax", "argmin", "logsumexp", "prod"};

/* ============================================================ helpers */

static void prof_out(const char *op, const ms_tensor *t, int calls) {
    if (ms_prof_on) ms_prof_tensor(op, t, calls);
}

static int prepare_out(ms_tensor **out, const char *op, int ndim, const int64_t *shape, int dtype, int device, int calls) {
    char have[DESC], want[DESC], s[DESC], d[32];
    if (!out) return ms_errorf("%s: no output slot given", op);
    if (!*out) {
        if (ms_tensor_empty(out, ndim, shape, dtype, device)) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s: %s", op, ms_last_error());
            ms_set_error(msg);
            return -1;
        }
        prof_out(op, *out, calls);
        return 0;
    }
    if (ms_tensor_check_live(*out, op)) return -1;
    int same = (*out)->ndim == ndim && (*out)->dtype_id == dtype && (*out)->device_id == device;
    for (int i = 0; same && i < ndim; i++) same = (*out)->sizes[i] == shape[i];
    if (!same) {
        snprintf(want, sizeof want, "%s %s %s", ms_dtype_name(dtype), ms_dims_str(ndim, shape, s, sizeof s),
                 ms_device_str(device, d, sizeof d));
        return ms_errorf("%s: out is %s, expected %s", op, ms_desc(*out, have, sizeof have), want);
    }
    prof_out(op, *out, calls);
    return 0;
}

/* (the op counter, core/prof.h: a call counts at its first output) */
int ms_prepare_out(ms_tensor **out, const char *op, int ndim, const int64_t *shape, int dtype, int device) {
    return prepare_out(out, op, ndim, shape, dtype, device, 1);
}
int ms_prepare_more(ms_tensor **out, const char *op, int ndim, const int64_t *shape, int dtype, int device) {
    return prepare_out(out, op, ndim, shape, dtype, device, 0);
}

/* on failure, free an output this call allocated and leave *out NULL */
static int finish(ms_tensor **out, int allocated, int rc) {
    if (rc && allocated && out && *out) {
        ms_tensor_free(*out);
        *out = NULL;
    }
    return rc;
}

/* all n tensors live, on one device, and none of an 8-bit float dtype (a
 * storage format: copies, views and the float8 ops of core/float8.c take it,
 * arithmetic does not) */
static int check_tensors(const char *op, int n, const ms_tensor *const *ts) {
    char a[DESC], b[DESC];
    for (int i = 0; i < n; i++) {
        if (ms_tensor_check_live(ts[i], op)) return -1;
        if (ms_is_float8(ts[i]->dtype_id))
            return ms_errorf("%s: %s is an 8-bit float tensor; those take copies (to), views and the float8 ops "
                             "(amax, float8_cast, scaled_matmul) only: convert it first (:to('bf16'))",
                             op, ms_desc(ts[i], a, sizeof a));
    }
    for (int i = 1; i < n; i++)
        if (ts[i]->device_id != ts[0]->device_id)
            return ms_errorf("%s: tensors on different devices: %s and %s", op, ms_desc(ts[0], a, sizeof a),
                             ms_desc(ts[i], b, sizeof b));
#ifndef MS_WITH_CUDA
    if (ts[0]->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    if (ts[0]->device_id < 0 && ms_cuda_capturing() >= 0)
        return ms_errorf("%s on cpu tensors during CUDA graph capture on cuda:%d: CPU work runs once, now, and a "
                         "replay would not repeat it; compute it before the capture or on the device (the capture "
                         "is aborted; docs/cuda-graphs.md)", op, ms_cuda_capturing());
    return 0;
}

static int check1(const char *op, const ms_tensor *a) {
    const ms_tensor *ts[1] = {a};
    return check_tensors(op, 1, ts);
}

static int check2(const char *op, const ms_tensor *a, const ms_tensor *b) {
    const ms_tensor *ts[2] = {a, b};
    return check_tensors(op, 2, ts);
}

static int check3(const char *op, const ms_tensor *a, const ms_tensor *b, const ms_tensor *c) {
    const ms_tensor *ts[3] = {a, b, c};
    return check_tensors(op, 3, ts);
}

/* numpy broadcast of two shapes into (*nd, shape) */
static int broadcast_dims(const char *op, int na, const int64_t *sa, int nb, const int64_t *sb, int *nd,
                          int64_t *shape) {
    char x[DESC], y[DESC];
    int n = na > nb ? na : nb;
    for (int i = 0; i < n; i++) {
        int ia = na - n + i, ib = nb - n + i;
        int64_t da = ia >= 0 ? sa[ia] : 1, db = ib >= 0 ? sb[ib] : 1;
        if (da == db || db == 1) shape[i] = da;
        else if (da == 1) shape[i] = db;
        else
            return ms_errorf("%s: shapes %s and %s cannot be broadcast", op, ms_dims_str(na, sa, x, sizeof x),
                             ms_dims_str(nb, sb, y, sizeof y));
    }
    *nd = n;
    return 0;
}

static int broadcast2(const char *op, const ms_tensor *a, const ms_tensor *b, int *nd, int64_t *shape) {
    return broadcast_dims(op, a->ndim, a->sizes, b->ndim, b->sizes, nd, shape);
}

static int need_float(const char *op, const ms_tensor *t) {
    char d[DESC];
    if (!ms_is_float(t->dtype_id)) return ms_errorf("%s: needs a float tensor, got %s", op, ms_desc(t, d, sizeof d));
    return 0;
}

static int same_shape(const ms_tensor *a, const ms_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->sizes[i] != b->sizes[i]) return 0;
    return 1;
}

/* a destination written in place must not have elements that alias
 * each other (an expanded view) */
static int check_no_self_overlap(const char *op, const ms_tensor *t) {
    char d[DESC];
    for (int i = 0; i < t->ndim; i++)
        if (t->strides[i] == 0 && t->sizes[i] > 1)
            return ms_errorf("%s: destination %s has overlapping elements (an expanded view)", op,
                             ms_desc(t, d, sizeof d));
    return 0;
}

/* the bytes [*lo, *hi) a non-empty view can touch */
static void view_bytes(const ms_tensor *t, int64_t *lo, int64_t *hi) {
    int64_t a = t->offset, b = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        int64_t span = t->strides[i] * (t->sizes[i] - 1);
        if (span < 0) a += span;
        else b += span;
    }
    int es = ms_dtype_size(t->dtype_id);
    *lo = a * es;
    *hi = (b + 1) * es;
}

static int same_view(const ms_tensor *a, const ms_tensor *b) {
    if (a->offset != b->offset || a->dtype_id != b->dtype_id || !same_shape(a, b)) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->sizes[i] > 1 && a->strides[i] != b->strides[i]) return 0;
    return 1;
}

/* out is written while `in` is read. Elementwise ops (same_ok) may write
 * over the very same view (in place); any other overlap would read elements
 * already written, so it is an error (as in PyTorch) rather than a wrong
 * answer. Only called for outputs given by the caller. */
static int check_overlap(const char *op, const ms_tensor *out, const ms_tensor *in, int same_ok) {
    char x[DESC], y[DESC];
    if (!in || in->storage != out->storage || ms_tensor_numel(out) == 0 || ms_tensor_numel(in) == 0) return 0;
    if (same_ok && same_view(out, in)) return 0;
    int64_t olo, ohi, ilo, ihi;
    view_bytes(out, &olo, &ohi);
    view_bytes(in, &ilo, &ihi);
    if (ohi <= ilo || ihi <= olo) return 0;
    return ms_errorf("%s: the output %s overlaps an input %s in another layout; write into a separate tensor", op,
                     ms_desc(out, x, sizeof x), ms_desc(in, y, sizeof y));
}

/* check_overlap for up to three inputs of an output given by the caller */
static int check_given_out(const char *op, int allocated, const ms_tensor *out, const ms_tensor *a,
                           const ms_tensor *b, const ms_tensor *c, int same_ok) {
    if (allocated) return 0;
    return check_no_self_overlap(op, out) || check_overlap(op, out, a, same_ok) || check_overlap(op, out, b, same_ok) ||
           check_overlap(op, out, c, same_ok);
}

/* ========================================================= elementwise */

/* ops that keep an integer dtype (the rest give f32 for integer inputs) */
static int unary_keeps_int(int op) {
    return op == MS_OP_NEG || op == MS_OP_ABS || op == MS_OP_SQUARE || op == MS_OP_SIGN || op == MS_OP_RELU;
}

int ms_unary(ms_tensor **out, int op, const ms_tensor *a) {
    if (op < 0 || op >= MS_OP_UNARY_END) return ms_errorf("unary: invalid op %d", op);
    const char *name = g_unary_names[op];
    if (check1(name, a)) return -1;
    int dtype = a->dtype_id;
    if (ms_is_int(dtype) && !unary_keeps_int(op)) dtype = MS_F32;
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, a->ndim, a->sizes, dtype, a->device_id) ||
        check_given_out(name, allocated, *out, a, NULL, NULL, 1))
        return -1;
    return finish(out, allocated, dev_unary(*out, op, a));
}

static int binary_is_comparison(int op) { return op >= MS_OP_EQ && op <= MS_OP_GE; }
static int binary_is_backward(int op) { return op >= MS_OP_GELU_BWD; }

/* result dtype of a op b for operand dtype `dtype` (already promoted) */
static int binary_result_dtype(int op, int dtype) {
    if (binary_is_comparison(op)) return MS_BOOL;
    if (ms_is_int(dtype) && (op == MS_OP_DIV || binary_is_backward(op))) return MS_F32;
    return dtype;
}

int ms_binary(ms_tensor **out, int op, const ms_tensor *a, const ms_tensor *b) {
    if (op < 0 || op >= MS_OP_BINARY_END) return ms_errorf("binary: invalid op %d", op);
    const char *name = g_binary_names[op];
    int nd;
    int64_t shape[MS_MAX_DIMS];
    if (check2(name, a, b) || broadcast2(name, a, b, &nd, shape)) return -1;
    int dtype = binary_result_dtype(op, ms_promote(a->dtype_id, b->dtype_id));
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, nd, shape, dtype, a->device_id) ||
        check_given_out(name, allocated, *out, a, b, NULL, 1))
        return -1;
    return finish(out, allocated, dev_binary(*out, op, a, b));
}

int ms_binary_scalar(ms_tensor **out, int op, const ms_tensor *a, double s, int reverse) {
    if (op < 0 || op >= MS_OP_BINARY_END) return ms_errorf("binary: invalid op %d", op);
    const char *name = g_binary_names[op];
    if (check1(name, a)) return -1;
    int dtype = binary_result_dtype(op, a->dtype_id);
    if (ms_is_int(dtype) && dtype != MS_BOOL && !(isfinite(s) && s == floor(s))) dtype = MS_F32;
    if (dtype == MS_BOOL && !binary_is_comparison(op)) /* bool with a number: i64, or f32 */
        dtype = (isfinite(s) && s == floor(s)) ? MS_I64 : MS_F32;
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, a->ndim, a->sizes, dtype, a->device_id) ||
        check_given_out(name, allocated, *out, a, NULL, NULL, 1))
        return -1;
    return finish(out, allocated, dev_binary_scalar(*out, op, a, s, reverse));
}

int ms_clamp(ms_tensor **out, const ms_tensor *a, double lo, double hi) {
    if (check1("clamp", a)) return -1;
    int allocated = out && !*out;
    if (ms_prepare_out(out, "clamp", a->ndim, a->sizes, a->dtype_id, a->device_id) ||
        check_given_out("clamp", allocated, *out, a, NULL, NULL, 1))
        return -1;
    return finish(out, allocated, dev_clamp(*out, a, lo, hi));
}

int ms_where(ms_tensor **out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b) {
    char d[DESC];
    int nd, nd2;
    int64_t s1[MS_MAX_DIMS], shape[MS_MAX_DIMS];
    if (check3("where", cond, a, b)) return -1;
    if (cond->dtype_id != MS_BOOL && cond->dtype_id != MS_U8)
        return ms_errorf("where: condition must be bool or u8, got %s", ms_desc(cond, d, sizeof d));
    if (broadcast2("where", a, b, &nd, s1) || broadcast_dims("where", cond->ndim, cond->sizes, nd, s1, &nd2, shape))
        return -1;
    int allocated = out && !*out;
    if (ms_prepare_out(out, "where", nd2, shape, ms_promote(a->dtype_id, b->dtype_id), a->device_id) ||
        check_given_out("where", allocated, *out, cond, a, b, 1))
        return -1;
    return finish(out, allocated, dev_where(*out, cond, a, b));
}

/* ========================================================== reductions */

int ms_reduce(ms_tensor **out, int op, const ms_tensor *a, int dim, int keepdim) {
    char s[DESC], d[DESC];
    if (op < 0 || op >= MS_RED_END) return ms_errorf("reduce: invalid op %d", op);
    const char *name = g_reduce_names[op];
    if (check1(name, a)) return -1;
    int all = dim == MS_ALL_DIMS || (a->ndim == 0 && (dim == 0 || dim == -1));
    int cd = -1;
    if (!all && ms_wrap_dim(name, dim, a->ndim, &cd)) return -1;
    /* result dtype */
    int dtype = a->dtype_id;
    if (op == MS_RED_SUM || op == MS_RED_PROD) dtype = ms_is_int(a->dtype_id) ? MS_I64 : a->dtype_id;
    else if (op == MS_RED_MEAN || op == MS_RED_LOGSUMEXP) {
        if (need_float(name, a)) return -1;
    } else if (op == MS_RED_ARGMAX || op == MS_RED_ARGMIN) dtype = MS_I64;
    /* max/min/arg* of nothing is undefined */
    int extremum = op == MS_RED_MAX || op == MS_RED_MIN || op == MS_RED_ARGMAX || op == MS_RED_ARGMIN;
    if (extremum && (all ? ms_tensor_numel(a) == 0 : a->sizes[cd] == 0)) {
        if (all) return ms_errorf("%s: cannot reduce an empty tensor %s", name, ms_desc(a, d, sizeof d));
        return ms_errorf("%s: cannot reduce over dim %d of size 0 (shape %s)", name, dim, ms_shape_str(a, s, sizeof s));
    }
    int64_t shape[MS_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < a->ndim; i++) {
        if (all || i == cd) {
            if (keepdim) shape[nd++] = 1;
        } else {
            shape[nd++] = a->sizes[i];
        }
    }
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, nd, shape, dtype, a->device_id) ||
        check_given_out(name, allocated, *out, a, NULL, NULL, 0))
        return -1;
    return finish(out, allocated, dev_reduce(*out, op, a, all ? -1 : cd, keepdim));
}

int ms_softmax(ms_tensor **out, const ms_tensor *a, int dim, int log) {
    const char *name = log ? "log_softmax" : "softmax";
    int cd;
    if (check1(name, a) || need_float(name, a)) return -1;
    if (a->ndim == 0 && (dim == 0 || dim == -1)) { /* a scalar is its own row */
        int allocated = out && !*out;
        if (ms_prepare_out(out, name, 0, a->sizes, a->dtype_id, a->device_id)) return -1;
        return finish(out, allocated, dev_fill_(*out, log ? 0.0 : 1.0));
    }
    if (ms_wrap_dim(name, dim, a->ndim, &cd)) return -1;
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, a->ndim, a->sizes, a->dtype_id, a->device_id) ||
        check_given_out(name, allocated, *out, a, NULL, NULL, 1))
        return -1;
    return finish(out, allocated, dev_softmax(*out, a, cd, log));
}

int ms_softmax_backward(ms_tensor **out, const ms_tensor *y, const ms_tensor *g, int dim, int log) {
    const char *name = log ? "log_softmax_backward" : "softmax_backward";
    char s1[DESC], s2[DESC];
    int cd;
    if (check2(name, y, g) || need_float(name, y) || need_float(name, g)) return -1;
    if (!same_shape(y, g))
        return ms_errorf("%s: output %s and gradient %s differ in shape", name, ms_shape_str(y, s1, sizeof s1),
                         ms_shape_str(g, s2, sizeof s2));
    int dtype = ms_promote(y->dtype_id, g->dtype_id);
    if (y->ndim == 0 && (dim == 0 || dim == -1)) {
        int allocated = out && !*out;
        if (ms_prepare_out(out, name, 0, y->sizes, dtype, y->device_id)) return -1;
        return finish(out, allocated, dev_fill_(*out, 0.0));
    }
    if (ms_wrap_dim(name, dim, y->ndim, &cd)) return -1;
    int allocated = out && !*out;
    if (ms_prepare_out(out, name, y->ndim, y->sizes, dtype, y->device_id) ||
        check_given_out(name, allocated, *out, y, g, NULL, 1))
        return -1;
    return finish(out, allocated, dev_softmax_backward(*out, y, g, cd, log));
}

/* ============================================================== matmul */

/* views freed together at the end of a call */
typedef struct view_list {
    ms_tensor *v[8];
    int n;
} view_list;

static ms_tensor *keep(view_list *l, ms_tensor *t) {
    l->v[l->n++] = t;
    return t;
}

static void free_views(view_list *l) {
    for (int i = 0; i < l->n; i++) ms_tensor_free(l->v[i]);
    l->n = 0;
}

/* rows and cols of a 2-D-or-more operand after an optional transpose */
static void matrix_dims(const ms_tensor *t, int trans, int64_t *rows, int64_t *cols) {
    int64_t r = t->sizes[t->ndim - 2], c = t->sizes[t->ndim - 1];
    *rows = trans ? c : r;
    *cols = trans ? r : c;
}

static int mismatch(const char *op, const ms_tensor *a, const ms_tensor *b, int transa, int transb) {
    char x[DESC], y[DESC];
    if (transa || transb)
        return ms_errorf("%s: shapes %s and %s do not match (transa=%d, transb=%d)", op,
                         ms_shape_str(a, x, sizeof x), ms_shape_str(b, y, sizeof y), transa ? 1 : 0, transb ? 1 : 0);
    return ms_errorf("%s: shapes %s and %s do not match", op, ms_shape_str(a, x, sizeof x), ms_shape_str(b, y, sizeof y));
}

/* low-precision matmul: in f32, rounded once into out */
static int matmul_lowp(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb) {
    ms_tensor *a32 = NULL, *b32 = NULL, *c32 = NULL;
    int rc = ms_tensor_to(&a32, a, MS_F32, a->device_id);
    if (!rc) rc = ms_tensor_to(&b32, b, MS_F32, b->device_id);
    if (!rc) rc = ms_matmul(&c32, a32, b32, transa, transb);
    if (!rc) rc = ms_tensor_copy_(out, c32);
    ms_tensor_free(a32);
    ms_tensor_free(b32);
    ms_tensor_free(c32);
    return rc;
}

int ms_matmul(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, int transa, int transb) {
    const char *op = "matmul";
    char x[DESC], y[DESC];
    if (check2(op, a, b)) return -1;
    if (a->ndim == 0 || b->ndim == 0)
        return ms_errorf("matmul: 0-dim operands are not supported: shapes %s and %s", ms_shape_str(a, x, sizeof x),
                         ms_shape_str(b, y, sizeof y));
    if (a->dtype_id != b->dtype_id)
        return ms_errorf("matmul: dtypes differ: %s and %s", ms_desc(a, x, sizeof x), ms_desc(b, y, sizeof y));
    if (!ms_is_float(a->dtype_id))
        return ms_errorf("matmul: integer tensors are not supported: %s and %s", ms_desc(a, x, sizeof x),
                         ms_desc(b, y, sizeof y));
    int a1 = a->ndim == 1, b1 = b->ndim == 1;
    int64_t M = 1, K, Kb, N = 1;
    if (a1) K = a->sizes[0];
    else matrix_dims(a, transa, &M, &K);
    if (b1) Kb = b->sizes[0];
    else matrix_dims(b, transb, &Kb, &N);
    if (K != Kb) return mismatch(op, a, b, transa && !a1, transb && !b1);
    /* batch dims */
    int nba = a1 ? 0 : a->ndim - 2, nbb = b1 ? 0 : b->ndim - 2, nb;
    int64_t batch[MS_MAX_DIMS];
    if (broadcast_dims(op, nba, a->sizes, nbb, b->sizes, &nb, batch))
        return ms_errorf("matmul: batch dims of shapes %s and %s cannot be broadcast", ms_shape_str(a, x, sizeof x),
                         ms_shape_str(b, y, sizeof y));
    int64_t shape[MS_MAX_DIMS];
    int nd = nb;
    memcpy(shape, batch, sizeof(int64_t) * (size_t)nb);
    if (!a1) shape[nd++] = M;
    if (!b1) shape[nd++] = N;
    int allocated = out && !*out;
    if (ms_prepare_out(out, op, nd, shape, a->dtype_id, a->device_id) ||
        check_given_out(op, allocated, *out, a, b, NULL, 0))
        return -1;
    if ((a->dtype_id == MS_BF16 || a->dtype_id == MS_F16) && a->device_id < 0)
        return finish(out, allocated, matmul_lowp(*out, a, b, transa, transb));

    /* views: a3 (batch, M, K), b3 (batch, K, N), c3 (batch, M, N) */
    view_list vl = {.n = 0};
    ms_tensor *t = NULL, *a3 = NULL, *b3 = NULL, *c3 = NULL;
    int rc = 0;
    int64_t full[MS_MAX_DIMS];
    memcpy(full, batch, sizeof(int64_t) * (size_t)nb);
    if (a1) rc = ms_tensor_unsqueeze(&t, a, 0);
    else if (transa) rc = ms_tensor_transpose(&t, a, -2, -1);
    else rc = ms_tensor_alias(&t, a);
    if (rc) goto done;
    a3 = keep(&vl, t);
    if (b1) rc = ms_tensor_unsqueeze(&t, b, 1);
    else if (transb) rc = ms_tensor_transpose(&t, b, -2, -1);
    else rc = ms_tensor_alias(&t, b);
    if (rc) goto done;
    b3 = keep(&vl, t);
    c3 = *out;
    if (a1) {
        if ((rc = ms_tensor_unsqueeze(&t, c3, nb))) goto done;
        c3 = keep(&vl, t);
    }
    if (b1) {
        if ((rc = ms_tensor_unsqueeze(&t, c3, c3->ndim))) goto done;
        c3 = keep(&vl, t);
    }
    /* a plain (..., M, K) @ (K, N): fold the batch into M for one GEMM */
    if (nb > 0 && nbb == 0 && !a1) {
        int64_t ak[2] = {-1, K}, cn[2] = {-1, N};
        ms_tensor *af = NULL, *cf = NULL;
        if (ms_tensor_view(&af, a3, 2, ak) == 0) {
            if (ms_tensor_view(&cf, c3, 2, cn) == 0) {
                keep(&vl, af);
                keep(&vl, cf);
                rc = dev_matmul(cf, af, b3);
                goto done;
            }
            ms_tensor_free(af);
        }
        ms_set_error("");
    }
    full[nb] = M; full[nb + 1] = K;
    if ((rc = ms_tensor_expand(&t, a3, nb + 2, full))) goto done;
    a3 = keep(&vl, t);
    full[nb] = K; full[nb + 1] = N;
    if ((rc = ms_tensor_expand(&t, b3, nb + 2, full))) goto done;
    b3 = keep(&vl, t);
    rc = dev_matmul(c3, a3, b3);
done:
    free_views(&vl);
    return finish(out, allocated, rc);
}

int ms_gemm_check(const ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb) {
    const char *op = "gemm_";
    char x[DESC], y[DESC], z[DESC];
    if (check3(op, out, a, b)) return -1;
    /* an f32 out of bf16/f16 operands (a gradient accumulated in f32 straight
     * from the GEMM) where the device has that GEMM */
    const int mixed = out->dtype_id == MS_F32 && (a->dtype_id == MS_BF16 || a->dtype_id == MS_F16) &&
                      b->dtype_id == a->dtype_id && gemm_mixed_ok(out->device_id);
    if (a->dtype_id != b->dtype_id || (out->dtype_id != a->dtype_id && !mixed))
        return ms_errorf("gemm_: dtypes differ: out %s, a %s, b %s (an f32 out takes bf16 or f16 operands)",
                         ms_desc(out, z, sizeof z), ms_desc(a, x, sizeof x), ms_desc(b, y, sizeof y));
    if (!ms_is_float(a->dtype_id)) return ms_errorf("gemm_: integer tensors are not supported: %s", ms_desc(a, x, sizeof x));
    if (a->ndim != 2 || b->ndim != 2 || out->ndim != 2)
        return ms_errorf("gemm_: needs 2-D tensors, got out %s, a %s, b %s", ms_shape_str(out, z, sizeof z),
                         ms_shape_str(a, x, sizeof x), ms_shape_str(b, y, sizeof y));
    if (check_no_self_overlap(op, out)) return -1;
    int64_t M, K, Kb, N;
    matrix_dims(a, transa, &M, &K);
    matrix_dims(b, transb, &Kb, &N);
    if (K != Kb) return mismatch(op, a, b, transa, transb);
    int64_t shape[2] = {M, N};
    ms_tensor *o = (ms_tensor *)out;
    if (ms_prepare_out(&o, op, 2, shape, out->dtype_id, a->device_id) || check_given_out(op, 0, out, a, b, NULL, 0))
        return -1;
    return 0;
}

int ms_gemm_(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb, double alpha,
             double beta) {
    if (ms_gemm_check(out, a, b, transa, transb)) return -1;
    ms_tensor *at = NULL, *bt = NULL;
    int rc = transa ? ms_tensor_transpose(&at, a, 0, 1) : ms_tensor_alias(&at, a);
    if (!rc) rc = transb ? ms_tensor_transpose(&bt, b, 0, 1) : ms_tensor_alias(&bt, b);
    if (!rc) rc = dev_gemm_(out, at, bt, alpha, beta);
    ms_tensor_free(at);
    ms_tensor_free(bt);
    return rc;
}

/* the (M, N) product's shape after the checks every 2-D epilogue makes */
static int epilogue_dims(const char *op, const ms_tensor *a, const ms_tensor *b, int transa, int transb, int64_t *M,
                         int64_t *N) {
    char x[DESC], y[DESC];
    if (check2(op, a, b)) return -1;
    if (a->ndim != 2 || b->ndim != 2)
        return ms_errorf("%s: needs 2-D operands, got %s and %s", op, ms_shape_str(a, x, sizeof x),
                         ms_shape_str(b, y, sizeof y));
    if (a->dtype_id != b->dtype_id || !ms_is_float(a->dtype_id))
        return ms_errorf("%s: operands must be floats of one dtype, got %s and %s", op, ms_desc(a, x, sizeof x),
                         ms_desc(b, y, sizeof y));
    int64_t K, Kb;
    matrix_dims(a, transa, M, &K);
    matrix_dims(b, transb, &Kb, N);
    if (K != Kb) return mismatch(op, a, b, transa, transb);
    return 0;
}

/* bias, when given: a vector of the N columns in a's dtype, on a's device */
static int check_bias_vec(const char *op, const ms_tensor *a, const ms_tensor *bias, int64_t N) {
    char x[DESC];
    if (check2(op, a, bias)) return -1;
    if (bias->ndim != 1 || bias->sizes[0] != N || bias->dtype_id != a->dtype_id)
        return ms_errorf("%s: bias must be a %s vector of %lld (the columns of the product), got %s", op,
                         ms_dtype_name(a->dtype_id), (long long)N, ms_desc(bias, x, sizeof x));
    return 0;
}

int ms_matmul_epilogue(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                       ms_tensor **bias, int mode) {
    const char *op = mode == MS_GEMM_BIAS ? "matmul (bias)" : "matmul (bias gradient)";
    if (mode != MS_GEMM_BIAS && mode != MS_GEMM_BGRAD_A && mode != MS_GEMM_BGRAD_B)
        return ms_errorf("matmul_epilogue: mode %d is not MS_GEMM_BIAS, _BGRAD_A or _BGRAD_B", mode);
    if (!bias) return ms_errorf("%s: no bias box", op);
    int64_t M, N;
    if (epilogue_dims(op, a, b, transa, transb, &M, &N)) return -1;
    int64_t blen = mode == MS_GEMM_BGRAD_A ? M : N;
    if (mode == MS_GEMM_BIAS && check_bias_vec(op, a, *bias, N)) return -1;
    int allocated = out && !*out;
    int64_t shape[2] = {M, N};
    if (ms_prepare_out(out, op, 2, shape, a->dtype_id, a->device_id) ||
        check_given_out(op, allocated, *out, a, b, NULL, 0))
        return -1;
    int bias_alloc = mode != MS_GEMM_BIAS && !*bias;
    if (mode != MS_GEMM_BIAS && ms_prepare_more(bias, op, 1, &blen, a->dtype_id, a->device_id))
        return finish(out, allocated, -1);
    int rc = 1;
#ifdef MS_WITH_CUDA
    if (a->device_id >= 0) rc = ms_cuda_gemm_epilogue(*out, a, b, transa, transb, *bias, mode);
#endif
    if (rc == 1) { /* two passes: the product, then the bias or its gradient */
        rc = ms_matmul(out, a, b, transa, transb);
        if (!rc && mode == MS_GEMM_BIAS) rc = ms_binary(out, MS_OP_ADD, *out, *bias);
        if (!rc && mode != MS_GEMM_BIAS) {
            /* op(a) (M, K) summed over k: a stored (K, M) when transposed */
            const ms_tensor *src = mode == MS_GEMM_BGRAD_A ? a : b;
            int dim = mode == MS_GEMM_BGRAD_A ? (transa ? 0 : 1) : (transb ? 1 : 0);
            rc = ms_reduce(bias, MS_RED_SUM, src, dim, 0);
        }
    }
    if (rc && bias_alloc && *bias) {
        ms_tensor_free(*bias);
        *bias = NULL;
    }
    return finish(out, allocated, rc);
}

int ms_matmul_gelu(ms_tensor **out, ms_tensor **pre, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                   const ms_tensor *bias) {
    const char *op = "matmul (gelu)";
    int64_t M, N;
    if (!out || !pre) return ms_errorf("%s: no output box", op);
    if (epilogue_dims(op, a, b, transa, transb, &M, &N)) return -1;
    if (bias && check_bias_vec(op, a, bias, N)) return -1;
    int64_t shape[2] = {M, N};
    int alloc_out = !*out, alloc_pre = !*pre;
    if (ms_prepare_out(out, op, 2, shape, a->dtype_id, a->device_id) ||
        check_given_out(op, alloc_out, *out, a, b, NULL, 0))
        return -1;
    if (ms_prepare_more(pre, op, 2, shape, a->dtype_id, a->device_id)) return finish(out, alloc_out, -1);
    int rc = 1;
#ifdef MS_WITH_CUDA
    if (a->device_id >= 0) rc = ms_cuda_gemm_gelu(*out, *pre, a, b, transa, transb, (ms_tensor *)bias, 0);
#endif
    if (rc == 1) {
        ms_tensor *bb = (ms_tensor *)bias;
        rc = bias ? ms_matmul_epilogue(pre, a, b, transa, transb, &bb, MS_GEMM_BIAS)
                  : ms_matmul(pre, a, b, transa, transb);
        if (!rc) rc = ms_unary(out, MS_OP_GELU, *pre);
    }
    if (rc) (void)finish(pre, alloc_pre, rc);
    return finish(out, alloc_out, rc);
}

int ms_matmul_dgelu(ms_tensor **out, ms_tensor **bias_grad, const ms_tensor *a, const ms_tensor *b, int transa,
                    int transb, const ms_tensor *pre) {
    const char *op = "matmul (gelu backward)";
    char x[DESC];
    int64_t M, N;
    if (!out) return ms_errorf("%s: no output box", op);
    if (epilogue_dims(op, a, b, transa, transb, &M, &N)) return -1;
    if (check2(op, a, pre)) return -1;
    if (pre->ndim != 2 || pre->sizes[0] != M || pre->sizes[1] != N || pre->dtype_id != a->dtype_id)
        return ms_errorf("%s: the pre-activation must be %s (%lld, %lld), got %s", op, ms_dtype_name(a->dtype_id),
                         (long long)M, (long long)N, ms_desc(pre, x, sizeof x));
    int64_t shape[2] = {M, N};
    int alloc_out = !*out, alloc_bg = bias_grad && !*bias_grad;
    if (ms_prepare_out(out, op, 2, shape, a->dtype_id, a->device_id) ||
        check_given_out(op, alloc_out, *out, a, b, NULL, 0))
        return -1;
    if (bias_grad && ms_prepare_more(bias_grad, op, 1, &N, a->dtype_id, a->device_id)) return finish(out, alloc_out, -1);
    int rc = 1;
#ifdef MS_WITH_CUDA
    if (a->device_id >= 0)
        rc = ms_cuda_gemm_gelu(*out, (ms_tensor *)pre, a, b, transa, transb, bias_grad ? *bias_grad : NULL, 1);
#endif
    if (rc == 1) {
        /* the GEMM, then g * gelu'(pre) with the bias gradient in the same
         * pass on CUDA (ms_cuda_gelu_backward_bgrad), else the op and a sum */
        ms_tensor *g = NULL;
        rc = ms_matmul(&g, a, b, transa, transb);
        int apart = 1;
#ifdef MS_WITH_CUDA
        if (!rc && a->device_id >= 0) {
            apart = ms_cuda_gelu_backward_bgrad(*out, bias_grad ? *bias_grad : NULL, pre, g);
            if (apart < 0) rc = -1;
        }
#endif
        if (!rc && apart) {
            rc = ms_binary(out, MS_OP_GELU_BWD, pre, g);   /* g * gelu'(pre) */
            if (!rc && bias_grad) rc = ms_reduce(bias_grad, MS_RED_SUM, *out, 0, 0);
        }
        ms_tensor_free(g);
    }
    if (rc && bias_grad) (void)finish(bias_grad, alloc_bg, rc);
    return finish(out, alloc_out, rc);
}

/* ============================================================ indexing */

static int check_index_tensor(const char *op, const ms_tensor *idx, int max_ndim) {
    char d[DESC];
    if (idx->dtype_id != MS_I64 && idx->dtype_id != MS_I32)
        return ms_errorf("%s: indices must be i64 or i32, got %s", op, ms_desc(idx, d, sizeof d));
    if (max_ndim >= 0 && idx->ndim > max_ndim)
        return ms_errorf("%s: indices must be 1-D, got %s", op, ms_desc(idx, d, sizeof d));
    return 0;
}

/* every id in idx within [0, size), checked before anything is written */
static int check_ids(const char *op, const ms_tensor *idx, int dim, int64_t size) {
    char pos[DESC];
    /* CUDA ids are checked by the kernel that reads them (a device flag the
     * host checks at its next sync point): reading them here would sync */
    if (idx->device_id >= 0) return 0;
    int64_t n = ms_tensor_numel(idx), index[MS_MAX_DIMS] = {0};
    int es = ms_dtype_size(idx->dtype_id);
    const char *base = ms_tensor_data(idx);
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < idx->ndim; d++) off += index[d] * idx->strides[d];
        int64_t v = idx->dtype_id == MS_I64 ? *(const int64_t *)(base + off * es) : *(const int32_t *)(base + off * es);
        if (v < 0 || v >= size) {
            if (idx->ndim <= 1) snprintf(pos, sizeof pos, "%lld", (long long)i);
            else ms_dims_str(idx->ndim, index, pos, sizeof pos);
            return ms_errorf("%s: index %lld at position %s is out of range for dim %d of size %lld", op, (long long)v,
                             pos, dim, (long long)size);
        }
        for (int d = idx->ndim - 1; d >= 0; d--) {
            if (++index[d] < idx->sizes[d]) break;
            index[d] = 0;
        }
    }
    return 0;
}

int ms_index_select(ms_tensor **out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    const char *op = "index_select";
    int cd;
    if (check2(op, a, idx) || check_index_tensor(op, idx, 1) || ms_wrap_dim(op, dim, a->ndim, &cd)) return -1;
    if (check_ids(op, idx, cd, a->sizes[cd])) return -1;
    int64_t shape[MS_MAX_DIMS];
    memcpy(shape, a->sizes, sizeof shape);
    shape[cd] = ms_tensor_numel(idx);
    int allocated = out && !*out;
    if (ms_prepare_out(out, op, a->ndim, shape, a->dtype_id, a->device_id) ||
        check_given_out(op, allocated, *out, a, idx, NULL, 0))
        return -1;
    return finish(out, allocated, dev_index_select(*out, a, cd, idx));
}

int ms_index_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
    const char *op = "index_add_";
    char x[DESC], y[DESC];
    int cd;
    if (check3(op, dst, idx, src) || check_index_tensor(op, idx, 1) || ms_wrap_dim(op, dim, dst->ndim, &cd)) return -1;
    if (dst->dtype_id != src->dtype_id)
        return ms_errorf("index_add_: dtypes differ: destination %s, source %s", ms_desc(dst, x, sizeof x),
                         ms_desc(src, y, sizeof y));
    int ok = src->ndim == dst->ndim;
    for (int i = 0; ok && i < dst->ndim; i++)
        ok = src->sizes[i] == (i == cd ? ms_tensor_numel(idx) : dst->sizes[i]);
    if (!ok)
        return ms_errorf("index_add_: source shape %s does not fit destination %s with %lld indices along dim %d",
                         ms_shape_str(src, x, sizeof x), ms_shape_str(dst, y, sizeof y), (long long)ms_tensor_numel(idx),
                         dim);
    if (check_no_self_overlap(op, dst) || check_given_out(op, 0, dst, idx, src, NULL, 0) ||
        check_ids(op, idx, cd, dst->sizes[cd]))
        return -1;
    MS_PROF_NOTE(op, src);
    return dev_index_add_(dst, cd, idx, src);
}

int ms_gather(ms_tensor **out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    const char *op = "gather";
    char x[DESC], y[DESC];
    int cd;
    if (check2(op, a, idx) || check_index_tensor(op, idx, -1) || ms_wrap_dim(op, dim, a->ndim, &cd)) return -1;
    int ok = idx->ndim == a->ndim;
    for (int i = 0; ok && i < a->ndim; i++) ok = i == cd || idx->sizes[i] <= a->sizes[i];
    if (!ok)
        return ms_errorf("gather: index shape %s does not fit input shape %s along dim %d", ms_shape_str(idx, x, sizeof x),
                         ms_shape_str(a, y, sizeof y), dim);
    if (check_ids(op, idx, cd, a->sizes[cd])) return -1;
    int allocated = out && !*out;
    if (ms_prepare_out(out, op, idx->ndim, idx->sizes, a->dtype_id, a->device_id) ||
        check_given_out(op, allocated, *out, a, idx, NULL, 0))
        return -1;
    return finish(out, allocated, dev_gather(*out, a, cd, idx));
}

int ms_scatter_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
    const char *op = "scatter_add_";
    char x[DESC], y[DESC], z[DESC];
    int cd;
    if (check3(op, dst, idx, src) || check_index_tensor(op, idx, -1) || ms_wrap_dim(op, dim, dst->ndim, &cd)) return -1;
    if (dst->dtype_id != src->dtype_id)
        return ms_errorf("scatter_add_: dtypes differ: destination %s, source %s", ms_desc(dst, x, sizeof x),
                         ms_desc(src, y, sizeof y));
    int ok = idx->ndim == dst->ndim && src->ndim == dst->ndim;
    for (int i = 0; ok && i < dst->ndim; i++)
        ok = idx->sizes[i] <= src->sizes[i] && (i == cd || idx->sizes[i] <= dst->sizes[i]);
    if (!ok)
        return ms_errorf("scatter_add_: index shape %s does not fit source %s and destination %s along dim %d",
                         ms_shape_str(idx, x, sizeof x), ms_shape_str(src, y, sizeof y), ms_shape_str(dst, z, sizeof z),
                         dim);
    if (check_no_self_overlap(op, dst) || check_given_out(op, 0, dst, idx, src, NULL, 0) ||
        check_ids(op, idx, cd, dst->sizes[cd]))
        return -1;
    MS_PROF_NOTE(op, src);
    return dev_scatter_add_(dst, cd, idx, src);
}

int ms_cat(ms_tensor **out, int n, ms_tensor *const *ts, int dim) {
    char x[DESC], y[DESC];
    int cd;
    if (n <= 0 || !ts) return ms_errorf("cat: needs at least one tensor");
    for (int i = 0; i < n; i++)
        if (ms_tensor_check_live(ts[i], "cat")) return -1;
    const ms_tensor *t0 = ts[0];
    if (t0->ndim == 0) return ms_errorf("cat: 0-dim tensors cannot be concatenated");
    if (ms_wrap_dim("cat", dim, t0->ndim, &cd)) return -1;
    int64_t shape[MS_MAX_DIMS];
    memcpy(shape, t0->sizes, sizeof shape);
    shape[cd] = 0;
    for (int i = 0; i < n; i++) {
        const ms_tensor *t = ts[i];
        if (t->device_id != t0->device_id)
            return ms_errorf("cat: tensors on different devices: %s and %s", ms_desc(t0, x, sizeof x),
                             ms_desc(t, y, sizeof y));
        if (t->dtype_id != t0->dtype_id)
            return ms_errorf("cat: dtypes differ: %s and %s", ms_desc(t0, x, sizeof x), ms_desc(t, y, sizeof y));
        int ok = t->ndim == t0->ndim;
        for (int d = 0; ok && d < t0->ndim; d++) ok = d == cd || t->sizes[d] == t0->sizes[d];
        if (!ok)
            return ms_errorf("cat: shapes %s and %s differ outside dim %d", ms_shape_str(t0, x, sizeof x),
                             ms_shape_str(t, y, sizeof y), dim);
        shape[cd] += t->sizes[cd];
    }
    int allocated = out && !*out;
    if (ms_prepare_out(out, "cat", t0->ndim, shape, t0->dtype_id, t0->device_id)) return -1;
    for (int i = 0; i < n && !allocated; i++)
        if (check_overlap("cat", *out, ts[i], 0)) return -1;
    int rc = 0;
    int64_t at = 0;
    for (int i = 0; i < n && !rc; i++) {
        ms_tensor *part = NULL;
        rc = ms_tensor_narrow(&part, *out, cd, at, ts[i]->sizes[cd]);
        if (!rc) rc = ms_tensor_copy_(part, ts[i]);
        ms_tensor_free(part);
        at += ts[i]->sizes[cd];
    }
    return finish(out, allocated, rc);
}

/* ====================================================== fills and rng */

int ms_fill_(ms_tensor *t, double value) {
    if (check1("fill_", t)) return -1;
    MS_PROF_NOTE("fill_", t);
    return dev_fill_(t, value);
}

int ms_arange_(ms_tensor *t, double start, double step) {
    if (check1("arange_", t)) return -1;
    MS_PROF_NOTE("arange_", t);
    return dev_arange_(t, start, step);
}

/* a random draw inside a CUDA graph capture: its seed and offset are
 * kernel arguments, so every replay would draw the same numbers */
static int refuse_draw(const char *op) {
    if (ms_cuda_capturing() < 0) return 0;
    return ms_errorf("%s during CUDA graph capture on cuda:%d: a random draw (dropout with p > 0, rand, randn) "
                     "would have its seed and offset baked into the graph, and every replay would draw the same "
                     "numbers; use dropout 0 or draw outside the graph (the capture is aborted; "
                     "docs/cuda-graphs.md)", op, ms_cuda_capturing());
}

int ms_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
    if (refuse_draw("rand_")) return -1;
    if (check1("rand_", t) || need_float("rand_", t)) return -1;
    MS_PROF_NOTE("rand_", t);
    return dev_rand_(t, seed, offset, lo, hi, 0);
}

int ms_randn_(ms_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
    if (refuse_draw("randn_")) return -1;
    if (check1("randn_", t) || need_float("randn_", t)) return -1;
    MS_PROF_NOTE("randn_", t);
    return dev_rand_(t, seed, offset, mean, std, 1);
}

/* ============================================================ fused ops
 * Norms, AdamW, sum of squares, RoPE (contracts in core/ops.h). The kernels
 * (core/fused_cpu.h, kernels/kernels.h) take contiguous tensors, with the
 * per-column operands (w, b, cos, sin) and the statistics in the compute
 * dtype (f64 for f64 x, else f32); the conversions are made here. */

static int dev_layer_norm(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
                          const ms_tensor *b, double eps) {
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_layer_norm(y, mean, rstd, x, w, b, eps);
#endif
    return ms_cpu_layer_norm(y, mean, rstd, x, w, b, eps);
}

static int dev_layer_norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g,
                                   const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd,
                                   const ms_tensor *w) {
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_layer_norm_backward(dx, dw, db, g, x, mean, rstd, w);
#endif
    return ms_cpu_layer_norm_backward(dx, dw, db, g, x, mean, rstd, w);
}

static int dev_rms_norm(ms_tensor *y, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w, double eps) {
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_rms_norm(y, rstd, x, w, eps);
#endif
    return ms_cpu_rms_norm(y, rstd, x, w, eps);
}

static int dev_rms_norm_backward(ms_tensor *dx, ms_tensor *dw, const ms_tensor *g, const ms_tensor *x,
                                 const ms_tensor *rstd, const ms_tensor *w) {
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_rms_norm_backward(dx, dw, g, x, rstd, w);
#endif
    return ms_cpu_rms_norm_backward(dx, dw, g, x, rstd, w);
}

/* AdamW's constants of one step: {1 - lr·wd, lr/(1-β1^step), sqrt(1-β2^step)},
 * computed here only, so a step whose constants come from the device
 * (ms_adamw_constants_) has the bits of one that takes them as arguments */
static void adamw_constants(double lr, double beta1, double beta2, double wd, int64_t step, double k[3]) {
    k[0] = 1.0 - lr * wd;
    k[1] = lr / (1.0 - pow(beta1, (double)step));
    k[2] = sqrt(1.0 - pow(beta2, (double)step));
}

static int dev_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m, ms_tensor *const *v,
                     double beta1, double beta2, double eps, const double k[3], const ms_tensor *kt,
                     ms_tensor *const *w, const ms_tensor *gs) {
#ifdef MS_WITH_CUDA
    if (p[0]->device_id >= 0)
        return ms_cuda_adamw(n, p, g, m, v, beta1, beta2, eps, k, kt ? (const double *)ms_tensor_data(kt) : NULL, w,
                             gs ? (const double *)ms_tensor_data(gs) : NULL);
#endif
    return ms_cpu_adamw(n, p, g, m, v, beta1, beta2, eps, kt ? (const double *)ms_tensor_data(kt) : k, w,
                        gs ? *(const double *)ms_tensor_data(gs) : 1.0, gs != NULL);
}

static int dev_sum_squares(ms_tensor *out, int n, ms_tensor *const *ts) {
#ifdef MS_WITH_CUDA
    if (out->device_id >= 0) return ms_cuda_sum_squares(out, n, ts);
#endif
    return ms_cpu_sum_squares(out, n, ts);
}

static int dev_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward) {
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_cuda_rope(out, x, cos, sin, backward);
#endif
    return ms_cpu_rope(out, x, cos, sin, backward);
}

/* f64 math for f64 inputs, f32 for the rest */
static int compute_dtype_of(int dtype) { return dtype == MS_F64 ? MS_F64 : MS_F32; }

/* up to 8 optional tensors (NULL skipped): live and on one device */
static int check_opt(const char *op, int n, const ms_tensor *const *ts) {
    const ms_tensor *live[8];
    int k = 0;
    for (int i = 0; i < n; i++)
        if (ts[i]) live[k++] = ts[i];
    return check_tensors(op, k, live);
}

/* *tmp = t contiguous in dtype (an alias when it already is); NULL for NULL */
static int contiguous_as(ms_tensor **tmp, const ms_tensor *t, int dtype) {
    *tmp = NULL;
    if (!t) return 0;
    if (t->dtype_id == dtype) return ms_tensor_contiguous(tmp, t);
    return ms_tensor_to(tmp, t, dtype, t->device_id);
}

/* an output slot: prepared like any other and, for these kernels, contiguous */
static int prepare_contig(ms_tensor **slot, const char *op, const char *what, int ndim, const int64_t *shape,
                          int dtype, int device, int *allocated) {
    char d[DESC];
    *allocated = slot && !*slot;
    /* the op counter counts the call at its first output: out (add_*: sum), dx */
    int first = !strcmp(what, "dx") || !strcmp(what, "sum") || (!strcmp(what, "out") && strncmp(op, "add_", 4));
    if ((first ? ms_prepare_out : ms_prepare_more)(slot, op, ndim, shape, dtype, device)) return -1;
    if (!*allocated && !ms_tensor_is_contiguous(*slot))
        return ms_errorf("%s: %s %s must be contiguous", op, what, ms_desc(*slot, d, sizeof d));
    return 0;
}

/* a (C) per-column operand: float, 1-D, C elements */
static int check_column(const char *op, const char *what, const ms_tensor *t, int64_t C, const ms_tensor *x) {
    char d[DESC], e[DESC];
    if (!t) return 0;
    if (!ms_is_float(t->dtype_id) || t->ndim != 1 || t->sizes[0] != C)
        return ms_errorf("%s: %s %s does not fit an input %s (expected a float (%lld))", op, what,
                         ms_desc(t, d, sizeof d), ms_desc(x, e, sizeof e), (long long)C);
    return 0;
}

/* shared checks of the norms' forward: x float with a last dim; out dtype */
static int norm_checks(const char *op, const ms_tensor *x, const ms_tensor *w, const ms_tensor *b, int *out_dtype,
                       int64_t *N, int64_t *C) {
    const ms_tensor *ts[3] = {x, w, b};
    char d[DESC];
    if (!x) return ms_errorf("%s: no input given", op);
    if (check_opt(op, 3, ts) || need_float(op, x)) return -1;
    if (x->ndim < 1) return ms_errorf("%s: needs an input with a last dim to normalise, got %s", op, ms_desc(x, d, sizeof d));
    *C = x->sizes[x->ndim - 1];
    *N = *C ? ms_tensor_numel(x) / *C : 0;
    if (check_column(op, "weight", w, *C, x) || check_column(op, "bias", b, *C, x)) return -1;
    if (*out_dtype < 0) *out_dtype = x->dtype_id;
    if (*out_dtype >= MS_NUM_DTYPES || !ms_is_float(*out_dtype))
        return ms_errorf("%s: out_dtype %d is not a float dtype", op, *out_dtype);
    return 0;
}

/* shared checks of the norms' backward: g like x, float; statistics (N) */
static int norm_backward_checks(const char *op, const ms_tensor *g, const ms_tensor *x, const ms_tensor *mean,
                                const ms_tensor *rstd, const ms_tensor *w, int64_t *N, int64_t *C) {
    const ms_tensor *ts[5] = {g, x, mean, rstd, w};
    char s1[DESC], s2[DESC];
    if (!g || !x || !rstd) return ms_errorf("%s: needs g, x and the saved rstd", op);
    if (check_opt(op, 5, ts) || need_float(op, x) || need_float(op, g)) return -1;
    if (x->ndim < 1 || !same_shape(g, x))
        return ms_errorf("%s: gradient %s and input %s differ in shape", op, ms_desc(g, s1, sizeof s1),
                         ms_desc(x, s2, sizeof s2));
    *C = x->sizes[x->ndim - 1];
    *N = *C ? ms_tensor_numel(x) / *C : 0;
    const ms_tensor *stats[2] = {mean, rstd};
    for (int i = 0; i < 2; i++) {
        const ms_tensor *s = stats[i];
        if (s && (!ms_is_float(s->dtype_id) || ms_tensor_numel(s) != *N))
            return ms_errorf("%s: saved %s %s does not fit an input %s (%lld rows)", op, i ? "rstd" : "mean",
                             ms_desc(s, s1, sizeof s1), ms_desc(x, s2, sizeof s2), (long long)*N);
    }
    return check_column(op, "weight", w, *C, x);
}

/* a (C) parameter gradient computed into `tmp` (compute dtype) handed to
 * its slot in `dtype`: taken over when the slot is empty and the dtypes
 * agree, else copied into a prepared output */
static int deliver_column(ms_tensor **slot, const char *op, const char *what, ms_tensor **tmp, int dtype) {
    int allocated = 0;
    if (!*slot && (*tmp)->dtype_id == dtype) {
        *slot = *tmp;
        *tmp = NULL;
        return 0;
    }
    if (prepare_contig(slot, op, what, 1, (*tmp)->sizes, dtype, (*tmp)->device_id, &allocated)) return -1;
    return finish(slot, allocated, ms_tensor_copy_(*slot, *tmp));
}

int ms_layer_norm(ms_tensor **out, ms_tensor **mean, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *w,
                  const ms_tensor *b, double eps, int out_dtype) {
    const char *op = "layer_norm";
    int64_t N, C;
    if (norm_checks(op, x, w, b, &out_dtype, &N, &C)) return -1;
    int cdt = compute_dtype_of(x->dtype_id), ay = 0, am = 0, ar = 0;
    ms_tensor *xc = NULL, *wc = NULL, *bc = NULL;
    int rc = prepare_contig(out, op, "out", x->ndim, x->sizes, out_dtype, x->device_id, &ay);
    if (!rc) rc = check_given_out(op, ay, *out, x, w, b, 0);
    if (!rc && mean) rc = prepare_contig(mean, op, "mean", 1, &N, cdt, x->device_id, &am);
    if (!rc && rstd) rc = prepare_contig(rstd, op, "rstd", 1, &N, cdt, x->device_id, &ar);
    if (!rc) rc = ms_tensor_contiguous(&xc, x);
    if (!rc) rc = contiguous_as(&wc, w, cdt);
    if (!rc) rc = contiguous_as(&bc, b, cdt);
    if (!rc) rc = dev_layer_norm(*out, mean ? *mean : NULL, rstd ? *rstd : NULL, xc, wc, bc, eps);
    ms_tensor_free(xc);
    ms_tensor_free(wc);
    ms_tensor_free(bc);
    finish(mean, am, rc);
    finish(rstd, ar, rc);
    return finish(out, ay, rc);
}

/* the backward of both norms after their checks: LayerNorm (mean given),
 * or RMSNorm (mean and db NULL); the statistics and w in the compute dtype,
 * dw and db computed there and delivered in w's dtype */
/* out (C) = the column sums of d seen as (N, C) rows, added in f32 (f64 for
 * f64 d) from d's stored values and rounded once into out's dtype: the
 * reference of dxl_sum, and its path wherever the kernel does not fuse it */
static int column_sum_rows(ms_tensor *out, const ms_tensor *d, int64_t C) {
    int64_t shape[2] = {ms_tensor_numel(d) / C, C};
    ms_tensor *f = NULL, *v = NULL, *s = NULL;
    int rc = ms_tensor_to(&f, d, d->dtype_id == MS_F64 ? MS_F64 : MS_F32, d->device_id);
    if (!rc) rc = ms_tensor_view(&v, f, 2, shape);
    if (!rc) rc = ms_reduce(&s, MS_RED_SUM, v, 0, 0);
    if (!rc) rc = ms_tensor_copy_(out, s);
    ms_tensor_free(s);
    ms_tensor_free(v);
    ms_tensor_free(f);
    return rc;
}

static int norm_backward(const char *op, ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g,
                         const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w,
                         int64_t C, const ms_tensor *gres, ms_tensor **dxl, ms_tensor **dxl_sum) {
    int cdt = compute_dtype_of(x->dtype_id), pdt = w ? w->dtype_id : cdt, ax = 0, al = 0, as = 0;
    ms_tensor *gc = NULL, *xc = NULL, *mc = NULL, *rc_ = NULL, *wc = NULL, *dwt = NULL, *dbt = NULL;
    int rc = 0;
    if (dx) {
        rc = prepare_contig(dx, op, "dx", x->ndim, x->sizes, x->dtype_id, x->device_id, &ax);
        if (!rc) rc = check_given_out(op, ax, *dx, g, x, w, 0);
    }
    if (!rc && dxl) {
        if (!dx) rc = ms_errorf("%s: dx in g's dtype asked for without dx", op);
        if (!rc) rc = prepare_contig(dxl, op, "dx (g's dtype)", x->ndim, x->sizes, g->dtype_id, x->device_id, &al);
        if (!rc) rc = check_given_out(op, al, *dxl, g, x, w, 0);
    }
    if (!rc && dxl_sum) {
        if (!dxl) rc = ms_errorf("%s: the column sums of dx in g's dtype asked for without that dx (dxl)", op);
        if (!rc) rc = prepare_contig(dxl_sum, op, "dxl_sum", 1, &C, g->dtype_id, x->device_id, &as);
    }
    if (!rc) rc = ms_tensor_contiguous(&gc, g);
    if (!rc) rc = ms_tensor_contiguous(&xc, x);
    if (!rc) rc = contiguous_as(&mc, mean, cdt);
    if (!rc) rc = contiguous_as(&rc_, rstd, cdt);
    if (!rc) rc = contiguous_as(&wc, w, cdt);
    if (!rc && dw) rc = ms_tensor_empty(&dwt, 1, &C, cdt, x->device_id);
    if (!rc && db) rc = ms_tensor_empty(&dbt, 1, &C, cdt, x->device_id);
    int fused = 0;
    if (!rc) {
        ms_tensor *dxt = dx ? *dx : NULL;
#ifdef MS_WITH_CUDA
        /* gres added by the kernel in its own pass when the dtypes allow */
        if (gres && dx && x->device_id >= 0) {
            ms_tensor *grc = NULL;
            rc = ms_tensor_contiguous(&grc, gres);
            if (!rc) rc = ms_cuda_norm_backward_add(dxt, dwt, dbt, gc, xc, mc, rc_, wc, grc, mean == NULL,
                                                    dxl ? *dxl : NULL, dxl_sum ? *dxl_sum : NULL);
            if (rc == 1 && dxl)   /* not with the second output: without it, then a conversion */
                rc = ms_cuda_norm_backward_add(dxt, dwt, dbt, gc, xc, mc, rc_, wc, grc, mean == NULL, NULL, NULL);
            else if (rc == 0 && dxl)
                fused = 2;
            ms_tensor_free(grc);
            if (rc == 0 && !fused) fused = 1;
            if (rc == 1) rc = 0;
        }
#endif
        if (!rc && !fused)
            rc = mean ? dev_layer_norm_backward(dxt, dwt, dbt, gc, xc, mc, rc_, wc)
                      : dev_rms_norm_backward(dxt, dwt, gc, xc, rc_, wc);
        if (!rc && gres && dx && !fused) rc = ms_binary(dx, MS_OP_ADD, *dx, gres);
        if (!rc && dxl && fused != 2) rc = ms_tensor_copy_(*dxl, *dx);   /* the CPU reference: a rounding copy */
        /* fused == 2: the kernel summed dxl's columns too (in its pass when
         * it could, else by its own reduction of dxl) */
        if (!rc && dxl_sum && fused != 2) rc = column_sum_rows(*dxl_sum, *dxl, C);
    }
    if (!rc && dw) rc = deliver_column(dw, op, "dw", &dwt, pdt);
    if (!rc && db) rc = deliver_column(db, op, "db", &dbt, pdt);
    ms_tensor_free(gc);
    ms_tensor_free(xc);
    ms_tensor_free(mc);
    ms_tensor_free(rc_);
    ms_tensor_free(wc);
    ms_tensor_free(dwt);
    ms_tensor_free(dbt);
    if (dxl_sum) finish(dxl_sum, as, rc);
    if (dxl) finish(dxl, al, rc);
    return finish(dx, ax, rc);
}

int ms_layer_norm_backward(ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g, const ms_tensor *x,
                           const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w) {
    const char *op = "layer_norm_backward";
    int64_t N, C;
    if (norm_backward_checks(op, g, x, mean, rstd, w, &N, &C)) return -1;
    if (!mean) return ms_errorf("%s: needs the saved mean", op);
    return norm_backward(op, dx, dw, db, g, x, mean, rstd, w, C, NULL, NULL, NULL);
}

static int norm_backward_add(const char *op, ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g,
                             const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w,
                             const ms_tensor *gres, ms_tensor **dxl, ms_tensor **dxl_sum) {
    char a[DESC], b[DESC];
    int64_t N, C;
    if (norm_backward_checks(op, g, x, mean, rstd, w, &N, &C)) return -1;
    if (gres) {
        if (check2(op, x, gres)) return -1;
        int same = gres->ndim == x->ndim;
        for (int i = 0; same && i < x->ndim; i++) same = gres->sizes[i] == x->sizes[i];
        if (!same || !ms_is_float(gres->dtype_id))
            return ms_errorf("%s: the residual gradient %s must be a float tensor of x's shape %s", op,
                             ms_desc(gres, a, sizeof a), ms_shape_str(x, b, sizeof b));
    }
    return norm_backward(op, dx, dw, db, g, x, mean, rstd, w, C, gres, dxl, dxl_sum);
}

int ms_layer_norm_backward_add(ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g,
                               const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w,
                               const ms_tensor *gres, ms_tensor **dxl, ms_tensor **dxl_sum) {
    const char *op = gres ? "layer_norm_backward (with a residual gradient)" : "layer_norm_backward";
    if (!mean) return ms_errorf("%s: needs the saved mean", op);
    return norm_backward_add(op, dx, dw, db, g, x, mean, rstd, w, gres, dxl, dxl_sum);
}

int ms_rms_norm_backward_add(ms_tensor **dx, ms_tensor **dw, const ms_tensor *g, const ms_tensor *x,
                             const ms_tensor *rstd, const ms_tensor *w, const ms_tensor *gres, ms_tensor **dxl,
                             ms_tensor **dxl_sum) {
    return norm_backward_add(gres ? "rms_norm_backward (with a residual gradient)" : "rms_norm_backward", dx, dw, NULL,
                             g, x, NULL, rstd, w, gres, dxl, dxl_sum);
}

/* res = x + h, then the norm (rms: RMSNorm, no mean or bias) of res */
static int add_norm(const char *op, int rms, ms_tensor **res, ms_tensor **out, ms_tensor **mean, ms_tensor **rstd,
                    const ms_tensor *x, const ms_tensor *h, const ms_tensor *w, const ms_tensor *b, double eps,
                    int out_dtype) {
    char d1[DESC], d2[DESC];
    int64_t N, C;
    if (!res) return ms_errorf("%s: no box for the sum", op);
    if (check2(op, x, h)) return -1;
    int same = h->ndim == x->ndim;
    for (int i = 0; same && i < x->ndim; i++) same = h->sizes[i] == x->sizes[i];
    if (!same || !ms_is_float(x->dtype_id) || !ms_is_float(h->dtype_id))
        return ms_errorf("%s: x %s and h %s must be float tensors of one shape", op, ms_desc(x, d1, sizeof d1),
                         ms_desc(h, d2, sizeof d2));
    if (norm_checks(op, x, w, b, &out_dtype, &N, &C)) return -1;
    int sdt = ms_promote(x->dtype_id, h->dtype_id);
    int as = 0, ay = 0, am = 0, ar = 0;
    int rc = prepare_contig(res, op, "sum", x->ndim, x->sizes, sdt, x->device_id, &as);
    if (!rc) rc = check_given_out(op, as, *res, x, h, NULL, 0);
    int tried = 0;
#ifdef MS_WITH_CUDA
    if (!rc && x->device_id >= 0 && sdt == x->dtype_id && h->dtype_id == out_dtype) {
        int cdt = compute_dtype_of(sdt);
        ms_tensor *xc = NULL, *hc = NULL, *wc = NULL, *bc = NULL;
        rc = prepare_contig(out, op, "out", x->ndim, x->sizes, out_dtype, x->device_id, &ay);
        if (!rc) rc = check_given_out(op, ay, *out, x, w, b, 0);
        if (!rc && mean) rc = prepare_contig(mean, op, "mean", 1, &N, cdt, x->device_id, &am);
        if (!rc && rstd) rc = prepare_contig(rstd, op, "rstd", 1, &N, cdt, x->device_id, &ar);
        if (!rc) rc = ms_tensor_contiguous(&xc, x);
        if (!rc) rc = ms_tensor_contiguous(&hc, h);
        if (!rc) rc = contiguous_as(&wc, w, cdt);
        if (!rc) rc = contiguous_as(&bc, b, cdt);
        if (!rc) {
            rc = ms_cuda_add_norm(*res, *out, mean ? *mean : NULL, rstd ? *rstd : NULL, xc, hc, wc, bc, eps, rms);
            tried = rc != 1;
            if (rc == 1) rc = 0;
        }
        ms_tensor_free(xc);
        ms_tensor_free(hc);
        ms_tensor_free(wc);
        ms_tensor_free(bc);
    }
#endif
    if (!rc && !tried) { /* two passes (the CPU's reference): the sum, then the norm */
        rc = ms_binary(res, MS_OP_ADD, x, h);
        if (!rc) rc = rms ? ms_rms_norm(out, rstd, *res, w, eps, out_dtype)
                          : ms_layer_norm(out, mean, rstd, *res, w, b, eps, out_dtype);
    }
    if (rc) {
        if (mean) finish(mean, am, rc);
        if (rstd) finish(rstd, ar, rc);
        finish(out, ay, rc);
    }
    return finish(res, as, rc);
}

int ms_add_layer_norm(ms_tensor **res, ms_tensor **out, ms_tensor **mean, ms_tensor **rstd, const ms_tensor *x,
                      const ms_tensor *h, const ms_tensor *w, const ms_tensor *b, double eps, int out_dtype) {
    return add_norm("add_layer_norm", 0, res, out, mean, rstd, x, h, w, b, eps, out_dtype);
}

int ms_add_rms_norm(ms_tensor **res, ms_tensor **out, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *h,
                    const ms_tensor *w, double eps, int out_dtype) {
    return add_norm("add_rms_norm", 1, res, out, NULL, rstd, x, h, w, NULL, eps, out_dtype);
}

int ms_rms_norm(ms_tensor **out, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *w, double eps,
                int out_dtype) {
    const char *op = "rms_norm";
    int64_t N, C;
    if (norm_checks(op, x, w, NULL, &out_dtype, &N, &C)) return -1;
    int cdt = compute_dtype_of(x->dtype_id), ay = 0, ar = 0;
    ms_tensor *xc = NULL, *wc = NULL;
    int rc = prepare_contig(out, op, "out", x->ndim, x->sizes, out_dtype, x->device_id, &ay);
    if (!rc) rc = check_given_out(op, ay, *out, x, w, NULL, 0);
    if (!rc && rstd) rc = prepare_contig(rstd, op, "rstd", 1, &N, cdt, x->device_id, &ar);
    if (!rc) rc = ms_tensor_contiguous(&xc, x);
    if (!rc) rc = contiguous_as(&wc, w, cdt);
    if (!rc) rc = dev_rms_norm(*out, rstd ? *rstd : NULL, xc, wc, eps);
    ms_tensor_free(xc);
    ms_tensor_free(wc);
    finish(rstd, ar, rc);
    return finish(out, ay, rc);
}

int ms_rms_norm_backward(ms_tensor **dx, ms_tensor **dw, const ms_tensor *g, const ms_tensor *x,
                         const ms_tensor *rstd, const ms_tensor *w) {
    const char *op = "rms_norm_backward";
    int64_t N, C;
    if (norm_backward_checks(op, g, x, NULL, rstd, w, &N, &C)) return -1;
    return norm_backward(op, dx, dw, NULL, g, x, NULL, rstd, w, C, NULL, NULL, NULL);
}

/* a and b share bytes of one storage */
static int bytes_overlap(const ms_tensor *a, const ms_tensor *b) {
    if (a->storage != b->storage || ms_tensor_numel(a) == 0 || ms_tensor_numel(b) == 0) return 0;
    int64_t alo, ahi, blo, bhi;
    view_bytes(a, &alo, &ahi);
    view_bytes(b, &blo, &bhi);
    return alo < bhi && blo < ahi;
}

/* AdamW's device-side constants: 3 contiguous f64 on the device of `like` */
static int check_constants(const char *op, const ms_tensor *k, const ms_tensor *like) {
    char a[DESC], b[DESC];
    if (ms_tensor_check_live(k, op)) return -1;
    if (k->dtype_id != MS_F64 || ms_tensor_numel(k) != 3 || !ms_tensor_is_contiguous(k) ||
        k->device_id != like->device_id)
        return ms_errorf("%s: the step's constants must be 3 contiguous f64 elements on the parameters' device (%s), "
                         "got %s", op, ms_desc(like, a, sizeof a), ms_desc(k, b, sizeof b));
    return 0;
}

int ms_adamw_multi_(int n, ms_tensor *const *params, ms_tensor *const *grads, ms_tensor *const *exp_avg,
                    ms_tensor *const *exp_avg_sq, double lr, double beta1, double beta2, double eps,
                    double weight_decay, int64_t step, ms_tensor *const *masters, const ms_tensor *grad_scale,
                    const ms_tensor *constants) {
    const char *op = "adamw_";
    char a[DESC], b[DESC];
    if (n < 1 || !params || !grads || !exp_avg || !exp_avg_sq) return ms_errorf("adamw_: needs n >= 1 tensors of each kind");
    if (step < 1) return ms_errorf("adamw_: step must be >= 1 (the count including this update), got %lld", (long long)step);
    if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1))
        return ms_errorf("adamw_: betas must be in [0, 1), got %g and %g", beta1, beta2);
    for (int i = 0; i < n; i++) {
        const ms_tensor *ts[5] = {params[0], params[i], grads[i], exp_avg[i], exp_avg_sq[i]};
        for (int k = 1; k < 5; k++)
            if (!ts[k]) return ms_errorf("adamw_: tensor group %d has a NULL tensor", i);
        if (check_tensors(op, 5, ts)) return -1;
        const ms_tensor *p = params[i], *g = grads[i], *m = exp_avg[i], *v = exp_avg_sq[i];
        int sdt = compute_dtype_of(p->dtype_id);
        if (!ms_is_float(p->dtype_id) || !ms_is_float(g->dtype_id))
            return ms_errorf("adamw_: parameter %s and gradient %s must be float (group %d)", ms_desc(p, a, sizeof a),
                             ms_desc(g, b, sizeof b), i);
        if (m->dtype_id != sdt || v->dtype_id != sdt)
            return ms_errorf("adamw_: moments must be %s for a %s parameter, got %s and %s (group %d)",
                             ms_dtype_name(sdt), ms_dtype_name(p->dtype_id), ms_dtype_name(m->dtype_id),
                             ms_dtype_name(v->dtype_id), i);
        int64_t np = ms_tensor_numel(p);
        if (ms_tensor_numel(g) != np || ms_tensor_numel(m) != np || ms_tensor_numel(v) != np)
            return ms_errorf("adamw_: parameter %s, gradient %s and moments of %lld and %lld elements differ in size "
                             "(group %d)", ms_desc(p, a, sizeof a), ms_desc(g, b, sizeof b),
                             (long long)ms_tensor_numel(m), (long long)ms_tensor_numel(v), i);
        for (int k = 1; k < 5; k++)
            if (!ms_tensor_is_contiguous(ts[k]))
                return ms_errorf("adamw_: %s %s must be contiguous (group %d)",
                                 k == 1 ? "parameter" : k == 2 ? "gradient" : "moment", ms_desc(ts[k], a, sizeof a), i);
        /* views of one flat buffer are fine as long as they do not overlap */
        for (int a = 1; a < 5; a++)
            for (int b = a + 1; b < 5; b++)
                if (bytes_overlap(ts[a], ts[b]))
                    return ms_errorf("adamw_: parameter, gradient and moments must not overlap in memory (group %d)", i);
        const ms_tensor *w = masters ? masters[i] : NULL;
        if (w) {
            const ms_tensor *pw[2] = {p, w};
            if (check_tensors(op, 2, pw)) return -1;
            if (w->dtype_id != sdt || p->dtype_id == sdt || ms_tensor_numel(w) != np || !ms_tensor_is_contiguous(w))
                return ms_errorf("adamw_: the master of parameter %s must be a contiguous %s tensor of its %lld "
                                 "elements, for a bf16/f16 parameter; got %s (group %d)", ms_desc(p, a, sizeof a),
                                 ms_dtype_name(sdt), (long long)np, ms_desc(w, b, sizeof b), i);
            for (int k = 1; k < 5; k++)
                if (bytes_overlap(ts[k], w))
                    return ms_errorf("adamw_: the master overlaps the parameter, gradient or moments (group %d)", i);
        }
    }
    if (grad_scale) {
        if (ms_tensor_check_live(grad_scale, op)) return -1;
        if (grad_scale->dtype_id != MS_F64 || ms_tensor_numel(grad_scale) != 1 ||
            grad_scale->device_id != params[0]->device_id)
            return ms_errorf("adamw_: grad_scale must be one f64 element on the parameters' device (%s), got %s",
                             ms_desc(params[0], a, sizeof a), ms_desc(grad_scale, b, sizeof b));
    }
    if (constants && check_constants(op, constants, params[0])) return -1;
    double k[3];
    adamw_constants(lr, beta1, beta2, weight_decay, step, k);
    return dev_adamw(n, params, grads, exp_avg, exp_avg_sq, beta1, beta2, eps, k, constants, masters, grad_scale);
}

int ms_adamw_constants_(ms_tensor *constants, double lr, double beta1, double beta2, double weight_decay,
                        int64_t step) {
    const char *op = "adamw_constants_";
    if (ms_tensor_check_live(constants, op) || check_constants(op, constants, constants)) return -1;
    if (step < 1) return ms_errorf("%s: step must be >= 1 (the count including this update), got %lld", op, (long long)step);
    double k[3];
    adamw_constants(lr, beta1, beta2, weight_decay, step, k);
#ifdef MS_WITH_CUDA
    if (constants->device_id >= 0) return ms_cuda_adamw_constants(constants, k);
#endif
    memcpy(ms_tensor_data(constants), k, sizeof k);
    return 0;
}

int ms_adamw_(ms_tensor *param, const ms_tensor *grad, ms_tensor *exp_avg, ms_tensor *exp_avg_sq, double lr,
              double beta1, double beta2, double eps, double weight_decay, int64_t step) {
    ms_tensor *g = (ms_tensor *)grad; /* read only: the list form takes no const */
    return ms_adamw_multi_(1, &param, &g, &exp_avg, &exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, NULL,
                           NULL, NULL);
}

int ms_sum_squares(ms_tensor **out, int n, ms_tensor *const *ts) {
    const char *op = "sum_squares";
    char d[DESC];
    if (n < 1 || !ts) return ms_errorf("sum_squares: needs at least one tensor");
    for (int i = 0; i < n; i++) {
        if (!ts[i]) return ms_errorf("sum_squares: tensor %d is NULL", i);
        const ms_tensor *pair[2] = {ts[0], ts[i]};
        if (check_tensors(op, 2, pair)) return -1;
        if (!ms_is_float(ts[i]->dtype_id))
            return ms_errorf("sum_squares: tensor %d %s is not a float tensor", i, ms_desc(ts[i], d, sizeof d));
    }
    int allocated = 0;
    int64_t scalar[1] = {1};
    if (prepare_contig(out, op, "out", 0, scalar, MS_F64, ts[0]->device_id, &allocated)) return -1;
    /* the kernels read contiguous tensors: copy the others (rare) */
    ms_tensor *tmp[64], **list = tmp;
    int rc = 0;
    if (n > 64) {
        list = calloc((size_t)n, sizeof *list);
        if (!list) return finish(out, allocated, ms_errorf("sum_squares: out of host memory for %d tensors", n));
    } else {
        memset(tmp, 0, sizeof tmp);
    }
    for (int i = 0; i < n && !rc; i++) rc = ms_tensor_contiguous(&list[i], ts[i]);
    if (!rc) rc = dev_sum_squares(*out, n, list);
    for (int i = 0; i < n; i++) ms_tensor_free(list[i]);
    if (list != tmp) free(list);
    return finish(out, allocated, rc);
}

int ms_rope(ms_tensor **out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward) {
    const char *op = backward ? "rope_backward" : "rope";
    char s1[DESC], s2[DESC], s3[DESC];
    if (!x || !cos || !sin) return ms_errorf("%s: needs x, cos and sin", op);
    if (check3(op, x, cos, sin) || need_float(op, x) || need_float(op, cos) || need_float(op, sin)) return -1;
    if (x->ndim < 2 || x->sizes[x->ndim - 1] % 2 != 0)
        return ms_errorf("%s: x must be (..., T, D) with an even D, got %s", op, ms_desc(x, s1, sizeof s1));
    int64_t T = x->sizes[x->ndim - 2], D = x->sizes[x->ndim - 1];
    if (cos->ndim != 2 || sin->ndim != 2 || cos->sizes[0] != T || cos->sizes[1] != D || !same_shape(cos, sin))
        return ms_errorf("%s: cos %s and sin %s must be (T, D) = (%lld, %lld) for x %s", op,
                         ms_desc(cos, s1, sizeof s1), ms_desc(sin, s2, sizeof s2), (long long)T, (long long)D,
                         ms_desc(x, s3, sizeof s3));
    int cdt = compute_dtype_of(x->dtype_id), allocated = 0;
    ms_tensor *xc = NULL, *cc = NULL, *sc = NULL;
    int rc = prepare_contig(out, op, "out", x->ndim, x->sizes, x->dtype_id, x->device_id, &allocated);
    if (!rc) rc = check_given_out(op, allocated, *out, x, cos, sin, 0);
    /* CUDA reads any layout with a unit-stride last dim in place */
    if (!rc && x->device_id >= 0 && x->strides[x->ndim - 1] == 1) rc = ms_tensor_alias(&xc, x);
    else if (!rc) rc = ms_tensor_contiguous(&xc, x);
    if (!rc) rc = contiguous_as(&cc, cos, cdt);
    if (!rc) rc = contiguous_as(&sc, sin, cdt);
    if (!rc) rc = dev_rope(*out, xc, cc, sc, backward);
    ms_tensor_free(xc);
    ms_tensor_free(cc);
    ms_tensor_free(sc);
    return finish(out, allocated, rc);
}

/* ------------------------------------------------------------ cast_flat */

int ms_cast_flat(ms_tensor **out, ms_tensor **src, int n, int dtype) {
    char d[DESC];
    if (!out) return ms_errorf("cast_flat: no output slot");
    *out = NULL;
    if (n < 1 || !src) return ms_errorf("cast_flat: %d tensors given, need at least one", n);
    if (dtype < 0 || dtype >= MS_NUM_DTYPES) return ms_errorf("cast_flat: invalid dtype %d", dtype);
    int64_t total = 0;
    int dev = -2, fast = 1;
    for (int i = 0; i < n; i++) {
        if (!src[i]) return ms_errorf("cast_flat: tensor %d is missing", i + 1);
        if (ms_tensor_check_live(src[i], "cast_flat")) return -1;
        if (i == 0) dev = src[i]->device_id;
        else if (src[i]->device_id != dev)
        {
            char d1[DESC];
            return ms_errorf("cast_flat: tensor %d is %s, on another device than tensor 1 (%s)", i + 1,
                             ms_desc(src[i], d, sizeof d), ms_desc(src[0], d1, sizeof d1));
        }
        if (!ms_tensor_is_contiguous(src[i]) || src[i]->dtype_id != src[0]->dtype_id) fast = 0;
        total += ms_tensor_numel(src[i]);
    }
    ms_tensor *flat = NULL;
    if (ms_tensor_empty(&flat, 1, &total, dtype, dev)) return -1;
    MS_PROF_NOTE("cast_flat", flat);
    int rc = 0;
#ifdef MS_WITH_CUDA
    int f32ish = src[0]->dtype_id == MS_F32 || src[0]->dtype_id == MS_BF16 || src[0]->dtype_id == MS_F16;
    int d32ish = dtype == MS_F32 || dtype == MS_BF16 || dtype == MS_F16;
    if (dev >= 0 && fast && f32ish && d32ish) {
        rc = ms_cuda_convert_many(flat, src, n);
        goto done;
    }
#else
    (void)fast;
#endif
    {
        int64_t off = 0;
        for (int i = 0; i < n && !rc; i++) {
            ms_tensor *part = NULL, *v = NULL;
            rc = ms_tensor_narrow(&part, flat, 0, off, ms_tensor_numel(src[i]));
            if (!rc) rc = ms_tensor_view(&v, part, src[i]->ndim, src[i]->sizes);
            if (!rc) rc = ms_tensor_copy_(v, src[i]);
            ms_tensor_free(v);
            ms_tensor_free(part);
            off += ms_tensor_numel(src[i]);
        }
    }
#ifdef MS_WITH_CUDA
done:
#endif
    if (rc) {
        ms_tensor_free(flat);
        return -1;
    }
    *out = flat;
    return 0;
}

int ms_split_flat_(ms_tensor **dst, int n, const ms_tensor *flat) {
    char d[DESC], d1[DESC];
    if (n < 1 || !dst) return ms_errorf("split_flat_: %d tensors given, need at least one", n);
    if (!flat) return ms_errorf("split_flat_: the flat tensor is missing");
    if (ms_tensor_check_live(flat, "split_flat_")) return -1;
    if (!ms_tensor_is_contiguous(flat))
        return ms_errorf("split_flat_: the flat tensor (%s) is not contiguous", ms_desc(flat, d, sizeof d));
    int64_t total = 0;
    int fast = 1;
    for (int i = 0; i < n; i++) {
        if (!dst[i]) return ms_errorf("split_flat_: tensor %d is missing", i + 1);
        if (ms_tensor_check_live(dst[i], "split_flat_")) return -1;
        if (dst[i]->device_id != flat->device_id)
            return ms_errorf("split_flat_: tensor %d is %s, on another device than the flat tensor (%s)", i + 1,
                             ms_desc(dst[i], d, sizeof d), ms_desc(flat, d1, sizeof d1));
        if (dst[i]->storage == flat->storage)
            return ms_errorf("split_flat_: tensor %d (%s) shares the flat tensor's storage", i + 1,
                             ms_desc(dst[i], d, sizeof d));
        if (!ms_tensor_is_contiguous(dst[i]) || dst[i]->dtype_id != dst[0]->dtype_id) fast = 0;
        total += ms_tensor_numel(dst[i]);
    }
    if (total != ms_tensor_numel(flat))
        return ms_errorf("split_flat_: the %d tensors hold %lld elements, the flat tensor (%s) %lld", n,
                         (long long)total, ms_desc(flat, d, sizeof d), (long long)ms_tensor_numel(flat));
#ifdef MS_WITH_CUDA
    int f32ish = flat->dtype_id == MS_F32 || flat->dtype_id == MS_BF16 || flat->dtype_id == MS_F16;
    int d32ish = dst[0]->dtype_id == MS_F32 || dst[0]->dtype_id == MS_BF16 || dst[0]->dtype_id == MS_F16;
    MS_PROF_NOTE("split_flat_", flat);
    if (flat->device_id >= 0 && fast && f32ish && d32ish) return ms_cuda_split_many(dst, n, flat);
#else
    (void)fast;
#endif
    int rc = 0;
    int64_t off = 0;
    for (int i = 0; i < n && !rc; i++) {
        ms_tensor *part = NULL, *v = NULL;
        rc = ms_tensor_narrow(&part, (ms_tensor *)flat, 0, off, ms_tensor_numel(dst[i]));
        if (!rc) rc = ms_tensor_view(&v, part, dst[i]->ndim, dst[i]->sizes);
        if (!rc) rc = ms_tensor_copy_(dst[i], v);
        ms_tensor_free(v);
        ms_tensor_free(part);
        off += ms_tensor_numel(dst[i]);
    }
    return rc ? -1 : 0;
}

/* the n byte copies of ms_copy_bytes_many (core/ops.h): checked, then one
 * memcpy each on the CPU or one kernel a 128 copies on CUDA */
int ms_copy_bytes_many(ms_tensor **dst, ms_tensor **src, const int64_t *spec, int n) {
    const char *op = "copy_bytes_many";
    char d[DESC], d1[DESC], name[64];
    if (n < 0) return ms_errorf("%s: %d copies", op, n);
    if (n == 0) return 0;
    if (!dst || !src || !spec) return ms_errorf("%s: dst, src or spec is missing", op);
    const int dev = dst[0] ? dst[0]->device_id : -1;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (copy %d)", op, i + 1);
        if (!dst[i] || !src[i]) return ms_errorf("%s: %s is missing", name, dst[i] ? "src" : "dst");
        if (ms_tensor_check_live(dst[i], name) || ms_tensor_check_live(src[i], name)) return -1;
        if (!ms_tensor_is_contiguous(dst[i]) || !ms_tensor_is_contiguous(src[i]) || dst[i]->device_id != dev ||
            src[i]->device_id != dev)
            return ms_errorf("%s: dst %s and src %s must be contiguous and on the first dst's device", name,
                             ms_desc(dst[i], d, sizeof d), ms_desc(src[i], d1, sizeof d1));
        const int64_t dn = ms_tensor_numel(dst[i]) * ms_dtype_size(dst[i]->dtype_id);
        const int64_t sn = ms_tensor_numel(src[i]) * ms_dtype_size(src[i]->dtype_id);
        const int64_t doff = spec[3 * i], soff = spec[3 * i + 1], nb = spec[3 * i + 2];
        if (nb < 0 || doff < 0 || soff < 0 || doff > dn - nb || soff > sn - nb)
            return ms_errorf("%s: %lld bytes from byte %lld of src %s (%lld bytes) to byte %lld of dst %s (%lld "
                             "bytes) do not fit", name, (long long)nb, (long long)soff, ms_desc(src[i], d1, sizeof d1),
                             (long long)sn, (long long)doff, ms_desc(dst[i], d, sizeof d), (long long)dn);
    }
#ifndef MS_WITH_CUDA
    if (dev >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    /* the written ranges overlap neither one another nor a read one */
    for (int a = 0; a < n; a++) {
        const char *wa = (const char *)ms_tensor_data(dst[a]) + spec[3 * a];
        const int64_t na = spec[3 * a + 2];
        if (na == 0) continue;
        for (int b = 0; b < n; b++) {
            const char *wb = (const char *)ms_tensor_data(dst[b]) + spec[3 * b];
            const char *rb = (const char *)ms_tensor_data(src[b]) + spec[3 * b + 1];
            const int64_t nbb = spec[3 * b + 2];
            if (nbb == 0) continue;
            if ((b > a && wa < wb + nbb && wb < wa + na) || (wa < rb + nbb && rb < wa + na))
                return ms_errorf("%s: copy %d writes bytes that copy %d %s", op, a + 1, b + 1,
                                 (b > a && wa < wb + nbb && wb < wa + na) ? "writes" : "reads");
        }
    }
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_copy_bytes_many(dst, src, spec, n, dev);
#endif
    for (int i = 0; i < n; i++)
        if (spec[3 * i + 2] > 0)
            memcpy((char *)ms_tensor_data(dst[i]) + spec[3 * i], (const char *)ms_tensor_data(src[i]) + spec[3 * i + 1],
                   (size_t)spec[3 * i + 2]);
    return 0;
}
