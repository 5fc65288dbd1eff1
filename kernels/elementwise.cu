// kernels/elementwise.cu — every pointwise op on the GPU: dtype-converting
// strided copy, unary, binary (broadcast), binary with a scalar, clamp,
// where, fill, arange, and Philox random numbers.
//
// Two paths. The fast path covers what a training step does: contiguous
// operands of one float dtype and one shape; it moves 16 bytes per thread
// per access (8 bf16 / 4 f32) and computes in f32. The general path takes
// any strides (broadcast operands have stride 0), any dtypes, and computes
// in f64 with a per-launch dtype switch; it is what the CPU reference is
// compared against for odd layouts, not a hot path.
// Bytes: each input read once, the output written once.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <math.h>

// ---------------------------------------------------------------- kernels

template <typename F>
__device__ __forceinline__ F gelu_tanh(F x) {
    const F k = (F)0.7978845608028654, c = (F)0.044715;
    return (F)0.5 * x * ((F)1 + tanh(k * (x + c * x * x * x)));
}

template <typename F>
__device__ __forceinline__ F gelu_tanh_grad(F x) {
    const F k = (F)0.7978845608028654, c = (F)0.044715;
    F u = k * (x + c * x * x * x);
    F t = tanh(u);
    return (F)0.5 * ((F)1 + t) + (F)0.5 * x * ((F)1 - t * t) * k * ((F)1 + (F)3 * c * x * x);
}

// the f32 forms through the logistic function, 0.5(1 + tanh u) = s =
// 1 / (1 + e), e = exp(-2u), 1 - tanh^2 u = 4 s (1 - s) and 1 - s = e s:
// one exp and one reciprocal instead of tanhf (about 3x the instructions,
// which made the GELU backward of a GPT-2 step compute-bound), no
// cancellation for large |u|, within a few ulp of the tanh form. The
// reciprocal is the approximate one (__fdividef: MUFU.RCP and a multiply,
// within 2 ulp; __frcp_rn's IEEE rounding added a Newton step and a
// branch an element, and left the GELU backward issue-bound: ncu, tenth
// session); 1 + e beyond 2^126 gives 0, as the exact value rounds near it
template <>
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f, c = 0.044715f;
    float u = k * fmaf(c * x * x, x, x);
    return x * __fdividef(1.f, 1.f + __expf(-2.f * u));
}
template <>
__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float k = 0.7978845608028654f, c = 0.044715f;
    float u = k * fmaf(c * x * x, x, x);
    float e = __expf(-2.f * u);
    float sg = __fdividef(1.f, 1.f + e);
    float r = fmaf(2.f * x * k * fmaf(3.f * c, x * x, 1.f) * e * sg, sg, sg);
    return isinf(e) ? 0.f : r;   // u -> -inf: s = 0 and e s^2 -> 0 (e * sg: inf * 0 otherwise)
}

template <typename F>
__device__ __forceinline__ F sigmoid_f(F x) { return (F)1 / ((F)1 + exp(-x)); }

template <typename F>
__device__ __forceinline__ F unary_f(int op, F x) {
    switch (op) {
    case MS_OP_NEG: return -x;
    case MS_OP_EXP: return exp(x);
    case MS_OP_LOG: return log(x);
    case MS_OP_SQRT: return sqrt(x);
    case MS_OP_RSQRT: return (F)1 / sqrt(x);
    case MS_OP_TANH: return tanh(x);
    case MS_OP_SIGMOID: return sigmoid_f(x);
    case MS_OP_RELU: return x > (F)0 ? x : (x != x ? x : (F)0);
    case MS_OP_GELU: return gelu_tanh(x);
    case MS_OP_SILU: return x * sigmoid_f(x);
    case MS_OP_ABS: return fabs(x);
    case MS_OP_SIN: return sin(x);
    case MS_OP_COS: return cos(x);
    case MS_OP_SQUARE: return x * x;
    case MS_OP_RECIP: return (F)1 / x;
    case MS_OP_SIGN: return x > (F)0 ? (F)1 : (x < (F)0 ? (F)-1 : x);
    }
    return x;
}

template <typename F>
__device__ __forceinline__ F binary_f(int op, F a, F b) {
    switch (op) {
    case MS_OP_ADD: return a + b;
    case MS_OP_SUB: return a - b;
    case MS_OP_MUL: return a * b;
    case MS_OP_DIV: return a / b;
    case MS_OP_POW: return pow(a, b);
    case MS_OP_MAXIMUM: return (a != a || b != b) ? a + b : (a > b ? a : b);
    case MS_OP_MINIMUM: return (a != a || b != b) ? a + b : (a < b ? a : b);
    case MS_OP_EQ: return a == b;
    case MS_OP_NE: return a != b;
    case MS_OP_LT: return a < b;
    case MS_OP_LE: return a <= b;
    case MS_OP_GT: return a > b;
    case MS_OP_GE: return a >= b;
    case MS_OP_GELU_BWD: return b * gelu_tanh_grad(a);
    case MS_OP_SILU_BWD: {
        F s = sigmoid_f(a);
        return b * s * ((F)1 + a * ((F)1 - s));
    }
    case MS_OP_SIGMOID_BWD: {
        F s = sigmoid_f(a);
        return b * s * ((F)1 - s);
    }
    case MS_OP_TANH_BWD: {
        F t = tanh(a);
        return b * ((F)1 - t * t);
    }
    case MS_OP_RELU_BWD: return a > (F)0 ? b : (F)0;
    case MS_OP_SWIGLU: return a * sigmoid_f(a) * b;
    }
    return a;
}

// general path: out[i] = f(a[...], b[...]) with per-operand layouts
struct ew_args {
    ms_layout out, a, b, c;
    void *po;
    const void *pa, *pb, *pc;
    int dto, dta, dtb, dtc;
    int kind;     // 0 copy, 1 unary, 2 binary, 3 scalar, 4 clamp, 5 where
    int op;
    int reverse;
    double s0, s1;
};

// F: the compute type — float unless an operand is f64 or i64 (then double)
template <typename F>
__global__ void ew_general_kernel(ew_args p, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        F a = (F)ld_any(p.pa, p.dta, ms_offset(p.a, i)), r;
        switch (p.kind) {
        case 0: r = a; break;
        case 1: r = unary_f<F>(p.op, a); break;
        case 2: r = binary_f<F>(p.op, a, (F)ld_any(p.pb, p.dtb, ms_offset(p.b, i))); break;
        case 3: r = p.reverse ? binary_f<F>(p.op, (F)p.s0, a) : binary_f<F>(p.op, a, (F)p.s0); break;
        case 4: r = a < (F)p.s0 ? (F)p.s0 : (a > (F)p.s1 ? (F)p.s1 : a); break;
        default: {  // where(cond=a, b, c)
            r = a != (F)0 ? (F)ld_any(p.pb, p.dtb, ms_offset(p.b, i)) : (F)ld_any(p.pc, p.dtc, ms_offset(p.c, i));
        }
        }
        st_any(p.po, p.dto, ms_offset(p.out, i), (double)r);
    }
}

// fast path: contiguous, one float dtype T, 16-byte vectors of V elements
template <typename T>
struct vec16 {
    static const int V = 16 / sizeof(T);
    T v[V];
};

// strided path for float dtypes: each thread takes 8 neighbouring elements of
// the innermost (collapsed) dim, which the output walks with stride 1 and
// every input with stride 1 (loaded as 16-byte vectors) or 0 (a broadcast
// scalar, as a bias row seen from (N, C)); the index arithmetic runs once per
// 8 elements and the loads/stores are typed, so a transpose-copy, a cast or a
// broadcast bias add moves at copy speed. Math in f32, as the general path.
template <typename T>
__device__ __forceinline__ void ld8(float v[8], const T *p, int64_t stride) {
    if (stride == 0) {
        float x = ms_ld(p);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = x;
        return;
    }
    const int V = 16 / sizeof(T);  // elements per 16-byte load
#pragma unroll
    for (int h = 0; h < 8 / V; h++) {
        vec16<T> x = ((const vec16<T> *)p)[h];
#pragma unroll
        for (int k = 0; k < V; k++) v[h * V + k] = ms_ld(&x.v[k]);
    }
}

template <typename T>
__device__ __forceinline__ void st8(T *p, const float v[8]) {
    const int V = 16 / sizeof(T);
#pragma unroll
    for (int h = 0; h < 8 / V; h++) {
        vec16<T> x;
#pragma unroll
        for (int k = 0; k < V; k++) ms_st(&x.v[k], v[h * V + k]);
        ((vec16<T> *)p)[h] = x;
    }
}

// IX: the index type of the coordinate arithmetic (32-bit when every size
// and the element count fit: a 64-bit division costs tens of instructions)
template <typename TA, typename TB, typename TO, typename IX>
__global__ void ew_vec8_kernel(ew_args p, int64_t nvec) {
    const ms_layout &o = p.out;
    const int nd = o.ndim;
    for (int64_t v = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; v < nvec;
         v += (int64_t)gridDim.x * blockDim.x) {
        IX i = (IX)(v * 8);
        int64_t oo = 0, oa = 0, ob = 0;
        for (int d = nd - 1; d >= 0; d--) {
            IX sz = (IX)o.sizes[d], q = i / sz, c = i - q * sz;
            oo += (int64_t)c * o.strides[d];
            oa += (int64_t)c * p.a.strides[d];
            ob += (int64_t)c * p.b.strides[d];
            i = q;
        }
        float a[8], r[8];
        ld8(a, (const TA *)p.pa + oa, p.a.strides[nd - 1]);
        switch (p.kind) {
        case 0:
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = a[k];
            break;
        case 1:
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = unary_f<float>(p.op, a[k]);
            break;
        case 2: {
            float b[8];
            ld8(b, (const TB *)p.pb + ob, p.b.strides[nd - 1]);
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = binary_f<float>(p.op, a[k], b[k]);
            break;
        }
        case 3: {
            float s = (float)p.s0;
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = p.reverse ? binary_f<float>(p.op, s, a[k]) : binary_f<float>(p.op, a[k], s);
            break;
        }
        default: {
            float lo = (float)p.s0, hi = (float)p.s1;
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = a[k] < lo ? lo : (a[k] > hi ? hi : a[k]);
        }
        }
        st8((TO *)p.po + oo, r);
    }
}


template <typename T, int OP = -1>
__global__ void unary_fast_kernel(T *out, const T *a, int64_t n, int op) {
    if (OP >= 0) op = OP;   // a constant: the switch in unary_f folds away
    const int V = vec16<T>::V;
    int64_t nv = n / V;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv;
         i += (int64_t)gridDim.x * blockDim.x) {
        vec16<T> x = ((const vec16<T> *)a)[i], y;
#pragma unroll
        for (int k = 0; k < V; k++) ms_st(&y.v[k], unary_f<float>(op, ms_ld(&x.v[k])));
        ((vec16<T> *)out)[i] = y;
    }
    for (int64_t i = nv * V + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        ms_st(&out[i], unary_f<float>(op, ms_ld(&a[i])));
}

template <typename T, int OP = -1>
__global__ void binary_fast_kernel(T *out, const T *a, const T *b, int64_t n, int op) {
    if (OP >= 0) op = OP;
    const int V = vec16<T>::V;
    int64_t nv = n / V;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv;
         i += (int64_t)gridDim.x * blockDim.x) {
        vec16<T> x = ((const vec16<T> *)a)[i], z = ((const vec16<T> *)b)[i], y;
#pragma unroll
        for (int k = 0; k < V; k++) ms_st(&y.v[k], binary_f<float>(op, ms_ld(&x.v[k]), ms_ld(&z.v[k])));
        ((vec16<T> *)out)[i] = y;
    }
    for (int64_t i = nv * V + blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        ms_st(&out[i], binary_f<float>(op, ms_ld(&a[i]), ms_ld(&b[i])));
}

template <typename T>
__global__ void scalar_fast_kernel(T *out, const T *a, int64_t n, int op, float s, int reverse) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float x = ms_ld(&a[i]);
        ms_st(&out[i], reverse ? binary_f<float>(op, s, x) : binary_f<float>(op, x, s));
    }
}

__global__ void fill_kernel(void *p, int dtype, ms_layout l, int64_t n, double v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_any(p, dtype, ms_offset(l, i), v);
}

__global__ void arange_kernel(void *p, int dtype, ms_layout l, int64_t n, double start, double step) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_any(p, dtype, ms_offset(l, i), start + (double)i * step);
}

// Philox4x32-10, the same function as core/rng.c: element i of the tensor
// uses counter (offset + i) / 4 and lane (offset + i) % 4
__device__ void philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

__device__ __forceinline__ double u01(uint32_t x) { return ((double)(x >> 8) + 0.5) * (1.0 / 16777216.0); }

__global__ void rand_kernel(void *p, int dtype, ms_layout l, int64_t n, uint64_t seed, uint64_t offset,
                            double a, double b, int normal) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t k = offset + (uint64_t)i;
        uint32_t r[4];
        philox(seed, k / 4, r);
        int lane = (int)(k % 4);
        double v;
        if (!normal) {
            v = a + (b - a) * u01(r[lane]);
        } else {
            int pair = lane & 2;
            double u1 = u01(r[pair]), u2 = u01(r[pair + 1]);
            double rad = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
            v = a + b * ((lane & 1) ? rad * sin(th) : rad * cos(th));
        }
        st_any(p, dtype, ms_offset(l, i), v);
    }
}

// -------------------------------------------------------------- launchers

namespace {

bool fast_float(int dt) { return dt == MS_F32 || dt == MS_BF16 || dt == MS_F16; }

bool same_contig(const ms_tensor *o, const ms_tensor *a) {
    if (!ms_tensor_is_contiguous(o) || !ms_tensor_is_contiguous(a)) return false;
    if (o->ndim != a->ndim || o->dtype_id != a->dtype_id) return false;
    for (int i = 0; i < o->ndim; i++)
        if (o->sizes[i] != a->sizes[i]) return false;
    return true;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// broadcast `t` to out's shape (ndim aligned at the right, stride 0 where 1)
ms_layout bcast_layout(const ms_tensor *t, const ms_tensor *out) {
    ms_layout l;
    l.ndim = out->ndim;
    int lead = out->ndim - t->ndim;
    for (int i = 0; i < 8; i++) {
        l.sizes[i] = i < out->ndim ? out->sizes[i] : 1;
        l.strides[i] = 0;
        if (i < out->ndim && i >= lead) {
            int j = i - lead;
            l.strides[i] = t->sizes[j] == 1 ? 0 : t->strides[j];
        }
    }
    return l;
}

// Merge neighbouring dims that every operand walks contiguously (and drop
// size-1 dims), so the per-element index arithmetic runs over as few dims as
// the layouts allow: a bias add (B,T,C)+(C) becomes (B*T, C).
void collapse(ms_layout *ls[], int n) {
    ms_layout &o = *ls[0];
    int nd = 0;
    int64_t sizes[8], strides[4][8];
    for (int d = 0; d < o.ndim; d++) {
        if (o.sizes[d] == 1) continue;
        bool merge = nd > 0;
        for (int k = 0; merge && k < n; k++)
            merge = strides[k][nd - 1] == ls[k]->strides[d] * o.sizes[d];
        if (merge) {
            sizes[nd - 1] *= o.sizes[d];
            for (int k = 0; k < n; k++) strides[k][nd - 1] = ls[k]->strides[d];
        } else {
            sizes[nd] = o.sizes[d];
            for (int k = 0; k < n; k++) strides[k][nd] = ls[k]->strides[d];
            nd++;
        }
    }
    for (int k = 0; k < n; k++) {
        ls[k]->ndim = nd;
        for (int d = 0; d < 8; d++) {
            ls[k]->sizes[d] = d < nd ? sizes[d] : 1;
            ls[k]->strides[d] = d < nd ? strides[k][d] : 0;
        }
    }
}

bool wide(int dt) { return dt == MS_F64 || dt == MS_I64 || dt == MS_I32; }

// can the vec8 kernel take these (collapsed) layouts? Float dtypes, kinds
// copy/unary/binary/scalar/clamp, output inner stride 1 and inner size a
// multiple of 8, every input's inner stride 1 or 0, and every 16-byte access
// aligned (base pointer and each outer stride, in bytes, multiples of 16).
bool vec8_layout_ok(const ms_layout &l, const void *ptr, int dt, bool out) {
    int nd = l.ndim;
    int64_t inner = l.strides[nd - 1];
    if (inner == 0 && !out) return true;
    if (inner != 1) return false;
    int64_t es = ms_dtype_size(dt);
    if (((uintptr_t)ptr & 15) != 0) return false;
    for (int d = 0; d < nd - 1; d++)
        if ((l.strides[d] * es) % 16 != 0) return false;
    return true;
}

template <typename TA, typename TB, typename TO>
void vec8_launch(ew_args &p, int64_t nvec, cudaStream_t s) {
    int g = ms_grid(nvec, 256);
    if (nvec * 8 < ((int64_t)1 << 31)) ew_vec8_kernel<TA, TB, TO, uint32_t><<<g, 256, 0, s>>>(p, nvec);
    else ew_vec8_kernel<TA, TB, TO, int64_t><<<g, 256, 0, s>>>(p, nvec);
}

template <typename TA, typename TB>
bool vec8_go_o(ew_args &p, int64_t nvec, cudaStream_t s) {
    switch (p.dto) {
    case MS_F32: vec8_launch<TA, TB, float>(p, nvec, s); return true;
    case MS_BF16: vec8_launch<TA, TB, __nv_bfloat16>(p, nvec, s); return true;
    case MS_F16: vec8_launch<TA, TB, __half>(p, nvec, s); return true;
    }
    return false;
}

template <typename TA>
bool vec8_go_b(ew_args &p, int64_t nvec, cudaStream_t s) {
    if (p.kind != 2) return vec8_go_o<TA, TA>(p, nvec, s);
    switch (p.dtb) {
    case MS_F32: return vec8_go_o<TA, float>(p, nvec, s);
    case MS_BF16: return vec8_go_o<TA, __nv_bfloat16>(p, nvec, s);
    case MS_F16: return vec8_go_o<TA, __half>(p, nvec, s);
    }
    return false;
}

bool launch_vec8(ew_args &p, int nops, int64_t n, cudaStream_t s) {
    if (p.kind > 4 || p.out.ndim < 1 || p.out.sizes[p.out.ndim - 1] % 8 != 0) return false;
    if (!fast_float(p.dto) || !fast_float(p.dta) || (nops > 2 && !fast_float(p.dtb))) return false;
    if (!vec8_layout_ok(p.out, p.po, p.dto, true) || !vec8_layout_ok(p.a, p.pa, p.dta, false)) return false;
    if (nops > 2 && !vec8_layout_ok(p.b, p.pb, p.dtb, false)) return false;
    if (nops <= 2) p.b = p.a;  // the kernel walks b's strides too; keep them valid
    int64_t nvec = n / 8;
    switch (p.dta) {
    case MS_F32: return vec8_go_b<float>(p, nvec, s);
    case MS_BF16: return vec8_go_b<__nv_bfloat16>(p, nvec, s);
    case MS_F16: return vec8_go_b<__half>(p, nvec, s);
    }
    return false;
}

int launch_general(ew_args &p, const ms_tensor *out) {
    int64_t n = ms_tensor_numel(out);
    if (n == 0) return 0;
    if (ms_cuda_activate(out->device_id)) return -1;
    cudaStream_t s = ms_cuda_stream_of(out->device_id);
    p.out = ms_layout_of(out);
    p.po = ms_tensor_data(out);
    p.dto = out->dtype_id;
    // operands in use: a always; b for binary and where; c for where
    ms_layout *ls[4] = {&p.out, &p.a, &p.b, &p.c};
    int nops = p.kind == 2 ? 3 : (p.kind == 5 ? 4 : 2);
    collapse(ls, nops);
    if (launch_vec8(p, nops, n, s)) {
        LAUNCH_CHECK("ew_vec8_kernel");
        return 0;
    }
    bool dbl = wide(p.dto) || wide(p.dta) || (nops > 2 && wide(p.dtb)) || (nops > 3 && wide(p.dtc));
    if (dbl) ew_general_kernel<double><<<ms_grid(n, 256), 256, 0, s>>>(p, n);
    else ew_general_kernel<float><<<ms_grid(n, 256), 256, 0, s>>>(p, n);
    LAUNCH_CHECK("ew_general_kernel");
    return 0;
}

}  // namespace

extern "C" int ms_cuda_convert(ms_tensor *dst, const ms_tensor *src) {
    int64_t n = ms_tensor_numel(dst);
    if (n == 0) return 0;
    if (same_contig(dst, src)) {
        if (ms_cuda_activate(dst->device_id)) return -1;
        CUDA_CHECK(cudaMemcpyAsync(ms_tensor_data(dst), ms_tensor_data(src),
                                   (size_t)(n * ms_dtype_size(dst->dtype_id)), cudaMemcpyDeviceToDevice,
                                   ms_cuda_stream_of(dst->device_id)));
        return 0;
    }
    ew_args p = {};
    p.kind = 0;
    p.a = bcast_layout(src, dst);
    p.pa = ms_tensor_data(src);
    p.dta = src->dtype_id;
    return launch_general(p, dst);
}

// the fast kernels with the training step's ops as compile-time constants
// (the per-element op switch and the unused branches fold away), any other
// op through the runtime switch
template <typename T>
void unary_fast(int g, cudaStream_t s, T *out, const T *a, int64_t n, int op) {
    switch (op) {
    case MS_OP_GELU: unary_fast_kernel<T, MS_OP_GELU><<<g, 256, 0, s>>>(out, a, n, op); break;
    case MS_OP_SILU: unary_fast_kernel<T, MS_OP_SILU><<<g, 256, 0, s>>>(out, a, n, op); break;
    default: unary_fast_kernel<T><<<g, 256, 0, s>>>(out, a, n, op);
    }
}

template <typename T>
void binary_fast(int g, cudaStream_t s, T *out, const T *a, const T *b, int64_t n, int op) {
    switch (op) {
#define MS_BINARY_FAST(OPC) case OPC: binary_fast_kernel<T, OPC><<<g, 256, 0, s>>>(out, a, b, n, op); break;
    MS_BINARY_FAST(MS_OP_ADD)
    MS_BINARY_FAST(MS_OP_SUB)
    MS_BINARY_FAST(MS_OP_MUL)
    MS_BINARY_FAST(MS_OP_GELU_BWD)
    MS_BINARY_FAST(MS_OP_SILU_BWD)
    MS_BINARY_FAST(MS_OP_SWIGLU)
#undef MS_BINARY_FAST
    default: binary_fast_kernel<T><<<g, 256, 0, s>>>(out, a, b, n, op);
    }
}

// ---------------------------------------------- GELU backward with its bias
// out (M, N) = g * gelu'(pre), and with part: part[b][n] the sum of out's
// column n over block b's rows. The rows are split evenly over the blocks;
// a thread owns 8 columns (one 16-byte access of 2-byte dtypes) and walks
// its block's rows, so the bias gradient of the layer before a GELU comes
// out of the pass that makes its input gradient (no second read of it).
template <typename T>
__global__ void dgelu_bgrad_kernel(T *__restrict__ out, float *__restrict__ part, const T *__restrict__ pre,
                                   const T *__restrict__ g, long long M, int N, long long rows_per_block) {
    const long long r0 = (long long)blockIdx.x * rows_per_block;
    const long long r1 = r0 + rows_per_block < M ? r0 + rows_per_block : M;
    for (int c0 = threadIdx.x * 8; c0 < N; c0 += blockDim.x * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (long long r = r0; r < r1; r++) {
            float x[8], d[8];
            load_v<float, T, 8>(x, pre + r * N + c0);
            load_v<float, T, 8>(d, g + r * N + c0);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                d[k] = round_as<T>(d[k] * gelu_tanh_grad(x[k]));   // the stored value is what is summed
                acc[k] += d[k];
            }
            store_v<T, 8>(out + r * N + c0, d);
        }
        if (part)
#pragma unroll
            for (int k = 0; k < 8; k++) part[(long long)blockIdx.x * N + c0 + k] = acc[k];
    }
}

// bias[n] = the sum over blocks b of part[b][n] in a fixed order: blocks of
// 8 columns (a 32-byte sector of a partial row) x 32 lanes, lane l summing
// rows l, l+32, ..., then lane 0 the 32 lane sums in order
template <typename T>
__global__ void part_sum_kernel(T *bias, const float *part, int nblocks, int N) {
    __shared__ float sh[32][8];
    const int n = blockIdx.x * 8 + threadIdx.x, l = threadIdx.y;
    float s = 0.f;
    if (n < N)
        for (int b = l; b < nblocks; b += 32) s += part[(long long)b * N + n];
    sh[l][threadIdx.x] = s;
    __syncthreads();
    if (l == 0 && n < N) {
        float t = 0.f;
        for (int k = 0; k < 32; k++) t += sh[k][threadIdx.x];
        bias[n] = conv<T>::store(t);
    }
}

// out = g * gelu'(pre) for 2-D contiguous (M, N) operands of one float dtype
// (f32, bf16, f16), N a multiple of 8 and 16-byte aligned rows, and with
// bias_grad (N) its column sums in the same pass (f32 sums, a fixed order).
// Returns 1, having done nothing, for anything else (core/ops.c then runs
// the elementwise op and the reduction apart).
extern "C" int ms_cuda_gelu_backward_bgrad(ms_tensor *out, ms_tensor *bias_grad, const ms_tensor *pre,
                                           const ms_tensor *g) {
    int dt = out->dtype_id;
    if (out->ndim != 2 || pre->dtype_id != dt || g->dtype_id != dt || (dt != MS_F32 && dt != MS_BF16 && dt != MS_F16))
        return 1;
    if (!ms_tensor_is_contiguous(out) || !ms_tensor_is_contiguous(pre) || !ms_tensor_is_contiguous(g)) return 1;
    long long M = out->sizes[0];
    int N = (int)out->sizes[1];
    size_t al = 8 * ms_dtype_size(dt);   // one thread's 8 elements, aligned as load_v needs
    if (N % 8 != 0 || M == 0 || N == 0 || ((uintptr_t)ms_tensor_data(out) | (uintptr_t)ms_tensor_data(pre) |
                                           (uintptr_t)ms_tensor_data(g)) % al != 0)
        return 1;
    if (bias_grad && (bias_grad->ndim != 1 || bias_grad->sizes[0] != N || bias_grad->dtype_id != dt ||
                      !ms_tensor_is_contiguous(bias_grad)))
        return 1;
    int device = out->device_id;
    if (ms_cuda_activate(device)) return -1;
    cudaStream_t s = ms_cuda_stream_of(device);
    int threads = (N / 8 + 31) / 32 * 32;
    if (threads > 1024) threads = 1024;
    return with_float32_type(dt, "gelu_backward", [&](auto t) -> int {
        using T = decltype(t);
        // one wave of resident blocks (registers decide: GPT-2's 384-thread
        // blocks fit fewer than the 5 an SM this asked for before), a
        // contiguous slab of rows each
        long long blocks = ms_one_wave(dgelu_bgrad_kernel<T>, device, threads, 0);
        if (blocks == 0)
            return ms_errorf("gelu_backward: the occupancy query failed (%s)", cudaGetErrorString(cudaGetLastError()));
        if (blocks > M) blocks = M;
        long long rpb = (M + blocks - 1) / blocks;
        blocks = (M + rpb - 1) / rpb;
        ms_tmp part;
        if (bias_grad) {
            int64_t ps[1] = {blocks * N};
            if (ms_tensor_empty(&part.t, 1, ps, MS_F32, device)) return -1;
        }
        float *pp = bias_grad ? (float *)ms_tensor_data(part.t) : nullptr;
        dgelu_bgrad_kernel<T><<<(unsigned)blocks, threads, 0, s>>>((T *)ms_tensor_data(out), pp,
                                                                   (const T *)ms_tensor_data(pre),
                                                                   (const T *)ms_tensor_data(g), M, N, rpb);
        LAUNCH_CHECK("dgelu_bgrad_kernel");
        if (bias_grad) {
            part_sum_kernel<T><<<(unsigned)((N + 7) / 8), dim3(8, 32), 0, s>>>((T *)ms_tensor_data(bias_grad), pp,
                                                                              (int)blocks, N);
            LAUNCH_CHECK("part_sum_kernel");
        }
        return 0;
    });
}

extern "C" int ms_cuda_unary(ms_tensor *out, int op, const ms_tensor *a) {
    int64_t n = ms_tensor_numel(out);
    if (n == 0) return 0;
    if (fast_float(a->dtype_id) && same_contig(out, a) && aligned16(ms_tensor_data(out)) &&
        aligned16(ms_tensor_data(a))) {
        if (ms_cuda_activate(out->device_id)) return -1;
        cudaStream_t s = ms_cuda_stream_of(out->device_id);
        int g = ms_grid(n / (16 / ms_dtype_size(a->dtype_id)) + 1, 256);
        switch (a->dtype_id) {
        case MS_F32:
            unary_fast<float>(g, s, (float *)ms_tensor_data(out), (const float *)ms_tensor_data(a), n, op);
            break;
        case MS_BF16:
            unary_fast<__nv_bfloat16>(g, s, (__nv_bfloat16 *)ms_tensor_data(out),
                                      (const __nv_bfloat16 *)ms_tensor_data(a), n, op);
            break;
        default:
            unary_fast<__half>(g, s, (__half *)ms_tensor_data(out), (const __half *)ms_tensor_data(a), n, op);
        }
        LAUNCH_CHECK("unary_fast_kernel");
        return 0;
    }
    ew_args p = {};
    p.kind = 1;
    p.op = op;
    p.a = bcast_layout(a, out);
    p.pa = ms_tensor_data(a);
    p.dta = a->dtype_id;
    return launch_general(p, out);
}

extern "C" int ms_cuda_binary(ms_tensor *out, int op, const ms_tensor *a, const ms_tensor *b) {
    int64_t n = ms_tensor_numel(out);
    if (n == 0) return 0;
    if (fast_float(a->dtype_id) && same_contig(out, a) && same_contig(out, b) &&
        aligned16(ms_tensor_data(out)) && aligned16(ms_tensor_data(a)) && aligned16(ms_tensor_data(b))) {
        if (ms_cuda_activate(out->device_id)) return -1;
        cudaStream_t s = ms_cuda_stream_of(out->device_id);
        int g = ms_grid(n / (16 / ms_dtype_size(a->dtype_id)) + 1, 256);
        switch (a->dtype_id) {
        case MS_F32:
            binary_fast<float>(g, s, (float *)ms_tensor_data(out), (const float *)ms_tensor_data(a),
                               (const float *)ms_tensor_data(b), n, op);
            break;
        case MS_BF16:
            binary_fast<__nv_bfloat16>(g, s, (__nv_bfloat16 *)ms_tensor_data(out),
                                       (const __nv_bfloat16 *)ms_tensor_data(a),
                                       (const __nv_bfloat16 *)ms_tensor_data(b), n, op);
            break;
        default:
            binary_fast<__half>(g, s, (__half *)ms_tensor_data(out), (const __half *)ms_tensor_data(a),
                                (const __half *)ms_tensor_data(b), n, op);
        }
        LAUNCH_CHECK("binary_fast_kernel");
        return 0;
    }
    ew_args p = {};
    p.kind = 2;
    p.op = op;
    p.a = bcast_layout(a, out);
    p.b = bcast_layout(b, out);
    p.pa = ms_tensor_data(a);
    p.pb = ms_tensor_data(b);
    p.dta = a->dtype_id;
    p.dtb = b->dtype_id;
    return launch_general(p, out);
}

extern "C" int ms_cuda_binary_scalar(ms_tensor *out, int op, const ms_tensor *a, double s, int reverse) {
    int64_t n = ms_tensor_numel(out);
    if (n == 0) return 0;
    if (fast_float(a->dtype_id) && same_contig(out, a)) {
        if (ms_cuda_activate(out->device_id)) return -1;
        cudaStream_t st = ms_cuda_stream_of(out->device_id);
        int g = ms_grid(n, 256);
        switch (a->dtype_id) {
        case MS_F32:
            scalar_fast_kernel<float><<<g, 256, 0, st>>>((float *)ms_tensor_data(out),
                                                         (const float *)ms_tensor_data(a), n, op, (float)s, reverse);
            break;
        case MS_BF16:
            scalar_fast_kernel<__nv_bfloat16><<<g, 256, 0, st>>>(
                (__nv_bfloat16 *)ms_tensor_data(out), (const __nv_bfloat16 *)ms_tensor_data(a), n, op, (float)s, reverse);
            break;
        default:
            scalar_fast_kernel<__half><<<g, 256, 0, st>>>((__half *)ms_tensor_data(out),
                                                          (const __half *)ms_tensor_data(a), n, op, (float)s, reverse);
        }
        LAUNCH_CHECK("scalar_fast_kernel");
        return 0;
    }
    ew_args p = {};
    p.kind = 3;
    p.op = op;
    p.reverse = reverse;
    p.s0 = s;
    p.a = bcast_layout(a, out);
    p.pa = ms_tensor_data(a);
    p.dta = a->dtype_id;
    return launch_general(p, out);
}

extern "C" int ms_cuda_clamp(ms_tensor *out, const ms_tensor *a, double lo, double hi) {
    ew_args p = {};
    p.kind = 4;
    p.s0 = lo;
    p.s1 = hi;
    p.a = bcast_layout(a, out);
    p.pa = ms_tensor_data(a);
    p.dta = a->dtype_id;
    return launch_general(p, out);
}

extern "C" int ms_cuda_where(ms_tensor *out, const ms_tensor *cond, const ms_tensor *a, const ms_tensor *b) {
    ew_args p = {};
    p.kind = 5;
    p.a = bcast_layout(cond, out);
    p.b = bcast_layout(a, out);
    p.c = bcast_layout(b, out);
    p.pa = ms_tensor_data(cond);
    p.pb = ms_tensor_data(a);
    p.pc = ms_tensor_data(b);
    p.dta = cond->dtype_id;
    p.dtb = a->dtype_id;
    p.dtc = b->dtype_id;
    return launch_general(p, out);
}

extern "C" int ms_cuda_fill(ms_tensor *t, double v) {
    int64_t n = ms_tensor_numel(t);
    if (n == 0) return 0;
    if (ms_cuda_activate(t->device_id)) return -1;
    cudaStream_t s = ms_cuda_stream_of(t->device_id);
    if (v == 0 && ms_tensor_is_contiguous(t)) {
        CUDA_CHECK(cudaMemsetAsync(ms_tensor_data(t), 0, (size_t)(n * ms_dtype_size(t->dtype_id)), s));
        return 0;
    }
    fill_kernel<<<ms_grid(n, 256), 256, 0, s>>>(ms_tensor_data(t), t->dtype_id, ms_layout_of(t), n, v);
    LAUNCH_CHECK("fill_kernel");
    return 0;
}

extern "C" int ms_cuda_arange(ms_tensor *t, double start, double step) {
    int64_t n = ms_tensor_numel(t);
    if (n == 0) return 0;
    if (ms_cuda_activate(t->device_id)) return -1;
    arange_kernel<<<ms_grid(n, 256), 256, 0, ms_cuda_stream_of(t->device_id)>>>(
        ms_tensor_data(t), t->dtype_id, ms_layout_of(t), n, start, step);
    LAUNCH_CHECK("arange_kernel");
    return 0;
}

extern "C" int ms_cuda_rand(ms_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal) {
    int64_t n = ms_tensor_numel(t);
    if (n == 0) return 0;
    if (ms_cuda_activate(t->device_id)) return -1;
    rand_kernel<<<ms_grid(n, 256), 256, 0, ms_cuda_stream_of(t->device_id)>>>(
        ms_tensor_data(t), t->dtype_id, ms_layout_of(t), n, seed, offset, a, b, normal);
    LAUNCH_CHECK("rand_kernel");
    return 0;
}
