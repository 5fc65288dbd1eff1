/* core/attention_cpu.c — the CPU reference of fused causal attention, and
 * the entry points ms_attention / ms_attention_backward (declared in ops.h).
 *
 * Mirrors torch.nn.functional.scaled_dot_product_attention
 * (https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html)
 * and grouped-query attention (query head h reads kv head h / (H / Hkv)).
 * causal: key j is visible to query i when j <= i + (Tk - Tq), the
 * bottom-right alignment Hugging Face uses (queries are the last Tq of Tk
 * positions, as with a KV cache); for Tq == Tk it is PyTorch's is_causal.
 * A query that sees no key gets a zero output and lse = -inf.
 *   q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), out (B, H, Tq, Dv)
 *   (v's head width Dv may differ from q/k's D: DeepSeek's MLA, q/k 192 and
 *   v 128),
 *   lse (B, H, Tq) f32 (f64 for f64 inputs, which run on the CPU only):
 *   log-sum-exp of the scaled scores of each query row.
 * The reference computes in f64 on contiguous f64 copies and rounds once into
 * the outputs; the CUDA kernels (kernels/attention.cu) never hold a T x T
 * matrix. Backward (FlashAttention-2's equations, with P recomputed from lse):
 *   D_i = dout_i . out_i (over Dv),  P_ij = exp(scale q_i.k_j - lse_i),
 *   dv_j = sum_i P_ij dout_i,  dP_ij = dout_i . v_j,  dS_ij = P_ij (dP_ij - D_i),
 *   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i
 * (dk, dv summed over the query heads sharing a kv head; dq, dk over D,
 * dv and dP over Dv). Gradients are
 * written (=), not accumulated: they are activation gradients.
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

typedef struct attn_dims {
    int64_t B, H, Hkv, Tq, Tk, D, Dv;  /* D: q/k's head width, Dv: v's */
} attn_dims;

static int check_qkv(const char *op, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v, attn_dims *d) {
    char a[200], b[200], c[200];
    if (ms_tensor_check_live(q, op) || ms_tensor_check_live(k, op) || ms_tensor_check_live(v, op)) return -1;
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
        return ms_errorf("%s: q, k, v must be (B, H, T, D) (v's D its own), got %s, %s, %s", op, ms_desc(q, a, sizeof a),
                         ms_desc(k, b, sizeof b), ms_desc(v, c, sizeof c));
    if (q->device_id != k->device_id || q->device_id != v->device_id)
        return ms_errorf("%s: tensors on different devices: %s, %s, %s", op, ms_desc(q, a, sizeof a),
                         ms_desc(k, b, sizeof b), ms_desc(v, c, sizeof c));
    if (q->dtype_id != k->dtype_id || q->dtype_id != v->dtype_id || !ms_is_float(q->dtype_id))
        return ms_errorf("%s: q, k, v need one float dtype, got %s, %s, %s", op, ms_desc(q, a, sizeof a),
                         ms_desc(k, b, sizeof b), ms_desc(v, c, sizeof c));
    d->B = q->sizes[0]; d->H = q->sizes[1]; d->Tq = q->sizes[2]; d->D = q->sizes[3];
    d->Hkv = k->sizes[1]; d->Tk = k->sizes[2]; d->Dv = v->sizes[3];
    if (k->sizes[0] != d->B || v->sizes[0] != d->B || k->sizes[3] != d->D || v->sizes[1] != d->Hkv ||
        v->sizes[2] != d->Tk || d->Hkv == 0 || d->H % d->Hkv != 0)
        return ms_errorf("%s: shapes q %s, k %s, v %s do not fit (q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, "
                         "Dv), H a multiple of Hkv)", op,
                         ms_shape_str(q, a, sizeof a), ms_shape_str(k, b, sizeof b), ms_shape_str(v, c, sizeof c));
    return 0;
}

/* t is (B, H, Tq, Dv) on q's device: the shape of out and dout */
static int out_shaped(const char *op, const char *what, const ms_tensor *t, const ms_tensor *q, const attn_dims *d) {
    char a[200], b[200];
    const int64_t want[4] = {d->B, d->H, d->Tq, d->Dv};
    int ok = t->ndim == 4 && t->device_id == q->device_id;
    for (int i = 0; ok && i < 4; i++) ok = t->sizes[i] == want[i];
    if (!ok)
        return ms_errorf("%s: %s is %s, expected (%lld,%lld,%lld,%lld) (q's (B, H, Tq) and v's head width) on the "
                         "device of q %s", op, what, ms_desc(t, a, sizeof a), (long long)d->B, (long long)d->H,
                         (long long)d->Tq, (long long)d->Dv, ms_desc(q, b, sizeof b));
    return 0;
}

/* contiguous f64 copy of t (freed by the caller) */
static double *f64_copy(const ms_tensor *t, ms_tensor **hold) {
    if (ms_tensor_to(hold, t, MS_F64, MS_CPU)) return NULL;
    return (double *)ms_tensor_data(*hold);
}

/* write a contiguous f64 buffer of dst's shape into dst (one rounding) */
static int store_f64(ms_tensor *dst, double *buf) {
    ms_tensor *src = NULL;
    if (ms_tensor_empty(&src, dst->ndim, dst->sizes, MS_F64, MS_CPU)) return -1;
    memcpy(ms_tensor_data(src), buf, (size_t)ms_tensor_numel(dst) * sizeof(double));
    int rc = ms_tensor_copy_(dst, src);
    ms_tensor_free(src);
    return rc;
}

/* number of keys query i sees */
static int64_t visible(int64_t i, int64_t Tq, int64_t Tk, int causal) {
    if (!causal) return Tk;
    int64_t n = i + 1 + (Tk - Tq);
    return n < 0 ? 0 : (n < Tk ? n : Tk);
}

static int attention_cpu(ms_tensor *out, ms_tensor *lse, const ms_tensor *q, const ms_tensor *k,
                         const ms_tensor *v, double scale, int causal, const attn_dims *d) {
    ms_tensor *hq = NULL, *hk = NULL, *hv = NULL;
    double *Q = f64_copy(q, &hq), *K = Q ? f64_copy(k, &hk) : NULL, *V = K ? f64_copy(v, &hv) : NULL;
    double *O = NULL, *L = NULL;
    int rc = -1;
    if (!V) goto done;
    O = calloc((size_t)(d->B * d->H * d->Tq * d->Dv) + 1, sizeof(double));
    L = calloc((size_t)(d->B * d->H * d->Tq) + 1, sizeof(double));
    if (!O || !L) { ms_errorf("attention: out of host memory"); goto done; }
    int64_t rep = d->H / d->Hkv, D = d->D, Dv = d->Dv;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < d->B; b++)
        for (int64_t h = 0; h < d->H; h++) {
            double *s = malloc(sizeof(double) * (size_t)(d->Tk ? d->Tk : 1));
            const double *Kb = K + ((b * d->Hkv + h / rep) * d->Tk) * D;
            const double *Vb = V + ((b * d->Hkv + h / rep) * d->Tk) * Dv;
            for (int64_t i = 0; i < d->Tq; i++) {
                const double *qi = Q + ((b * d->H + h) * d->Tq + i) * D;
                double *oi = O + ((b * d->H + h) * d->Tq + i) * Dv;
                int64_t n = visible(i, d->Tq, d->Tk, causal);
                double m = -INFINITY, sum = 0;
                for (int64_t j = 0; j < n; j++) {
                    double dot = 0;
                    for (int64_t e = 0; e < D; e++) dot += qi[e] * Kb[j * D + e];
                    s[j] = dot * scale;
                    if (s[j] > m) m = s[j];
                }
                for (int64_t j = 0; j < n; j++) {
                    s[j] = exp(s[j] - m);
                    sum += s[j];
                }
                for (int64_t j = 0; j < n; j++)
                    for (int64_t e = 0; e < Dv; e++) oi[e] += s[j] / sum * Vb[j * Dv + e];
                L[(b * d->H + h) * d->Tq + i] = n ? m + log(sum) : -INFINITY;
            }
            free(s);
        }
    rc = store_f64(out, O);
    if (!rc) rc = store_f64(lse, L);
done:
    free(O);
    free(L);
    ms_tensor_free(hq);
    ms_tensor_free(hk);
    ms_tensor_free(hv);
    return rc;
}

static int attention_backward_cpu(ms_tensor *dq, ms_tensor *dk, ms_tensor *dv, const ms_tensor *q,
                                  const ms_tensor *k, const ms_tensor *v, const ms_tensor *out,
                                  const ms_tensor *lse, const ms_tensor *dout, double scale, int causal,
                                  const attn_dims *d) {
    ms_tensor *h[6] = {NULL};
    double *Q = f64_copy(q, &h[0]), *K = Q ? f64_copy(k, &h[1]) : NULL, *V = K ? f64_copy(v, &h[2]) : NULL;
    double *O = V ? f64_copy(out, &h[3]) : NULL, *L = O ? f64_copy(lse, &h[4]) : NULL; /* checked, not used */
    double *G = L ? f64_copy(dout, &h[5]) : NULL;
    double *dQ = NULL, *dK = NULL, *dV = NULL;
    int rc = -1;
    if (!G) goto done;
    int64_t D = d->D, Dv = d->Dv, rep = d->H / d->Hkv;
    dQ = calloc((size_t)(d->B * d->H * d->Tq * D) + 1, sizeof(double));
    dK = calloc((size_t)(d->B * d->Hkv * d->Tk * D) + 1, sizeof(double));
    dV = calloc((size_t)(d->B * d->Hkv * d->Tk * Dv) + 1, sizeof(double));
    if (!dQ || !dK || !dV) { ms_errorf("attention_backward: out of host memory"); goto done; }
    /* parallel over kv heads: the query heads of one group write the same dk/dv */
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < d->B; b++)
        for (int64_t g = 0; g < d->Hkv; g++) {
            const double *Kb = K + (b * d->Hkv + g) * d->Tk * D, *Vb = V + (b * d->Hkv + g) * d->Tk * Dv;
            double *dKb = dK + (b * d->Hkv + g) * d->Tk * D, *dVb = dV + (b * d->Hkv + g) * d->Tk * Dv;
            for (int64_t h = g * rep; h < (g + 1) * rep; h++)
                for (int64_t i = 0; i < d->Tq; i++) {
                    int64_t row = (b * d->H + h) * d->Tq + i;
                    const double *qi = Q + row * D, *oi = O + row * Dv, *gi = G + row * Dv;
                    double *dqi = dQ + row * D;
                    double Di = 0;
                    for (int64_t e = 0; e < Dv; e++) Di += gi[e] * oi[e];
                    int64_t n = visible(i, d->Tq, d->Tk, causal);
                    /* the row's log-sum-exp again, in f64 (the saved lse is f32) */
                    double m = -INFINITY, sum = 0, Li;
                    for (int64_t j = 0; j < n; j++) {
                        double s = 0;
                        for (int64_t e = 0; e < D; e++) s += qi[e] * Kb[j * D + e];
                        if (s * scale > m) m = s * scale;
                    }
                    for (int64_t j = 0; j < n; j++) {
                        double s = 0;
                        for (int64_t e = 0; e < D; e++) s += qi[e] * Kb[j * D + e];
                        sum += exp(s * scale - m);
                    }
                    Li = m + log(sum);
                    for (int64_t j = 0; j < n; j++) {
                        double s = 0, dp = 0;
                        for (int64_t e = 0; e < D; e++) s += qi[e] * Kb[j * D + e];
                        for (int64_t e = 0; e < Dv; e++) dp += gi[e] * Vb[j * Dv + e];
                        double p = exp(s * scale - Li);
                        double ds = p * (dp - Di);
                        for (int64_t e = 0; e < Dv; e++) dVb[j * Dv + e] += p * gi[e];
                        for (int64_t e = 0; e < D; e++) {
                            dqi[e] += scale * ds * Kb[j * D + e];
                            dKb[j * D + e] += scale * ds * qi[e];
                        }
                    }
                }
        }
    rc = store_f64(dq, dQ);
    if (!rc) rc = store_f64(dk, dK);
    if (!rc) rc = store_f64(dv, dV);
done:
    free(dQ);
    free(dK);
    free(dV);
    for (int i = 0; i < 6; i++) ms_tensor_free(h[i]);
    return rc;
}

/* ========================================================== entry points */

/* the lse's dtype: f64 for f64 inputs (so that f64 results merged by their
 * lse, moonshard.cp's ring attention, stay f64-exact), else f32 */
static int32_t lse_dtype(const ms_tensor *q) { return q->dtype_id == MS_F64 ? MS_F64 : MS_F32; }

int ms_attention(ms_tensor **out, ms_tensor **lse, const ms_tensor *q, const ms_tensor *k, const ms_tensor *v,
                 double scale, int causal) {
    attn_dims d;
    if (check_qkv("attention", q, k, v, &d)) return -1;
    int alloc_out = !*out, alloc_lse = !*lse;
    int64_t ls[3] = {d.B, d.H, d.Tq}, os[4] = {d.B, d.H, d.Tq, d.Dv};
    if (ms_prepare_out(out, "attention", 4, os, q->dtype_id, q->device_id)) return -1;
    if (ms_prepare_more(lse, "attention", 3, ls, lse_dtype(q), q->device_id)) {
        if (alloc_out) { ms_tensor_free(*out); *out = NULL; }
        return -1;
    }
    int rc;
#ifdef MS_WITH_CUDA
    if (q->device_id >= 0) rc = ms_cuda_attention(*out, *lse, q, k, v, scale, causal);
    else
#endif
        rc = attention_cpu(*out, *lse, q, k, v, scale, causal, &d);
    if (rc) {
        if (alloc_out) { ms_tensor_free(*out); *out = NULL; }
        if (alloc_lse) { ms_tensor_free(*lse); *lse = NULL; }
    }
    return rc;
}

/* dst[h·D + d] = Σ_{b,t} x[b, h, t, d] as stored (x on the CPU) */
static void column_sums_cpu(float *dst, const ms_tensor *x) {
    const int64_t B = x->sizes[0], H = x->sizes[1], Tn = x->sizes[2], D = x->sizes[3];
    const char *base = (const char *)x->storage->data;
    const int64_t es = ms_dtype_size(x->dtype_id);
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) {
            double s = 0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t t = 0; t < Tn; t++)
                    s += ms_load(base + (x->offset + b * x->strides[0] + h * x->strides[1] + t * x->strides[2] +
                                         d * x->strides[3]) * es, x->dtype_id);
            dst[h * D + d] = (float)s;
        }
}

static int attention_backward_impl(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q,
                                   const ms_tensor *k, const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse,
                                   const ms_tensor *dout, double scale, int causal, ms_tensor *dsum);

int ms_attention_backward(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q, const ms_tensor *k,
                          const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout,
                          double scale, int causal) {
    return attention_backward_impl(dq, dk, dv, q, k, v, out, lse, dout, scale, causal, NULL) < 0 ? -1 : 0;
}

int ms_attention_backward_sum(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q, const ms_tensor *k,
                              const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse, const ms_tensor *dout,
                              double scale, int causal, ms_tensor *dsum) {
    if (!dsum) return ms_errorf("attention_backward_sum: dsum is NULL (use ms_attention_backward)");
    return attention_backward_impl(dq, dk, dv, q, k, v, out, lse, dout, scale, causal, dsum);
}

static int attention_backward_impl(ms_tensor **dq, ms_tensor **dk, ms_tensor **dv, const ms_tensor *q,
                                   const ms_tensor *k, const ms_tensor *v, const ms_tensor *out, const ms_tensor *lse,
                                   const ms_tensor *dout, double scale, int causal, ms_tensor *dsum) {
    const char *op = "attention_backward";
    attn_dims d;
    if (check_qkv(op, q, k, v, &d)) return -1;
    if (ms_tensor_check_live(out, op) || ms_tensor_check_live(lse, op) || ms_tensor_check_live(dout, op)) return -1;
    if (out_shaped(op, "out", out, q, &d) || out_shaped(op, "dout", dout, q, &d)) return -1;
    if (lse->ndim != 3 || lse->sizes[0] != d.B || lse->sizes[1] != d.H || lse->sizes[2] != d.Tq ||
        lse->dtype_id != lse_dtype(q) || lse->device_id != q->device_id) {
        char a[200];
        return ms_errorf("%s: lse is %s, expected %s (%lld,%lld,%lld) on q's device", op, ms_desc(lse, a, sizeof a),
                         lse_dtype(q) == MS_F64 ? "f64" : "f32", (long long)d.B, (long long)d.H, (long long)d.Tq);
    }
    if (dsum) {
        char a[200];
        if (ms_tensor_check_live(dsum, op)) return -1;
        if (dsum->dtype_id != MS_F32 || !ms_tensor_is_contiguous(dsum) || dsum->device_id != q->device_id ||
            ms_tensor_numel(dsum) != (d.H + d.Hkv) * d.D + d.Hkv * d.Dv)
            return ms_errorf("%s: dsum is %s, expected a contiguous f32 tensor of %lld elements (H·D + Hkv·D + "
                             "Hkv·Dv) on q's device", op, ms_desc(dsum, a, sizeof a),
                             (long long)((d.H + d.Hkv) * d.D + d.Hkv * d.Dv));
    }
    ms_tensor **outs[3] = {dq, dk, dv};
    int alloc[3] = {!*dq, !*dk, !*dv};
    if (ms_prepare_out(dq, op, 4, q->sizes, q->dtype_id, q->device_id) ||
        ms_prepare_more(dk, op, 4, k->sizes, k->dtype_id, k->device_id) ||
        ms_prepare_more(dv, op, 4, v->sizes, v->dtype_id, v->device_id))
        goto fail;
    int rc, summed = 0;
#ifdef MS_WITH_CUDA
    if (q->device_id >= 0)
        rc = ms_cuda_attention_backward(*dq, *dk, *dv, q, k, v, out, lse, dout, scale, causal,
                                        dsum ? (float *)ms_tensor_data(dsum) : NULL, &summed);
    else
#endif
    {
        rc = attention_backward_cpu(*dq, *dk, *dv, q, k, v, out, lse, dout, scale, causal, &d);
        if (!rc && dsum) {
            float *s = (float *)ms_tensor_data(dsum);
            column_sums_cpu(s, *dq);
            column_sums_cpu(s + d.H * d.D, *dk);
            column_sums_cpu(s + (d.H + d.Hkv) * d.D, *dv);
            summed = 1;
        }
    }
    if (!rc) return summed;
fail:
    for (int i = 0; i < 3; i++)
        if (alloc[i] && *outs[i]) { ms_tensor_free(*outs[i]); *outs[i] = NULL; }
    return -1;
}

int ms_attention_widths(int device, int dtype, int64_t D, int64_t Dv, int64_t *dqk, int64_t *dv) {
    if (D < 1 || Dv < 1)
        return ms_errorf("attention_widths: head widths must be positive, got q/k %lld, v %lld", (long long)D,
                         (long long)Dv);
    if (device < 0) {
        *dqk = D;
        *dv = Dv;
        return 0;
    }
#ifdef MS_WITH_CUDA
    return ms_cuda_attention_widths(dtype, D, Dv, dqk, dv);
#else
    (void)dtype;
    return ms_errorf("attention_widths: device %d: moonshard was built without CUDA", device);
#endif
}

/* ================================================ merging key blocks (cp) */

static int check_rows(const char *op, const char *what, const ms_tensor *t, const ms_tensor *like4, int ndim) {
    char a[200], b[200];
    int ok = t->ndim == ndim && t->device_id == like4->device_id;
    for (int i = 0; ok && i < ndim; i++) ok = t->sizes[i] == like4->sizes[i];
    if (!ok)
        return ms_errorf("%s: %s is %s, expected %s%s on the device of %s", op, what, ms_desc(t, a, sizeof a),
                         ndim == 3 ? "the (B, H, T) rows of " : "the shape of ", ms_shape_str(like4, b, sizeof b),
                         "that tensor");
    return 0;
}

static int64_t off4(const ms_tensor *t, int64_t b, int64_t h, int64_t i, int64_t d) {
    return t->offset + b * t->strides[0] + h * t->strides[1] + i * t->strides[2] + d * t->strides[3];
}
static int64_t off3(const ms_tensor *t, int64_t b, int64_t h, int64_t i) {
    return t->offset + b * t->strides[0] + h * t->strides[1] + i * t->strides[2];
}

int ms_attention_merge_(ms_tensor *acc, ms_tensor *acc_lse, const ms_tensor *o, const ms_tensor *lse, int first) {
    const char *op = "attention_merge_";
    char a[200], b[200];
    if (ms_tensor_check_live(acc, op) || ms_tensor_check_live(acc_lse, op) || ms_tensor_check_live(o, op) ||
        ms_tensor_check_live(lse, op))
        return -1;
    if (acc->ndim != 4 || (acc->dtype_id != MS_F32 && acc->dtype_id != MS_F64))
        return ms_errorf("%s: acc is %s, expected a (B, H, T, D) f32 or f64 tensor", op, ms_desc(acc, a, sizeof a));
    if (acc_lse->dtype_id != acc->dtype_id)
        return ms_errorf("%s: acc_lse is %s, expected acc's dtype (%s)", op, ms_desc(acc_lse, a, sizeof a),
                         ms_desc(acc, b, sizeof b));
    if (!ms_is_float(o->dtype_id) || (lse->dtype_id != MS_F32 && lse->dtype_id != MS_F64))
        return ms_errorf("%s: o %s and lse %s: expected a float o and an f32 or f64 lse", op, ms_desc(o, a, sizeof a),
                         ms_desc(lse, b, sizeof b));
    if (check_rows(op, "o", o, acc, 4) || check_rows(op, "acc_lse", acc_lse, acc, 3) || check_rows(op, "lse", lse, acc, 3))
        return -1;
#ifdef MS_WITH_CUDA
    if (acc->device_id >= 0) return ms_cuda_attention_merge(acc, acc_lse, o, lse, first);
#endif
    const int64_t B = acc->sizes[0], H = acc->sizes[1], Tn = acc->sizes[2], D = acc->sizes[3];
    char *pa = (char *)acc->storage->data, *pl = (char *)acc_lse->storage->data;
    const char *po = (const char *)o->storage->data, *pb = (const char *)lse->storage->data;
    const int64_t ea = ms_dtype_size(acc->dtype_id), eo = ms_dtype_size(o->dtype_id), eb = ms_dtype_size(lse->dtype_id);
    const int at = acc->dtype_id, ot = o->dtype_id, bt = lse->dtype_id;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Tn; i++) {
                void *la = pl + off3(acc_lse, bb, h, i) * ea;
                double lb = ms_load(pb + off3(lse, bb, h, i) * eb, bt);
                if (first) {
                    ms_store(la, at, lb);
                    for (int64_t d = 0; d < D; d++)
                        ms_store(pa + off4(acc, bb, h, i, d) * ea, at, ms_load(po + off4(o, bb, h, i, d) * eo, ot));
                    continue;
                }
                double lv = ms_load(la, at), m = lv > lb ? lv : lb;
                if (m == -INFINITY) continue;
                double wa = exp(lv - m), wb = exp(lb - m), sum = wa + wb;
                wa /= sum;
                wb /= sum;
                for (int64_t d = 0; d < D; d++) {
                    void *p = pa + off4(acc, bb, h, i, d) * ea;
                    ms_store(p, at, ms_load(p, at) * wa + ms_load(po + off4(o, bb, h, i, d) * eo, ot) * wb);
                }
                ms_store(la, at, m + log(sum));
            }
    return 0;
}

int ms_attention_block_grad(ms_tensor **out, const ms_tensor *g, const ms_tensor *lse_b, const ms_tensor *lse,
                            int dtype) {
    const char *op = "attention_block_grad";
    char a[200], b[200];
    if (ms_tensor_check_live(g, op) || ms_tensor_check_live(lse_b, op) || ms_tensor_check_live(lse, op)) return -1;
    if (g->ndim != 4 || !ms_is_float(g->dtype_id) || !ms_is_float(dtype))
        return ms_errorf("%s: g is %s, expected a (B, H, T, D) float tensor and a float out dtype", op,
                         ms_desc(g, a, sizeof a));
    if ((lse_b->dtype_id != MS_F32 && lse_b->dtype_id != MS_F64) || (lse->dtype_id != MS_F32 && lse->dtype_id != MS_F64))
        return ms_errorf("%s: lse_b %s and lse %s: expected f32 or f64", op, ms_desc(lse_b, a, sizeof a),
                         ms_desc(lse, b, sizeof b));
    if (check_rows(op, "lse_b", lse_b, g, 3) || check_rows(op, "lse", lse, g, 3)) return -1;
    int alloc = !*out;
    if (ms_prepare_out(out, op, 4, g->sizes, dtype, g->device_id)) return -1;
    int rc = 0;
#ifdef MS_WITH_CUDA
    if (g->device_id >= 0) rc = ms_cuda_attention_block_grad(*out, g, lse_b, lse);
    else
#endif
    {
        const int64_t B = g->sizes[0], H = g->sizes[1], Tn = g->sizes[2], D = g->sizes[3];
        const char *pg = (const char *)g->storage->data, *p1 = (const char *)lse_b->storage->data,
                   *p2 = (const char *)lse->storage->data;
        char *po = (char *)(*out)->storage->data;
        const int64_t eg = ms_dtype_size(g->dtype_id), e1 = ms_dtype_size(lse_b->dtype_id),
                      e2 = ms_dtype_size(lse->dtype_id), eo = ms_dtype_size(dtype);
        const ms_tensor *ot = *out;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t bb = 0; bb < B; bb++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < Tn; i++) {
                    double w = exp(ms_load(p1 + off3(lse_b, bb, h, i) * e1, lse_b->dtype_id) -
                                   ms_load(p2 + off3(lse, bb, h, i) * e2, lse->dtype_id));
                    for (int64_t d = 0; d < D; d++)
                        ms_store(po + off4(ot, bb, h, i, d) * eo, dtype,
                                 ms_load(pg + off4(g, bb, h, i, d) * eg, g->dtype_id) * w);
                }
    }
    if (rc && alloc) {
        ms_tensor_free(*out);
        *out = NULL;
    }
    return rc;
}
