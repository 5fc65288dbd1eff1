/* core/fused_cpu.h — the CPU references of the fused ops of core/ops.h:
 * LayerNorm/RMSNorm (core/norm_cpu.c), AdamW and the sum of squares behind
 * the global grad norm (core/adamw_cpu.c), rotary embeddings
 * (core/rope_cpu.c). Their CUDA twins are in kernels/norm.cu,
 * kernels/adamw.cu and kernels/rope.cu (declared in kernels/kernels.h).
 *
 * core/ops.c checks the arguments and prepares the outputs before these
 * run: every tensor here is contiguous, the shapes fit, and the small
 * per-column operands (w, b, cos, sin) are already in the compute dtype —
 * f64 when x is f64, f32 otherwise. Rows: x is (N, C) with C its last dim.
 */
#ifndef MS_FUSED_CPU_H
#define MS_FUSED_CPU_H

#include "tensor.h"

/* y (N, C) in its own dtype; mean, rstd (N) in the compute dtype or NULL;
 * w, b (C) in the compute dtype or NULL */
int ms_cpu_layer_norm(ms_tensor *y, ms_tensor *mean, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w,
                      const ms_tensor *b, double eps);
/* dx (N, C) in x's dtype or NULL; dw, db (C) in the compute dtype or NULL */
int ms_cpu_layer_norm_backward(ms_tensor *dx, ms_tensor *dw, ms_tensor *db, const ms_tensor *g, const ms_tensor *x,
                               const ms_tensor *mean, const ms_tensor *rstd, const ms_tensor *w);
int ms_cpu_rms_norm(ms_tensor *y, ms_tensor *rstd, const ms_tensor *x, const ms_tensor *w, double eps);
int ms_cpu_rms_norm_backward(ms_tensor *dx, ms_tensor *dw, const ms_tensor *g, const ms_tensor *x,
                             const ms_tensor *rstd, const ms_tensor *w);

/* n tensors, each group (p, g, m, v) of one numel; the hyper-parameters as
 * ms_adamw_multi_ (core/ops.h), k the step's constants {1 - lr·wd,
 * lr/(1-β1^step), sqrt(1-β2^step)} */
int ms_cpu_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m, ms_tensor *const *v,
                 double beta1, double beta2, double eps, const double k[3], ms_tensor *const *w,
                 double grad_scale, int scaled);
/* out: 0-dim f64 */
int ms_cpu_sum_squares(ms_tensor *out, int n, ms_tensor *const *ts);

/* x, out (..., T, D) contiguous; cos, sin (T, D) in the compute dtype */
int ms_cpu_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward);

#endif
