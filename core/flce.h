/* core/flce.h — fused linear cross-entropy (FLCE): the cross-entropy of the
 * logits x·Wᵀ (+ b) against class targets, and its gradients, computed
 * without ever holding the (BT, V) logits.
 *
 *   ms_flce_opts o;
 *   ms_flce_opts_init(&o);                 // mean, ignore_index -100, no extras
 *   ms_tensor *loss = NULL, *gx = NULL, *gw = NULL;
 *   if (ms_flce(&o, x, w, targets, NULL, NULL, NULL,
 *               &loss, NULL, NULL, &gx, &gw, NULL) != 0)
 *       puts(ms_last_error());
 *   // loss: f32 scalar; gx (BT, H) and gw (V, H): d loss / d x, d loss / d W
 *
 * Semantics (torch.nn.functional.cross_entropy, plus Liger's options):
 *   z_j   = x_i·W_jᵀ + b_j;  with softcap s > 0: z_j = s·tanh(z_j / s)
 *   lse   = log Σ_j exp(z_j)
 *   ce_i  = (1-ε)·w_y·(lse - z_y) + (ε/V)·Σ_j w_j·(lse - z_j)
 *   zl_i  = lse_square_scale·lse²                     (the z-loss)
 *   loss_i = ce_i + zl_i for a valid token (targets[i] != ignore_index), 0
 *   for an ignored one; w = ce_weight (all ones without it), ε =
 *   label_smoothing. 'sum' sums over tokens; 'mean' divides the ce part by
 *   Σ_valid w_y (the number of valid tokens without ce_weight: torch's
 *   weighted mean) and the z-loss part by the number of valid tokens; when
 *   every target is ignored, 'mean' gives 0 (torch gives NaN), and so do the
 *   gradients. 'none' gives loss_i per token. z_loss is the zl part alone
 *   under the same reduction; accuracy is the share of valid tokens whose
 *   argmax logit (first on ties) is the target (0 when none is valid).
 *   A target that is neither ignore_index nor in [0, V) is an error: on the
 *   CPU at once, naming position and value; on CUDA through the device flag
 *   (core/cuda.h ms_cuda_check_device_flags), raised at the next sync point,
 *   the token counting as ignored meanwhile (nothing is read out of bounds).
 *
 * Algorithm: tokens are taken in chunks of `chunk_size` rows; per chunk one
 * GEMM gives the logits, one fused pass over each row gives max, sum-exp,
 * loss, z-loss, argmax and overwrites the logits with d loss / d logits;
 * then grad_x's chunk rows = dlogits @ W and grad_W += dlogitsᵀ @ x_chunk
 * (GEMMs), grad_bias += column sums of dlogits; the chunk buffer is reused.
 * All gradients are final when ms_flce returns. grad_scale (numel 1 or BT)
 * multiplies each token's loss before differentiation: the gradients are
 * those of Σ_i grad_scale_i·loss_i (reduced as asked), which is how the
 * backward of reduction 'none' runs (grad_scale = grad_output).
 *
 * Output slots: NULL means "not wanted" (and its work is skipped: without
 * the three gradient slots only the logits GEMM runs); a slot holding NULL
 * receives a new tensor; a slot holding a tensor is written into after its
 * shape, dtype and device are checked. loss, z_loss: f32 (f64 for f64
 * inputs), scalars (0-dim) for mean/sum, (BT) for 'none'; accuracy: a
 * scalar of the same dtype; grad_x, grad_w, grad_bias: the dtypes of x, W
 * and bias, overwritten (=) — accumulating into .grad is the autograd's job.
 *
 * Precision: the CPU computes in f32 (f64 for f64 inputs, bf16/f16 inputs
 * converted to f32 first), per-row statistics in f64. CUDA: cuBLASLt GEMMs
 * (bf16/f16 inputs with f32 accumulation, logits and dlogits stored in the
 * input dtype, as PyTorch's x@Wᵀ in bf16 would), the fused pass in f32,
 * grad_W and grad_bias accumulated across chunks in `accum_dtype` (f32 by
 * default) and cast at the end. Results do not depend on the number of CPU
 * threads; they depend on the chunk size only through the order in which
 * grad_W / grad_bias add up the chunks (rounding-level).
 */
#ifndef MS_FLCE_H
#define MS_FLCE_H

#include "tensor.h"

/* FFI-BEGIN */
enum { MS_FLCE_MEAN = 0, MS_FLCE_SUM = 1, MS_FLCE_NONE = 2 };

typedef struct ms_flce_opts {
    int64_t ignore_index;     /* -100 */
    double label_smoothing;   /* ε in [0, 1]; 0 */
    double lse_square_scale;  /* z-loss coefficient; 0 (off) */
    double softcap;           /* > 0: logits = softcap·tanh(logits/softcap); 0 (off) */
    int32_t reduction;        /* MS_FLCE_MEAN, MS_FLCE_SUM or MS_FLCE_NONE */
    int32_t accum_dtype;      /* dtype of grad_W/grad_bias accumulation across
                                 chunks: -1 (default) f32 (f64 for f64); or the
                                 dtype of W (accumulate in the output, no copy) */
    int32_t grad_dtype;       /* dtype of grad_W and grad_bias: -1 (default) W's
                                 and bias's; f32 (f64 for f64) for a low-precision
                                 W standing for an f32 master weight (autocast):
                                 with f32 accumulation the output is the
                                 accumulator, no cast and no second copy */
    int64_t chunk_size;       /* rows per chunk; 0: from memory_budget */
    int64_t memory_budget;    /* bytes of the chunk's logits; 0: the default
                                 (ms_flce_chunk_rows) */
    /* vocabulary-parallel (group != NULL, see below): W, bias and ce_weight
       hold the classes [vocab_start, vocab_start + V) of vocab_size */
    struct ms_comm *group;
    int64_t vocab_start;
    int64_t vocab_size;
    int32_t grad_x_partial;   /* vocabulary-parallel: nonzero leaves grad_x
                                 this rank's classes' part, not summed over
                                 the group (the caller sums it: a sequence-
                                 parallel gather's reduce-scatter); 0 */
} ms_flce_opts;

void ms_flce_opts_init(ms_flce_opts *o);

/* rows per chunk for these sizes: opts->chunk_size when > 0, else the rows
 * whose logits (in the dtype they are stored in on `device`) fit
 * memory_budget; the default budget is BT·H elements (the size of x), and
 * on CUDA at least 256 MiB (grad_W is read and written once per chunk, so
 * chunks of fewer than ~1k rows leave the GEMMs waiting on memory).
 * Clamped to [1, BT]; on CUDA rounded down to a multiple of 128 when larger. */
int64_t ms_flce_chunk_rows(const ms_flce_opts *o, int64_t bt, int64_t h, int64_t v, int dtype, int device);

/* the classes [*start, *start + *rows) of a vocabulary of v held by group
 * rank `rank` of `size` in the vocabulary-parallel mode: ceil(v / size) rows
 * per rank, the last ranks fewer (possibly none) — the flat-parameter rule,
 * right-padded to a multiple of the group size, applied to whole rows */
void ms_flce_vocab_shard(int64_t v, int rank, int size, int64_t *start, int64_t *rows);

/* x (BT, H), w (V, H), targets (BT) i64/i32; bias (V), ce_weight (V) float,
 * grad_scale (1) or (BT): optional (NULL). See the top of this file.
 *
 * Vocabulary-parallel mode (o->group set, a process group of core/dist/comm.h
 * on x's device: MPI for CPU tensors, NCCL for CUDA ones): every rank of the
 * group calls with the same x, targets (ids in [0, vocab_size)) and options,
 * and its own rows of W (V = its row count, 0 allowed), bias and ce_weight.
 * Per chunk, each rank's row statistics (max and sum-exp, target logit,
 * Σ w·z, the target's weight, argmax) are combined with three all-reduces
 * (max, sum, min) of a few values per token, so loss, z-loss and accuracy
 * are those of the full vocabulary, identical on every rank; grad_W and
 * grad_bias are this rank's rows; grad_x is all-reduced (summed) at the end,
 * complete on every rank (with o->grad_x_partial: this rank's classes' part
 * of it, left for the caller to sum). */
int ms_flce(const ms_flce_opts *o, const ms_tensor *x, const ms_tensor *w, const ms_tensor *targets,
            const ms_tensor *bias, const ms_tensor *ce_weight, const ms_tensor *grad_scale,
            ms_tensor **loss, ms_tensor **z_loss, ms_tensor **accuracy,
            ms_tensor **grad_x, ms_tensor **grad_w, ms_tensor **grad_bias);

/* t *= g[0] in place (g: one element, float, t's device), done on the
 * device: no host sync, and nothing is written when g[0] == 1 (the backward
 * of a mean/sum FLCE under loss:backward()) */
int ms_flce_scale_(ms_tensor *t, const ms_tensor *g);

/* The fused linear JSD's row pass (lua/moonshard/jsd.lua runs the chunk
 * loop and its GEMMs). s, t (n, V) contiguous: a chunk's student and
 * teacher logits already divided by the temperature, of one float dtype
 * (f32, bf16 or f16; f64 too on the CPU).
 * With ls, lt their log-softmax rows, q = exp(ls), p = exp(lt), each row's
 *   beta = 0:  loss = Σ p (lt − ls),              grad = q − p
 *   beta = 1:  loss = Σ q (ls − lt),              grad = q ⊙ (h − Σ q h), h = ls − lt
 *   else:      loss = β Σ p (lt − lm) + (1 − β) Σ q (ls − lm), lm = log(β p + (1 − β) q),
 *                                                 grad = q ⊙ (h − Σ q h), h = (1 − β)(ls − lm)
 * (TRL's generalized JSD; grad is d loss / d s). loss (n), f64 for f64
 * logits else f32, gets each row's loss; g (n, V) contiguous float (on CUDA:
 * f32 or the logits' dtype), or NULL for the loss alone, gets grad · scale;
 * g may be s itself (the gradient written over the student's logits). A row whose label (labels (n)
 * i64/i32, or NULL: every row counted) is ignore_index gets loss 0 and a
 * zero gradient. Math in f64 on the CPU, f32 on CUDA (one block a row:
 * the row's two log-sum-exps, then its sums, then the gradient), no host
 * sync. */
int ms_jsd_rows(ms_tensor *g, ms_tensor *loss, const ms_tensor *s, const ms_tensor *t, const ms_tensor *labels,
                int64_t ignore_index, double beta, double scale);
/* FFI-END */

#endif
