/* core/rope_cpu.c — CPU reference of the rotary position embedding
 * (core/ops.h ms_rope; the CUDA kernel is kernels/rope.cu).
 *
 * Hugging Face Llama's apply_rotary_pos_emb (the rotate_half convention),
 * https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/modeling_llama.py
 *   y = x·cos + rotate_half(x)·sin,  rotate_half(x) = cat(-x[h:], x[:h]),  h = D/2
 * i.e. for i < h:
 *   y[i]   = x[i]·cos[i]     - x[i+h]·sin[i]
 *   y[i+h] = x[i+h]·cos[i+h] + x[i]·sin[i+h]
 * and the backward (the transpose of that linear map, cos and sin constant):
 *   dx[i]   = g[i]·cos[i]     + g[i+h]·sin[i+h]
 *   dx[i+h] = g[i+h]·cos[i+h] - g[i]·sin[i]
 * x, out: (N, D), the rows of (..., T, D), contiguous; row r is position
 * r mod T; cos, sin: (T, D) in the compute dtype (f64 for f64 x, else f32).
 * Math in f64, one rounding on store.
 */
#include "internal.h"

#include <omp.h>

#include "fused_cpu.h"

static double ld(const void *p, int dtype, int64_t i) {
    switch (dtype) {
    case MS_F64: return ((const double *)p)[i];
    case MS_F32: return ((const float *)p)[i];
    case MS_BF16: return ms_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ms_f16_to_f32(((const uint16_t *)p)[i]);
    }
}

static void st(void *p, int dtype, int64_t i, double v) {
    switch (dtype) {
    case MS_F64: ((double *)p)[i] = v; break;
    case MS_F32: ((float *)p)[i] = (float)v; break;
    case MS_BF16: ((uint16_t *)p)[i] = ms_f32_to_bf16((float)v); break;
    default: ((uint16_t *)p)[i] = ms_f32_to_f16((float)v); break;
    }
}

int ms_cpu_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward) {
    int64_t T = cos->sizes[0], D = x->sizes[x->ndim - 1], h = D / 2;
    int64_t N = D ? ms_tensor_numel(x) / D : 0;
    const void *xp = ms_tensor_data(x);
    void *op = ms_tensor_data(out);
    const void *cp = ms_tensor_data(cos), *sp = ms_tensor_data(sin);
    int xd = x->dtype_id, od = out->dtype_id, cd = cos->dtype_id;
#pragma omp parallel for schedule(static) if (N * D > 32768)
    for (int64_t r = 0; r < N; r++) {
        int64_t t = r % T, xb = r * D, cb = t * D;
        for (int64_t i = 0; i < h; i++) {
            double x1 = ld(xp, xd, xb + i), x2 = ld(xp, xd, xb + i + h);
            double c1 = ld(cp, cd, cb + i), c2 = ld(cp, cd, cb + i + h);
            double s1 = ld(sp, cd, cb + i), s2 = ld(sp, cd, cb + i + h);
            double y1, y2;
            if (!backward) {
                y1 = x1 * c1 - x2 * s1;
                y2 = x2 * c2 + x1 * s2;
            } else {
                y1 = x1 * c1 + x2 * s2;
                y2 = x2 * c2 - x1 * s1;
            }
            st(op, od, xb + i, y1);
            st(op, od, xb + i + h, y2);
        }
    }
    return 0;
}
