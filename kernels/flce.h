/* kernels/flce.h — the CUDA launchers of the fused linear cross-entropy
 * (kernels/flce.cu). core/flce.c checks the arguments, owns the chunk loop
 * and its GEMMs (ms_cuda_gemm), and calls these for the steps between the
 * GEMMs. Every launcher runs on the current stream of the tensors' device
 * and never synchronises the host. */
#ifndef MS_KERNELS_FLCE_H
#define MS_KERNELS_FLCE_H

#include <stdint.h>
#include "../core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* one chunk's row pass */
typedef struct ms_flce_params {
    int64_t n;             /* rows in the chunk */
    int64_t row0;          /* index of the chunk's first row in the batch */
    int64_t v;             /* classes */
    int64_t ignore_index;
    float label_smoothing, lse_square_scale, softcap;
    int32_t reduction;     /* MS_FLCE_* */
    int32_t want_grad;     /* overwrite the logits with d loss / d logits */
    int64_t v0, vtot;      /* the chunk's V classes are [v0, v0 + V) of vtot */
} ms_flce_params;

/* targets (BT) i64/i32 (valid: ignore_index or in [0, vtot)), ce_weight
 * (V) f32 or NULL for the classes [v0, v0 + V) -> scal (3) f64 on the device:
 * Σ w_y over valid targets among these classes, Σ w, #valid (the first two
 * are this rank's parts in the vocabulary-parallel mode). Out-of-range
 * targets set the device flag. */
int ms_cuda_flce_prep(const ms_tensor *targets, const ms_tensor *ce_weight, int64_t v0, int64_t v, int64_t vtot,
                      int64_t ignore_index, ms_tensor *scal);

/* logits (n, V) contiguous rows, in place; bias (V) in the logits' dtype or
 * NULL; ce_weight (V) f32 or NULL; targets (BT); grad_scale (1) or (BT) f32
 * or NULL; scal from prep; rows (BT, 3) f32 receives ce, z-loss, hit of the
 * chunk's rows */
int ms_cuda_flce_rows(ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                      const ms_tensor *targets, const ms_tensor *grad_scale, const ms_tensor *scal,
                      ms_tensor *rows, const ms_flce_params *p);

/* vocabulary-parallel row pass (core/flce.c vp_rows): st (7, n) f32
 * contiguous, mx (2, n) f32. stats: this rank's partial statistics of each
 * row; fix: rescale to the group's max (mx, all-reduced); grad: rows and the
 * gradient from the group's statistics (st and mx all-reduced) */
int ms_cuda_flce_vp_stats(const ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                          const ms_tensor *targets, ms_tensor *st, const ms_flce_params *p);
int ms_cuda_flce_vp_fix(ms_tensor *st, const ms_tensor *mx);
int ms_cuda_flce_vp_grad(ms_tensor *logits, const ms_tensor *bias, const ms_tensor *ce_weight,
                         const ms_tensor *targets, const ms_tensor *grad_scale, const ms_tensor *scal,
                         const ms_tensor *st, const ms_tensor *mx, ms_tensor *rows, const ms_flce_params *p);

/* acc (V) (+)= column sums of dl (n, V); accumulate 0: overwrite */
int ms_cuda_flce_colsum(ms_tensor *acc, const ms_tensor *dl, int accumulate);

/* rows (BT, 3) -> loss, z_loss (scalars, or (BT) for 'none'), accuracy; any may be NULL */
int ms_cuda_flce_finish(const ms_tensor *rows, const ms_tensor *scal, int reduction, ms_tensor *loss,
                        ms_tensor *z_loss, ms_tensor *accuracy);

/* t *= g[0] for a contiguous float t; nothing when g[0] == 1 */
int ms_cuda_flce_scale(ms_tensor *t, const ms_tensor *g);

/* the fused linear JSD's row pass (core/flce.h ms_jsd_rows; kernels/jsd.cu),
 * arguments checked by core/jsd.c: s, t (n, V) f32, loss (n) f32, g (n, V)
 * f32/bf16/f16 or NULL, labels (n) i64/i32 or NULL */
int ms_cuda_jsd_rows(ms_tensor *g, ms_tensor *loss, const ms_tensor *s, const ms_tensor *t, const ms_tensor *labels,
                     int64_t ignore_index, double beta, double scale);

#ifdef __cplusplus
}
#endif

#endif
