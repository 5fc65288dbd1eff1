/* core/fp8.h — the two 8-bit float formats, bit by bit, shared by the CPU
 * core and the CUDA kernels (the same code on both sides, so a conversion
 * gives the same bits on both).
 *
 *   f8e4m3  OCP E4M3 "FN" (torch.float8_e4m3fn): sign, 4 exponent bits
 *           (bias 7), 3 mantissa bits; no infinity; 0x7f / 0xff are NaN;
 *           largest 448, smallest normal 2^-6, subnormals k * 2^-9
 *   f8e5m2  OCP E5M2 (torch.float8_e5m2): IEEE-like, 5 exponent bits (bias
 *           15), 2 mantissa bits; infinities 0x7c / 0xfc; largest 57344,
 *           smallest normal 2^-14, subnormals k * 2^-16
 *
 * f32 -> f8 rounds to nearest, ties to even, straight from the f32 bits
 * (no detour through f16). Without saturation a value that rounds past the
 * largest finite one becomes NaN (e4m3: |x| > 464, infinities too) or
 * infinity (e5m2: |x| >= 61440), as torch's .to(float8) does; with
 * saturation (the scaled casts of training) it becomes the largest finite
 * value of its sign. NaN stays NaN (0x7f with x's sign). From f64 the value
 * is rounded once (ms_fp8_from_f64).
 * Not part of the FFI (no FFI-BEGIN): tensor.h's ms_f32_to_f8 and
 * ms_f8_to_f32 are the callable forms. */
#ifndef MS_FP8_H
#define MS_FP8_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define MS_FP8_HD __host__ __device__
#else
#define MS_FP8_HD
#endif

#define MS_F8E4M3_MAX 448.0f
#define MS_F8E5M2_MAX 57344.0f

MS_FP8_HD static inline uint32_t ms_fp8_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

MS_FP8_HD static inline float ms_fp8_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* e5m2 = 0: e4m3; 1: e5m2. sat: clamp to the largest finite value. */
MS_FP8_HD static inline uint8_t ms_fp8_from_f32(float x, int e5m2, int sat) {
    const uint32_t u = ms_fp8_f32_bits(x);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);                  /* NaN */
    /* the largest finite value's f32 bits, its code, and the smallest normal */
    const uint32_t max_bits = e5m2 ? 0x47600000u : 0x43e00000u;           /* 57344, 448 */
    const uint8_t max_code = e5m2 ? 0x7bu : 0x7eu;
    const uint32_t min_normal = e5m2 ? 0x38800000u : 0x3c800000u;         /* 2^-14, 2^-6 */
    if (sat && a >= max_bits) return (uint8_t)(sign | max_code);
    if (a < min_normal) {
        /* subnormal (or zero): k * 2^-16 (e5m2) / k * 2^-9 (e4m3), k rounded
         * half to even; k at the top is the smallest normal's code */
        float f = ms_fp8_bits_f32(a) * (e5m2 ? 65536.0f : 512.0f);        /* exact: a power of two */
        uint32_t k = (uint32_t)f;
        float rem = f - (float)k;
        if (rem > 0.5f || (rem == 0.5f && (k & 1u))) k++;
        return (uint8_t)(sign | k);
    }
    const int shift = e5m2 ? 21 : 20;                                     /* 23 - mantissa bits */
    uint32_t r = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);    /* round at bit `shift` */
    uint32_t code = (r >> shift) - (e5m2 ? (112u << 2) : (120u << 3));    /* rebias 127 -> 15 / 7 */
    if (code > max_code) {
        if (sat) return (uint8_t)(sign | max_code);
        return (uint8_t)(sign | (e5m2 ? 0x7cu : 0x7fu));                   /* inf (e5m2), NaN (e4m3) */
    }
    return (uint8_t)(sign | code);
}

/* from f64 with one rounding: v goes to f32 rounding to odd first (the f32
 * neighbour toward zero with its last bit set when v is not exact), which
 * keeps enough bits that the f8 rounding after it is the rounding of v */
MS_FP8_HD static inline uint8_t ms_fp8_from_f64(double v, int e5m2, int sat) {
    float f = (float)v;
    if ((double)f != v && v == v && !(f > 3.4e38f || f < -3.4e38f)) {
        uint32_t u = ms_fp8_f32_bits(f);
        if (fabs((double)f) > fabs(v)) u -= 1;   /* rounded away from zero: step back */
        f = ms_fp8_bits_f32(u | 1u);
    }
    return ms_fp8_from_f32(f, e5m2, sat);
}

MS_FP8_HD static inline float ms_fp8_to_f32(uint8_t c, int e5m2) {
    const uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t bits;
    if (e5m2) {
        uint32_t e = (c >> 2) & 0x1fu, m = c & 3u;
        if (e == 31) bits = m ? 0x7fc00000u : 0x7f800000u;
        else if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * (1.0f / 65536.0f);
        else bits = ((e + 112u) << 23) | (m << 21);
    } else {
        uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
        if (e == 15 && m == 7) bits = 0x7fc00000u;
        else if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * (1.0f / 512.0f);
        else bits = ((e + 120u) << 23) | (m << 20);
    }
    return ms_fp8_bits_f32(sign | bits);
}

/* the scale of torchao's dynamic tensorwise cast: fmax / max(amax, 1e-12),
 * computed in f64 and rounded to f32; pow2: rounded down to a power of two
 * (then x * scale is exact before the cast). An amax of NaN or infinity
 * gives a scale of NaN or 0: the cast then gives NaN (every value, or the
 * infinite ones): a bad tensor is not hidden. */
MS_FP8_HD static inline float ms_fp8_scale(float amax, int e5m2, int pow2) {
    const double fmax = e5m2 ? MS_F8E5M2_MAX : MS_F8E4M3_MAX;
    double a = (double)amax;
    if (a < 1e-12) a = 1e-12;                 /* (NaN falls through: NaN) */
    float s = (float)(fmax / a);
    if (pow2 && s == s && s > 0.0f && s < 3.0e38f) {
        uint32_t b = ms_fp8_f32_bits(s) & 0x7f800000u;   /* keep the exponent: 2^floor(log2 s) */
        s = ms_fp8_bits_f32(b);
    }
    return s;
}

#endif
