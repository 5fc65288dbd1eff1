/* core/float8.c — the float8 ops of core/ops.h (ms_amax, ms_float8_cast,
 * ms_scaled_matmul): argument checks, outputs, the CPU reference, and the
 * CUDA dispatch (kernels/float8.cu, kernels/gemm.cu).
 *
 * The CPU reference is what the GPU is checked against: the cast gives the
 * same bits (both sides round with core/fp8.h, scale and product in f32), the
 * product the same values up to the order of the f32 sums (the CPU widens
 * the 8-bit operands to f32, which is exact, and multiplies through
 * OpenBLAS in fixed tiles). */
#include "internal.h"
#include "fp8.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MS_WITH_CUDA
#include "../kernels/kernels.h"
#endif

#define DESC 200

static int is_e5m2(int dtype) { return dtype == MS_F8E5M2; }

/* a 0-dim (or one-element) f32 scalar on `device` */
static int check_scalar(const char *op, const char *what, const ms_tensor *s, int device) {
    char d[DESC], dv[32];
    if (!s) return ms_errorf("%s: %s is missing", op, what);
    if (ms_tensor_check_live(s, op)) return -1;
    if (s->dtype_id != MS_F32 || ms_tensor_numel(s) != 1 || s->device_id != device)
        return ms_errorf("%s: %s must be one f32 element on %s, got %s", op, what,
                         ms_device_str(device, dv, sizeof dv), ms_desc(s, d, sizeof d));
    return 0;
}

/* the one f32 value of a CPU scalar */
static float scalar_value(const ms_tensor *s) { return *(const float *)ms_tensor_data(s); }

/* *tmp = t as a contiguous f32 CPU tensor (an alias when it already is) */
static int f32_contig(ms_tensor **tmp, const ms_tensor *t) {
    *tmp = NULL;
    if (t->dtype_id == MS_F32) return ms_tensor_contiguous(tmp, t);
    return ms_tensor_to(tmp, t, MS_F32, t->device_id);
}

static int finish(ms_tensor **out, int allocated, int rc) {
    if (rc && allocated && out && *out) {
        ms_tensor_free(*out);
        *out = NULL;
    }
    return rc;
}

/* ------------------------------------------------------------------ amax */

/* max |p[i]| over n f32 values (0 for none; NaN when one is NaN): ms_amax's
 * and ms_float8_amax_many's CPU reference */
static float amax_f32(const float *p, int64_t n) {
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(p[i]);
        if (a != a) nan = 1;
        else if (a > m) m = a;
    }
    return nan ? NAN : m;
}

int ms_amax(ms_tensor **out, const ms_tensor *x) {
    char d[DESC];
    if (ms_tensor_check_live(x, "amax")) return -1;
    if (!ms_is_float(x->dtype_id))
        return ms_errorf("amax: needs a float tensor (f64, f32, bf16, f16), got %s", ms_desc(x, d, sizeof d));
    int allocated = out && !*out;
    if (ms_prepare_out(out, "amax", 0, NULL, MS_F32, x->device_id)) return -1;
#ifdef MS_WITH_CUDA
    if (x->device_id >= 0) {
        ms_tensor *c = NULL;
        int rc = ms_tensor_contiguous(&c, x);
        if (!rc) rc = ms_cuda_amax(*out, c);
        ms_tensor_free(c);
        return finish(out, allocated, rc);
    }
#else
    if (x->device_id >= 0) return finish(out, allocated, ms_errorf("amax: cuda tensors need a build with CUDA"));
#endif
    /* in f32 (an f64 x is rounded first: rounding is monotonic, so the max
     * of the rounded values is the rounded max) */
    ms_tensor *c = NULL;
    if (f32_contig(&c, x)) return finish(out, allocated, -1);
    *(float *)ms_tensor_data(*out) = amax_f32(ms_tensor_data(c), ms_tensor_numel(x));
    ms_tensor_free(c);
    return 0;
}

/* ------------------------------------------------------------------ cast */

/* an output slot of op's: NULL (not wanted) or prepared, contiguous */
static int cast_slot(const char *op, ms_tensor **slot, const char *what, int ndim, const int64_t *shape, int dtype,
                     int device, int *allocated) {
    char d[DESC];
    *allocated = slot && !*slot;
    if (!slot) return 0;
    /* the op counter counts the call at its first output */
    int first = !strcmp(what, "out") || !strcmp(what, "row_amax") || !strcmp(what, "scale");
    if ((first ? ms_prepare_out : ms_prepare_more)(slot, op, ndim, shape, dtype, device)) return -1;
    if (!*allocated && !ms_tensor_is_contiguous(*slot))
        return ms_errorf("%s: %s %s must be contiguous", op, what, ms_desc(*slot, d, sizeof d));
    return 0;
}

/* the source and target of a cast: x a live 2-D float tensor, dtype an
 * 8-bit float, a CUDA x only in a build with CUDA */
static int check_cast(const char *op, const ms_tensor *x, int dtype) {
    char d[DESC];
    if (ms_tensor_check_live(x, op)) return -1;
    if (!ms_is_float(x->dtype_id) || x->ndim != 2)
        return ms_errorf("%s: x must be a 2-D float tensor (f64, f32, bf16, f16), got %s", op,
                         ms_desc(x, d, sizeof d));
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
#ifndef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    return 0;
}

/* the cast with a given amax (amax) or x's own (dynamic: amax NULL, its
 * value written to *amax_slot when that slot is given) */
static int cast_impl(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, ms_tensor **amax_slot,
                     const ms_tensor *amax, const ms_tensor *x, int dtype, int pow2) {
    const char *op = "float8_cast";
    if (check_cast(op, x, dtype)) return -1;
    if (amax && check_scalar(op, "amax", amax, x->device_id)) return -1;
    const int64_t R = x->sizes[0], C = x->sizes[1];
    const int64_t shape[2] = {R, C}, shape_t[2] = {C, R};
    int a_out = 0, a_t = 0, a_inv = 0, a_am = 0, rc;
    rc = cast_slot(op, out, "out", 2, shape, dtype, x->device_id, &a_out);
    if (!rc) rc = cast_slot(op, out_t, "out_t", 2, shape_t, dtype, x->device_id, &a_t);
    if (!rc) rc = cast_slot(op, inv, "inv", 0, NULL, MS_F32, x->device_id, &a_inv);
    if (!rc && !amax) rc = cast_slot(op, amax_slot, "amax", 0, NULL, MS_F32, x->device_id, &a_am);
    if (!rc) {
        ms_tensor *o = out ? *out : NULL, *ot = out_t ? *out_t : NULL, *iv = inv ? *inv : NULL;
        ms_tensor *am = !amax && amax_slot ? *amax_slot : NULL;
        ms_tensor *c = NULL, *own = NULL;
        rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
        if (!rc && x->device_id >= 0) {
            rc = amax ? ms_cuda_float8_cast(o, ot, iv, c, amax, dtype, pow2)
                      : ms_cuda_float8_cast_dyn(o, ot, iv, am, c, dtype, pow2);
        } else
#endif
        if (!rc) {
            if (!amax) {   /* x's own amax first */
                rc = am ? ms_amax(&am, c) : ms_amax(&own, c);
                amax = am ? am : own;
            }
            const int e5 = is_e5m2(dtype);
            ms_tensor *f = NULL;
            if (!rc) rc = f32_contig(&f, c);
            if (!rc) {
                const float scale = ms_fp8_scale(scalar_value(amax), e5, pow2);
                const float *p = ms_tensor_data(f);
                uint8_t *po = o ? ms_tensor_data(o) : NULL, *pt = ot ? ms_tensor_data(ot) : NULL;
                for (int64_t i = 0; i < R; i++)
                    for (int64_t j = 0; j < C; j++) {
                        uint8_t v = ms_fp8_from_f32(p[i * C + j] * scale, e5, 1);
                        if (po) po[i * C + j] = v;
                        if (pt) pt[j * R + i] = v;
                    }
                if (iv) *(float *)ms_tensor_data(iv) = 1.0f / scale;
            }
            ms_tensor_free(f);
        }
        ms_tensor_free(c);
        ms_tensor_free(own);
    }
    if (rc) {
        finish(out, a_out, rc);
        finish(out_t, a_t, rc);
        finish(inv, a_inv, rc);
        finish(amax_slot, a_am, rc);
    }
    return rc;
}

int ms_float8_cast(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, const ms_tensor *x, const ms_tensor *amax,
                   int dtype, int pow2) {
    if (!amax) return ms_errorf("float8_cast: amax is missing (ms_float8_cast_dynamic finds x's own)");
    return cast_impl(out, out_t, inv, NULL, amax, x, dtype, pow2);
}

int ms_float8_cast_dynamic(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, ms_tensor **amax, const ms_tensor *x,
                           int dtype, int pow2) {
    return cast_impl(out, out_t, inv, amax, NULL, x, dtype, pow2);
}

/* ---------------------------------------------------------- axiswise */

/* the rows' (ra, R) and columns' (ca, C) amax of the f32 row-major p (R, C),
 * either NULL; NaN wins */
static void axis_amax_cpu(const float *p, int64_t R, int64_t C, float *ra, float *ca) {
    if (ra)
        for (int64_t i = 0; i < R; i++) {
            float m = 0.0f;
            for (int64_t j = 0; j < C; j++) {
                float a = fabsf(p[i * C + j]);
                if (a != a || a > m) m = (m != m) ? m : a;
            }
            ra[i] = m;
        }
    if (ca) {
        for (int64_t j = 0; j < C; j++) ca[j] = 0.0f;
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < C; j++) {
                float a = fabsf(p[i * C + j]);
                if (ca[j] == ca[j] && (a != a || a > ca[j])) ca[j] = a;
            }
    }
}

/* an amax vector given to the cast: f32, 1-D of n, contiguous, on x's device */
static int check_amax_vec(const char *op, const char *what, const ms_tensor *a, int64_t n, const ms_tensor *x) {
    char d[DESC], dx[DESC];
    if (ms_tensor_check_live(a, op)) return -1;
    if (a->dtype_id != MS_F32 || a->ndim != 1 || a->sizes[0] != n || a->device_id != x->device_id ||
        !ms_tensor_is_contiguous(a))
        return ms_errorf("%s: %s must be a contiguous f32 vector of %lld on x's device (x %s), got %s", op, what,
                         (long long)n, ms_desc(x, dx, sizeof dx), ms_desc(a, d, sizeof d));
    return 0;
}

int ms_float8_amax_axiswise(ms_tensor **row_amax, ms_tensor **col_amax, const ms_tensor *x) {
    const char *op = "float8_amax_axiswise";
    char d[DESC];
    if (ms_tensor_check_live(x, op)) return -1;
    if (!ms_is_float(x->dtype_id) || x->ndim != 2)
        return ms_errorf("%s: x must be a 2-D float tensor (f64, f32, bf16, f16), got %s", op,
                         ms_desc(x, d, sizeof d));
#ifndef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    const int64_t R = x->sizes[0], C = x->sizes[1];
    int a_r = 0, a_c = 0;
    int rc = cast_slot(op, row_amax, "row_amax", 1, &R, MS_F32, x->device_id, &a_r);
    if (!rc) rc = cast_slot(op, col_amax, "col_amax", 1, &C, MS_F32, x->device_id, &a_c);
    if (!rc) {
        ms_tensor *ra = row_amax ? *row_amax : NULL, *ca = col_amax ? *col_amax : NULL, *c = NULL;
        rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
        if (!rc && x->device_id >= 0) {
            rc = ms_cuda_float8_amax_axiswise(ra, ca, c);
        } else
#endif
        if (!rc) {
            ms_tensor *f = NULL;
            rc = f32_contig(&f, c);
            if (!rc)
                axis_amax_cpu(ms_tensor_data(f), R, C, ra ? ms_tensor_data(ra) : NULL, ca ? ms_tensor_data(ca) : NULL);
            ms_tensor_free(f);
        }
        ms_tensor_free(c);
    }
    if (rc) {
        finish(row_amax, a_r, rc);
        finish(col_amax, a_c, rc);
    }
    return rc;
}

/* the rowwise / columnwise cast (torchao's axiswise scaling): every row of
 * out scaled by its own amax, every row of out_t (a column of x) by that
 * column's; the amaxes x's own (row_amax / col_amax NULL) or given (the
 * group's); the scales of a pass are those of the CPU loop below */
int ms_float8_cast_axiswise(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv_rows, ms_tensor **inv_cols,
                            const ms_tensor *x, const ms_tensor *row_amax, const ms_tensor *col_amax, int dtype,
                            int pow2) {
    const char *op = "float8_cast_axiswise";
    if (check_cast(op, x, dtype)) return -1;
    if (inv_rows && !out) return ms_errorf("%s: inv_rows is the scale of out: ask for out too", op);
    if (inv_cols && !out_t) return ms_errorf("%s: inv_cols is the scale of out_t: ask for out_t too", op);
    const int64_t R = x->sizes[0], C = x->sizes[1];
    if (row_amax && check_amax_vec(op, "row_amax", row_amax, R, x)) return -1;
    if (col_amax && check_amax_vec(op, "col_amax", col_amax, C, x)) return -1;
    const int64_t shape[2] = {R, C}, shape_t[2] = {C, R};
    int a_out = 0, a_t = 0, a_ir = 0, a_ic = 0, rc;
    rc = cast_slot(op, out, "out", 2, shape, dtype, x->device_id, &a_out);
    if (!rc) rc = cast_slot(op, out_t, "out_t", 2, shape_t, dtype, x->device_id, &a_t);
    if (!rc) rc = cast_slot(op, inv_rows, "inv_rows", 1, &shape[0], MS_F32, x->device_id, &a_ir);
    if (!rc) rc = cast_slot(op, inv_cols, "inv_cols", 1, &shape[1], MS_F32, x->device_id, &a_ic);
    if (!rc) {
        ms_tensor *o = out ? *out : NULL, *ot = out_t ? *out_t : NULL;
        ms_tensor *ir = inv_rows ? *inv_rows : NULL, *ic = inv_cols ? *inv_cols : NULL;
        ms_tensor *c = NULL;
        rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
        if (!rc && x->device_id >= 0) {
            rc = ms_cuda_float8_cast_axiswise(o, ot, ir, ic, c, o ? row_amax : NULL, ot ? col_amax : NULL, dtype,
                                              pow2);
        } else
#endif
        if (!rc) {
            const int e5 = is_e5m2(dtype);
            ms_tensor *f = NULL;
            float *own = NULL;   /* x's own amaxes (R rows, then C columns) where none are given */
            const int need_r = o && !row_amax, need_c = ot && !col_amax;
            rc = f32_contig(&f, c);
            if (!rc && (need_r || need_c) && (own = malloc(sizeof(float) * (size_t)(R + C + 1))) == NULL)
                rc = ms_errorf("%s: out of host memory for %lld scales", op, (long long)(R + C));
            if (!rc) {
                const float *p = ms_tensor_data(f);
                if (own) axis_amax_cpu(p, R, C, need_r ? own : NULL, need_c ? own + R : NULL);
                const float *ra = row_amax ? ms_tensor_data(row_amax) : own;
                const float *ca = col_amax ? ms_tensor_data(col_amax) : own ? own + R : NULL;
                if (o) {
                    uint8_t *po = ms_tensor_data(o);
                    for (int64_t i = 0; i < R; i++) {
                        const float s = ms_fp8_scale(ra[i], e5, pow2);
                        for (int64_t j = 0; j < C; j++) po[i * C + j] = ms_fp8_from_f32(p[i * C + j] * s, e5, 1);
                        if (ir) ((float *)ms_tensor_data(ir))[i] = 1.0f / s;
                    }
                }
                if (ot) {
                    uint8_t *pt = ms_tensor_data(ot);
                    for (int64_t j = 0; j < C; j++) {
                        const float s = ms_fp8_scale(ca[j], e5, pow2);
                        for (int64_t i = 0; i < R; i++) pt[j * R + i] = ms_fp8_from_f32(p[i * C + j] * s, e5, 1);
                        if (ic) ((float *)ms_tensor_data(ic))[j] = 1.0f / s;
                    }
                }
            }
            free(own);
            ms_tensor_free(f);
        }
        ms_tensor_free(c);
    }
    if (rc) {
        finish(out, a_out, rc);
        finish(out_t, a_t, rc);
        finish(inv_rows, a_ir, rc);
        finish(inv_cols, a_ic, rc);
    }
    return rc;
}

/* --------------------------------------------------------- transpose */

int ms_float8_transpose(ms_tensor **out, const ms_tensor *x) {
    char d[DESC];
    const char *op = "float8_transpose";
    if (ms_tensor_check_live(x, op)) return -1;
    if (!ms_is_float8(x->dtype_id) || x->ndim != 2)
        return ms_errorf("%s: x must be a 2-D f8e4m3 or f8e5m2 tensor, got %s", op, ms_desc(x, d, sizeof d));
#ifndef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    const int64_t R = x->sizes[0], C = x->sizes[1], shape_t[2] = {C, R};
    int allocated = 0;
    if (cast_slot(op, out, "out", 2, shape_t, x->dtype_id, x->device_id, &allocated)) return finish(out, allocated, -1);
    ms_tensor *c = NULL;
    int rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
    if (!rc && x->device_id >= 0) {
        rc = ms_cuda_transpose8(*out, c);
    } else
#endif
    if (!rc) {
        const uint8_t *p = ms_tensor_data(c);
        uint8_t *o = ms_tensor_data(*out);
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < C; j++) o[j * R + i] = p[i * C + j];
    }
    ms_tensor_free(c);
    return finish(out, allocated, rc);
}

/* ------------------------------------------------------------- the GEMM */

/* an FP8 GEMM operand: 2-D, 8-bit float, rows contiguous (K the unit-stride dim) */
static int check_operand(const char *op, const char *what, const ms_tensor *t) {
    char d[DESC];
    if (ms_tensor_check_live(t, op)) return -1;
    if (!ms_is_float8(t->dtype_id) || t->ndim != 2)
        return ms_errorf("%s: %s must be a 2-D f8e4m3 or f8e5m2 tensor, got %s", op, what, ms_desc(t, d, sizeof d));
    const int64_t r = t->sizes[0], k = t->sizes[1];
    if (!((k <= 1 || t->strides[1] == 1) && (r <= 1 || t->strides[0] >= k)))
        return ms_errorf("%s: %s %s must have contiguous rows (its last dim of unit stride: pass the transposed "
                         "copy float8_cast makes, not a transposed view)", op, what, ms_desc(t, d, sizeof d));
    return 0;
}

/* the dequantisation factors: both one f32 element (tensorwise: 0), or ainv
 * (M) and binv (N) f32 vectors (axiswise, cuBLASLt's outer-vector scaling:
 * 1); -1 on an error */
static int check_scales(const char *op, const ms_tensor *ainv, const ms_tensor *binv, int64_t M, int64_t N, int dev) {
    char x[DESC], y[DESC], dv[32];
    if (!ainv || !binv) return ms_errorf("%s: %s is missing", op, ainv ? "binv" : "ainv");
    if (ms_tensor_check_live(ainv, op) || ms_tensor_check_live(binv, op)) return -1;
    const int sa = ainv->ndim <= 1 && ms_tensor_numel(ainv) == 1, sb = binv->ndim <= 1 && ms_tensor_numel(binv) == 1;
    const int va = ainv->ndim == 1 && ainv->sizes[0] == M, vb = binv->ndim == 1 && binv->sizes[0] == N;
    int bad = ainv->dtype_id != MS_F32 || binv->dtype_id != MS_F32 || ainv->device_id != dev ||
              binv->device_id != dev;
    if (!bad && ainv->ndim == 1 && !ms_tensor_is_contiguous(ainv)) bad = 1;
    if (!bad && binv->ndim == 1 && !ms_tensor_is_contiguous(binv)) bad = 1;
    if (!bad && sa && sb) return 0;
    if (!bad && va && vb) return 1;
    return ms_errorf("%s: ainv and binv must both be one f32 element (tensorwise) or contiguous f32 vectors of (%lld) "
                     "and (%lld) (axiswise: a's rows, b's rows), on %s; got %s and %s",
                     op, (long long)M, (long long)N, ms_device_str(dev, dv, sizeof dv), ms_desc(ainv, x, sizeof x),
                     ms_desc(binv, y, sizeof y));
}

/* the operands of a scaled product a @ b^T: 2-D 8-bit floats (check_operand)
 * on one device, sharing K */
static int check_pair(const char *op, const ms_tensor *a, const ms_tensor *b) {
    char x[DESC], y[DESC];
    if (check_operand(op, "a", a) || check_operand(op, "b", b)) return -1;
    if (a->device_id != b->device_id)
        return ms_errorf("%s: a and b on different devices: %s and %s", op, ms_desc(a, x, sizeof x),
                         ms_desc(b, y, sizeof y));
    if (a->sizes[1] != b->sizes[1])
        return ms_errorf("%s: a %s and b %s must share their last dim K (out = a @ b^T)", op, ms_desc(a, x, sizeof x),
                         ms_desc(b, y, sizeof y));
    return 0;
}

/* a scaled product's output (M, N) of out_dtype on dev, its bias and beta
 * checked, *out allocated when not given: -1 on an error (an output it
 * allocated freed), 1 when there is nothing to compute (M or N is 0), 0 to
 * go on */
static int scaled_out(const char *op, ms_tensor **out, int out_dtype, const ms_tensor *bias, double beta, int64_t M,
                      int64_t N, int dev) {
    char x[DESC];
    if (out_dtype != MS_F32 && out_dtype != MS_BF16 && out_dtype != MS_F16)
        return ms_errorf("%s: the output dtype must be f32, bf16 or f16, got %s", op, ms_dtype_name(out_dtype));
    if (bias) {
        if (ms_tensor_check_live(bias, op)) return -1;
        if (bias->ndim != 1 || bias->sizes[0] != N || bias->dtype_id != out_dtype || bias->device_id != dev)
            return ms_errorf("%s: bias must be (%lld) %s on the operands' device, got %s", op, (long long)N,
                             ms_dtype_name(out_dtype), ms_desc(bias, x, sizeof x));
    }
    if (beta != 0 && !(out && *out))
        return ms_errorf("%s: beta = %g adds to the output, so the output must be given", op, beta);
    const int64_t shape[2] = {M, N};
    int allocated = out && !*out;
    if (ms_prepare_out(out, op, 2, shape, out_dtype, dev)) return -1;
    if (!ms_tensor_is_contiguous(*out))
        return finish(out, allocated, ms_errorf("%s: out %s must be contiguous", op, ms_desc(*out, x, sizeof x)));
    return M == 0 || N == 0 ? 1 : 0;
}

int ms_scaled_matmul(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                     const ms_tensor *binv, const ms_tensor *bias, int out_dtype, double beta, int fast_accum) {
    const char *op = "scaled_matmul";
    if (check_pair(op, a, b)) return -1;
    if (a->dtype_id == MS_F8E5M2 && b->dtype_id == MS_F8E5M2)
        return ms_errorf("%s: a and b are both f8e5m2; one of them must be f8e4m3", op);
    const int dev = a->device_id;
    const int64_t M = a->sizes[0], N = b->sizes[0], K = a->sizes[1];
    const int vec = check_scales(op, ainv, binv, M, N, dev);
    if (vec < 0) return -1;
    if (out && *out) out_dtype = (*out)->dtype_id;
    int allocated = out && !*out;
    int st = scaled_out(op, out, out_dtype, bias, beta, M, N, dev);
    if (st) return st < 0 ? -1 : 0;
    if (dev >= 0) {
#ifdef MS_WITH_CUDA
        return finish(out, allocated, ms_cuda_scaled_gemm(*out, a, b, ainv, binv, vec, bias, beta, fast_accum));
#else
        return finish(out, allocated, ms_errorf("%s: cuda tensors need a build with CUDA", op));
#endif
    }
    /* the CPU: widen both (exact), one f32 product, then scale, bias, beta
     * in f64 and one rounding into out's dtype */
    ms_tensor *af = NULL, *bf = NULL, *bt = NULL, *prod = NULL, *bc = NULL;
    int rc = ms_tensor_to(&af, a, MS_F32, -1);
    if (!rc) rc = ms_tensor_to(&bf, b, MS_F32, -1);
    if (!rc) rc = ms_tensor_transpose(&bt, bf, 0, 1);
    if (!rc && K > 0) rc = ms_matmul(&prod, af, bt, 0, 0);
    if (!rc && bias) rc = ms_tensor_contiguous(&bc, bias);
    if (!rc) {
        const float *ia = ms_tensor_data(ainv), *ib = ms_tensor_data(binv);
        const float *pp = prod ? ms_tensor_data(prod) : NULL;
        char *po = ms_tensor_data(*out);
        const char *pb = bc ? ms_tensor_data(bc) : NULL;
        const int es = ms_dtype_size(out_dtype);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                char *q = po + (i * N + j) * es;
                const double s = (double)ia[vec ? i : 0] * (double)ib[vec ? j : 0];
                double v = (pp ? (double)pp[i * N + j] : 0.0) * s;
                if (pb) v += ms_load(pb + j * es, out_dtype);
                if (beta != 0) v += beta * ms_load(q, out_dtype);
                ms_store(q, out_dtype, v);
            }
    }
    ms_tensor_free(af);
    ms_tensor_free(bf);
    ms_tensor_free(bt);
    ms_tensor_free(prod);
    ms_tensor_free(bc);
    return finish(out, allocated, rc);
}

/* ------------------------------------------------------------ blockwise */

static int64_t cdiv128(int64_t n) { return (n + 127) / 128; }
static int64_t pad4(int64_t n) { return (n + 3) / 4 * 4; }

/* the inverse scales' shape for an operand (R, K) with blocks along K:
 * 1x128 (ceil(K/128), R), 128x128 (ceil(R/128), ceil(K/128) padded to 4) */
static void blk_scale_shape(int blocks, int64_t R, int64_t K, int64_t shape[2]) {
    if (blocks == MS_FLOAT8_1X128) {
        shape[0] = cdiv128(K);
        shape[1] = R;
    } else {
        shape[0] = cdiv128(R);
        shape[1] = pad4(cdiv128(K));
    }
}

static const char *blk_name(int blocks) { return blocks == MS_FLOAT8_1X128 ? "1x128" : "128x128"; }

static int check_blocks(const char *op, const char *what, int blocks) {
    if (blocks != MS_FLOAT8_1X128 && blocks != MS_FLOAT8_128X128)
        return ms_errorf("%s: %s must be MS_FLOAT8_1X128 (1) or MS_FLOAT8_128X128 (2), got %d", op, what, blocks);
    return 0;
}

/* NaN-winning max of |v| into *m */
static void amax_in(float *m, float v) {
    float a = fabsf(v);
    if (*m == *m && (a != a || a > *m)) *m = a;
}

int ms_float8_cast_blockwise(ms_tensor **out, ms_tensor **out_t, ms_tensor **inv, ms_tensor **inv_t,
                             const ms_tensor *x, int blocks, int dtype, int pow2) {
    const char *op = "float8_cast_blockwise";
    if (check_cast(op, x, dtype) || check_blocks(op, "blocks", blocks)) return -1;
    if (inv && !out) return ms_errorf("%s: inv is the scale of out: ask for out too", op);
    if (inv_t && !out_t) return ms_errorf("%s: inv_t is the scale of out_t: ask for out_t too", op);
    const int64_t R = x->sizes[0], C = x->sizes[1];
    const int64_t shape[2] = {R, C}, shape_t[2] = {C, R};
    int64_t sh_inv[2], sh_inv_t[2];
    blk_scale_shape(blocks, R, C, sh_inv);
    blk_scale_shape(blocks, C, R, sh_inv_t);
    int a_out = 0, a_t = 0, a_i = 0, a_it = 0, rc;
    rc = cast_slot(op, out, "out", 2, shape, dtype, x->device_id, &a_out);
    if (!rc) rc = cast_slot(op, out_t, "out_t", 2, shape_t, dtype, x->device_id, &a_t);
    if (!rc) rc = cast_slot(op, inv, "inv", 2, sh_inv, MS_F32, x->device_id, &a_i);
    if (!rc) rc = cast_slot(op, inv_t, "inv_t", 2, sh_inv_t, MS_F32, x->device_id, &a_it);
    if (!rc) {
        ms_tensor *o = out ? *out : NULL, *ot = out_t ? *out_t : NULL;
        ms_tensor *iv = inv ? *inv : NULL, *ivt = inv_t ? *inv_t : NULL;
        ms_tensor *c = NULL;
        rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
        if (!rc && x->device_id >= 0) {
            rc = ms_cuda_float8_cast_blockwise(o, ot, iv, ivt, c, blocks, dtype, pow2);
        } else
#endif
        if (!rc) {
            const int e5 = is_e5m2(dtype);
            ms_tensor *f = NULL;
            rc = f32_contig(&f, c);
            if (!rc) {
                const float *p = ms_tensor_data(f);
                uint8_t *po = o ? ms_tensor_data(o) : NULL, *pt = ot ? ms_tensor_data(ot) : NULL;
                float *si = iv ? ms_tensor_data(iv) : NULL, *st = ivt ? ms_tensor_data(ivt) : NULL;
                if (si) memset(si, 0, sizeof(float) * (size_t)(sh_inv[0] * sh_inv[1]));
                if (st) memset(st, 0, sizeof(float) * (size_t)(sh_inv_t[0] * sh_inv_t[1]));
                if (blocks == MS_FLOAT8_1X128) {
                    /* out: row i, columns [128 kb, ...) */
                    if (po)
                        for (int64_t i = 0; i < R; i++)
                            for (int64_t j0 = 0; j0 < C; j0 += 128) {
                                const int64_t j1 = j0 + 128 < C ? j0 + 128 : C;
                                float m = 0.0f;
                                for (int64_t j = j0; j < j1; j++) amax_in(&m, p[i * C + j]);
                                const float s = ms_fp8_scale(m, e5, pow2);
                                for (int64_t j = j0; j < j1; j++) po[i * C + j] = ms_fp8_from_f32(p[i * C + j] * s, e5, 1);
                                if (si) si[(j0 / 128) * R + i] = 1.0f / s;
                            }
                    /* out_t: x's column j, rows [128 rb, ...) */
                    if (pt)
                        for (int64_t j = 0; j < C; j++)
                            for (int64_t i0 = 0; i0 < R; i0 += 128) {
                                const int64_t i1 = i0 + 128 < R ? i0 + 128 : R;
                                float m = 0.0f;
                                for (int64_t i = i0; i < i1; i++) amax_in(&m, p[i * C + j]);
                                const float s = ms_fp8_scale(m, e5, pow2);
                                for (int64_t i = i0; i < i1; i++) pt[j * R + i] = ms_fp8_from_f32(p[i * C + j] * s, e5, 1);
                                if (st) st[(i0 / 128) * C + j] = 1.0f / s;
                            }
                } else {
                    const int64_t ld = pad4(cdiv128(C)), ld_t = pad4(cdiv128(R));
                    for (int64_t i0 = 0; i0 < R; i0 += 128)
                        for (int64_t j0 = 0; j0 < C; j0 += 128) {
                            const int64_t i1 = i0 + 128 < R ? i0 + 128 : R, j1 = j0 + 128 < C ? j0 + 128 : C;
                            float m = 0.0f;
                            for (int64_t i = i0; i < i1; i++)
                                for (int64_t j = j0; j < j1; j++) amax_in(&m, p[i * C + j]);
                            const float s = ms_fp8_scale(m, e5, pow2);
                            for (int64_t i = i0; i < i1; i++)
                                for (int64_t j = j0; j < j1; j++) {
                                    const uint8_t v = ms_fp8_from_f32(p[i * C + j] * s, e5, 1);
                                    if (po) po[i * C + j] = v;
                                    if (pt) pt[j * R + i] = v;
                                }
                            if (si) si[(i0 / 128) * ld + j0 / 128] = 1.0f / s;
                            if (st) st[(j0 / 128) * ld_t + i0 / 128] = 1.0f / s;
                        }
                }
            }
            ms_tensor_free(f);
        }
        ms_tensor_free(c);
    }
    if (rc) {
        finish(out, a_out, rc);
        finish(out_t, a_t, rc);
        finish(inv, a_i, rc);
        finish(inv_t, a_it, rc);
    }
    return rc;
}

/* a blockwise operand's inverse scales: f32, contiguous, on dev, of the
 * shape blk_scale_shape gives for the operand (R, K) */
static int check_blk_scales(const char *op, const char *what, const ms_tensor *s, int blocks, int64_t R, int64_t K,
                            int dev) {
    char d[DESC], dv[32];
    int64_t want[2];
    if (!s) return ms_errorf("%s: %s is missing", op, what);
    if (ms_tensor_check_live(s, op)) return -1;
    blk_scale_shape(blocks, R, K, want);
    if (s->dtype_id != MS_F32 || s->ndim != 2 || s->sizes[0] != want[0] || s->sizes[1] != want[1] ||
        s->device_id != dev || !ms_tensor_is_contiguous(s))
        return ms_errorf("%s: %s (%s scales of a (%lld, %lld) operand) must be a contiguous f32 (%lld, %lld) on %s "
                         "(float8_cast_blockwise's layout), got %s", op, what, blk_name(blocks), (long long)R,
                         (long long)K, (long long)want[0], (long long)want[1], ms_device_str(dev, dv, sizeof dv),
                         ms_desc(s, d, sizeof d));
    return 0;
}

/* the value of operand t (R, K) element (i, k), dequantised in f64 */
static double blk_dequant(const uint8_t *q, const float *s, int blocks, int e5, int64_t R, int64_t K, int64_t ld,
                          int64_t i, int64_t k) {
    const float inv = blocks == MS_FLOAT8_1X128 ? s[(k / 128) * R + i] : s[(i / 128) * pad4(cdiv128(K)) + k / 128];
    return (double)ms_fp8_to_f32(q[i * ld + k], e5) * (double)inv;
}

int ms_scaled_matmul_blockwise(ms_tensor **out, const ms_tensor *a, const ms_tensor *b, const ms_tensor *ainv,
                               int a_blocks, const ms_tensor *binv, int b_blocks, const ms_tensor *bias,
                               int out_dtype, double beta) {
    char x[DESC], y[DESC];
    const char *op = "scaled_matmul_blockwise";
    if (check_pair(op, a, b)) return -1;
    if (check_blocks(op, "a_blocks", a_blocks) || check_blocks(op, "b_blocks", b_blocks)) return -1;
    if (a->dtype_id != MS_F8E4M3 || b->dtype_id != MS_F8E4M3)
        return ms_errorf("%s: blockwise products take f8e4m3 operands (DeepSeek-V3's recipe, cuBLASLt's block "
                         "scaling), got a %s and b %s", op, ms_desc(a, x, sizeof x), ms_desc(b, y, sizeof y));
    const int dev = a->device_id;
    const int64_t M = a->sizes[0], N = b->sizes[0], K = a->sizes[1];
    if (a_blocks == MS_FLOAT8_128X128 && b_blocks == MS_FLOAT8_128X128)
        return ms_errorf("%s: a (%lld, %lld) and b (%lld, %lld) both with 128x128 blocks: cuBLASLt (Hopper) takes "
                         "1x128 x 1x128, 1x128 x 128x128 and 128x128 x 1x128 only", op, (long long)M, (long long)K,
                         (long long)N, (long long)K);
    if (check_blk_scales(op, "ainv", ainv, a_blocks, M, K, dev) ||
        check_blk_scales(op, "binv", binv, b_blocks, N, K, dev))
        return -1;
    if (out && *out) out_dtype = (*out)->dtype_id;
    int allocated = out && !*out;
    int st = scaled_out(op, out, out_dtype, bias, beta, M, N, dev);
    if (st) return st < 0 ? -1 : 0;
    if (dev >= 0) {
#ifdef MS_WITH_CUDA
        return finish(out, allocated,
                      ms_cuda_scaled_gemm_blockwise(*out, a, b, ainv, a_blocks, binv, b_blocks, bias, beta));
#else
        return finish(out, allocated, ms_errorf("%s: cuda tensors need a build with CUDA", op));
#endif
    }
    /* the CPU: both operands dequantised in f64 (each value exact: an 8-bit
     * float times an f32), one f64 product, then bias and beta in f64 and one
     * rounding into out's dtype */
    ms_tensor *af = NULL, *bf = NULL, *bt = NULL, *prod = NULL, *bc = NULL;
    const int64_t sa[2] = {M, K}, sb[2] = {N, K};
    int rc = ms_tensor_empty(&af, 2, sa, MS_F64, -1);
    if (!rc) rc = ms_tensor_empty(&bf, 2, sb, MS_F64, -1);
    if (!rc) {
        const uint8_t *qa = ms_tensor_data(a), *qb = ms_tensor_data(b);
        const int64_t lda = M > 1 ? a->strides[0] : K, ldb = N > 1 ? b->strides[0] : K;
        double *pa = ms_tensor_data(af), *pb = ms_tensor_data(bf);
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++)
                pa[i * K + k] = blk_dequant(qa, ms_tensor_data(ainv), a_blocks, 0, M, K, lda, i, k);
        for (int64_t j = 0; j < N; j++)
            for (int64_t k = 0; k < K; k++)
                pb[j * K + k] = blk_dequant(qb, ms_tensor_data(binv), b_blocks, 0, N, K, ldb, j, k);
    }
    if (!rc) rc = ms_tensor_transpose(&bt, bf, 0, 1);
    if (!rc && K > 0) rc = ms_matmul(&prod, af, bt, 0, 0);
    if (!rc && bias) rc = ms_tensor_contiguous(&bc, bias);
    if (!rc) {
        const double *pp = prod ? ms_tensor_data(prod) : NULL;
        char *po = ms_tensor_data(*out);
        const char *pb = bc ? ms_tensor_data(bc) : NULL;
        const int es = ms_dtype_size(out_dtype);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                char *q = po + (i * N + j) * es;
                double v = pp ? pp[i * N + j] : 0.0;
                if (pb) v += ms_load(pb + j * es, out_dtype);
                if (beta != 0) v += beta * ms_load(q, out_dtype);
                ms_store(q, out_dtype, v);
            }
    }
    ms_tensor_free(af);
    ms_tensor_free(bf);
    ms_tensor_free(bt);
    ms_tensor_free(prod);
    ms_tensor_free(bc);
    return finish(out, allocated, rc);
}

/* ------------------------------------------- blockwise pieces (FSDP) */

/* a piece x (n) of a row-major (R, C) matrix at offset: x a live 1-D float
 * tensor, R, C >= 0, the piece inside the matrix */
static int check_piece(const char *op, const ms_tensor *x, int64_t R, int64_t C, int64_t offset) {
    char d[DESC];
    if (ms_tensor_check_live(x, op)) return -1;
    if (!ms_is_float(x->dtype_id) || x->ndim != 1)
        return ms_errorf("%s: x must be a 1-D float tensor (f64, f32, bf16, f16; a flat piece of the matrix), got %s",
                         op, ms_desc(x, d, sizeof d));
    const int64_t n = x->sizes[0];
    if (R < 0 || C < 0 || offset < 0 || (C > 0 && R > INT64_MAX / C) || offset + n > R * C)
        return ms_errorf("%s: x %s at offset %lld is not inside a (%lld, %lld) matrix", op, ms_desc(x, d, sizeof d),
                         (long long)offset, (long long)R, (long long)C);
#ifndef MS_WITH_CUDA
    if (x->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    return 0;
}

/* a block grid's f32 tensor: contiguous (nbr, nbc) on dev */
static int check_grid(const char *op, const char *what, const ms_tensor *s, int64_t nbr, int64_t nbc, int dev) {
    char d[DESC], dv[32];
    if (!s) return ms_errorf("%s: %s is missing", op, what);
    if (ms_tensor_check_live(s, op)) return -1;
    if (s->dtype_id != MS_F32 || s->ndim != 2 || s->sizes[0] != nbr || s->sizes[1] != nbc || s->device_id != dev ||
        !ms_tensor_is_contiguous(s))
        return ms_errorf("%s: %s must be a contiguous f32 (%lld, %lld) on %s (one a 128 x 128 block), got %s", op, what,
                         (long long)nbr, (long long)nbc, ms_device_str(dev, dv, sizeof dv), ms_desc(s, d, sizeof d));
    return 0;
}

int ms_float8_amax_blockwise_piece(ms_tensor **out, const ms_tensor *x, int64_t R, int64_t C, int64_t offset) {
    const char *op = "float8_amax_blockwise_piece";
    if (check_piece(op, x, R, C, offset)) return -1;
    const int64_t nbr = cdiv128(R), nbc = cdiv128(C), shape[2] = {nbr, nbc};
    int allocated = 0;
    if (cast_slot(op, out, "out", 2, shape, MS_F32, x->device_id, &allocated)) return -1;
    if (!out) return 0;
    ms_tensor *c = NULL;
    int rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
    if (!rc && x->device_id >= 0) {
        rc = ms_cuda_float8_amax_blockwise_piece(*out, c, R, C, offset);
    } else
#endif
    if (!rc) {
        /* in f32 (an f64 x rounded first), as ms_float8_cast_blockwise does */
        ms_tensor *f = NULL;
        rc = f32_contig(&f, c);
        if (!rc) {
            const float *p = ms_tensor_data(f);
            float *m = ms_tensor_data(*out);
            for (int64_t k = 0; k < nbr * nbc; k++) m[k] = 0.0f;
            /* row by row: the piece's part of row e / C from column e % C */
            const int64_t n = x->sizes[0];
            for (int64_t e = offset, i = 0; e < offset + n;) {
                const int64_t row = e / C, c0 = e % C, len = C - c0 < offset + n - e ? C - c0 : offset + n - e;
                float *mr = m + (row / 128) * nbc;
                for (int64_t k = 0; k < len; k++) amax_in(&mr[(c0 + k) / 128], p[i + k]);
                e += len, i += len;
            }
        }
        ms_tensor_free(f);
    }
    ms_tensor_free(c);
    return finish(out, allocated, rc);
}

int ms_float8_scales_blockwise(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t, const ms_tensor *amax,
                               int dtype, int pow2) {
    const char *op = "float8_scales_blockwise";
    char d[DESC];
    if (!amax) return ms_errorf("%s: amax is missing", op);
    if (ms_tensor_check_live(amax, op)) return -1;
    if (amax->dtype_id != MS_F32 || amax->ndim != 2 || !ms_tensor_is_contiguous(amax))
        return ms_errorf("%s: amax must be a contiguous f32 (row blocks, column blocks) grid, got %s", op,
                         ms_desc(amax, d, sizeof d));
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
#ifndef MS_WITH_CUDA
    if (amax->device_id >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    const int64_t nbr = amax->sizes[0], nbc = amax->sizes[1], ld = pad4(nbc), ld_t = pad4(nbr);
    const int64_t sh[2] = {nbr, nbc}, sh_i[2] = {nbr, ld}, sh_t[2] = {nbc, ld_t};
    const int dev = amax->device_id;
    int a_s = 0, a_i = 0, a_t = 0, rc;
    rc = cast_slot(op, scale, "scale", 2, sh, MS_F32, dev, &a_s);
    if (!rc) rc = cast_slot(op, inv, "inv", 2, sh_i, MS_F32, dev, &a_i);
    if (!rc) rc = cast_slot(op, inv_t, "inv_t", 2, sh_t, MS_F32, dev, &a_t);
    if (!rc) {
        ms_tensor *s = scale ? *scale : NULL, *iv = inv ? *inv : NULL, *it = inv_t ? *inv_t : NULL;
#ifdef MS_WITH_CUDA
        if (dev >= 0) {
            rc = ms_cuda_float8_scales_blockwise(s, iv, it, amax, dtype, pow2);
        } else
#endif
        {
            const int e5 = is_e5m2(dtype);
            const float *m = ms_tensor_data(amax);
            float *ps = s ? ms_tensor_data(s) : NULL, *pi = iv ? ms_tensor_data(iv) : NULL;
            float *pt = it ? ms_tensor_data(it) : NULL;
            if (pi) memset(pi, 0, sizeof(float) * (size_t)(nbr * ld));
            if (pt) memset(pt, 0, sizeof(float) * (size_t)(nbc * ld_t));
            for (int64_t rb = 0; rb < nbr; rb++)
                for (int64_t cb = 0; cb < nbc; cb++) {
                    const float sc = ms_fp8_scale(m[rb * nbc + cb], e5, pow2);
                    if (ps) ps[rb * nbc + cb] = sc;
                    if (pi) pi[rb * ld + cb] = 1.0f / sc;
                    if (pt) pt[cb * ld_t + rb] = 1.0f / sc;
                }
        }
    }
    if (rc) {
        finish(scale, a_s, rc);
        finish(inv, a_i, rc);
        finish(inv_t, a_t, rc);
    }
    return rc;
}

int ms_float8_cast_blockwise_piece(ms_tensor **out, const ms_tensor *x, const ms_tensor *scale, int64_t R, int64_t C,
                                   int64_t offset, int dtype) {
    const char *op = "float8_cast_blockwise_piece";
    if (check_piece(op, x, R, C, offset)) return -1;
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
    const int64_t nbr = cdiv128(R), nbc = cdiv128(C), n = x->sizes[0];
    if (check_grid(op, "scale", scale, nbr, nbc, x->device_id)) return -1;
    int allocated = 0;
    if (cast_slot(op, out, "out", 1, &n, dtype, x->device_id, &allocated)) return -1;
    if (!out) return 0;
    ms_tensor *c = NULL;
    int rc = ms_tensor_contiguous(&c, x);
#ifdef MS_WITH_CUDA
    if (!rc && x->device_id >= 0) {
        rc = ms_cuda_float8_cast_blockwise_piece(*out, c, scale, R, C, offset, dtype);
    } else
#endif
    if (!rc) {
        ms_tensor *f = NULL;
        rc = f32_contig(&f, c);
        if (!rc) {
            const int e5 = is_e5m2(dtype);
            const float *p = ms_tensor_data(f), *s = ms_tensor_data(scale);
            uint8_t *po = ms_tensor_data(*out);
            for (int64_t e = offset, i = 0; e < offset + n;) {
                const int64_t row = e / C, c0 = e % C, len = C - c0 < offset + n - e ? C - c0 : offset + n - e;
                const float *sr = s + (row / 128) * nbc;
                for (int64_t k = 0; k < len; k++) po[i + k] = ms_fp8_from_f32(p[i + k] * sr[(c0 + k) / 128], e5, 1);
                e += len, i += len;
            }
        }
        ms_tensor_free(f);
    }
    ms_tensor_free(c);
    return finish(out, allocated, rc);
}

/* ------------------------------------- many blockwise pieces (FSDP) */

#include "f8many.h"

/* a byte range a many-op writes or reads, for the overlap check */
typedef struct {
    const char *lo, *hi;
    const char *what;
    int i;
} f8_span;

static void span_add(f8_span *s, int *k, const ms_tensor *t, const char *what, int i) {
    if (!t || ms_tensor_numel(t) == 0) return;
    s[*k].lo = (const char *)ms_tensor_data(t);
    s[*k].hi = s[*k].lo + ms_tensor_numel(t) * ms_dtype_size(t->dtype_id);
    s[*k].what = what;
    s[*k].i = i;
    (*k)++;
}

/* the first nw spans (written) overlap neither one another nor the rest
 * (read) */
static int check_spans(const char *op, const f8_span *s, int nw, int n) {
    for (int a = 0; a < nw; a++)
        for (int b = a + 1; b < n; b++)
            if (s[a].lo < s[b].hi && s[b].lo < s[a].hi)
                return ms_errorf("%s: %s[%d] overlaps %s[%d] (the tensors a many-op writes must not overlap one "
                                 "another nor what it reads)", op, s[a].what, s[a].i + 1, s[b].what, s[b].i + 1);
    return 0;
}

/* the device of the first tensor given among lists a, b (n entries each,
 * either list or entry NULL); -1 when there is none */
static int many_device(ms_tensor **a, ms_tensor **b, int n) {
    for (int i = 0; i < n; i++) {
        if (a && a[i]) return a[i]->device_id;
        if (b && b[i]) return b[i]->device_id;
    }
    return -1;
}

/* piece i of a many-op: inside its matrix, x[i] (NULL: empty) a contiguous
 * 1-D float tensor on dev; geom given when n > 0 */
static int check_many_pieces(const char *op, ms_tensor **x, const int64_t *geom, int n, int dev) {
    char name[96], d[DESC], dv[32];
    if (n < 0) return ms_errorf("%s: %d pieces", op, n);
    if (n > 0 && !geom) return ms_errorf("%s: geom (each piece's R, C, offset) is missing", op);
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (piece %d)", op, i + 1);
        const int64_t R = geom[3 * i], C = geom[3 * i + 1], off = geom[3 * i + 2];
        const ms_tensor *xi = x ? x[i] : NULL;
        if (xi) {
            if (check_piece(name, xi, R, C, off)) return -1;
            if (!ms_tensor_is_contiguous(xi) || xi->device_id != dev)
                return ms_errorf("%s: x must be contiguous and on %s, got %s", name, ms_device_str(dev, dv, sizeof dv),
                                 ms_desc(xi, d, sizeof d));
        } else if (R < 0 || C < 0 || off < 0 || (C > 0 && R > INT64_MAX / C) || off > R * C) {
            return ms_errorf("%s: an empty piece at offset %lld is not inside a (%lld, %lld) matrix", name,
                             (long long)off, (long long)R, (long long)C);
        }
    }
    return 0;
}

static int64_t piece_n(ms_tensor **x, int i) { return x && x[i] ? x[i]->sizes[0] : 0; }

/* f[i] = x[i] as contiguous f32 (CPU; NULL for an empty piece) */
static int many_f32(ms_tensor **f, ms_tensor **x, int n) {
    for (int i = 0; i < n; i++)
        if (piece_n(x, i) > 0 && f32_contig(&f[i], x[i])) return -1;
    return 0;
}

static void many_free(ms_tensor **f, int n) {
    if (!f) return;
    for (int i = 0; i < n; i++) ms_tensor_free(f[i]);
    free(f);
}

/* the work items of the pieces in turn (core/f8many.h): first[0..n], g0[i] */
static void many_items(ms_tensor **x, const int64_t *geom, int n, int64_t *first, int64_t *g0) {
    first[0] = 0;
    for (int i = 0; i < n; i++)
        first[i + 1] = first[i] + ms_f8p_items(piece_n(x, i), geom[3 * i + 1], geom[3 * i + 2], &g0[i]);
}

/* the CPU's walk of item w, as a warp of blk_piece_many_kernel walks it:
 * its 16 rows, and in each lane l's columns l, l + 32, l + 64, l + 96 of the
 * block; amax: folded into the block's maximum (m), else cast with the
 * block's scale (sc) into po */
static void item_walk(const float *p, int64_t n, int64_t C, int64_t offset, int64_t g0, int64_t item, float *m,
                      float sc, uint8_t *po, int e5) {
    const int64_t nbc = cdiv128(C), rg = g0 + item / nbc, cb = item % nbc, end = offset + n;
    for (int rr = 0; rr < MS_F8P_ROWS; rr++) {
        const int64_t re = (rg * MS_F8P_ROWS + rr) * C;   /* the row's first element */
        if (re >= end) break;
        if (re + C <= offset) continue;
        for (int t = 0; t < 4; t++)
            for (int lane = 0; lane < 32; lane++) {
                const int64_t j = cb * MS_F8P_BLK + lane + 32 * t, e = re + j;
                if (j < C && e >= offset && e < end) {
                    if (m) amax_in(m, p[e - offset]);
                    else po[e - offset] = ms_fp8_from_f32(p[e - offset] * sc, e5, 1);
                }
            }
    }
}

/* the block (rg, cb)'s entry in a (nbr, nbc) grid, rg a 16-row group */
static int64_t item_block(int64_t C, int64_t g0, int64_t item) {
    const int64_t nbc = cdiv128(C), rg = g0 + item / nbc, cb = item % nbc;
    return (rg * MS_F8P_ROWS / MS_F8P_BLK) * nbc + cb;
}

// the CPU walk of the many-piece ops, work item by work item as the
// kernels number them (core/f8many.h): with amax, each item's block
// maximum into its grid (zeroed by the caller); else each item cast with
// its block's scale into out
static int many_walk(const char *op, ms_tensor **x, const int64_t *geom, int n, ms_tensor **amax,
                     ms_tensor **scale, ms_tensor **out, int e5m2) {
    ms_tensor **f = calloc((size_t)n, sizeof *f);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(2 * n + 1));
    if (!f || !first) {
        free(f);
        free(first);
        return ms_errorf("%s: out of host memory", op);
    }
    int64_t *g0 = first + n + 1;
    int rc = many_f32(f, x, n);
    if (!rc) {
        many_items(x, geom, n, first, g0);
        for (int64_t w = 0; w < first[n]; w++) {
            const int i = ms_f8p_find(first, n, w);
            const int64_t C = geom[3 * i + 1], item = w - first[i], blk = item_block(C, g0[i], item);
            if (amax)
                item_walk(ms_tensor_data(f[i]), piece_n(x, i), C, geom[3 * i + 2], g0[i], item,
                          (float *)ms_tensor_data(amax[i]) + blk, 0.0f, NULL, 0);
            else
                item_walk(ms_tensor_data(f[i]), piece_n(x, i), C, geom[3 * i + 2], g0[i], item, NULL,
                          ((const float *)ms_tensor_data(scale[i]))[blk], ms_tensor_data(out[i]), e5m2);
        }
    }
    many_free(f, n);
    free(first);
    return rc;
}

int ms_float8_amax_blockwise_many(ms_tensor **amax, ms_tensor **x, const int64_t *geom, int n) {
    const char *op = "float8_amax_blockwise_many";
    char name[96];
    if (n > 0 && !amax) return ms_errorf("%s: amax (a grid a piece) is missing", op);
    const int dev = many_device(amax, x, n);
    if (check_many_pieces(op, x, geom, n, dev)) return -1;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (piece %d)", op, i + 1);
        if (check_grid(name, "amax", amax[i], cdiv128(geom[3 * i]), cdiv128(geom[3 * i + 1]), dev)) return -1;
    }
    f8_span *sp = n > 0 ? malloc(sizeof(f8_span) * 2 * (size_t)n) : NULL;
    if (n > 0 && !sp) return ms_errorf("%s: out of host memory", op);
    int ns = 0;
    for (int i = 0; i < n; i++) span_add(sp, &ns, amax[i], "amax", i);
    const int nw = ns;
    for (int i = 0; i < n; i++) span_add(sp, &ns, x ? x[i] : NULL, "x", i);
    int rc = check_spans(op, sp, nw, ns);
    free(sp);
    if (rc || n == 0) return rc;
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_float8_amax_blockwise_many(amax, x, geom, n, dev);
#endif
    for (int i = 0; i < n; i++) memset(ms_tensor_data(amax[i]), 0, sizeof(float) * (size_t)ms_tensor_numel(amax[i]));
    return many_walk(op, x, geom, n, amax, NULL, NULL, 0);
}

int ms_float8_cast_blockwise_many(ms_tensor **out, ms_tensor **x, ms_tensor **scale, const int64_t *geom, int n,
                                  int dtype) {
    const char *op = "float8_cast_blockwise_many";
    char name[96], d[DESC], dv[32];
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
    const int dev = many_device(x, out, n);
    if (check_many_pieces(op, x, geom, n, dev)) return -1;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (piece %d)", op, i + 1);
        const int64_t m = piece_n(x, i);
        ms_tensor *o = out ? out[i] : NULL;
        if (m == 0) {
            if (o && (ms_tensor_check_live(o, name) || ms_tensor_numel(o) != 0))
                return ms_errorf("%s: an empty piece's out must be NULL or empty, got %s", name, ms_desc(o, d, sizeof d));
            continue;
        }
        if (check_grid(name, "scale", scale ? scale[i] : NULL, cdiv128(geom[3 * i]), cdiv128(geom[3 * i + 1]), dev))
            return -1;
        if (!o) return ms_errorf("%s: out is missing", name);
        if (ms_tensor_check_live(o, name)) return -1;
        if (o->dtype_id != dtype || o->ndim != 1 || o->sizes[0] != m || o->device_id != dev ||
            !ms_tensor_is_contiguous(o))
            return ms_errorf("%s: out must be a contiguous %s (%lld) on %s (the piece's elements), got %s", name,
                             ms_dtype_name(dtype), (long long)m, ms_device_str(dev, dv, sizeof dv),
                             ms_desc(o, d, sizeof d));
    }
    f8_span *sp = n > 0 ? malloc(sizeof(f8_span) * 3 * (size_t)n) : NULL;
    if (n > 0 && !sp) return ms_errorf("%s: out of host memory", op);
    int ns = 0;
    for (int i = 0; i < n; i++) span_add(sp, &ns, piece_n(x, i) > 0 ? out[i] : NULL, "out", i);
    const int nw = ns;
    for (int i = 0; i < n; i++) {
        span_add(sp, &ns, x ? x[i] : NULL, "x", i);
        span_add(sp, &ns, piece_n(x, i) > 0 ? scale[i] : NULL, "scale", i);
    }
    int rc = check_spans(op, sp, nw, ns);
    free(sp);
    if (rc || n == 0) return rc;
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_float8_cast_blockwise_many(out, x, scale, geom, n, dtype, dev);
#endif
    return many_walk(op, x, geom, n, NULL, scale, out, is_e5m2(dtype));
}

int ms_float8_scales_blockwise_many(ms_tensor **scale, ms_tensor **inv, ms_tensor **inv_t, ms_tensor **amax,
                                    const int *pow2, int n, int dtype) {
    const char *op = "float8_scales_blockwise_many";
    char name[96], d[DESC];
    if (n < 0) return ms_errorf("%s: %d grids", op, n);
    if (n > 0 && !amax) return ms_errorf("%s: amax (a grid a weight) is missing", op);
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
    const int dev = many_device(amax, NULL, n);
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (grid %d)", op, i + 1);
        const ms_tensor *a = amax[i];
        if (!a) return ms_errorf("%s: amax is missing", name);
        if (ms_tensor_check_live(a, name)) return -1;
        if (a->dtype_id != MS_F32 || a->ndim != 2 || !ms_tensor_is_contiguous(a) || a->device_id != dev)
            return ms_errorf("%s: amax must be a contiguous f32 (row blocks, column blocks) grid on the first's "
                             "device, got %s", name, ms_desc(a, d, sizeof d));
        const int64_t nbr = a->sizes[0], nbc = a->sizes[1];
        if ((scale && scale[i] && check_grid(name, "scale", scale[i], nbr, nbc, dev)) ||
            (inv && inv[i] && check_grid(name, "inv", inv[i], nbr, pad4(nbc), dev)) ||
            (inv_t && inv_t[i] && check_grid(name, "inv_t", inv_t[i], nbc, pad4(nbr), dev)))
            return -1;
    }
#ifndef MS_WITH_CUDA
    if (dev >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    f8_span *sp = n > 0 ? malloc(sizeof(f8_span) * 4 * (size_t)n) : NULL;
    if (n > 0 && !sp) return ms_errorf("%s: out of host memory", op);
    int ns = 0;
    for (int i = 0; i < n; i++) {
        span_add(sp, &ns, scale ? scale[i] : NULL, "scale", i);
        span_add(sp, &ns, inv ? inv[i] : NULL, "inv", i);
        span_add(sp, &ns, inv_t ? inv_t[i] : NULL, "inv_t", i);
    }
    const int nw = ns;
    for (int i = 0; i < n; i++) span_add(sp, &ns, amax[i], "amax", i);
    int rc = check_spans(op, sp, nw, ns);
    free(sp);
    if (rc || n == 0) return rc;
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_float8_scales_blockwise_many(scale, inv, inv_t, amax, pow2, n, dtype, dev);
#endif
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!first) return ms_errorf("%s: out of host memory", op);
    first[0] = 0;
    for (int i = 0; i < n; i++) first[i + 1] = first[i] + ms_f8p_slots(amax[i]->sizes[0], amax[i]->sizes[1]);
    for (int64_t s = 0; s < first[n]; s++) {
        const int i = ms_f8p_find(first, n, s);
        ms_f8p_scales_slot(ms_tensor_data(amax[i]), scale && scale[i] ? ms_tensor_data(scale[i]) : NULL,
                    inv && inv[i] ? ms_tensor_data(inv[i]) : NULL, inv_t && inv_t[i] ? ms_tensor_data(inv_t[i]) : NULL,
                    amax[i]->sizes[0], amax[i]->sizes[1], s - first[i], is_e5m2(dtype), pow2 ? pow2[i] : 0);
    }
    free(first);
    return 0;
}

/* ------------------------------------ many tensorwise pieces (FSDP) */

/* piece i of a tensorwise many-op: x[i] NULL (no element here) or a live
 * contiguous 1-D float tensor on dev; amax[i] one f32 element on dev */
static int check_tw_pieces(const char *op, ms_tensor **x, ms_tensor **amax, int n, int dev) {
    char name[96], d[DESC], dv[32];
    if (n < 0) return ms_errorf("%s: %d pieces", op, n);
    if (n > 0 && !amax) return ms_errorf("%s: amax (one f32 element a piece) is missing", op);
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (piece %d)", op, i + 1);
        if (check_scalar(name, "amax", amax[i], dev)) return -1;
        const ms_tensor *xi = x ? x[i] : NULL;
        if (!xi) continue;
        if (ms_tensor_check_live(xi, name)) return -1;
        if (!ms_is_float(xi->dtype_id) || xi->ndim != 1 || !ms_tensor_is_contiguous(xi) || xi->device_id != dev)
            return ms_errorf("%s: x must be a contiguous 1-D float tensor (f64, f32, bf16, f16) on %s, got %s", name,
                             ms_device_str(dev, dv, sizeof dv), ms_desc(xi, d, sizeof d));
    }
#ifndef MS_WITH_CUDA
    if (dev >= 0) return ms_errorf("%s: cuda tensors need a build with CUDA", op);
#endif
    return 0;
}

int ms_float8_amax_many(ms_tensor **amax, ms_tensor **x, int n) {
    const char *op = "float8_amax_many";
    const int dev = many_device(amax, x, n);
    if (check_tw_pieces(op, x, amax, n, dev)) return -1;
    f8_span *sp = n > 0 ? malloc(sizeof(f8_span) * 2 * (size_t)n) : NULL;
    if (n > 0 && !sp) return ms_errorf("%s: out of host memory", op);
    int ns = 0;
    for (int i = 0; i < n; i++) span_add(sp, &ns, amax[i], "amax", i);
    const int nw = ns;
    for (int i = 0; i < n; i++) span_add(sp, &ns, x ? x[i] : NULL, "x", i);
    int rc = check_spans(op, sp, nw, ns);
    free(sp);
    if (rc || n == 0) return rc;
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_float8_amax_many(amax, x, n, dev);
#endif
    for (int i = 0; i < n && !rc; i++) {
        ms_tensor *f = NULL;
        const int64_t m = piece_n(x, i);
        if (m > 0) rc = f32_contig(&f, x[i]);
        if (!rc) *(float *)ms_tensor_data(amax[i]) = m > 0 ? amax_f32(ms_tensor_data(f), m) : 0.0f;
        ms_tensor_free(f);
    }
    return rc;
}

int ms_float8_cast_many(ms_tensor **out, ms_tensor **inv, ms_tensor **x, ms_tensor **amax, const int *pow2, int n,
                        int dtype) {
    const char *op = "float8_cast_many";
    char name[96], d[DESC], dv[32];
    if (!ms_is_float8(dtype))
        return ms_errorf("%s: the target dtype must be f8e4m3 or f8e5m2, got %s", op, ms_dtype_name(dtype));
    const int dev = many_device(amax, x, n);
    if (check_tw_pieces(op, x, amax, n, dev)) return -1;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s (piece %d)", op, i + 1);
        const int64_t m = piece_n(x, i);
        ms_tensor *o = out ? out[i] : NULL;
        if (inv && inv[i] && check_scalar(name, "inv", inv[i], dev)) return -1;
        if (m == 0) {
            if (o && (ms_tensor_check_live(o, name) || ms_tensor_numel(o) != 0))
                return ms_errorf("%s: an empty piece's out must be NULL or empty, got %s", name, ms_desc(o, d, sizeof d));
            continue;
        }
        if (!o) return ms_errorf("%s: out is missing", name);
        if (ms_tensor_check_live(o, name)) return -1;
        if (o->dtype_id != dtype || o->ndim != 1 || o->sizes[0] != m || o->device_id != dev ||
            !ms_tensor_is_contiguous(o))
            return ms_errorf("%s: out must be a contiguous %s (%lld) on %s (the piece's elements), got %s", name,
                             ms_dtype_name(dtype), (long long)m, ms_device_str(dev, dv, sizeof dv),
                             ms_desc(o, d, sizeof d));
    }
    f8_span *sp = n > 0 ? malloc(sizeof(f8_span) * 4 * (size_t)n) : NULL;
    if (n > 0 && !sp) return ms_errorf("%s: out of host memory", op);
    int ns = 0;
    for (int i = 0; i < n; i++) {
        span_add(sp, &ns, piece_n(x, i) > 0 ? out[i] : NULL, "out", i);
        span_add(sp, &ns, inv ? inv[i] : NULL, "inv", i);
    }
    const int nw = ns;
    for (int i = 0; i < n; i++) {
        span_add(sp, &ns, x ? x[i] : NULL, "x", i);
        span_add(sp, &ns, amax[i], "amax", i);
    }
    int rc = check_spans(op, sp, nw, ns);
    free(sp);
    if (rc || n == 0) return rc;
#ifdef MS_WITH_CUDA
    if (dev >= 0) return ms_cuda_float8_cast_many(out, inv, x, amax, pow2, n, dtype, dev);
#endif
    /* ms_float8_cast's loop: the scale from the amax, x * scale rounded */
    const int e5 = is_e5m2(dtype);
    for (int i = 0; i < n && !rc; i++) {
        const float scale = ms_fp8_scale(scalar_value(amax[i]), e5, pow2 ? pow2[i] : 0);
        if (inv && inv[i]) *(float *)ms_tensor_data(inv[i]) = 1.0f / scale;
        const int64_t m = piece_n(x, i);
        ms_tensor *f = NULL;
        if (m > 0) rc = f32_contig(&f, x[i]);
        if (rc || m == 0) continue;
        const float *p = ms_tensor_data(f);
        uint8_t *po = ms_tensor_data(out[i]);
        for (int64_t j = 0; j < m; j++) po[j] = ms_fp8_from_f32(p[j] * scale, e5, 1);
        ms_tensor_free(f);
    }
    return rc;
}
