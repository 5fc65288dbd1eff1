// kernels/rope.cu — rotary position embedding, forward and backward
// (contract in core/ops.h; CPU reference core/rope_cpu.c).
//
// Hugging Face's rotate_half convention over the last dim D (h = D/2):
//   y[i] = x[i]·cos[t,i] - x[i+h]·sin[t,i];  y[i+h] = x[i+h]·cos[t,i+h] + x[i]·sin[t,i+h]
// and its transpose for the backward. Why fused: the composed path
// (narrow, neg, cat, mul, mul, add) makes three full-size temporaries; here
// x is read once and y written once, and cos/sin (T, D) stay in L2.
// Shapes: x (..., T, D) in any layout whose last dim has unit stride — the
// (B, H, T, D) view of a (B, T, H, D) projection is read in place, no copy;
// out (..., T, D) contiguous; cos, sin (T, D) f32 (f64 for f64 x).
// Bytes: numel·(|x| + |out|) + T·D·8 (cached). Math in f32 (f64 for f64).
// Layout: one warp per row of D; lane l takes the pairs (l, l+h),
// (l+32, l+32+h), ... — consecutive lanes read consecutive elements.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

// ---------------------------------------------------------------- kernels

// rows: the leading dims of x (all but the last), `lead` their layout
template <typename X, typename A>
__global__ void rope_kernel(X *__restrict__ out, const X *__restrict__ x, ms_layout lead, long long rows, int T,
                            int D, const A *__restrict__ cos, const A *__restrict__ sin, int backward) {
    const int lane = threadIdx.x & 31, h = D / 2;
    const long long wpb = blockDim.x >> 5;
    for (long long r = blockIdx.x * wpb + (threadIdx.x >> 5); r < rows; r += (long long)gridDim.x * wpb) {
        const X *xr = x + ms_offset(lead, r);
        X *orow = out + r * D;
        const long long t = r % T;
        const A *cr = cos + t * D, *sr = sin + t * D;
        for (int i = lane; i < h; i += 32) {
            const A x1 = (A)conv<X>::load(xr[i]), x2 = (A)conv<X>::load(xr[i + h]);
            const A c1 = cr[i], c2 = cr[i + h], s1 = sr[i], s2 = sr[i + h];
            A y1, y2;
            if (!backward) {
                y1 = x1 * c1 - x2 * s1;
                y2 = x2 * c2 + x1 * s2;
            } else {
                y1 = x1 * c1 + x2 * s2;
                y2 = x2 * c2 - x1 * s1;
            }
            orow[i] = conv<X>::store(y1);
            orow[i + h] = conv<X>::store(y2);
        }
    }
}

// -------------------------------------------------------------- launchers

namespace {

template <typename X, typename A>
int launch_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin, int backward) {
    const int nd = x->ndim, D = (int)x->sizes[nd - 1], T = (int)x->sizes[nd - 2];
    ms_layout lead;
    lead.ndim = nd - 1;
    long long rows = 1;
    for (int i = 0; i < 8; i++) {
        lead.sizes[i] = i < nd - 1 ? x->sizes[i] : 1;
        lead.strides[i] = i < nd - 1 ? x->strides[i] : 0;
        if (i < nd - 1) rows *= x->sizes[i];
    }
    if (rows == 0 || D == 0) return 0;
    const int threads = 256;
    long long blocks = (rows + threads / 32 - 1) / (threads / 32);
    if (blocks > 65535LL * 32) blocks = 65535LL * 32;
    rope_kernel<X, A><<<(unsigned)blocks, threads, 0, ms_cuda_stream_of(x->device_id)>>>(
        (X *)ms_tensor_data(out), (const X *)ms_tensor_data(x), lead, rows, T, D,
        (const A *)ms_tensor_data(cos), (const A *)ms_tensor_data(sin), backward);
    LAUNCH_CHECK("rope_kernel");
    return 0;
}

}  // namespace

extern "C" int ms_cuda_rope(ms_tensor *out, const ms_tensor *x, const ms_tensor *cos, const ms_tensor *sin,
                            int backward) {
    if (ms_cuda_activate(x->device_id)) return -1;
    if (x->dtype_id == MS_F64) return launch_rope<double, double>(out, x, cos, sin, backward);
    return with_float32_type(x->dtype_id, "rope", [&](auto xt) {
        using X = decltype(xt);
        return launch_rope<X, float>(out, x, cos, sin, backward);
    });
}
