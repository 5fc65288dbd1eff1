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
    /* silu(a) * b: SwiGLU's gate a and up b in one pass */
    MS_OP_SWIGLU,
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
/* 2-D out (M, N) = op(a) @ op(b) with a bias epilogue, in the GEMM's own
 * pass on CUDA when cuBLASLt has one (kernels/gemm.cu), else as a second
 * pass (and always on the CPU, the reference):
 *   MS_GEMM_BIAS     out = op(a) @ op(b) + bias (N) on every row; bias given
 *   MS_GEMM_BGRAD_A  also *bias (M) = sum over k of op(a) (M, K)
 *   MS_GEMM_BGRAD_B  also *bias (N) = sum over k of op(b) (K, N)
 * (a linear layer's bias in the forward, and its bias gradient beside the
 * weight gradient g^T x or x^T g). bias has out's dtype; sums accumulate in
 * f32 or wider and round once. */
enum { MS_GEMM_BIAS = 1, MS_GEMM_BGRAD_A = 2, MS_GEMM_BGRAD_B = 3 };
int ms_matmul_epilogue(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                       ms_tensor **bias, int mode);
/* 2-D with the tanh GELU (as unary MS_OP_GELU), in the GEMM's epilogue on
 * CUDA when cuBLASLt has it, else in separate passes (the CPU's reference):
 *   ms_matmul_gelu:  *pre = op(a) @ op(b) + bias (bias may be NULL),
 *                    *out = gelu(*pre)  (pre is what the backward needs)
 *   ms_matmul_dgelu: *out = (op(a) @ op(b)) * gelu'(pre), pre (M, N); with
 *                    bias_grad non-NULL also *bias_grad (N) = column sums
 *                    of *out (the bias gradient of the layer before the GELU) */
int ms_matmul_gelu(ms_tensor **out, ms_tensor **pre, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                   const ms_tensor *bias);
int ms_matmul_dgelu(ms_tensor **out, ms_tensor **bias_grad, const ms_tensor *a, const ms_tensor *b, int transa,
                    int transb, const ms_tensor *pre);
/* out = beta*out + alpha * op(a) @ op(b), 2-D only; out must exist (used for
 * accumulating gradients without a temporary). out may be f32 with bf16 or
 * f16 operands (the product accumulated and kept in f32, not rounded) */
int ms_gemm_(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
             double alpha, double beta);
/* c[g] = beta*c[g] + op(a[g]) @ op(b[g]) for the G groups (alpha 1, beta 0
 * or 1), each by ms_gemm_'s rules; a group whose inner dimension is empty
 * gets c[g] = beta*c[g]. On CUDA one grouped kernel launch
 * (kernels/grouped_gemm.cu: wgmma on sm_90, mma.sync elsewhere, f32
 * accumulation) can serve them all when the operands are bf16/f16 (c in
 * their dtype or f32), 2-D with unit column strides, the row stride of a,
 * of b and of c each the same across the groups, N the same, the operands'
 * row lengths multiples of 8, and not transa with transb; otherwise (and on
 * the CPU) ms_gemm_ a group. The experts of a mixture-of-experts layer
 * (core/moe.c) are its users. */
int ms_gemm_grouped_(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb, double beta);
/* how CUDA's ms_gemm_grouped_ runs: AUTO (the default) the grouped kernel
 * where it applies and its groups are small enough to beat a cuBLASLt GEMM
 * a group (core/gemm_grouped.c: under 4.5 GFLOP a group on average), KERNEL
 * wherever it applies, MMA the same with the mma.sync kernel on Hopper too,
 * LOOP never; -1 leaves it. Returns the previous mode */
enum { MS_GROUPED_LOOP = 0, MS_GROUPED_AUTO = 1, MS_GROUPED_KERNEL = 2, MS_GROUPED_MMA = 3 };
int ms_gemm_grouped_set_kernel(int mode);
/* One contiguous 1-D tensor of dtype on src[0]'s device holding the n
 * tensors src[i] (any dtypes and layouts, one device) in turn, converted:
 * element k of src[i] at offset (numel src[0] + ... + numel src[i-1]) + k
 * in row-major order. On CUDA with every source contiguous, of one float
 * dtype, and dtype a float one: one kernel per 64 tensors
 * (kernels/convert_many.cu); otherwise a copy each. A mixture-of-experts
 * layer's weights, cast to the compute dtype once a forward (core/moe.c
 * reads expert e's gate, up and down at e x 3 I H). */
int ms_cast_flat(ms_tensor **out, ms_tensor **src, int n, int dtype);
/* The way back: the n tensors dst[i] (any dtypes and layouts, on flat's
 * device) written with flat's elements in turn, converted: dst[i] gets
 * elements (numel dst[0] + ... + numel dst[i-1]) .. + numel dst[i] - 1 of
 * flat (contiguous) in row-major order. flat must hold exactly the sum of
 * their elements. On CUDA with every destination contiguous, of one float
 * dtype, and flat a float one: one kernel per 64 tensors; otherwise a copy
 * each. No destination may share flat's storage. A packed gradient
 * bucket copied back into its gradients. */
int ms_split_flat_(ms_tensor **dst, int n, const ms_tensor *flat);
/* GEMM tuning's choice among n candidates timed ms[i] (ms[0] the library
 * heuristic's first; a negative time is a candidate that did not run): the
 * fastest, when it is faster than ms[0] by more than margin (a fraction),
 * else 0 (ms[0] not timed: the fastest that ran; none ran: 0) */
int ms_gemm_tune_pick(const double *ms, int n, double margin);
/* GEMM tuning records (core/gemm_tune.c; the file of MS_GEMM_TUNE_FILE):
 * a plan's key (MS_GEMM_TUNE_KEY integers), the chosen candidate and how
 * many the heuristic offered. format: one line into buf (n bytes). read:
 * the records of (version, device) in path (malloc'd, free with
 * ms_gemm_tune_free; a missing file has none; a malformed line is an error
 * naming the file and line). append: one line, one write. */
enum { MS_GEMM_TUNE_KEY = 22 };
typedef struct ms_gemm_tune_rec {
    int64_t key[MS_GEMM_TUNE_KEY];
    int pick, found;
} ms_gemm_tune_rec;
int ms_gemm_tune_format(char *buf, size_t n, uint64_t version, const char *device, const int64_t *key, int pick,
                        int found);
int ms_gemm_tune_read(const char *path, uint64_t version, const char *device, ms_gemm_tune_rec **recs, int *count);
int ms_gemm_tune_append(const char *path, const char *line);
void ms_gemm_tune_free(ms_gemm_tune_rec *recs);

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

/* Mixture-of-experts SwiGLU experts (moonshard.nn.moe), the whole loop in
 * one call. xs (M, H) holds the experts' runs of rows in turn, rows[e] for
 * expert e (summing to M; a run may be empty); wf is every expert's weights
 * in one contiguous tensor of xs's dtype and device: expert e's gate w1
 * (I, H), up w3 (I, H) and down w2 (H, I) in turn from e x 3 I H (the
 * layout ms_cast_flat gives [w1, w3, w2, ...]).
 *   forward:  gu (M, 2 I) = each run @ [w1; w3]^T (gate, then up: one
 *             product an expert); ys (M, H) = swiglu(gate, up) @ w2^T
 *             (outputs given, written);
 *   backward: from gy (M, H) and the forward's xs and gu: dxs (M, H) and
 *             each expert's dw1[e], dw3[e] (I, H) and dw2[e] (H, I),
 *             tensors of their own in their own dtype (f32 from bf16
 *             operands), written (not added); an expert with no rows gets
 *             zeros. */
int ms_moe_experts_forward(ms_tensor *ys, ms_tensor *gu, const ms_tensor *xs, const ms_tensor *wf,
                           const int64_t *rows, int E);
int ms_moe_experts_backward(ms_tensor *dxs, ms_tensor **dw1, ms_tensor **dw3, ms_tensor **dw2, const ms_tensor *gy,
                            const ms_tensor *xs, const ms_tensor *gu, const ms_tensor *wf, const int64_t *rows, int E);
/* The experts' SwiGLU on a gate-and-up product gu (M, 2 I), contiguous,
 * one pass each way (CUDA: kernels/moe.cu; CPU: f64 math):
 *   ms_moe_swiglu:          h (M, I) = silu(gu[:, :I]) * gu[:, I:];
 *   ms_moe_swiglu_backward: from dh (M, I), d13 (M, 2 I) = [silu'(gate)
 *                           dh up, silu(gate) dh] (its own storage). */
int ms_moe_swiglu(ms_tensor *h, const ms_tensor *gu);
int ms_moe_swiglu_backward(ms_tensor *d13, const ms_tensor *gu, const ms_tensor *dh);
/* The rows' moves of a mixture-of-experts layer (moonshard.nn.moe): N
 * tokens, k slots a token (slot s = n k + j), M rows in the experts' order
 * (padding rows between the experts' runs); ids are i64 on the rows' device.
 *   ms_moe_gather_rows:      out (M, H) row r = x (N, H) row idx[r], zeros
 *                            where idx[r] == N (padding);
 *   ms_moe_combine:          out (N, H) row n = sum over j of
 *                            w[n k + j] * ys (M, H) row inv[n k + j]
 *                            (w NULL: weights 1), summed in f32 (f64 for f64);
 *   ms_moe_combine_backward: gys (M, H) row r = w[s] * g (N, H) row s / k
 *                            for s = back[r], zeros where back[r] == N k;
 *                            gw (N k) [s] = g row s / k . ys row r (gw NULL:
 *                            not made).
 * w and gw have the rows' dtype. An id out of range is an error naming it
 * (on CUDA: the device flag, raised at the next sync point). */
int ms_moe_gather_rows(ms_tensor *out, const ms_tensor *x, const ms_tensor *idx);
int ms_moe_combine(ms_tensor *out, const ms_tensor *ys, const ms_tensor *inv, const ms_tensor *w, int k);
int ms_moe_combine_backward(ms_tensor *gys, ms_tensor *gw, const ms_tensor *g, const ms_tensor *ys,
                            const ms_tensor *back, const ms_tensor *w, int k);
/* The host's counting sort of a layer's slots by expert (moonshard.nn.moe):
 * ids (n = N k) in [0, E); each expert's run padded to a multiple of align.
 * Writes order (n: the slots by expert, stable), inv (n: slot -> row), tok
 * and back (up to cap rows: row -> token, N at padding; row -> slot, n at
 * padding), counts and rows (E: slots and padded rows an expert) and *M
 * (the rows). An id out of range is an error naming its slot; cap below
 * the rows needed, an error. */
int ms_moe_sort_slots(const int64_t *ids, int64_t n, int k, int E, int64_t align, int64_t cap, int64_t *order,
                      int64_t *inv, int64_t *tok, int64_t *back, int64_t *counts, int64_t *rows, int64_t *M);
/* The same sort as one op on the ids' device (moe.routing_read: on a GPU
 * nothing but `info` need come back to the host): ids (n = N k) i64,
 * contiguous; order and inv (n), tok and back (n + E (align - 1) or more)
 * and info (2 E + 3 or more) contiguous i64 on the ids' device. Writes
 * order, inv, tok and back as ms_moe_sort_slots does (tok and back only up
 * to the M rows), and info = [counts (E), rows (E), M, the first slot with
 * an id outside [0, E) or -1, that id (0 when none)]. A bad id is reported
 * in info, not as a status (a kernel cannot return one): the caller raises
 * it, and then uses none of the outputs. CUDA (kernels/moe.cu): E at most
 * MS_MOE_SORT_MAX_E, n + E (align - 1) below 2^31. */
enum { MS_MOE_SORT_MAX_E = 1024 };
int ms_moe_sort(const ms_tensor *ids, int k, int E, int64_t align, ms_tensor *order, ms_tensor *inv, ms_tensor *tok,
                ms_tensor *back, ms_tensor *info);
/* A layer's routing choice in one pass (moonshard.nn.moe.select): for each
 * token n, its choice scores c = scores (N, E) row n + bias (E, or NULL),
 * added in the scores' dtype (f32 or f64; bias of that dtype); with G > 1
 * groups of E / G experts, each scored by the sum of its two best (how 0)
 * or its best (how 1), only the TG best groups' experts are candidates;
 * ids (N, k) i64 = the k best candidates, best first, ties to the lower
 * expert (and to the lower group). The same choice as top-k by k passes of
 * argmax over the scores masked to -inf outside the groups. G <= 64,
 * k <= 64, k <= TG E / G. */
enum { MS_MOE_SELECT_MAX = 64 };
int ms_moe_select(ms_tensor *ids, const ms_tensor *scores, const ms_tensor *bias, int G, int TG, int how, int k);
int ms_arange_(ms_tensor *t, double start, double step);
int ms_rand_(ms_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi);
int ms_randn_(ms_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);
void ms_philox(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* threads used by the CPU ops (OpenMP and OpenBLAS); 0 = the default */
void ms_set_num_threads(int n);
int ms_get_num_threads(void);

/* ---- fused ops: norms, AdamW, grad norm, RoPE -------------------------
 * CPU references in core/norm_cpu.c, core/adamw_cpu.c, core/rope_cpu.c;
 * CUDA kernels in kernels/norm.cu, kernels/adamw.cu, kernels/rope.cu.
 * Output slots as everywhere (*out NULL: allocated; a tensor: written after
 * its shape, dtype and device are checked, and it must be contiguous); a
 * slot pointer that is NULL means "not wanted" and skips that work.
 *
 * Norms over the last dim of x (..., C), seen as N = numel/C rows:
 *   layer_norm  mean = Σx/C, rstd = 1/sqrt(Σ(x-mean)²/C + eps),
 *               y = (x - mean)·rstd·w + b
 *   rms_norm    rstd = 1/sqrt(Σx²/C + eps), y = round_x(x·rstd)·w, where
 *               round_x rounds to x's dtype (Hugging Face LlamaRMSNorm
 *               casts the normalised x back before the weight multiplies)
 * x, g: any float dtype and layout; w, b (C): any float dtype, or NULL.
 * Math in f32 at least (f64 for f64 x); storage dtypes are converted on
 * load and the result rounded once into y's dtype `out_dtype` (-1: x's),
 * so a norm can read an f32 residual and emit bf16 for the next matmul.
 * mean, rstd: (N) in the compute dtype (f32; f64 for f64 x) — what the
 * backward needs besides x (mean is LayerNorm's only).
 * Backward: g (..., C) the gradient of y -> dx (x's dtype) and the column
 * sums dw, db (w's dtype; f32/f64 without w). All are overwritten (=):
 * accumulating into .grad is the autograd's job. Deterministic: dw and db
 * add up rows in a fixed order (no float atomics on the GPU). */
int ms_layer_norm(ms_tensor **out, ms_tensor **mean, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *w,
                  const ms_tensor *b, double eps, int out_dtype);
int ms_layer_norm_backward(ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g, const ms_tensor *x,
                           const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w);
/* The residual add fused in front of a LayerNorm: *res = x + h (promoted
 * dtype; h of x's shape), then layer_norm(*res) into out, mean, rstd as
 * ms_layer_norm. One CUDA pass when res has x's dtype and h out's (an f32
 * residual stream, a bf16 branch output, a bf16 norm output), else the add
 * and the norm apart (and always on the CPU, the reference).
 * ms_layer_norm_backward_add: the backward with gres, a gradient of x from
 * elsewhere (the residual stream's), added into dx in the same pass; with
 * dxl (or NULL) dx once more in g's dtype (the gradient of a bf16 branch
 * output h, which x + h made: one pass writes both on CUDA); with dxl_sum
 * (or NULL; needs dxl) also the column sums of dxl, (C) in g's dtype,
 * added in f32 from dxl's rounded values and rounded once: the bias
 * gradient of the affine layer that made h, computed in the pass that
 * writes dxl when the CUDA kernel allows (rows up to 1024 f32 / 2048 bf16
 * wide), else by a separate reduction of dxl (the CPU reference). */
int ms_add_layer_norm(ms_tensor **res, ms_tensor **out, ms_tensor **mean, ms_tensor **rstd, const ms_tensor *x,
                      const ms_tensor *h, const ms_tensor *w, const ms_tensor *b, double eps, int out_dtype);
int ms_layer_norm_backward_add(ms_tensor **dx, ms_tensor **dw, ms_tensor **db, const ms_tensor *g,
                               const ms_tensor *x, const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w,
                               const ms_tensor *gres, ms_tensor **dxl, ms_tensor **dxl_sum);
/* the same before an RMSNorm (Llama's post-attention norm) */
int ms_add_rms_norm(ms_tensor **res, ms_tensor **out, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *h,
                    const ms_tensor *w, double eps, int out_dtype);
int ms_rms_norm_backward_add(ms_tensor **dx, ms_tensor **dw, const ms_tensor *g, const ms_tensor *x,
                             const ms_tensor *rstd, const ms_tensor *w, const ms_tensor *gres, ms_tensor **dxl,
                             ms_tensor **dxl_sum);
int ms_rms_norm(ms_tensor **out, ms_tensor **rstd, const ms_tensor *x, const ms_tensor *w, double eps,
                int out_dtype);
int ms_rms_norm_backward(ms_tensor **dx, ms_tensor **dw, const ms_tensor *g, const ms_tensor *x,
                         const ms_tensor *rstd, const ms_tensor *w);

/* AdamW (torch.optim.AdamW) in place, one pass over each tensor:
 *   p <- p·(1 - lr·wd);  m <- β1·m + (1-β1)·g;  v <- β2·v + (1-β2)·g²
 *   p <- p - lr/(1-β1^step) · m / (sqrt(v)/sqrt(1-β2^step) + eps)
 * step >= 1 counts this update. p: f32, bf16/f16 (updated in f32, rounded
 * once) or f64; g: any float dtype; m, v: f32 (f64 for f64 p). Each group
 * p[i], g[i], m[i], v[i] contiguous, of one numel, on one device. The
 * multi form steps n tensors (the parameters of a group) in one launch on
 * CUDA (a few when they are very many or of mixed dtypes); ms_adamw_ is
 * n = 1, e.g. a flat parameter shard. masters (NULL, or n entries each NULL
 * or a tensor): f32 master weights of bf16/f16 parameters (Megatron's
 * fp32 main parameters): the update reads and writes masters[i] in place of
 * p[i] and stores p[i] as its rounding, so the parameter's own precision
 * never holds the running value. grad_scale (NULL, or one f64 element on
 * the parameters' device): every gradient enters the update multiplied by it,
 * as a multiply in the gradient's dtype by the scale rounded to that dtype
 * would have left it (the same bits as scaling the gradients first):
 * clip_grad_norm's coefficient without a pass over the gradients.
 * constants (NULL, or 3 contiguous f64 on the parameters' device): the
 * step's {1 - lr·wd, lr/(1-β1^step), sqrt(1-β2^step)} read from there by
 * the kernel instead of made from lr, weight_decay and step (a step
 * captured in a CUDA graph: ms_adamw_constants_ writes the next step's
 * before each replay; the same doubles, so the same bits). */
int ms_adamw_(ms_tensor *param, const ms_tensor *grad, ms_tensor *exp_avg, ms_tensor *exp_avg_sq, double lr,
              double beta1, double beta2, double eps, double weight_decay, int64_t step);
int ms_adamw_multi_(int n, ms_tensor *const *params, ms_tensor *const *grads, ms_tensor *const *exp_avg,
                    ms_tensor *const *exp_avg_sq, double lr, double beta1, double beta2, double eps,
                    double weight_decay, int64_t step, ms_tensor *const *masters, const ms_tensor *grad_scale,
                    const ms_tensor *constants);
/* constants (3 contiguous f64, any device) = the constants of a step
 * (above), written on the device's stream without a host sync */
int ms_adamw_constants_(ms_tensor *constants, double lr, double beta1, double beta2, double weight_decay,
                        int64_t step);
/* out: 0-dim f64 = Σ_i Σ_j ts[i][j]² over n float tensors of one device,
 * accumulated in f64 in a fixed order (the global grad norm is its square
 * root); no host sync on CUDA */
int ms_sum_squares(ms_tensor **out, int n, ms_tensor *const *ts);

/* Rotary position embedding, Hugging Face's rotate_half convention over the
 * last dim D (even, h = D/2) of x (..., T, D); cos, sin (T, D), any float
 * dtype, constants:
 *   y[i] = x[i]·cos[i] - x[i+h]·sin[i];  y[i+h] = x[i+h]·cos[i+h] + x[i]·sin[i+h]
 * backward = 1 applies the transpose (dx from g):
 *   dx[i] = g[i]·cos[i] + g[i+h]·sin[i+h];  dx[i+h] = g[i+h]·cos[i+h] - g[i]·sin[i]
 * x any layout (a (B, H, T, D) view of (B, T, H, D) is read in place on
 * CUDA); out: x's shape and dtype. Math in f32 (f64 for f64). */
int ms_rope(ms_tensor **out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward);
/* fused attention (core/attention_cpu.c, kernels/attention.cu): q (B, H, Tq, D),
 * k (B, Hkv, Tk, D) and v (B, Hkv, Tk, Dv) with H a multiple of Hkv
 * (grouped-query) and v's head width Dv its own (DeepSeek's MLA: D 192, Dv
 * 128), out (B, H, Tq, Dv), lse (B, H, Tq) f32 (f64 for f64 q: CPU only)
 * saved for backward; causal: key j visible to query i when j <= i + Tk - Tq
 * (bottom-right, as Hugging Face). No T x T matrix is kept. The CPU takes
 * any widths; CUDA the pairs ms_attention_widths gives back unchanged (else
 * an error naming the shapes). Backward writes dq, dk, dv (like q, k, v). */
int ms_attention(ms_tensor **out, ms_tensor **lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
                 double scale, int causal);
int ms_attention_backward(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q, const ms_tensor *k,
                          const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout,
                          double scale, int causal);
/* The same, and dsum (a contiguous f32 tensor of H·D + Hkv·D + Hkv·Dv elements on
 * q's device): the column sums over (B, T) of dq, dk and dv as stored, in
 * that order, heads then D (the bias gradient of a fused qkv projection,
 * GPT-2's c_attn, when the three are views of its output's gradient).
 * Returns 1 when dsum was written: on the CPU (a pass over the outputs) and
 * with the wgmma kernels on sm_90 (each block's rows summed in its
 * epilogue, the blocks in a fixed order); 0 when not (the other CUDA
 * kernels: sum them another way); -1 on an error. */
int ms_attention_backward_sum(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q, const ms_tensor *k,
                              const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout,
                              double scale, int causal, ms_tensor *dsum);
/* the head widths (*dqk for q/k, *dv for v) that fused attention on `device`
 * (-1: the CPU) runs q/k width D and v width Dv of `dtype` at: D and Dv on the
 * CPU; on CUDA the narrowest pair its kernels take with *dqk >= D and *dv >=
 * Dv (f32: one width up to 128; bf16/f16: one width up to 128 or 192, or q/k
 * 192 with v 128). A caller whose widths come back larger pads q and k with
 * zero columns (q·kᵀ unchanged) and v too, and drops the output's extra
 * columns. Returns 0, or -1 with an error naming the widths when none fits. */
int ms_attention_widths(int device, int dtype, int64_t D, int64_t Dv, int64_t *dqk, int64_t *dv);

/* Attention over key blocks merged by their log-sum-exp (moonshard.cp's
 * ring; core/attention_cpu.c, kernels/attention.cu).
 * ms_attention_merge_: acc (B, H, T, Dv) f32 or f64 and acc_lse (B, H, T) of
 * its dtype hold the output and log-sum-exp of the blocks so far (Dv: v's
 * head width, any); o (B, H, T, Dv) of any float dtype and lse (B, H, T) f32 or f64 are another
 * block's (ms_attention's out and lse). first = 1: acc = o, acc_lse = lse.
 * Else per row, with a = acc_lse, b = lse, m = max(a, b) (rows where both
 * are -inf are left as they are):
 *   wa = e^(a-m), wb = e^(b-m), acc = (acc·wa + o·wb) / (wa + wb),
 *   acc_lse = m + log(wa + wb).
 * ms_attention_block_grad: out (B, H, T, Dv) = g·e^(lse_b - lse) per row, the
 * part of the merged output's gradient g that a block whose log-sum-exp is
 * lse_b sees (lse: the merged one); out contiguous, of dtype `dtype`.
 * Both: any strides (on CUDA the last dim's stride 1, and acc f32), one
 * device; math in f32 (f64 when acc or out is f64). */
int ms_attention_merge_(ms_tensor *acc, ms_tensor *acc_lse, const ms_tensor *o, const ms_tensor *lse, int first);
int ms_attention_block_grad(ms_tensor **out, const ms_tensor *g, const ms_tensor *lse_b, const ms_tensor *lse,
                            int dtype);

/* ---- float8 (core/float8.c; CUDA kernels in kernels/float8.cu, the GEMM
 * in kernels/gemm.cu): torchao's dynamic tensorwise scaling.
 *
 * ms_amax: out 0-dim f32 = max |x| over x (any float dtype, any layout; NaN
 * when x holds one; 0 for an empty x). No host sync on CUDA.
 *
 * ms_float8_cast: x (R, C), any float dtype and layout; amax 0-dim f32 on
 * x's device (ms_amax of x, or of a larger tensor x is part of). With
 *   scale = fmax / max(amax, 1e-12)   (f64 math, rounded to f32; pow2: the
 *                                      power of two at or below it)
 * writes the slots given (NULL: not wanted, *slot NULL: allocated, else
 * checked: contiguous, of the shape and dtype below):
 *   out   (R, C) dtype = saturate(x * scale) rounded to nearest even
 *   out_t (C, R) dtype, the same values transposed (row-major)
 *   inv   0-dim f32 = 1 / scale (the dequantisation factor)
 * dtype MS_F8E4M3 (fmax 448) or MS_F8E5M2 (57344); x * scale in f32.
 *
 * ms_scaled_matmul: out (M, N) = ainv * binv * (a @ b^T) [+ bias] [+ beta *
 * out] with a (M, K) and b (N, K) 8-bit float tensors whose rows are
 * contiguous (K is the unit-stride dim of both: cuBLASLt's FP8 layout; pass
 * the transposed copies ms_float8_cast makes for the other products), ainv
 * and binv 0-dim f32 on their device (tensorwise), or ainv (M) and binv
 * (N) f32 vectors (axiswise: out[i, j] = ainv[i] * binv[j] * (a @ b^T)[i,
 * j], cuBLASLt's outer-vector scaling), bias (N) of out's dtype or NULL.
 * out_dtype f32, bf16 or f16 (*out NULL) or *out itself (beta != 0 adds
 * to it: a gradient accumulated in f32). e4m3 with e4m3 or e5m2 either
 * way; two e5m2 operands are refused (cuBLASLt has no such kernel).
 * fast_accum: CUDA only, cuBLASLt's FP8 fast accumulation (torchao's choice
 * for the forward product; the CPU always sums in f32 through OpenBLAS).
 * CUDA needs compute capability 8.9 or newer and M, N, K multiples of 16. */
int ms_amax(ms_tensor **out, const ms_tensor *x);
int ms_float8_cast(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, const ms_tensor *x, const ms_tensor *amax,
                   int dtype, int pow2);
/* ms_float8_cast_dynamic: the same with the amax of x itself (the dynamic
 * scale), written to *amax when that slot is given (NULL: not kept); on
 * CUDA one cooperative kernel finds it and casts (cuda.h:
 * ms_cuda_float8_set_fused) */
int ms_float8_cast_dynamic(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, ms_tensor **amax, const ms_tensor *x,
                           int dtype, int pow2);
int ms_scaled_matmul(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                     const ms_tensor *binv, const ms_tensor *bias, int out_dtype, double beta, int fast_accum);
/* ms_float8_cast_axiswise: torchao's axiswise (rowwise) scaling of x (R, C)
 * (any float dtype and layout), each slot as in ms_float8_cast:
 *   out      (R, C) dtype, row i scaled by fmax / max(amax(x[i, :]), 1e-12)
 *   out_t    (C, R) dtype, x transposed, row j (x's column j) scaled by
 *            fmax / max(amax(x[:, j]), 1e-12)
 *   inv_rows (R) f32 = 1 / out's row scales (needs out)
 *   inv_cols (C) f32 = 1 / out_t's row scales (needs out_t)
 * pow2 as in ms_float8_cast. Each layout is K-major with its scales along
 * K: out feeds a product contracting over C, out_t one contracting over R
 * (ms_scaled_matmul with vector scales). */
int ms_float8_cast_axiswise(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv_rows, ms_tensor **inv_cols,
                            const ms_tensor *x, const ms_tensor *row_amax, const ms_tensor *col_amax, int dtype,
                            int pow2);
/* ms_float8_amax_axiswise: row_amax (R) f32 = max |x[i, :]|, col_amax (C)
 * f32 = max |x[:, j]| of x (R, C) (either slot NULL; NaN when the row or
 * column holds one): what ms_float8_cast_axiswise scales by. Given to it
 * (out by row_amax, out_t by col_amax; a layout whose amax is NULL takes
 * x's own), after an all-reduce (max) over a tensor-parallel group, the
 * casts are those of the unsplit tensor's rows and columns. */
int ms_float8_amax_axiswise(ms_tensor **row_amax, ms_tensor **col_amax, const ms_tensor *x);
/* ms_float8_transpose: out (C, R) contiguous = x (R, C) transposed, x a 2-D
 * 8-bit float tensor (any layout); the same bytes (a tiled kernel on CUDA:
 * the other layout of an f8 weight gathered by FSDP) */
int ms_float8_transpose(ms_tensor **out, const ms_tensor *x);
/* ---- blockwise (DeepSeek-V3's scaling; torchao's blockwise fp8 training)
 *
 * A block's scale is scale = fmax / max(amax(block), 1e-12) as above (pow2
 * as in ms_float8_cast; DeepSeek and torchao keep it exact, 0). Blocks run
 * along K, the contraction dim of the layout they feed; a block at an edge
 * takes what is left of its rows / columns (ceil division).
 *
 * ms_float8_cast_blockwise: x (R, C) any float dtype and layout; blocks
 * MS_FLOAT8_1X128 (activations, gradients) or MS_FLOAT8_128X128 (weights):
 *   out   (R, C) dtype; 1x128: row i's columns [128 kb, 128 kb + 128)
 *         scaled together; 128x128: the 128 x 128 tiles of x
 *   out_t (C, R) dtype, x transposed; 1x128: row j's (x's column j)
 *         entries [128 rb, ...) scaled together (x's 128 x 1 blocks);
 *         128x128: the same tiles as out (the same bytes, transposed)
 *   inv   1 / out's scales, in cuBLASLt's layout for out as an operand:
 *         1x128 (ceil(C/128), R): inv[kb][i];
 *         128x128 (ceil(R/128), ld) with ld = ceil(ceil(C/128) / 4) * 4:
 *         inv[rb][kb], columns kb >= ceil(C/128) padding (written 0)
 *   inv_t the same for out_t (C, R): 1x128 (ceil(R/128), C), 128x128
 *         (ceil(C/128), ceil(ceil(R/128) / 4) * 4)
 * inv needs out, inv_t needs out_t.
 *
 * ms_scaled_matmul_blockwise: out (M, N) = sum over K blocks kb of
 *   ainv_kb(i) * binv_kb(j) * (a @ b^T restricted to kb) [+ bias] [+ beta out]
 * with a (M, K), b (N, K) as in ms_scaled_matmul, ainv / binv the inverse
 * scales of a / b in the layout ms_float8_cast_blockwise writes for
 * a_blocks / b_blocks (MS_FLOAT8_1X128 or MS_FLOAT8_128X128). The CPU
 * dequantises both in f64 and multiplies in f64 (one rounding into out);
 * CUDA: cuBLASLt's VEC128_32F / BLK128x128_32F scaling on compute
 * capability 9.x (Hopper), e4m3 operands, K a multiple of 128, M and N of
 * 16, not both 128x128, no fast accumulation. */
enum { MS_FLOAT8_1X128 = 1, MS_FLOAT8_128X128 = 2 };
int ms_float8_cast_blockwise(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, ms_tensor **inv_t,
                             const ms_tensor *x, int blocks, int dtype, int pow2);
int ms_scaled_matmul_blockwise(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                               int a_blocks, const ms_tensor *binv, int b_blocks, const ms_tensor *bias,
                               int out_dtype, double beta);
/* ---- blockwise weights cut at arbitrary offsets (FSDP's float8 all-gathers
 * of the blockwise recipe's weights: each rank holds a flat piece of a
 * weight, whose 128 x 128 blocks may span ranks; docs/fsdp.md)
 *
 * A piece: x (n), a 1-D float tensor (any dtype and layout), holding the
 * elements [offset, offset + n) of a row-major (R, C) matrix (0 <= offset,
 * offset + n <= R C). The block grid is (ceil(R/128), ceil(C/128)), the
 * 128 x 128 tiles of ms_float8_cast_blockwise (128x128), edge blocks
 * holding what is left.
 *
 * ms_float8_amax_blockwise_piece: out (ceil(R/128), ceil(C/128)) f32, every
 * entry written: max |x| over the piece's elements in that block (0 where
 * it has none; NaN where one is NaN). The max over the pieces of a matrix
 * (an all-reduce) is the block maxima of the whole.
 * ms_float8_scales_blockwise: from block maxima amax (nbr, nbc) f32
 * contiguous, each slot as in ms_float8_cast (NULL: not wanted):
 *   scale (nbr, nbc) f32 = fmax / max(amax, 1e-12) (pow2 as there)
 *   inv   (nbr, ceil(nbc / 4) * 4) f32 = 1 / scale, the padding 0
 *   inv_t (nbc, ceil(nbr / 4) * 4) f32, its transpose, the padding 0
 * inv and inv_t are what ms_float8_cast_blockwise (128x128) writes for the
 * whole matrix and its transpose: the same bits.
 * ms_float8_cast_blockwise_piece: out (n) dtype = saturate(x * scale of the
 * element's block) rounded to nearest even, scale (ceil(R/128),
 * ceil(C/128)) f32 contiguous (ms_float8_scales_blockwise's): with the
 * whole matrix's maxima, the bytes ms_float8_cast_blockwise writes there. */
int ms_float8_amax_blockwise_piece(ms_tensor **out, const ms_tensor *x, int64_t R, int64_t C, int64_t offset);
int ms_float8_scales_blockwise(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t, const ms_tensor *amax,
                               int dtype, int pow2);
int ms_float8_cast_blockwise_piece(ms_tensor **out, const ms_tensor *x, const ms_tensor *scale, int64_t R, int64_t C,
                                   int64_t offset, int dtype);
/* ---- the same for many pieces at once (FSDP's once-a-step precompute of
 * every blockwise weight of a model: one launch each, a table of pieces
 * carried as the kernel's parameter, up to 128 pieces a launch; core/f8many.h
 * has the indexing the CPU and CUDA share)
 *
 * n pieces; piece i is x[i] (a contiguous 1-D float tensor, or NULL: no
 * element here) at geom[3i + 2] of a (geom[3i], geom[3i + 1]) matrix, all
 * on one device (any float dtypes). Every tensor is given (nothing is
 * allocated), the written ones do not overlap one another nor what is read.
 *
 * ms_float8_amax_blockwise_many: amax[i] = ms_float8_amax_blockwise_piece
 * of piece i (its whole grid written; a NULL piece's zeroed).
 * ms_float8_scales_blockwise_many: scale[i], inv[i], inv_t[i] =
 * ms_float8_scales_blockwise(amax[i], dtype, pow2[i]) (a NULL array or
 * entry: not wanted; pow2 NULL: all 0); here x and geom are not used, the
 * grids' shapes are amax[i]'s.
 * ms_float8_cast_blockwise_many: out[i] (n_i) dtype =
 * ms_float8_cast_blockwise_piece(x[i], scale[i], ...) (out[i] NULL or
 * empty for a NULL piece).
 * The bits are those of the per-piece ops. */
int ms_float8_amax_blockwise_many(ms_tensor **amax, ms_tensor **x, const int64_t *geom, int n);
int ms_float8_scales_blockwise_many(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t, ms_tensor **amax,
                                    const int *pow2, int n, int dtype);
int ms_float8_cast_blockwise_many(ms_tensor **out, ms_tensor **x, ms_tensor **scale, const int64_t *geom, int n,
                                  int dtype);
/* ---- the tensorwise recipe's casts of many pieces at once (FSDP's
 * once-a-step precompute of every tensorwise weight's shard part: one
 * launch each, up to 128 pieces a launch, one more a further x dtype)
 *
 * n pieces; piece i is x[i] (a contiguous 1-D float tensor of any float
 * dtype, or NULL: no element here), amax[i] one f32 element (a slot of
 * an amax vector), all on one device. Nothing is allocated; the written
 * tensors overlap neither one another nor what is read.
 * ms_float8_amax_many: amax[i] = ms_amax(x[i]) (0 for a NULL or empty x;
 * NaN when one is NaN).
 * ms_float8_cast_many: with scale_i = ms_fp8_scale(amax[i], dtype,
 * pow2[i]) (pow2 NULL: all 0), out[i] (n_i) dtype = saturate(x[i] *
 * scale_i) and inv[i] (one f32 element; a NULL array or entry: not
 * wanted) = 1 / scale_i, written for a NULL x too (out[i] NULL or empty
 * there): the bits ms_float8_cast writes for x[i] with amax[i]. */
int ms_float8_amax_many(ms_tensor **amax, ms_tensor **x, int n);
int ms_float8_cast_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax, const int *pow2, int n,
                        int dtype);
/* ms_copy_bytes_many: n byte copies, copy i moving spec[3i + 2] bytes from
 * src[i] (contiguous, any dtype) at byte spec[3i + 1] to dst[i]
 * (contiguous) at byte spec[3i], every range inside its tensor, all on one
 * device, the written ranges overlapping neither one another nor a read
 * one. CUDA: one kernel a 128 copies (kernels/convert_many.cu). FSDP's f8
 * gathers pack a unit's other parameters into the f8 shard's bytes and
 * unpack them from the gathered bytes with it. */
int ms_copy_bytes_many(ms_tensor **dst, ms_tensor **src, const int64_t *spec, int n);
/* FFI-END */

#define MS_ALL_DIMS (-1000)

#endif
