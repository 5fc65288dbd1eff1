/* core/ops_cpu.c — CPU reference kernels for core/ops.h.
 *
 * core/ops.c checks arguments, allocates outputs and calls these; here the
 * shapes are known to be right. Each kernel names the PyTorch op it mirrors.
 *
 * Layout: every kernel walks its tensors with one strided iterator
 * (iter_init/iter_for_each): numpy broadcasting is a stride of 0, views of
 * any strides work, and adjacent dims that are contiguous in every operand
 * are merged, so a contiguous tensor is one long run. Elementwise kernels
 * work on runs in blocks of BLOCK elements: operands are loaded into a
 * compute buffer (f32 for f32/bf16/f16, f64 otherwise) — or used in place
 * when they already are contiguous in the compute dtype, which is the fast
 * path for contiguous f32/f64 — computed, and stored with one rounding.
 *
 * Threads: OpenMP over independent output elements only; no reduction order
 * depends on the number of threads, so results are bitwise identical for
 * any ms_set_num_threads.
 */
#include "internal.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu.h"

enum {
    BLOCK = 256,          /* elements per compute block (stack buffers) */
    GRAIN = 32768,        /* elements per parallel chunk of cheap work */
    ITER_MAX_OPS = 4,     /* operands of one iterator: out + up to 3 inputs */
    REDUCE_BLOCK = 65536  /* fixed partial-sum block of all-dims reductions */
};

/* ============================================================ iterator */

/* A walk over `shape` (row-major) of up to ITER_MAX_OPS operands, each with
 * its own byte strides (0 where broadcast). */
typedef struct iter_t {
    int ndim, nops;
    int64_t numel;
    int64_t size[MS_MAX_DIMS];
    int64_t step[ITER_MAX_OPS][MS_MAX_DIMS]; /* bytes */
    char *data[ITER_MAX_OPS];
} iter_t;

/* a run of `len` elements: operand k starts at p[k] and steps st[k] bytes;
 * `linear` is the row-major index of the run's first element */
typedef void (*run_fn)(void *ctx, int64_t len, char *const *p, const int64_t *st, int64_t linear);

/* strides of t aligned right to an ndim-dim shape, 0 where t broadcasts */
static void broadcast_strides(const ms_tensor *t, int ndim, const int64_t *shape, int64_t *stride) {
    int lead = ndim - t->ndim;
    for (int d = 0; d < ndim; d++) {
        if (d < lead) stride[d] = 0;
        else stride[d] = (t->sizes[d - lead] == 1 && shape[d] != 1) ? 0 : t->strides[d - lead];
    }
}

/* element strides -> byte strides; drops size-1 dims; merges adjacent dims
 * that are contiguous with each other in every operand */
static void iter_init(iter_t *it, int ndim, const int64_t *shape, int nops, char *const *data,
                      int64_t (*elem_stride)[MS_MAX_DIMS], const int *elsize) {
    it->nops = nops;
    it->numel = 1;
    for (int d = 0; d < ndim; d++) it->numel *= shape[d];
    for (int k = 0; k < nops; k++) it->data[k] = data[k];
    int n = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue;
        if (n > 0) {
            int merge = 1;
            for (int k = 0; k < nops; k++)
                if (it->step[k][n - 1] != elem_stride[k][d] * elsize[k] * shape[d]) merge = 0;
            if (merge) {
                it->size[n - 1] *= shape[d];
                for (int k = 0; k < nops; k++) it->step[k][n - 1] = elem_stride[k][d] * elsize[k];
                continue;
            }
        }
        it->size[n] = shape[d];
        for (int k = 0; k < nops; k++) it->step[k][n] = elem_stride[k][d] * elsize[k];
        n++;
    }
    if (n == 0) { /* a single element */
        it->size[0] = 1;
        for (int k = 0; k < nops; k++) it->step[k][0] = 0;
        n = 1;
    }
    it->ndim = n;
}

/* run fn over the elements [begin, end) of the walk */
static void iter_chunk(const iter_t *it, int64_t begin, int64_t end, run_fn fn, void *ctx) {
    if (begin >= end) return;
    int last = it->ndim - 1;
    int64_t idx[MS_MAX_DIMS];
    char *p[ITER_MAX_OPS];
    int64_t inner[ITER_MAX_OPS];
    int64_t rem = begin;
    for (int d = last; d >= 0; d--) {
        idx[d] = rem % it->size[d];
        rem /= it->size[d];
    }
    for (int k = 0; k < it->nops; k++) {
        p[k] = it->data[k];
        for (int d = 0; d <= last; d++) p[k] += idx[d] * it->step[k][d];
        inner[k] = it->step[k][last];
    }
    int64_t pos = begin;
    while (pos < end) {
        int64_t len = it->size[last] - idx[last];
        if (len > end - pos) len = end - pos;
        fn(ctx, len, p, inner, pos);
        pos += len;
        if (pos >= end) break;
        idx[last] += len;
        for (int k = 0; k < it->nops; k++) p[k] += len * inner[k];
        for (int d = last; d > 0 && idx[d] == it->size[d]; d--) {
            idx[d] = 0;
            idx[d - 1]++;
            for (int k = 0; k < it->nops; k++) p[k] += it->step[k][d - 1] - it->size[d] * it->step[k][d];
        }
    }
}

/* the whole walk, in parallel chunks of `grain` elements when it is large */
static void iter_for_each(const iter_t *it, int64_t grain, run_fn fn, void *ctx) {
    int64_t n = it->numel;
    if (n == 0) return;
    if (grain < 1) grain = 1;
    int64_t nchunks = (n + grain - 1) / grain;
    if (nchunks <= 1) {
        iter_chunk(it, 0, n, fn, ctx);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t end = (c + 1) * grain < n ? (c + 1) * grain : n;
        iter_chunk(it, c * grain, end, fn, ctx);
    }
}

/* ========================================================= load / store */

/* compute dtype: f32 for f32/bf16/f16, f64 for f64 and integers */
static int compute_dtype(int dtype) {
    return (dtype == MS_F32 || dtype == MS_BF16 || dtype == MS_F16) ? MS_F32 : MS_F64;
}

/* n elements of dtype at p (byte stride st) into dst as f32 */
static void load_f32(float *dst, const char *p, int64_t st, int dtype, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F32:
        if (st == 4) memcpy(dst, p, (size_t)n * 4);
        else for (i = 0; i < n; i++) dst[i] = *(const float *)(p + i * st);
        break;
    case MS_F64: for (i = 0; i < n; i++) dst[i] = (float)*(const double *)(p + i * st); break;
    case MS_BF16: for (i = 0; i < n; i++) dst[i] = ms_bf16_to_f32(*(const uint16_t *)(p + i * st)); break;
    case MS_F16: for (i = 0; i < n; i++) dst[i] = ms_f16_to_f32(*(const uint16_t *)(p + i * st)); break;
    case MS_I64: for (i = 0; i < n; i++) dst[i] = (float)*(const int64_t *)(p + i * st); break;
    case MS_I32: for (i = 0; i < n; i++) dst[i] = (float)*(const int32_t *)(p + i * st); break;
    case MS_U8: for (i = 0; i < n; i++) dst[i] = *(const uint8_t *)(p + i * st); break;
    case MS_BOOL: for (i = 0; i < n; i++) dst[i] = *(const uint8_t *)(p + i * st) != 0; break;
    }
}

/* n elements of dtype at p (byte stride st) into dst as f64 */
static void load_f64(double *dst, const char *p, int64_t st, int dtype, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F64:
        if (st == 8) memcpy(dst, p, (size_t)n * 8);
        else for (i = 0; i < n; i++) dst[i] = *(const double *)(p + i * st);
        break;
    case MS_F32: for (i = 0; i < n; i++) dst[i] = *(const float *)(p + i * st); break;
    case MS_BF16: for (i = 0; i < n; i++) dst[i] = ms_bf16_to_f32(*(const uint16_t *)(p + i * st)); break;
    case MS_F16: for (i = 0; i < n; i++) dst[i] = ms_f16_to_f32(*(const uint16_t *)(p + i * st)); break;
    case MS_I64: for (i = 0; i < n; i++) dst[i] = (double)*(const int64_t *)(p + i * st); break;
    case MS_I32: for (i = 0; i < n; i++) dst[i] = *(const int32_t *)(p + i * st); break;
    case MS_U8: for (i = 0; i < n; i++) dst[i] = *(const uint8_t *)(p + i * st); break;
    case MS_BOOL: for (i = 0; i < n; i++) dst[i] = *(const uint8_t *)(p + i * st) != 0; break;
    }
}

/* n f32 values into dtype at p (byte stride st), rounding once */
static void store_f32(char *p, int64_t st, int dtype, const float *src, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F32:
        if (st == 4) memcpy(p, src, (size_t)n * 4);
        else for (i = 0; i < n; i++) *(float *)(p + i * st) = src[i];
        break;
    case MS_F64: for (i = 0; i < n; i++) *(double *)(p + i * st) = src[i]; break;
    case MS_BF16: for (i = 0; i < n; i++) *(uint16_t *)(p + i * st) = ms_f32_to_bf16(src[i]); break;
    case MS_F16: for (i = 0; i < n; i++) *(uint16_t *)(p + i * st) = ms_f32_to_f16(src[i]); break;
    case MS_I64: for (i = 0; i < n; i++) *(int64_t *)(p + i * st) = (int64_t)src[i]; break;
    case MS_I32: for (i = 0; i < n; i++) *(int32_t *)(p + i * st) = (int32_t)src[i]; break;
    case MS_U8: for (i = 0; i < n; i++) *(uint8_t *)(p + i * st) = (uint8_t)(int64_t)src[i]; break;
    case MS_BOOL: for (i = 0; i < n; i++) *(uint8_t *)(p + i * st) = src[i] != 0; break;
    }
}

/* n f64 values into dtype at p (byte stride st) */
static void store_f64(char *p, int64_t st, int dtype, const double *src, int64_t n) {
    int64_t i;
    switch (dtype) {
    case MS_F64:
        if (st == 8) memcpy(p, src, (size_t)n * 8);
        else for (i = 0; i < n; i++) *(double *)(p + i * st) = src[i];
        break;
    case MS_F32: for (i = 0; i < n; i++) *(float *)(p + i * st) = (float)src[i]; break;
    default: for (i = 0; i < n; i++) ms_store(p + i * st, dtype, src[i]); break;
    }
}

/* an operand block as f32: in place when it already is contiguous f32 */
static const float *operand_f32(const char *p, int64_t st, int dtype, int64_t n, float *buf) {
    if (dtype == MS_F32 && st == 4) return (const float *)p;
    load_f32(buf, p, st, dtype, n);
    return buf;
}

static const double *operand_f64(const char *p, int64_t st, int dtype, int64_t n, double *buf) {
    if (dtype == MS_F64 && st == 8) return (const double *)p;
    load_f64(buf, p, st, dtype, n);
    return buf;
}

/* ============================================== scalar math, f32 and f64 */

static const double GELU_C = 0.7978845608028654;   /* sqrt(2/pi) */
static const double GELU_A = 0.044715;

static float sigmoid_f32(float x) { return 1.0f / (1.0f + expf(-x)); }
static double sigmoid_f64(double x) { return 1.0 / (1.0 + exp(-x)); }

/* gelu, tanh form: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
 * computed as x * sigmoid(2u) (the same function: 0.5 (1 + tanh u) =
 * sigmoid(2u)), which needs one exp instead of a tanh and does not cancel
 * for negative x */
static float gelu_f32(float x) {
    float u = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}
static double gelu_f64(double x) {
    double u = GELU_C * (x + GELU_A * x * x * x);
    return x / (1.0 + exp(-2.0 * u));
}

/* d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) u', t = tanh(u),
 * u' = sqrt(2/pi) (1 + 3 0.044715 x^2); with s = sigmoid(2u):
 * 0.5 (1 + t) = s and 0.5 (1 - t^2) = 2 s (1 - s) */
static float gelu_grad_f32(float x) {
    float u = (float)GELU_C * (x + (float)GELU_A * x * x * x);
    float s = 1.0f / (1.0f + expf(-2.0f * u));
    return s + 2.0f * x * s * (1.0f - s) * (float)GELU_C * (1.0f + 3.0f * (float)GELU_A * x * x);
}
static double gelu_grad_f64(double x) {
    double u = GELU_C * (x + GELU_A * x * x * x);
    double s = 1.0 / (1.0 + exp(-2.0 * u));
    return s + 2.0 * x * s * (1.0 - s) * GELU_C * (1.0 + 3.0 * GELU_A * x * x);
}

/* d silu / dx = s (1 + x (1 - s)), s = sigmoid(x) */
static float silu_grad_f32(float x) {
    float s = sigmoid_f32(x);
    return s * (1.0f + x * (1.0f - s));
}
static double silu_grad_f64(double x) {
    double s = sigmoid_f64(x);
    return s * (1.0 + x * (1.0 - s));
}

/* NaN-propagating max/min (torch.maximum / torch.minimum) */
static float maximum_f32(float a, float b) { return (a != a || a > b) ? a : b; }
static float minimum_f32(float a, float b) { return (a != a || a < b) ? a : b; }
static double maximum_f64(double a, double b) { return (a != a || a > b) ? a : b; }
static double minimum_f64(double a, double b) { return (a != a || a < b) ? a : b; }

static float sign_f32(float x) { return x > 0 ? 1.0f : x < 0 ? -1.0f : x; }
static double sign_f64(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : x; }

/* y = f(x) over n contiguous f32; y may be x */
static void unary_f32(int op, int64_t n, const float *x, float *y) {
    int64_t i;
    switch (op) {
    case MS_OP_NEG: for (i = 0; i < n; i++) y[i] = -x[i]; break;
    case MS_OP_EXP: for (i = 0; i < n; i++) y[i] = expf(x[i]); break;
    case MS_OP_LOG: for (i = 0; i < n; i++) y[i] = logf(x[i]); break;
    case MS_OP_SQRT: for (i = 0; i < n; i++) y[i] = sqrtf(x[i]); break;
    case MS_OP_RSQRT: for (i = 0; i < n; i++) y[i] = 1.0f / sqrtf(x[i]); break;
    case MS_OP_TANH: for (i = 0; i < n; i++) y[i] = tanhf(x[i]); break;
    case MS_OP_SIGMOID: for (i = 0; i < n; i++) y[i] = sigmoid_f32(x[i]); break;
    case MS_OP_RELU: for (i = 0; i < n; i++) y[i] = x[i] < 0 ? 0.0f : x[i]; break;
    case MS_OP_GELU: for (i = 0; i < n; i++) y[i] = gelu_f32(x[i]); break;
    case MS_OP_SILU: for (i = 0; i < n; i++) y[i] = x[i] * sigmoid_f32(x[i]); break;
    case MS_OP_ABS: for (i = 0; i < n; i++) y[i] = fabsf(x[i]); break;
    case MS_OP_SIN: for (i = 0; i < n; i++) y[i] = sinf(x[i]); break;
    case MS_OP_COS: for (i = 0; i < n; i++) y[i] = cosf(x[i]); break;
    case MS_OP_SQUARE: for (i = 0; i < n; i++) y[i] = x[i] * x[i]; break;
    case MS_OP_RECIP: for (i = 0; i < n; i++) y[i] = 1.0f / x[i]; break;
    case MS_OP_SIGN: for (i = 0; i < n; i++) y[i] = sign_f32(x[i]); break;
    }
}

static void unary_f64(int op, int64_t n, const double *x, double *y) {
    int64_t i;
    switch (op) {
    case MS_OP_NEG: for (i = 0; i < n; i++) y[i] = -x[i]; break;
    case MS_OP_EXP: for (i = 0; i < n; i++) y[i] = exp(x[i]); break;
    case MS_OP_LOG: for (i = 0; i < n; i++) y[i] = log(x[i]); break;
    case MS_OP_SQRT: for (i = 0; i < n; i++) y[i] = sqrt(x[i]); break;
    case MS_OP_RSQRT: for (i = 0; i < n; i++) y[i] = 1.0 / sqrt(x[i]); break;
    case MS_OP_TANH: for (i = 0; i < n; i++) y[i] = tanh(x[i]); break;
    case MS_OP_SIGMOID: for (i = 0; i < n; i++) y[i] = sigmoid_f64(x[i]); break;
    case MS_OP_RELU: for (i = 0; i < n; i++) y[i] = x[i] < 0 ? 0.0 : x[i]; break;
    case MS_OP_GELU: for (i = 0; i < n; i++) y[i] = gelu_f64(x[i]); break;
    case MS_OP_SILU: for (i = 0; i < n; i++) y[i] = x[i] * sigmoid_f64(x[i]); break;
    case MS_OP_ABS: for (i = 0; i < n; i++) y[i] = fabs(x[i]); break;
    case MS_OP_SIN: for (i = 0; i < n; i++) y[i] = sin(x[i]); break;
    case MS_OP_COS: for (i = 0; i < n; i++) y[i] = cos(x[i]); break;
    case MS_OP_SQUARE: for (i = 0; i < n; i++) y[i] = x[i] * x[i]; break;
    case MS_OP_RECIP: for (i = 0; i < n; i++) y[i] = 1.0 / x[i]; break;
    case MS_OP_SIGN: for (i = 0; i < n; i++) y[i] = sign_f64(x[i]); break;
    }
}

/* o = a op b over n contiguous f32; o may be a or b. For the *_BWD ops
 * a is the forward input x and b the incoming gradient. */
static void binary_f32(int op, int64_t n, const float *a, const float *b, float *o) {
    int64_t i;
    switch (op) {
    case MS_OP_ADD: for (i = 0; i < n; i++) o[i] = a[i] + b[i]; break;
    case MS_OP_SUB: for (i = 0; i < n; i++) o[i] = a[i] - b[i]; break;
    case MS_OP_MUL: for (i = 0; i < n; i++) o[i] = a[i] * b[i]; break;
    case MS_OP_DIV: for (i = 0; i < n; i++) o[i] = a[i] / b[i]; break;
    case MS_OP_POW: for (i = 0; i < n; i++) o[i] = powf(a[i], b[i]); break;
    case MS_OP_MAXIMUM: for (i = 0; i < n; i++) o[i] = maximum_f32(a[i], b[i]); break;
    case MS_OP_MINIMUM: for (i = 0; i < n; i++) o[i] = minimum_f32(a[i], b[i]); break;
    case MS_OP_EQ: for (i = 0; i < n; i++) o[i] = a[i] == b[i]; break;
    case MS_OP_NE: for (i = 0; i < n; i++) o[i] = a[i] != b[i]; break;
    case MS_OP_LT: for (i = 0; i < n; i++) o[i] = a[i] < b[i]; break;
    case MS_OP_LE: for (i = 0; i < n; i++) o[i] = a[i] <= b[i]; break;
    case MS_OP_GT: for (i = 0; i < n; i++) o[i] = a[i] > b[i]; break;
    case MS_OP_GE: for (i = 0; i < n; i++) o[i] = a[i] >= b[i]; break;
    case MS_OP_GELU_BWD: for (i = 0; i < n; i++) o[i] = b[i] * gelu_grad_f32(a[i]); break;
    case MS_OP_SILU_BWD: for (i = 0; i < n; i++) o[i] = b[i] * silu_grad_f32(a[i]); break;
    case MS_OP_SIGMOID_BWD:
        for (i = 0; i < n; i++) {
            float s = sigmoid_f32(a[i]);
            o[i] = b[i] * s * (1.0f - s);
        }
        break;
    case MS_OP_TANH_BWD:
        for (i = 0; i < n; i++) {
            float t = tanhf(a[i]);
            o[i] = b[i] * (1.0f - t * t);
        }
        break;
    case MS_OP_RELU_BWD: for (i = 0; i < n; i++) o[i] = a[i] > 0 ? b[i] : 0.0f; break;
    case MS_OP_SWIGLU: for (i = 0; i < n; i++) o[i] = a[i] * sigmoid_f32(a[i]) * b[i]; break;
    }
}

static void binary_f64(int op, int64_t n, const double *a, const double *b, double *o) {
    int64_t i;
    switch (op) {
    case MS_OP_ADD: for (i = 0; i < n; i++) o[i] = a[i] + b[i]; break;
    case MS_OP_SUB: for (i = 0; i < n; i++) o[i] = a[i] - b[i]; break;
    case MS_OP_MUL: for (i = 0; i < n; i++) o[i] = a[i] * b[i]; break;
    case MS_OP_DIV: for (i = 0; i < n; i++) o[i] = a[i] / b[i]; break;
    case MS_OP_POW: for (i = 0; i < n; i++) o[i] = pow(a[i], b[i]); break;
    case MS_OP_MAXIMUM: for (i = 0; i < n; i++) o[i] = maximum_f64(a[i], b[i]); break;
    case MS_OP_MINIMUM: for (i = 0; i < n; i++) o[i] = minimum_f64(a[i], b[i]); break;
    case MS_OP_EQ: for (i = 0; i < n; i++) o[i] = a[i] == b[i]; break;
    case MS_OP_NE: for (i = 0; i < n; i++) o[i] = a[i] != b[i]; break;
    case MS_OP_LT: for (i = 0; i < n; i++) o[i] = a[i] < b[i]; break;
    case MS_OP_LE: for (i = 0; i < n; i++) o[i] = a[i] <= b[i]; break;
    case MS_OP_GT: for (i = 0; i < n; i++) o[i] = a[i] > b[i]; break;
    case MS_OP_GE: for (i = 0; i < n; i++) o[i] = a[i] >= b[i]; break;
    case MS_OP_GELU_BWD: for (i = 0; i < n; i++) o[i] = b[i] * gelu_grad_f64(a[i]); break;
    case MS_OP_SILU_BWD: for (i = 0; i < n; i++) o[i] = b[i] * silu_grad_f64(a[i]); break;
    case MS_OP_SIGMOID_BWD:
        for (i = 0; i < n; i++) {
            double s = sigmoid_f64(a[i]);
            o[i] = b[i] * s * (1.0 - s);
        }
        break;
    case MS_OP_TANH_BWD:
        for (i = 0; i < n; i++) {
            double t = tanh(a[i]);
            o[i] = b[i] * (1.0 - t * t);
        }
        break;
    case MS_OP_RELU_BWD: for (i = 0; i < n; i++) o[i] = a[i] > 0 ? b[i] : 0.0; break;
    case MS_OP_SWIGLU: for (i = 0; i < n; i++) o[i] = a[i] * sigmoid_f64(a[i]) * b[i]; break;
    }
}

/* ========================================================= elementwise */

/* what an elementwise run needs: the op, the compute dtype and the dtype of
 * each operand (0: out, 1..: inputs) */
typedef struct ew_ctx {
    int op, ct;
    int dtype[ITER_MAX_OPS];
    double lo, hi; /* clamp bounds */
} ew_ctx;

/* iterator over out's shape for out and inputs broadcast to it; a NULL
 * input is a scalar at *scalar (f64, stride 0) */
static void ew_iter(iter_t *it, const ms_tensor *out, int nin, const ms_tensor *const *in,
                    const double *scalar, int *dtypes) {
    int64_t st[ITER_MAX_OPS][MS_MAX_DIMS];
    char *data[ITER_MAX_OPS];
    int elsize[ITER_MAX_OPS];
    data[0] = ms_tensor_data(out);
    elsize[0] = ms_dtype_size(out->dtype_id);
    dtypes[0] = out->dtype_id;
    for (int d = 0; d < out->ndim; d++) st[0][d] = out->strides[d];
    for (int k = 0; k < nin; k++) {
        if (in[k]) {
            data[k + 1] = ms_tensor_data(in[k]);
            elsize[k + 1] = ms_dtype_size(in[k]->dtype_id);
            dtypes[k + 1] = in[k]->dtype_id;
            broadcast_strides(in[k], out->ndim, out->sizes, st[k + 1]);
        } else {
            data[k + 1] = (char *)scalar;
            elsize[k + 1] = 8;
            dtypes[k + 1] = MS_F64;
            for (int d = 0; d < out->ndim; d++) st[k + 1][d] = 0;
        }
    }
    iter_init(it, out->ndim, out->sizes, nin + 1, data, st, elsize);
}

static void unary_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const ew_ctx *c = vctx;
    for (int64_t i = 0; i < len; i += BLOCK) {
        int64_t n = len - i < BLOCK ? len - i : BLOCK;
        char *po = p[0] + i * st[0];
        const char *pa = p[1] + i * st[1];
        if (c->ct == MS_F32) {
            float ba[BLOCK], bo[BLOCK];
            const float *x = operand_f32(pa, st[1], c->dtype[1], n, ba);
            int direct = c->dtype[0] == MS_F32 && st[0] == 4;
            float *y = direct ? (float *)po : bo;
            unary_f32(c->op, n, x, y);
            if (!direct) store_f32(po, st[0], c->dtype[0], y, n);
        } else {
            double ba[BLOCK], bo[BLOCK];
            const double *x = operand_f64(pa, st[1], c->dtype[1], n, ba);
            int direct = c->dtype[0] == MS_F64 && st[0] == 8;
            double *y = direct ? (double *)po : bo;
            unary_f64(c->op, n, x, y);
            if (!direct) store_f64(po, st[0], c->dtype[0], y, n);
        }
    }
}

static void binary_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const ew_ctx *c = vctx;
    for (int64_t i = 0; i < len; i += BLOCK) {
        int64_t n = len - i < BLOCK ? len - i : BLOCK;
        char *po = p[0] + i * st[0];
        const char *pa = p[1] + i * st[1], *pb = p[2] + i * st[2];
        if (c->ct == MS_F32) {
            float ba[BLOCK], bb[BLOCK], bo[BLOCK];
            const float *x = operand_f32(pa, st[1], c->dtype[1], n, ba);
            const float *y = operand_f32(pb, st[2], c->dtype[2], n, bb);
            int direct = c->dtype[0] == MS_F32 && st[0] == 4;
            float *o = direct ? (float *)po : bo;
            binary_f32(c->op, n, x, y, o);
            if (!direct) store_f32(po, st[0], c->dtype[0], o, n);
        } else {
            double ba[BLOCK], bb[BLOCK], bo[BLOCK];
            const double *x = operand_f64(pa, st[1], c->dtype[1], n, ba);
            const double *y = operand_f64(pb, st[2], c->dtype[2], n, bb);
            int direct = c->dtype[0] == MS_F64 && st[0] == 8;
            double *o = direct ? (double *)po : bo;
            binary_f64(c->op, n, x, y, o);
            if (!direct) store_f64(po, st[0], c->dtype[0], o, n);
        }
    }
}

/* clamp: bounds that are NaN are ignored; x NaN stays NaN */
static void clamp_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const ew_ctx *c = vctx;
    int has_lo = c->lo == c->lo, has_hi = c->hi == c->hi;
    for (int64_t i = 0; i < len; i += BLOCK) {
        int64_t n = len - i < BLOCK ? len - i : BLOCK;
        char *po = p[0] + i * st[0];
        const char *pa = p[1] + i * st[1];
        if (c->ct == MS_F32) {
            float ba[BLOCK], bo[BLOCK], lo = (float)c->lo, hi = (float)c->hi;
            const float *x = operand_f32(pa, st[1], c->dtype[1], n, ba);
            for (int64_t j = 0; j < n; j++) {
                float v = x[j];
                if (has_lo && v < lo) v = lo;
                if (has_hi && v > hi) v = hi;
                bo[j] = v;
            }
            store_f32(po, st[0], c->dtype[0], bo, n);
        } else {
            double ba[BLOCK], bo[BLOCK];
            const double *x = operand_f64(pa, st[1], c->dtype[1], n, ba);
            for (int64_t j = 0; j < n; j++) {
                double v = x[j];
                if (has_lo && v < c->lo) v = c->lo;
                if (has_hi && v > c->hi) v = c->hi;
                bo[j] = v;
            }
            store_f64(po, st[0], c->dtype[0], bo, n);
        }
    }
}

/* where: operands out, cond, a, b */
static void where_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const ew_ctx *c = vctx;
    for (int64_t i = 0; i < len; i += BLOCK) {
        int64_t n = len - i < BLOCK ? len - i : BLOCK;
        char *po = p[0] + i * st[0];
        const char *pc = p[1] + i * st[1], *pa = p[2] + i * st[2], *pb = p[3] + i * st[3];
        if (c->ct == MS_F32) {
            float bc[BLOCK], ba[BLOCK], bb[BLOCK], bo[BLOCK];
            load_f32(bc, pc, st[1], c->dtype[1], n);
            const float *x = operand_f32(pa, st[2], c->dtype[2], n, ba);
            const float *y = operand_f32(pb, st[3], c->dtype[3], n, bb);
            for (int64_t j = 0; j < n; j++) bo[j] = bc[j] != 0 ? x[j] : y[j];
            store_f32(po, st[0], c->dtype[0], bo, n);
        } else {
            double bc[BLOCK], ba[BLOCK], bb[BLOCK], bo[BLOCK];
            load_f64(bc, pc, st[1], c->dtype[1], n);
            const double *x = operand_f64(pa, st[2], c->dtype[2], n, ba);
            const double *y = operand_f64(pb, st[3], c->dtype[3], n, bb);
            for (int64_t j = 0; j < n; j++) bo[j] = bc[j] != 0 ? x[j] : y[j];
            store_f64(po, st[0], c->dtype[0], bo, n);
        }
    }
}

static int op_is_comparison(int op) { return op >= MS_OP_EQ && op <= MS_OP_GE; }

// https://pytorch.org/docs/stable/torch.html#pointwise-ops (neg, exp, ..., sign)
// a: any shape; out: a's shape
int ms_cpu_unary(ms_tensor *out, int op, const ms_tensor *a) {
    iter_t it;
    ew_ctx c = {.op = op, .ct = compute_dtype(out->dtype_id)};
    ew_iter(&it, out, 1, &a, NULL, c.dtype);
    iter_for_each(&it, GRAIN / 4, unary_run, &c);
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.add.html (and sub, mul, div,
// pow, maximum, minimum, eq..ge; *_BWD: out = b * f'(a))
// a, b: broadcastable; out: the broadcast shape
int ms_cpu_binary(ms_tensor *out, int op, const ms_tensor *a, const ms_tensor *b) {
    iter_t it;
    const ms_tensor *in[2] = {a, b};
    int in_dtype = op_is_comparison(op) ? ms_promote(a->dtype_id, b->dtype_id) : out->dtype_id;
    ew_ctx c = {.op = op, .ct = compute_dtype(in_dtype)};
    ew_iter(&it, out, 2, in, NULL, c.dtype);
    iter_for_each(&it, GRAIN / 4, binary_run, &c);
    return 0;
}

// a op s, or s op a when reverse; a: any shape; out: a's shape
int ms_cpu_binary_scalar(ms_tensor *out, int op, const ms_tensor *a, double s, int reverse) {
    iter_t it;
    const ms_tensor *in[2] = {reverse ? NULL : a, reverse ? a : NULL};
    int in_dtype = op_is_comparison(op) ? a->dtype_id : out->dtype_id;
    if (op_is_comparison(op) && ms_is_int(a->dtype_id) && s != floor(s)) in_dtype = MS_F64;
    ew_ctx c = {.op = op, .ct = compute_dtype(in_dtype)};
    ew_iter(&it, out, 2, in, &s, c.dtype);
    iter_for_each(&it, GRAIN / 4, binary_run, &c);
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.clamp.html
// a: any shape; out: a's shape
int ms_cpu_clamp(ms_tensor *out, const ms_tensor *a, double lo, double hi) {
    iter_t it;
    ew_ctx c = {.ct = compute_dtype(out->dtype_id), .lo = lo, .hi = hi};
    ew_iter(&it, out, 1, &a, NULL, c.dtype);
    iter_for_each(&it, GRAIN, clamp_run, &c);
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.where.html
// cond, a, b: broadcastable; out: the broadcast shape
int ms_cpu_where(ms_tensor *out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b) {
    iter_t it;
    const ms_tensor *in[3] = {cond, a, b};
    ew_ctx c = {.ct = compute_dtype(out->dtype_id)};
    ew_iter(&it, out, 3, in, NULL, c.dtype);
    iter_for_each(&it, GRAIN, where_run, &c);
    return 0;
}

/* ============================================================ fills */

typedef struct fill_ctx {
    int dtype, elsize;
    unsigned char bytes[8]; /* the value, already in dtype */
    double start, step;     /* arange */
} fill_ctx;

static void fill_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const fill_ctx *c = vctx;
    char *q = p[0];
    int64_t s = st[0];
    switch (c->elsize) {
    case 8: { uint64_t v; memcpy(&v, c->bytes, 8); for (int64_t i = 0; i < len; i++) *(uint64_t *)(q + i * s) = v; break; }
    case 4: { uint32_t v; memcpy(&v, c->bytes, 4); for (int64_t i = 0; i < len; i++) *(uint32_t *)(q + i * s) = v; break; }
    case 2: { uint16_t v; memcpy(&v, c->bytes, 2); for (int64_t i = 0; i < len; i++) *(uint16_t *)(q + i * s) = v; break; }
    default: for (int64_t i = 0; i < len; i++) q[i * s] = (char)c->bytes[0]; break;
    }
}

static void arange_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const fill_ctx *c = vctx;
    for (int64_t i = 0; i < len; i++)
        ms_store(p[0] + i * st[0], c->dtype, c->start + (double)(linear + i) * c->step);
}

static void single_iter(iter_t *it, const ms_tensor *t) {
    int64_t st[1][MS_MAX_DIMS];
    char *data[1] = {ms_tensor_data(t)};
    int elsize[1] = {ms_dtype_size(t->dtype_id)};
    for (int d = 0; d < t->ndim; d++) st[0][d] = t->strides[d];
    iter_init(it, t->ndim, t->sizes, 1, data, st, elsize);
}

// https://pytorch.org/docs/stable/generated/torch.Tensor.fill_.html
// t: any shape
int ms_cpu_fill_(ms_tensor *t, double value) {
    iter_t it;
    fill_ctx c = {.dtype = t->dtype_id, .elsize = ms_dtype_size(t->dtype_id)};
    ms_store(c.bytes, t->dtype_id, value);
    single_iter(&it, t);
    iter_for_each(&it, GRAIN * 4, fill_run, &c);
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.arange.html
// t: any shape; t[i] = start + i * step, i the row-major index
int ms_cpu_arange_(ms_tensor *t, double start, double step) {
    iter_t it;
    fill_ctx c = {.dtype = t->dtype_id, .start = start, .step = step};
    single_iter(&it, t);
    iter_for_each(&it, GRAIN, arange_run, &c);
    return 0;
}

/* ========================================================== reductions */

/* the reduction of one fiber of n elements (byte stride st), in f64:
 * *val, and for argmax/argmin *arg (first occurrence; a NaN wins) */
static void reduce_fiber(int op, const char *p, int64_t st, int dtype, int64_t n, double *val, int64_t *arg) {
    double buf[BLOCK];
    double acc = 0, best = 0;
    int64_t besti = 0;
    switch (op) {
    case MS_RED_SUM:
    case MS_RED_MEAN:
        for (int64_t i = 0; i < n; i += BLOCK) {
            int64_t m = n - i < BLOCK ? n - i : BLOCK;
            const double *x = operand_f64(p + i * st, st, dtype, m, buf);
            for (int64_t j = 0; j < m; j++) acc += x[j];
        }
        *val = op == MS_RED_MEAN ? acc / (double)n : acc;
        return;
    case MS_RED_PROD:
        acc = 1;
        for (int64_t i = 0; i < n; i += BLOCK) {
            int64_t m = n - i < BLOCK ? n - i : BLOCK;
            const double *x = operand_f64(p + i * st, st, dtype, m, buf);
            for (int64_t j = 0; j < m; j++) acc *= x[j];
        }
        *val = acc;
        return;
    case MS_RED_MAX:
    case MS_RED_MIN:
    case MS_RED_ARGMAX:
    case MS_RED_ARGMIN:
    case MS_RED_LOGSUMEXP: {
        int want_max = op == MS_RED_MAX || op == MS_RED_ARGMAX || op == MS_RED_LOGSUMEXP;
        best = want_max ? -INFINITY : INFINITY;
        besti = 0;
        int found_nan = 0;
        for (int64_t i = 0; i < n && !found_nan; i += BLOCK) {
            int64_t m = n - i < BLOCK ? n - i : BLOCK;
            const double *x = operand_f64(p + i * st, st, dtype, m, buf);
            for (int64_t j = 0; j < m; j++) {
                double v = x[j];
                if (v != v) {
                    best = v;
                    besti = i + j;
                    found_nan = 1;
                    break;
                }
                if (i + j == 0 || (want_max ? v > best : v < best)) {
                    best = v;
                    besti = i + j;
                }
            }
        }
        if (op != MS_RED_LOGSUMEXP) {
            *val = best;
            *arg = besti;
            return;
        }
        /* logsumexp = max + log(sum exp(x - max)); an infinite or NaN max is the answer */
        if (n == 0 || !isfinite(best)) {
            *val = best;
            return;
        }
        for (int64_t i = 0; i < n; i += BLOCK) {
            int64_t m = n - i < BLOCK ? n - i : BLOCK;
            const double *x = operand_f64(p + i * st, st, dtype, m, buf);
            for (int64_t j = 0; j < m; j++) acc += exp(x[j] - best);
        }
        *val = best + log(acc);
        return;
    }
    }
}

typedef struct reduce_ctx {
    int op, in_dtype, out_dtype;
    int64_t n;         /* fiber length */
    int64_t fiber_st;  /* bytes between fiber elements */
} reduce_ctx;

static void reduce_store(const reduce_ctx *c, char *po, double val, int64_t arg) {
    if (c->op == MS_RED_ARGMAX || c->op == MS_RED_ARGMIN) *(int64_t *)po = arg;
    else if (c->out_dtype == MS_F32) *(float *)po = (float)val;
    else ms_store(po, c->out_dtype, val);
}

/* operands: out, a (at fiber start). One fiber per output element. */
static void reduce_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const reduce_ctx *c = vctx;
    for (int64_t j = 0; j < len; j++) {
        double val = 0;
        int64_t arg = 0;
        reduce_fiber(c->op, p[1] + j * st[1], c->fiber_st, c->in_dtype, c->n, &val, &arg);
        reduce_store(c, p[0] + j * st[0], val, arg);
    }
}

/* sum/mean/prod of a run of outputs whose inputs are contiguous while the
 * fiber is strided (reducing a leading dim, e.g. a bias gradient): walk the
 * fiber in the outer loop. Each output still accumulates in fiber order, so
 * the result is the same as reduce_run's. */
static void reduce_run_columns(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const reduce_ctx *c = vctx;
    double acc[BLOCK], buf[BLOCK];
    for (int64_t j = 0; j < len; j += BLOCK) {
        int64_t m = len - j < BLOCK ? len - j : BLOCK;
        double init = c->op == MS_RED_PROD ? 1.0 : 0.0;
        for (int64_t k = 0; k < m; k++) acc[k] = init;
        for (int64_t r = 0; r < c->n; r++) {
            const double *x = operand_f64(p[1] + j * st[1] + r * c->fiber_st, st[1], c->in_dtype, m, buf);
            if (c->op == MS_RED_PROD) for (int64_t k = 0; k < m; k++) acc[k] *= x[k];
            else for (int64_t k = 0; k < m; k++) acc[k] += x[k];
        }
        if (c->op == MS_RED_MEAN) for (int64_t k = 0; k < m; k++) acc[k] /= (double)c->n;
        for (int64_t k = 0; k < m; k++) reduce_store(c, p[0] + (j + k) * st[0], acc[k], 0);
    }
}

/* combine the partial results of fixed blocks of an all-dims reduction, in
 * block order (so the answer does not depend on the number of threads) */
static void reduce_combine(int op, int64_t nblocks, const double *val, const int64_t *arg, int64_t n,
                           double *res, int64_t *resi) {
    double acc = op == MS_RED_PROD ? 1.0 : 0.0;
    int64_t besti = 0;
    switch (op) {
    case MS_RED_SUM:
    case MS_RED_MEAN:
        for (int64_t b = 0; b < nblocks; b++) acc += val[b];
        *res = op == MS_RED_MEAN ? acc / (double)n : acc;
        return;
    case MS_RED_PROD:
        for (int64_t b = 0; b < nblocks; b++) acc *= val[b];
        *res = acc;
        return;
    case MS_RED_LOGSUMEXP: {
        double m = -INFINITY;
        for (int64_t b = 0; b < nblocks; b++) m = maximum_f64(val[b], m);
        if (!isfinite(m)) { *res = m; return; }
        for (int64_t b = 0; b < nblocks; b++) acc += exp(val[b] - m);
        *res = m + log(acc);
        return;
    }
    default: { /* max, min, argmax, argmin: first occurrence, NaN wins */
        int want_max = op == MS_RED_MAX || op == MS_RED_ARGMAX;
        double best = val[0];
        besti = arg[0];
        for (int64_t b = 1; b < nblocks && best == best; b++) {
            double v = val[b];
            if (v != v || (want_max ? v > best : v < best)) {
                best = v;
                besti = b * REDUCE_BLOCK + arg[b];
            }
        }
        *res = best;
        *resi = besti;
        return;
    }
    }
}

/* all elements: contiguous input in fixed blocks, partials in parallel */
static int reduce_all(ms_tensor *out, int op, const ms_tensor *a) {
    ms_tensor *ac = NULL;
    if (ms_tensor_contiguous(&ac, a)) return -1;
    int64_t n = ms_tensor_numel(ac);
    int64_t nblocks = n == 0 ? 1 : (n + REDUCE_BLOCK - 1) / REDUCE_BLOCK;
    double *val = malloc((size_t)nblocks * sizeof *val);
    int64_t *arg = malloc((size_t)nblocks * sizeof *arg);
    if (!val || !arg) {
        free(val); free(arg); ms_tensor_free(ac);
        return ms_errorf("reduce: out of host memory");
    }
    const char *base = ms_tensor_data(ac);
    int es = ms_dtype_size(ac->dtype_id), sub = op == MS_RED_MEAN ? MS_RED_SUM : op;
#pragma omp parallel for schedule(static) if (nblocks > 1)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t len = n - b * REDUCE_BLOCK < REDUCE_BLOCK ? n - b * REDUCE_BLOCK : REDUCE_BLOCK;
        arg[b] = 0;
        reduce_fiber(sub, base + b * REDUCE_BLOCK * es, es, ac->dtype_id, len, &val[b], &arg[b]);
    }
    double res = 0;
    int64_t resi = 0;
    reduce_combine(op, nblocks, val, arg, n, &res, &resi);
    reduce_ctx c = {.op = op, .in_dtype = a->dtype_id, .out_dtype = out->dtype_id};
    reduce_store(&c, ms_tensor_data(out), res, resi);
    free(val); free(arg); ms_tensor_free(ac);
    return 0;
}

/* out's byte strides aligned to a's dims, 0 at the reduced dim */
static void reduce_out_strides(const ms_tensor *out, const ms_tensor *a, int dim, int keepdim, int64_t *st) {
    for (int d = 0, k = 0; d < a->ndim; d++) {
        if (d == dim) {
            st[d] = 0;
            if (keepdim) k++;
        } else {
            st[d] = out->strides[k++];
        }
    }
}

// https://pytorch.org/docs/stable/generated/torch.sum.html (mean, amax, amin,
// argmax, argmin, logsumexp, prod)
// a: any shape; dim -1: all elements; out: a's shape without dim (1 with keepdim)
int ms_cpu_reduce(ms_tensor *out, int op, const ms_tensor *a, int dim, int keepdim) {
    if (dim < 0) return reduce_all(out, op, a);
    int64_t shape[MS_MAX_DIMS], st[2][MS_MAX_DIMS];
    char *data[2] = {ms_tensor_data(out), ms_tensor_data(a)};
    int elsize[2] = {ms_dtype_size(out->dtype_id), ms_dtype_size(a->dtype_id)};
    for (int d = 0; d < a->ndim; d++) {
        shape[d] = d == dim ? 1 : a->sizes[d];
        st[1][d] = a->strides[d];
    }
    reduce_out_strides(out, a, dim, keepdim, st[0]);
    iter_t it;
    iter_init(&it, a->ndim, shape, 2, data, st, elsize);
    reduce_ctx c = {.op = op, .in_dtype = a->dtype_id, .out_dtype = out->dtype_id, .n = a->sizes[dim],
                    .fiber_st = a->strides[dim] * elsize[1]};
    int64_t grain = GRAIN / (c.n > 0 ? c.n : 1);
    int columns = (op == MS_RED_SUM || op == MS_RED_MEAN || op == MS_RED_PROD) &&
                  it.step[1][it.ndim - 1] == elsize[1] && c.fiber_st != elsize[1] && it.size[it.ndim - 1] > 1;
    iter_for_each(&it, grain, columns ? reduce_run_columns : reduce_run, &c);
    return 0;
}

/* ============================================================= softmax */

typedef struct softmax_ctx {
    int log, out_dtype, y_dtype, g_dtype;
    int64_t n;                        /* row length */
    int64_t out_st, y_st, g_st;       /* bytes between row elements */
} softmax_ctx;

/* max of a row, NaN-propagating */
static double row_max(const char *p, int64_t st, int dtype, int64_t n) {
    double val = -INFINITY;
    int64_t arg = 0;
    reduce_fiber(MS_RED_MAX, p, st, dtype, n, &val, &arg);
    return val;
}

/* one contiguous f32 row (y may be x): max, then exp(x - max) stored and
 * summed in double, then scaled; log_softmax needs no stored exp */
static void softmax_row_f32(const float *x, float *y, int64_t n, int take_log) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m; /* a NaN spreads through the sum */
    if (m == -INFINITY) m = 0; /* an all -inf row: 0/0 = NaN as in torch */
    double sum = 0;
    if (take_log) {
        for (int64_t i = 0; i < n; i++) sum += expf(x[i] - m);
        float lse = (float)log(sum);
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - m) - lse;
    } else {
        for (int64_t i = 0; i < n; i++) {
            float e = expf(x[i] - m);
            y[i] = e;
            sum += e;
        }
        float inv = (float)(1.0 / sum);
        for (int64_t i = 0; i < n; i++) y[i] *= inv;
    }
}

/* operands: out, a (row starts). out = exp(x - max) / sum, or x - max - log(sum) */
static void softmax_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const softmax_ctx *c = vctx;
    double buf[BLOCK], o[BLOCK];
    int fast = c->out_dtype == MS_F32 && c->y_dtype == MS_F32 && c->out_st == 4 && c->y_st == 4;
    for (int64_t r = 0; r < len; r++) {
        char *po = p[0] + r * st[0];
        const char *pa = p[1] + r * st[1];
        if (fast) {
            softmax_row_f32((const float *)pa, (float *)po, c->n, c->log);
            continue;
        }
        double m = row_max(pa, c->y_st, c->y_dtype, c->n), sum = 0;
        if (m == -INFINITY) m = 0; /* an all -inf row: exp gives 0s, 0/0 = NaN as in torch */
        for (int64_t i = 0; i < c->n; i += BLOCK) {
            int64_t k = c->n - i < BLOCK ? c->n - i : BLOCK;
            const double *x = operand_f64(pa + i * c->y_st, c->y_st, c->y_dtype, k, buf);
            for (int64_t j = 0; j < k; j++) sum += exp(x[j] - m);
        }
        double lse = log(sum), inv = 1.0 / sum;
        for (int64_t i = 0; i < c->n; i += BLOCK) {
            int64_t k = c->n - i < BLOCK ? c->n - i : BLOCK;
            const double *x = operand_f64(pa + i * c->y_st, c->y_st, c->y_dtype, k, buf);
            if (c->log) for (int64_t j = 0; j < k; j++) o[j] = x[j] - m - lse;
            else for (int64_t j = 0; j < k; j++) o[j] = exp(x[j] - m) * inv;
            store_f64(po + i * c->out_st, c->out_st, c->out_dtype, o, k);
        }
    }
}

/* one contiguous f32 row; out may alias y or g */
static void softmax_backward_row_f32(const float *y, const float *g, float *out, int64_t n, int take_log) {
    double s = 0;
    if (take_log) {
        for (int64_t i = 0; i < n; i++) s += g[i];
        float fs = (float)s;
        for (int64_t i = 0; i < n; i++) out[i] = g[i] - expf(y[i]) * fs;
    } else {
        for (int64_t i = 0; i < n; i++) s += (double)g[i] * y[i];
        float fs = (float)s;
        for (int64_t i = 0; i < n; i++) out[i] = y[i] * (g[i] - fs);
    }
}

/* operands: out, y, g (row starts).
 * softmax:     gx = y * (g - sum(g * y))
 * log_softmax: gx = g - exp(y) * sum(g) */
static void softmax_backward_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const softmax_ctx *c = vctx;
    double by[BLOCK], bg[BLOCK], o[BLOCK];
    int fast = c->out_dtype == MS_F32 && c->y_dtype == MS_F32 && c->g_dtype == MS_F32 && c->out_st == 4 &&
               c->y_st == 4 && c->g_st == 4;
    for (int64_t r = 0; r < len; r++) {
        char *po = p[0] + r * st[0];
        const char *py = p[1] + r * st[1], *pg = p[2] + r * st[2];
        if (fast) {
            softmax_backward_row_f32((const float *)py, (const float *)pg, (float *)po, c->n, c->log);
            continue;
        }
        double s = 0;
        for (int64_t i = 0; i < c->n; i += BLOCK) {
            int64_t k = c->n - i < BLOCK ? c->n - i : BLOCK;
            const double *g = operand_f64(pg + i * c->g_st, c->g_st, c->g_dtype, k, bg);
            if (c->log) {
                for (int64_t j = 0; j < k; j++) s += g[j];
            } else {
                const double *y = operand_f64(py + i * c->y_st, c->y_st, c->y_dtype, k, by);
                for (int64_t j = 0; j < k; j++) s += g[j] * y[j];
            }
        }
        for (int64_t i = 0; i < c->n; i += BLOCK) {
            int64_t k = c->n - i < BLOCK ? c->n - i : BLOCK;
            const double *y = operand_f64(py + i * c->y_st, c->y_st, c->y_dtype, k, by);
            const double *g = operand_f64(pg + i * c->g_st, c->g_st, c->g_dtype, k, bg);
            if (c->log) for (int64_t j = 0; j < k; j++) o[j] = g[j] - exp(y[j]) * s;
            else for (int64_t j = 0; j < k; j++) o[j] = y[j] * (g[j] - s);
            store_f64(po + i * c->out_st, c->out_st, c->out_dtype, o, k);
        }
    }
}

/* an iterator over the rows along dim of out and the inputs (same shape) */
static void row_iter(iter_t *it, const ms_tensor *out, int dim, int nin, const ms_tensor *const *in) {
    int64_t shape[MS_MAX_DIMS], st[ITER_MAX_OPS][MS_MAX_DIMS];
    char *data[ITER_MAX_OPS];
    int elsize[ITER_MAX_OPS];
    const ms_tensor *ts[ITER_MAX_OPS] = {out};
    for (int k = 0; k < nin; k++) ts[k + 1] = in[k];
    for (int k = 0; k <= nin; k++) {
        data[k] = ms_tensor_data(ts[k]);
        elsize[k] = ms_dtype_size(ts[k]->dtype_id);
        for (int d = 0; d < out->ndim; d++) st[k][d] = ts[k]->strides[d];
    }
    for (int d = 0; d < out->ndim; d++) shape[d] = d == dim ? 1 : out->sizes[d];
    iter_init(it, out->ndim, shape, nin + 1, data, st, elsize);
}

// https://pytorch.org/docs/stable/generated/torch.nn.functional.softmax.html
// https://pytorch.org/docs/stable/generated/torch.nn.functional.log_softmax.html
// a: any shape, rows along dim; out: a's shape
int ms_cpu_softmax(ms_tensor *out, const ms_tensor *a, int dim, int log) {
    iter_t it;
    row_iter(&it, out, dim, 1, &a);
    softmax_ctx c = {.log = log, .out_dtype = out->dtype_id, .y_dtype = a->dtype_id, .n = a->sizes[dim],
                     .out_st = out->strides[dim] * ms_dtype_size(out->dtype_id),
                     .y_st = a->strides[dim] * ms_dtype_size(a->dtype_id)};
    iter_for_each(&it, GRAIN / 8 / (c.n > 0 ? c.n : 1), softmax_run, &c);
    return 0;
}

// y, g, out: the same shape, rows along dim
int ms_cpu_softmax_backward(ms_tensor *out, const ms_tensor *y, const ms_tensor *g, int dim, int log) {
    iter_t it;
    const ms_tensor *in[2] = {y, g};
    row_iter(&it, out, dim, 2, in);
    softmax_ctx c = {.log = log, .out_dtype = out->dtype_id, .y_dtype = y->dtype_id, .g_dtype = g->dtype_id,
                     .n = out->sizes[dim],
                     .out_st = out->strides[dim] * ms_dtype_size(out->dtype_id),
                     .y_st = y->strides[dim] * ms_dtype_size(y->dtype_id),
                     .g_st = g->strides[dim] * ms_dtype_size(g->dtype_id)};
    iter_for_each(&it, GRAIN / 8 / (c.n > 0 ? c.n : 1), softmax_backward_run, &c);
    return 0;
}

/* ============================================================== matmul */

/* How BLAS can read a (rows, cols) matrix with element strides (rs, cs):
 * row-major (*trans = 0) or as the transpose of a row-major (cols, rows)
 * (*trans = 1), with leading dim *ld. 0 when a copy is needed. */
static int blas_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
    int64_t minld_rm = cols > 1 ? cols : 1, minld_cm = rows > 1 ? rows : 1;
    if ((cols == 1 || cs == 1) && (rows == 1 || rs >= minld_rm)) {
        *trans = 0;
        *ld = rows == 1 ? minld_rm : rs;
        return 1;
    }
    if ((rows == 1 || rs == 1) && (cols == 1 || cs >= minld_cm)) {
        *trans = 1;
        *ld = cols == 1 ? minld_cm : cs;
        return 1;
    }
    return 0;
}

/* one matrix operand for BLAS: the base pointer, transpose flag and leading
 * dim; non-BLAS strides are copied into *tmp (caller frees) */
typedef struct blas_mat {
    const void *data;
    int trans;
    int64_t ld;
} blas_mat;

static int blas_operand(blas_mat *m, const char *base, int dtype, int64_t rows, int64_t cols, int64_t rs,
                        int64_t cs, void **tmp) {
    int es = ms_dtype_size(dtype);
    if (blas_layout(rows, cols, rs, cs, &m->trans, &m->ld)) {
        m->data = base;
        return 0;
    }
    char *t = malloc((size_t)(rows * cols * es) + 1);
    if (!t) return ms_errorf("matmul: out of host memory copying a (%lld,%lld) operand", (long long)rows,
                             (long long)cols);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            memcpy(t + (i * cols + j) * es, base + (i * rs + j * cs) * es, (size_t)es);
    *tmp = t;
    m->data = t;
    m->trans = 0;
    m->ld = cols > 1 ? cols : 1;
    return 0;
}

static int blas_int_ok(int64_t v) { return v >= 0 && v <= 2147483647; }

/* C (M,N) = alpha * A (M,K) @ B (K,N) + beta * C, row-major, C at c with
 * row stride ldc and unit column stride; dtype f32 or f64 */
static int gemm_rowmajor(int dtype, int64_t M, int64_t N, int64_t K, double alpha, const blas_mat *A,
                         const blas_mat *B, double beta, void *c, int64_t ldc) {
    if (!blas_int_ok(M) || !blas_int_ok(N) || !blas_int_ok(K) || !blas_int_ok(A->ld) || !blas_int_ok(B->ld) ||
        !blas_int_ok(ldc))
        return ms_errorf("matmul: sizes (%lld,%lld,%lld) exceed BLAS's 32-bit integers", (long long)M,
                         (long long)N, (long long)K);
    if (M == 0 || N == 0) return 0;
    if (K == 0) { /* C = beta * C, and 0 * NaN is 0 here as in BLAS */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                if (dtype == MS_F32) {
                    float *p = (float *)c + i * ldc + j;
                    *p = beta == 0 ? 0.0f : (float)beta * *p;
                } else {
                    double *p = (double *)c + i * ldc + j;
                    *p = beta == 0 ? 0.0 : beta * *p;
                }
            }
        return 0;
    }
    enum CBLAS_TRANSPOSE ta = A->trans ? CblasTrans : CblasNoTrans, tb = B->trans ? CblasTrans : CblasNoTrans;
    if (dtype == MS_F32)
        cblas_sgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)N, (blasint)K, (float)alpha, A->data,
                    (blasint)A->ld, B->data, (blasint)B->ld, (float)beta, c, (blasint)ldc);
    else
        cblas_dgemm(CblasRowMajor, ta, tb, (blasint)M, (blasint)N, (blasint)K, alpha, A->data, (blasint)A->ld,
                    B->data, (blasint)B->ld, beta, c, (blasint)ldc);
    return 0;
}

/* C = alpha * A @ B + beta * C for one matrix of each, any strides.
 * a: (M,K) strides (ars, acs); b: (K,N); c: (M,N); element strides. */
static int gemm_strided(int dtype, int64_t M, int64_t N, int64_t K, double alpha, const char *a, int64_t ars,
                        int64_t acs, const char *b, int64_t brs, int64_t bcs, double beta, char *c, int64_t crs,
                        int64_t ccs) {
    int trans;
    int64_t ldc;
    void *ta = NULL, *tb = NULL;
    int rc;
    blas_mat A, B;
    if (!blas_layout(M, N, crs, ccs, &trans, &ldc))
        return ms_errorf("matmul: output strides (%lld,%lld) are not BLAS-compatible", (long long)crs,
                         (long long)ccs);
    if (!trans) {
        rc = blas_operand(&A, a, dtype, M, K, ars, acs, &ta);
        if (!rc) rc = blas_operand(&B, b, dtype, K, N, brs, bcs, &tb);
        if (!rc) rc = gemm_rowmajor(dtype, M, N, K, alpha, &A, &B, beta, c, ldc);
    } else {
        /* C is column-major: compute C^T (N,M) = B^T @ A^T row-major */
        rc = blas_operand(&B, b, dtype, N, K, bcs, brs, &tb);
        if (!rc) rc = blas_operand(&A, a, dtype, K, M, acs, ars, &ta);
        if (!rc) rc = gemm_rowmajor(dtype, N, M, K, alpha, &B, &A, beta, c, ldc);
    }
    free(ta);
    free(tb);
    return rc;
}

static int out_blas_ok(const ms_tensor *c) {
    int trans;
    int64_t ld;
    int n = c->ndim;
    return blas_layout(c->sizes[n - 2], c->sizes[n - 1], c->strides[n - 2], c->strides[n - 1], &trans, &ld);
}

/* t itself when BLAS can read its last two dims, else a contiguous copy in
 * *copy (caller frees) */
static int blas_ready(const ms_tensor *t, ms_tensor **copy, const ms_tensor **use) {
    *copy = NULL;
    *use = t;
    if (out_blas_ok(t)) return 0;
    if (ms_tensor_clone(copy, t)) return -1;
    *use = *copy;
    return 0;
}

/* Matmuls are split into tiles of the output, each one single-threaded
 * BLAS call, run in parallel by OpenMP. The tiles depend only on the
 * shapes, so results do not depend on the number of threads (OpenBLAS's own
 * threading takes another path with one thread than with several, which
 * changes the last bits), and batches of small matrices (attention heads)
 * run in parallel too. OpenBLAS itself is kept at one thread. */
enum { GEMM_TILE_MIN = 64, GEMM_TILE_MAX = 512, GEMM_TASKS = 64 };

static void blas_single_thread(void) {
    static int done = 0;
    if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
        openblas_set_num_threads(1);
        __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    }
}

/* tile sizes from the shapes alone: at most GEMM_TILE_MAX, halved (down
 * to GEMM_TILE_MIN) until there are GEMM_TASKS tasks */
static void gemm_tiles(int64_t nbatch, int64_t M, int64_t N, int64_t *tm, int64_t *tn) {
    int64_t a = M > 0 ? M : 1, b = N > 0 ? N : 1;
    while (a > GEMM_TILE_MAX) a = (a + 1) / 2;
    while (b > GEMM_TILE_MAX) b = (b + 1) / 2;
    for (;;) {
        int64_t tasks = nbatch * ((M + a - 1) / a) * ((N + b - 1) / b);
        if (tasks >= GEMM_TASKS) break;
        if (a >= b && a > GEMM_TILE_MIN) a = (a + 1) / 2;
        else if (b > GEMM_TILE_MIN) b = (b + 1) / 2;
        else if (a > GEMM_TILE_MIN) a = (a + 1) / 2;
        else break;
    }
    *tm = a;
    *tn = b;
}

/* c = alpha * a @ b + beta * c over the batch dims of c (a and b have the
 * same batch dims, possibly with stride 0); the last two dims of all three
 * are BLAS-readable. f32 or f64. */
static int gemm_batched(const ms_tensor *c, const ms_tensor *a, const ms_tensor *b, double alpha, double beta) {
    int nd = c->ndim, nb = nd - 2, dtype = c->dtype_id, es = ms_dtype_size(dtype);
    int64_t M = c->sizes[nd - 2], N = c->sizes[nd - 1], K = a->sizes[nd - 1];
    int64_t nbatch = 1;
    for (int d = 0; d < nb; d++) nbatch *= c->sizes[d];
    if (nbatch == 0 || M == 0 || N == 0) return 0;
    /* every ld and size must fit BLAS's int */
    const ms_tensor *ts[3] = {c, a, b};
    for (int k = 0; k < 3; k++)
        for (int d = nd - 2; d < nd; d++)
            if (!blas_int_ok(ts[k]->sizes[d]) || (ts[k]->sizes[d] > 1 && !blas_int_ok(ts[k]->strides[d])))
                return ms_errorf("matmul: sizes (%lld,%lld,%lld) or strides exceed BLAS's 32-bit integers",
                                 (long long)M, (long long)N, (long long)K);
    blas_single_thread();
    int64_t tm, tn;
    gemm_tiles(nbatch, M, N, &tm, &tn);
    int64_t mt = (M + tm - 1) / tm, nt = (N + tn - 1) / tn, ntasks = nbatch * mt * nt;
    double work = (double)M * (double)N * (double)(K > 0 ? K : 1) * (double)nbatch;
    char *cbase = ms_tensor_data(c);
    const char *abase = ms_tensor_data(a), *bbase = ms_tensor_data(b);
    int64_t crs = c->strides[nd - 2], ccs = c->strides[nd - 1], ars = a->strides[nd - 2], acs = a->strides[nd - 1];
    int64_t brs = b->strides[nd - 2], bcs = b->strides[nd - 1];
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (ntasks > 1 && work > 65536.0)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t bi = t / (mt * nt), r = t % (mt * nt);
        int64_t m0 = (r / nt) * tm, n0 = (r % nt) * tn;
        int64_t m = M - m0 < tm ? M - m0 : tm, n = N - n0 < tn ? N - n0 : tn;
        int64_t off[3] = {0, 0, 0};
        for (int d = nb - 1; d >= 0; d--) {
            int64_t i = bi % c->sizes[d];
            bi /= c->sizes[d];
            for (int k = 0; k < 3; k++) off[k] += i * ts[k]->strides[d];
        }
        int rc = gemm_strided(dtype, m, n, K, alpha, abase + (off[1] + m0 * ars) * es, ars, acs,
                              bbase + (off[2] + n0 * bcs) * es, brs, bcs, beta,
                              cbase + (off[0] + m0 * crs + n0 * ccs) * es, crs, ccs);
        if (rc) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
    }
    if (failed) return ms_errorf("matmul: a BLAS tile failed (out of host memory?)");
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.matmul.html
// a: (*, M, K), b: (*, K, N), c: (*, M, N), the same batch dims (ops.c has
// applied transposes, 1-D promotion and batch broadcasting as views); f32/f64
int ms_cpu_matmul(ms_tensor *c, const ms_tensor *a, const ms_tensor *b) {
    if (!out_blas_ok(c)) { /* compute into a contiguous temporary */
        ms_tensor *t = NULL;
        if (ms_tensor_empty(&t, c->ndim, c->sizes, c->dtype_id, c->device_id)) return -1;
        int rc = ms_cpu_matmul(t, a, b);
        if (!rc) rc = ms_tensor_copy_(c, t);
        ms_tensor_free(t);
        return rc;
    }
    ms_tensor *ca = NULL, *cb = NULL;
    const ms_tensor *ua, *ub;
    int rc = blas_ready(a, &ca, &ua);
    if (!rc) rc = blas_ready(b, &cb, &ub);
    if (!rc) rc = gemm_batched(c, ua, ub, 1.0, 0.0);
    ms_tensor_free(ca);
    ms_tensor_free(cb);
    return rc;
}

// https://pytorch.org/docs/stable/generated/torch.addmm.html
// c (M,N) = beta * c + alpha * a (M,K) @ b (K,N); a, b after transposes
// (views); all one dtype. bf16/f16 or a non-BLAS c: the product goes through
// an f32/f64 temporary and is combined with c in one rounding.
int ms_cpu_gemm_(ms_tensor *c, const ms_tensor *a, const ms_tensor *b, double alpha, double beta) {
    if ((c->dtype_id == MS_F32 || c->dtype_id == MS_F64) && out_blas_ok(c)) {
        ms_tensor *ca = NULL, *cb = NULL;
        const ms_tensor *ua, *ub;
        /* bf16/f16 operands of an f32 out: widened first (exact) */
        int rc = a->dtype_id == c->dtype_id ? blas_ready(a, &ca, &ua) : ms_tensor_to(&ca, a, c->dtype_id, a->device_id);
        if (a->dtype_id != c->dtype_id) ua = ca;
        if (!rc) rc = b->dtype_id == c->dtype_id ? blas_ready(b, &cb, &ub) : ms_tensor_to(&cb, b, c->dtype_id, b->device_id);
        if (!rc && b->dtype_id != c->dtype_id) ub = cb;
        if (!rc) rc = gemm_batched(c, ua, ub, alpha, beta);
        ms_tensor_free(ca);
        ms_tensor_free(cb);
        return rc;
    }
    int wide = c->dtype_id == MS_F64 ? MS_F64 : MS_F32;
    ms_tensor *ta = NULL, *tb = NULL, *tp = NULL;
    int rc = 0;
    if (a->dtype_id != wide) rc = ms_tensor_to(&ta, a, wide, a->device_id);
    if (!rc && b->dtype_id != wide) rc = ms_tensor_to(&tb, b, wide, b->device_id);
    if (!rc) rc = ms_tensor_empty(&tp, 2, c->sizes, wide, c->device_id);
    if (!rc) rc = ms_cpu_matmul(tp, ta ? ta : a, tb ? tb : b);
    if (!rc) {
        int es = ms_dtype_size(c->dtype_id), ws = ms_dtype_size(wide);
        const char *pp = ms_tensor_data(tp);
        char *pc = ms_tensor_data(c);
        for (int64_t i = 0; i < c->sizes[0]; i++)
            for (int64_t j = 0; j < c->sizes[1]; j++) {
                char *q = pc + (i * c->strides[0] + j * c->strides[1]) * es;
                double prod = ms_load(pp + (i * c->sizes[1] + j) * ws, wide);
                double v = alpha * prod + (beta == 0 ? 0.0 : beta * ms_load(q, c->dtype_id));
                if (wide == MS_F32) ms_store(q, c->dtype_id, (float)v);
                else ms_store(q, c->dtype_id, v);
            }
    }
    ms_tensor_free(ta);
    ms_tensor_free(tb);
    ms_tensor_free(tp);
    return rc;
}

/* ============================================================ indexing */

static int64_t index_at(const char *p, int dtype) {
    return dtype == MS_I64 ? *(const int64_t *)p : (int64_t)*(const int32_t *)p;
}

/* the i-th id of a 1-D (or 0-dim) index tensor of i64/i32 ids */
static int64_t id_of(const ms_tensor *idx, int64_t i) {
    int64_t st = idx->ndim ? idx->strides[0] : 0;
    const char *p = ms_tensor_data(idx);
    return index_at(p + i * st * ms_dtype_size(idx->dtype_id), idx->dtype_id);
}

/* copy one element of es bytes */
static void copy_elem(char *dst, const char *src, int es) {
    switch (es) {
    case 8: *(uint64_t *)dst = *(const uint64_t *)src; break;
    case 4: *(uint32_t *)dst = *(const uint32_t *)src; break;
    case 2: *(uint16_t *)dst = *(const uint16_t *)src; break;
    default: *dst = *src; break;
    }
}

/* *dst += *src for one element of dtype (f32 math for f32/bf16/f16) */
static void add_elem(char *dst, const char *src, int dtype) {
    switch (dtype) {
    case MS_F32: *(float *)dst += *(const float *)src; break;
    case MS_F64: *(double *)dst += *(const double *)src; break;
    case MS_I64: *(int64_t *)dst += *(const int64_t *)src; break;
    case MS_I32: *(int32_t *)dst += *(const int32_t *)src; break;
    case MS_BF16:
        *(uint16_t *)dst = ms_f32_to_bf16(ms_bf16_to_f32(*(uint16_t *)dst) + ms_bf16_to_f32(*(const uint16_t *)src));
        break;
    case MS_F16:
        *(uint16_t *)dst = ms_f32_to_f16(ms_f16_to_f32(*(uint16_t *)dst) + ms_f16_to_f32(*(const uint16_t *)src));
        break;
    case MS_U8: *(uint8_t *)dst = (uint8_t)(*(uint8_t *)dst + *(const uint8_t *)src); break;
    case MS_BOOL: *(uint8_t *)dst = (*(uint8_t *)dst | *(const uint8_t *)src) != 0; break;
    }
}

typedef struct index_ctx {
    int dtype, es;
} index_ctx;

/* operands: dst, src — copy */
static void copy_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const index_ctx *c = vctx;
    if (st[0] == c->es && st[1] == c->es) {
        memcpy(p[0], p[1], (size_t)(len * c->es));
        return;
    }
    for (int64_t i = 0; i < len; i++) copy_elem(p[0] + i * st[0], p[1] + i * st[1], c->es);
}

/* operands: dst, src — accumulate */
static void add_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const index_ctx *c = vctx;
    if (c->dtype == MS_F32 && st[0] == 4 && st[1] == 4) {
        float *d = (float *)p[0];
        const float *s = (const float *)p[1];
        for (int64_t i = 0; i < len; i++) d[i] += s[i];
        return;
    }
    for (int64_t i = 0; i < len; i++) add_elem(p[0] + i * st[0], p[1] + i * st[1], c->dtype);
}

/* an iterator over t's shape without dim (size 1 there) for two tensors */
static void slice_iter(iter_t *it, const ms_tensor *t0, const ms_tensor *t1, int dim) {
    int64_t shape[MS_MAX_DIMS], st[2][MS_MAX_DIMS];
    char *data[2] = {ms_tensor_data(t0), ms_tensor_data(t1)};
    int elsize[2] = {ms_dtype_size(t0->dtype_id), ms_dtype_size(t1->dtype_id)};
    for (int d = 0; d < t0->ndim; d++) {
        shape[d] = d == dim ? 1 : t0->sizes[d];
        st[0][d] = t0->strides[d];
        st[1][d] = t1->strides[d];
    }
    iter_init(it, t0->ndim, shape, 2, data, st, elsize);
}

// https://pytorch.org/docs/stable/generated/torch.index_select.html
// a: (..., S, ...) with S at dim; idx: (n,); out: a's shape with n at dim
// (ids already checked by ops.c)
int ms_cpu_index_select(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    iter_t it;
    slice_iter(&it, out, a, dim);
    index_ctx c = {.dtype = a->dtype_id, .es = ms_dtype_size(a->dtype_id)};
    int64_t n = ms_tensor_numel(idx);
    int64_t ost = out->strides[dim] * c.es, ast = a->strides[dim] * c.es;
#pragma omp parallel for schedule(static) if (n * it.numel > GRAIN)
    for (int64_t i = 0; i < n; i++) {
        iter_t local = it;
        local.data[0] += i * ost;
        local.data[1] += id_of(idx, i) * ast;
        iter_chunk(&local, 0, local.numel, copy_run, &c);
    }
    return 0;
}

/* dst.narrow(dim, idx[i], 1) += src.narrow(dim, i, 1) for i in order, in
 * parallel over disjoint chunks of the slice (ids may repeat) */
// https://pytorch.org/docs/stable/generated/torch.Tensor.index_add_.html
// dst: (..., S, ...); idx: (n,); src: dst's shape with n at dim
int ms_cpu_index_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
    iter_t it;
    slice_iter(&it, dst, src, dim);
    index_ctx c = {.dtype = dst->dtype_id, .es = ms_dtype_size(dst->dtype_id)};
    int64_t n = ms_tensor_numel(idx);
    int64_t dst_st = dst->strides[dim] * c.es, src_st = src->strides[dim] * c.es;
    int64_t m = it.numel, grain = GRAIN / (n > 0 ? n : 1);
    if (grain < 256) grain = 256;
    int64_t nchunks = (m + grain - 1) / grain;
#pragma omp parallel for schedule(static) if (nchunks > 1)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        int64_t begin = ch * grain, end = begin + grain < m ? begin + grain : m;
        for (int64_t i = 0; i < n; i++) {
            iter_t local = it;
            local.data[0] += id_of(idx, i) * dst_st;
            local.data[1] += i * src_st;
            iter_chunk(&local, begin, end, add_run, &c);
        }
    }
    return 0;
}

typedef struct gather_ctx {
    int es, idx_dtype, op_add, dtype;
    int64_t n;             /* fiber length along dim (scatter) */
    int64_t a_dim_st;      /* bytes per step of dim in a / dst */
    int64_t idx_dim_st, src_dim_st;
} gather_ctx;

/* operands: out, idx, a (a's stride 0 at dim): out = a[..., idx, ...] */
static void gather_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const gather_ctx *c = vctx;
    for (int64_t i = 0; i < len; i++) {
        int64_t k = index_at(p[1] + i * st[1], c->idx_dtype);
        copy_elem(p[0] + i * st[0], p[2] + i * st[2] + k * c->a_dim_st, c->es);
    }
}

/* operands: dst (stride 0 at dim), idx, src, over idx's shape with 1 at dim:
 * each element is a fiber along dim, all of whose writes land in one fiber
 * of dst, so fibers run in parallel and each in index order */
static void scatter_add_run(void *vctx, int64_t len, char *const *p, const int64_t *st, int64_t linear) {
    const gather_ctx *c = vctx;
    for (int64_t i = 0; i < len; i++) {
        char *pd = p[0] + i * st[0];
        const char *pi = p[1] + i * st[1], *ps = p[2] + i * st[2];
        for (int64_t r = 0; r < c->n; r++) {
            int64_t k = index_at(pi + r * c->idx_dim_st, c->idx_dtype);
            add_elem(pd + k * c->a_dim_st, ps + r * c->src_dim_st, c->dtype);
        }
    }
}

// https://pytorch.org/docs/stable/generated/torch.gather.html
// a: (d0, .., dn); idx, out: (i0, .., in) with i_k <= d_k for k != dim
int ms_cpu_gather(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    int64_t st[3][MS_MAX_DIMS];
    char *data[3] = {ms_tensor_data(out), ms_tensor_data(idx), ms_tensor_data(a)};
    int elsize[3] = {ms_dtype_size(out->dtype_id), ms_dtype_size(idx->dtype_id), ms_dtype_size(a->dtype_id)};
    for (int d = 0; d < out->ndim; d++) {
        st[0][d] = out->strides[d];
        st[1][d] = idx->strides[d];
        st[2][d] = d == dim ? 0 : a->strides[d];
    }
    iter_t it;
    iter_init(&it, out->ndim, out->sizes, 3, data, st, elsize);
    gather_ctx c = {.es = elsize[2], .idx_dtype = idx->dtype_id, .a_dim_st = a->strides[dim] * elsize[2]};
    iter_for_each(&it, GRAIN, gather_run, &c);
    return 0;
}

// https://pytorch.org/docs/stable/generated/torch.Tensor.scatter_add_.html
// dst: (d0, .., dn); idx: (i0, .., in); src: (s0, .., sn) with i_k <= s_k and
// i_k <= d_k for k != dim: dst[.., idx[j], ..] += src[.., j, ..]
int ms_cpu_scatter_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src) {
    int64_t shape[MS_MAX_DIMS] = {0}, st[3][MS_MAX_DIMS] = {{0}};
    char *data[3] = {ms_tensor_data(dst), ms_tensor_data(idx), ms_tensor_data(src)};
    int elsize[3] = {ms_dtype_size(dst->dtype_id), ms_dtype_size(idx->dtype_id), ms_dtype_size(src->dtype_id)};
    for (int d = 0; d < idx->ndim; d++) {
        shape[d] = d == dim ? 1 : idx->sizes[d];
        st[0][d] = dst->strides[d];
        st[1][d] = idx->strides[d];
        st[2][d] = src->strides[d];
    }
    iter_t it;
    iter_init(&it, idx->ndim, shape, 3, data, st, elsize);
    gather_ctx c = {.es = elsize[0], .idx_dtype = idx->dtype_id, .dtype = dst->dtype_id,
                    .n = idx->ndim ? idx->sizes[dim] : 1,
                    .a_dim_st = idx->ndim ? dst->strides[dim] * elsize[0] : 0,
                    .idx_dim_st = idx->ndim ? idx->strides[dim] * elsize[1] : 0,
                    .src_dim_st = idx->ndim ? src->strides[dim] * elsize[2] : 0};
    iter_for_each(&it, GRAIN / (c.n > 0 ? c.n : 1), scatter_add_run, &c);
    return 0;
}

/* ============================================================= threads */

static int g_default_threads = 0;

void ms_set_num_threads(int n) {
    if (g_default_threads == 0) g_default_threads = omp_get_max_threads();
    if (n <= 0) n = g_default_threads;
    omp_set_num_threads(n);
    blas_single_thread(); /* BLAS runs inside our threads: see gemm_batched */
}

int ms_get_num_threads(void) { return omp_get_max_threads(); }
