/* core/ops.h — tensor operations, dispatched by device.
 *
 * Every op takes `ms_tensor **out` first. When *out is NULL the op allocates
 * the result (dtype and shape follow the rules below); when *out is a tensor
 * the op writes into it (in-place and out= forms) after checking that its
 * shape, dtype and device are what the op would have allocated.
 *
 *   ms_tensor *c = NULL;
 *   if (ms_binary(&c, MS_OP_ADD, a, b) != 0) puts(ms_last_error());
 *
 * Broadcasting follows numpy: shapes align at the right, a dim of 1 (or a
 * missing dim) stretches. Binary ops promote dtypes: float beats integer,
 * wider float beats narrower (f64 > f32 > bf16/f16; bf16 with f16 gives f32);
 * comparisons return MS_BOOL. Reductions of integers return i64 (sum) or the
 * input dtype (max/min); mean/logsumexp need a float dtype. argmax returns i64.
 *
 * Dims are 0-based and may be negative (-1 is the last). Low-precision
 * floats (bf16, f16) are computed in f32 and rounded once on store.
 * Gradient rule (written down once, for the kernels and the autograd):
 * parameter gradients accumulate (+=), activation gradients overwrite (=).
 */
#ifndef MS_OPS_H
#define MS_OPS_H

#include "tensor.h"

/* FFI-BEGIN */
enum {
    /* unary: out = f(a) */
    MS_OP_NEG = 0, MS_OP_EXP, MS_OP_LOG, MS_OP_SQRT, MS_OP_RSQRT, MS_OP_TANH,
    MS_OP_SIGMOID, MS_OP_RELU, MS_OP_GELU, MS_OP_SILU, MS_OP_ABS,
    MS_OP_SIN, MS_OP_COS, MS_OP_SQUARE, MS_OP_RECIP, MS_OP_SIGN,
    MS_OP_UNARY_END
};
enum {
    /* binary: out = a op b */
    MS_OP_ADD = 0, MS_OP_SUB, MS_OP_MUL, MS_OP_DIV, MS_OP_POW,
    MS_OP_MAXIMUM, MS_OP_MINIMUM,
    MS_OP_EQ, MS_OP_NE, MS_OP_LT, MS_OP_LE, MS_OP_GT, MS_OP_GE,
    /* backward helpers: out = grad * f'(x), a = x, b = grad */
    MS_OP_GELU_BWD, MS_OP_SILU_BWD, MS_OP_SIGMOID_BWD, MS_OP_TANH_BWD, MS_OP_RELU_BWD,
    MS_OP_BINARY_END
};
enum {
    MS_RED_SUM = 0, MS_RED_MEAN, MS_RED_MAX, MS_RED_MIN, MS_RED_ARGMAX, MS_RED_ARGMIN,
    MS_RED_LOGSUMEXP, MS_RED_PROD, MS_RED_END
};

int ms_unary(ms_tensor **out, int op, const ms_tensor *a);
int ms_binary(ms_tensor **out, int op, const ms_tensor *a, const ms_tensor *b);
/* a op s (reverse=0) or s op a (reverse=1); result dtype is a's (bool for
 * comparisons; integer a with a non-integer s gives f32) */
int ms_binary_scalar(ms_tensor **out, int op, const ms_tensor *a, double s, int reverse);
int ms_clamp(ms_tensor **out, const ms_tensor *a, double lo, double hi); /* NaN bound: none */
int ms_where(ms_tensor **out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b);

/* dim in [-ndim, ndim) or MS_ALL_DIMS (-1000) for all elements */
int ms_reduce(ms_tensor **out, int op, const ms_tensor *a, int dim, int keepdim);
int ms_softmax(ms_tensor **out, const ms_tensor *a, int dim, int log);
/* softmax backward: y = softmax (or log_softmax) output, g = dL/dy */
int ms_softmax_backward(ms_tensor **out, const ms_tensor *y, const ms_tensor *g, int dim, int log);

/* out = op(a) @ op(b): a (..., M, K), b (..., K, N) before transposes; batch
 * dims broadcast; 1-D operands as in numpy.matmul. f32/f64 through OpenBLAS,
 * bf16/f16 computed in f32. */
int ms_matmul(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, int transa, int transb);
/* out = beta*out + alpha * op(a) @ op(b), 2-D only; out must exist (used for
 * accumulating gradients without a temporary) */
int ms_gemm_(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
             double alpha, double beta);

/* indexing; idx is i64 or i32, 0-based; out-of-range ids are an error */
int ms_index_select(ms_tensor **out, const ms_tensor *a, int dim, const ms_tensor *idx);
/* dst.index_add_(dim, idx, src): dst.narrow(dim, idx[i], 1) += src.narrow(dim, i, 1) */
int ms_index_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);
int ms_gather(ms_tensor **out, const ms_tensor *a, int dim, const ms_tensor *idx);
int ms_scatter_add_(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);
int ms_cat(ms_tensor **out, int n, ms_tensor *const *ts, int dim);

/* fills and random numbers. Random numbers are Philox4x32-10 keyed by seed;
 * element i (in row-major order of t) uses counter offset + i, so results do
 * not depend on the device or the number of threads. */
int ms_fill_(ms_tensor *t, double value);
int ms_arange_(ms_tensor *t, double start, double step);
int ms_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi);
int ms_randn_(ms_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);
void ms_philox(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* threads used by the CPU ops (OpenMP and OpenBLAS); 0 = the default */
void ms_set_num_threads(int n);
int ms_get_num_threads(void);
/* FFI-END */

#define MS_ALL_DIMS (-1000)

#endif
