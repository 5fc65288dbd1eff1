/* kernels/kernels.h — the CUDA launchers core/ops.c dispatches to. Each
 * takes tensors already checked and allocated by core/ops.c (shapes, dtypes,
 * devices agree; `out` has the result's shape and dtype), launches on the
 * current stream of the tensors' device, checks the launch, and returns 0 or
 * -1 with the message set. */
#ifndef MS_KERNELS_H
#define MS_KERNELS_H

#include <stdint.h>
#include "../core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* elementwise.cu */
int ms_cuda_convert(ms_tensor *dst, const ms_tensor *src);
/* convert_many.cu: dst (contiguous) = the n contiguous sources in turn, one
 * float dtype (f32/bf16/f16) among them, dst's a float one too */
int ms_cuda_convert_many(ms_tensor *dst, ms_tensor **src, int n);
int ms_cuda_split_many(ms_tensor **dst, int n, const ms_tensor *src);
/* convert_many.cu: core/ops.h ms_copy_bytes_many (checked there, on device dev) */
int ms_cuda_copy_bytes_many(ms_tensor **dst, ms_tensor **src, const int64_t *spec, int n, int dev);
int ms_cuda_unary(ms_tensor *out, int op, const ms_tensor *a);
int ms_cuda_binary(ms_tensor *out, int op, const ms_tensor *a, const ms_tensor *b);
int ms_cuda_binary_scalar(ms_tensor *out, int op, const ms_tensor *a, double s, int reverse);
int ms_cuda_clamp(ms_tensor *out, const ms_tensor *a, double lo, double hi);
int ms_cuda_where(ms_tensor *out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b);
int ms_cuda_fill(ms_tensor *t, double v);
int ms_cuda_arange(ms_tensor *t, double start, double step);
int ms_cuda_rand(ms_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal);
/* out = g * gelu'(pre) (2-D) with, given bias_grad, its column sums in the
 * same pass; 1: layout or dtype not taken, nothing done */
int ms_cuda_gelu_backward_bgrad(ms_tensor *out, ms_tensor *bias_grad, const ms_tensor *pre, const ms_tensor *g);

/* reduce.cu: a is viewed as (outer, n, inner) around the reduced dim
 * (dim = -1000: all elements); out has outer*inner elements */
int ms_cuda_reduce(ms_tensor *out, int op, const ms_tensor *a, int dim);
int ms_cuda_softmax(ms_tensor *out, const ms_tensor *a, int dim, int log);
int ms_cuda_softmax_backward(ms_tensor *out, const ms_tensor *y, const ms_tensor *g, int dim, int log);

/* gemm.cu: cuBLASLt, f32 accumulation; out = alpha*op(a)@op(b) + beta*out
 * over batch dims already broadcast by the caller (a, b, out 3-D views) */
int ms_cuda_gemm(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                 double alpha, double beta);
/* 2-D with a cuBLASLt epilogue (MS_GEMM_* of ops.h); 1: not taken, nothing done */
int ms_cuda_gemm_epilogue(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                          ms_tensor *bias, int mode);
/* 2-D with the GELU epilogues (forward with the pre-activation as aux, or
 * the backward's dgelu with the bias gradient); 1: not taken */
int ms_cuda_gemm_gelu(ms_tensor *out, ms_tensor *aux, const ms_tensor *a, const ms_tensor *b, int transa, int transb,
                      ms_tensor *bias, int backward);

/* float8.cu: out 0-dim f32 = max |x| (x contiguous, any float dtype); the
 * scaled saturating cast of x (R, C) contiguous into out (R, C) and/or
 * out_t (C, R) (NULL: not wanted) and inv = 1 / scale (core/ops.h) */
int ms_cuda_amax(ms_tensor *out, const ms_tensor *x);
int ms_cuda_float8_cast(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, const ms_tensor *x, const ms_tensor *amax,
                        int dtype, int pow2);
/* the same with x's own amax, found in the same launch (written to amax when
 * given) */
int ms_cuda_float8_cast_dyn(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *amax, const ms_tensor *x,
                            int dtype, int pow2);
/* the axiswise cast (core/ops.h ms_float8_cast_axiswise; x contiguous, the
 * slots prepared or NULL; row_amax / col_amax given, checked, or NULL: x's
 * own) and its amaxes (ms_float8_amax_axiswise; the slots prepared or NULL) */
int ms_cuda_float8_cast_axiswise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv_rows, ms_tensor *inv_cols,
                                 const ms_tensor *x, const ms_tensor *row_amax, const ms_tensor *col_amax, int dtype,
                                 int pow2);
int ms_cuda_float8_amax_axiswise(ms_tensor *row_amax, ms_tensor *col_amax, const ms_tensor *x);
/* the blockwise cast (core/ops.h ms_float8_cast_blockwise; x contiguous,
 * the slots prepared or NULL) */
int ms_cuda_float8_cast_blockwise(ms_tensor *out, ms_tensor *out_t, ms_tensor *inv, ms_tensor *inv_t,
                                  const ms_tensor *x, int blocks, int dtype, int pow2);
/* a blockwise weight's flat piece (core/ops.h
 * ms_float8_amax_blockwise_piece, ms_float8_scales_blockwise,
 * ms_float8_cast_blockwise_piece; checked there, x contiguous, the slots
 * prepared or NULL) */
int ms_cuda_float8_amax_blockwise_piece(ms_tensor *out, const ms_tensor *x, long long R, long long C, long long offset);
int ms_cuda_float8_scales_blockwise(ms_tensor *scale, ms_tensor *inv, ms_tensor *inv_t, const ms_tensor *amax,
                                    int dtype, int pow2);
int ms_cuda_float8_cast_blockwise_piece(ms_tensor *out, const ms_tensor *x, const ms_tensor *scale, long long R,
                                        long long C, long long offset, int dtype);
/* the many-piece forms (core/ops.h ms_float8_*_blockwise_many; checked
 * there: every tensor contiguous, of its shape, on device dev; NULL
 * entries as there) */
int ms_cuda_float8_amax_blockwise_many(ms_tensor **amax, ms_tensor **x, const int64_t *geom, int n, int dev);
int ms_cuda_float8_scales_blockwise_many(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t, ms_tensor **amax,
                                         const int *pow2, int n, int dtype, int dev);
int ms_cuda_float8_cast_blockwise_many(ms_tensor **out, ms_tensor **x, ms_tensor **scale, const int64_t *geom, int n,
                                       int dtype, int dev);
/* core/ops.h ms_float8_amax_many / ms_float8_cast_many (checked there:
 * every tensor contiguous, of its shape, on device dev; NULL entries as
 * there) */
int ms_cuda_float8_amax_many(ms_tensor **amax, ms_tensor **x, int n, int dev);
int ms_cuda_float8_cast_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax, const int *pow2, int n,
                             int dtype, int dev);
/* out (C, R) = x (R, C) transposed, 8-bit elements, both contiguous */
int ms_cuda_transpose8(ms_tensor *out, const ms_tensor *x);
/* gemm.cu: out (M, N) = ainv * binv * a (M, K) @ b (N, K)^T [+ bias] [+ beta
 * out], 8-bit float operands with contiguous rows, out contiguous; vec:
 * ainv (M) and binv (N) vectors (cuBLASLt's outer-vector scaling), else
 * one f32 each */
int ms_cuda_scaled_gemm(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                        const ms_tensor *binv, int vec, const ms_tensor *bias, double beta, int fast_accum);

/* gemm.cu: the blockwise-scaled product (core/ops.h
 * ms_scaled_matmul_blockwise; core/float8.c checked it) */
int ms_cuda_scaled_gemm_blockwise(ms_tensor *out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                                  int a_blocks, const ms_tensor *binv, int b_blocks, const ms_tensor *bias,
                                  double beta);

/* index.cu */
int ms_cuda_index_select(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx);
/* grouped_gemm.cu: c[g] = op(a[g]) @ op(b[g]) + beta c[g], bf16/f16 operands,
 * c in their dtype or f32, as checked by ms_gemm_grouped_ (core/gemm_grouped.c):
 * one dtype, one N and one row stride each for a, b and c across the groups,
 * unit column strides, the contiguous dimensions multiples of 8; not transa
 * with transb. mode 1: wgmma on sm_90, else mma.sync; 2: mma.sync */
int ms_cuda_gemm_grouped(ms_tensor **c, ms_tensor **a, ms_tensor **b, int G, int transa, int transb, double beta,
                         int mode);
// kernels/moe.cu: a mixture-of-experts layer's row moves (core/ops.h)
int ms_cuda_moe_gather_rows(ms_tensor *out, const ms_tensor *x, const ms_tensor *idx);
int ms_cuda_moe_select(ms_tensor *ids, const ms_tensor *scores, const ms_tensor *bias, int G, int TG, int how, int k);
int ms_cuda_moe_sort(const ms_tensor *ids, int k, int E, long long align, ms_tensor *order, ms_tensor *inv,
                     ms_tensor *tok, ms_tensor *back, ms_tensor *info);
int ms_cuda_moe_combine(ms_tensor *out, const ms_tensor *ys, const ms_tensor *inv, const ms_tensor *w, int k);
int ms_cuda_moe_swiglu(ms_tensor *h, const ms_tensor *gu);
int ms_cuda_moe_swiglu_backward(ms_tensor *d13, const ms_tensor *gu, const ms_tensor *dh);
int ms_cuda_moe_combine_backward(ms_tensor *gys, ms_tensor *gw, const ms_tensor *g, const ms_tensor *ys,
                                 const ms_tensor *back, const ms_tensor *w, int k);
int ms_cuda_index_add(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);
int ms_cuda_gather(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx);
int ms_cuda_scatter_add(ms_tensor *dst, int dim, const ms_tensor *idx, const ms_tensor *src);

/* norm.cu, adamw.cu, rope.cu: the fused ops (contracts in core/ops.h; the
 * CPU references and what core/ops.c prepares in core/fused_cpu.h): x, g,
 * y, dx contiguous; w, b, mean, rstd, dw, db, cos, sin contiguous in the
 * compute dtype (f64 for f64 x, else f32); optional ones may be NULL */
int ms_cuda_layer_norm(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
                       const ms_tensor *b, double eps);
int ms_cuda_layer_norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                                const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w);
/* the residual add fused into the norm (rms: RMSNorm, else LayerNorm);
 * 1: not taken (dtypes) */
int ms_cuda_add_norm(ms_tensor *res, ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x,
                     const ms_tensor *h, const ms_tensor *w, const ms_tensor *b, double eps, int rms);
/* the backward with dx += gres in one pass; dxl (or NULL): dx a second time
 * in g's dtype, from the same pass; dxl_sum (or NULL; needs dxl): the
 * column sums of dxl in its dtype, from the same pass when the warp-per-row
 * kernel runs, else from a separate reduction of dxl */
int ms_cuda_norm_backward_add(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                              const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w, const ms_tensor *gres,
                              int rms, ms_tensor *dxl, ms_tensor *dxl_sum);
int ms_cuda_rms_norm(ms_tensor *y, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w, double eps);
int ms_cuda_rms_norm_backward(ms_tensor *dx, ms_tensor *dw, const ms_tensor *g, const ms_tensor *x,
                              const ms_tensor *rstd, const ms_tensor *w);
/* k: the step's constants {1 - lr·wd, lr/(1-β1^step), sqrt(1-β2^step)}
 * (core/ops.c adamw_constants), or k_dev: the same 3 f64 on the device,
 * read by the kernel (a step replayed by a CUDA graph) */
int ms_cuda_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m, ms_tensor *const *v,
                  double beta1, double beta2, double eps, const double k[3], const double *k_dev,
                  ms_tensor *const *w, const double *grad_scale);
/* dst (3 f64) = k on the current stream (a kernel: no host sync) */
int ms_cuda_adamw_constants(ms_tensor *dst, const double k[3]);
int ms_cuda_sum_squares(ms_tensor *out, int n, ms_tensor *const *ts);
/* x: any layout with a unit-stride last dim (read in place); out contiguous */
int ms_cuda_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward);

/* attention.cu: flash-style fused attention (contract in core/ops.h) */
int ms_cuda_attention(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
                      double scale, int causal);
/* dsum (or NULL): with the wgmma kernels, the column sums of dq, dk, dv as
 * stored, [H·D | Hkv·D | Hkv·Dv] f32 on the device, and *summed = 1; else 0 */
int ms_cuda_attention_backward(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q, const ms_tensor *k,
                               const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout,
                               double scale, int causal, float *dsum, int *summed);
/* ms_attention_widths on CUDA: the kernels' (q/k, v) widths for (D, Dv) in dtype */
int ms_cuda_attention_widths(int dtype, int64_t D, int64_t Dv, int64_t *dqk, int64_t *dv);
/* the block merge and a block's gradient share (contracts in core/ops.h; checked there) */
int ms_cuda_attention_merge(ms_tensor *acc, ms_tensor *acc_lse, const ms_tensor *o, const ms_tensor *lse, int first);
int ms_cuda_attention_block_grad(ms_tensor *out, const ms_tensor *g, const ms_tensor *lse_b, const ms_tensor *lse);

#ifdef __cplusplus
}
#endif

#endif
