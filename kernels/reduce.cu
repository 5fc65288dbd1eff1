// kernels/reduce.cu — reductions over one dim or all elements, and softmax /
// log_softmax forward and backward over one dim.
//
// The input is made contiguous and seen as (outer, n, inner) around the
// reduced dim; there are outer*inner outputs. When inner == 1 (the last dim,
// the common case: rows of logits, hidden states) a warp owns a row and its
// lanes read consecutive elements; otherwise a thread owns an output and
// neighbouring threads read neighbouring columns, so loads stay coalesced.
// Accumulation is in f64 (these are memory-bound: one read of the input,
// one write of the output), so results match the CPU reference closely.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <math.h>

// ---------------------------------------------------------------- kernels

struct red_state {
    double v;     // running sum / product / max / min, or lse max
    double s;     // lse: running sum of exp(x - v)
    long long i;  // argmax/argmin index
};

__device__ __forceinline__ red_state red_init(int op) {
    red_state r;
    r.s = 0;
    r.i = 0;
    switch (op) {
    case MS_RED_PROD: r.v = 1; break;
    case MS_RED_MAX: case MS_RED_ARGMAX: case MS_RED_LOGSUMEXP: r.v = -INFINITY; r.i = -1; break;
    case MS_RED_MIN: case MS_RED_ARGMIN: r.v = INFINITY; r.i = -1; break;
    default: r.v = 0;
    }
    return r;
}

// fold element x at index k into r
__device__ __forceinline__ void red_add(int op, red_state &r, double x, long long k) {
    switch (op) {
    case MS_RED_SUM: case MS_RED_MEAN: r.v += x; break;
    case MS_RED_PROD: r.v *= x; break;
    case MS_RED_MAX: if (x > r.v || x != x) r.v = (r.v != r.v) ? r.v : x; break;
    case MS_RED_MIN: if (x < r.v || x != x) r.v = (r.v != r.v) ? r.v : x; break;
    case MS_RED_ARGMAX:
        if (r.i < 0 || x > r.v || (x != x && r.v == r.v)) { r.v = x; r.i = k; }
        break;
    case MS_RED_ARGMIN:
        if (r.i < 0 || x < r.v || (x != x && r.v == r.v)) { r.v = x; r.i = k; }
        break;
    case MS_RED_LOGSUMEXP:
        if (x > r.v) { r.s = r.s * exp(r.v - x) + 1; r.v = x; }
        else if (x == x) r.s += exp(x - r.v);
        else { r.v = x; r.s = 1; }
        break;
    }
}

// merge b into a (b covers later indices than a when lanes are in order)
__device__ __forceinline__ void red_merge(int op, red_state &a, const red_state &b) {
    switch (op) {
    case MS_RED_SUM: case MS_RED_MEAN: a.v += b.v; break;
    case MS_RED_PROD: a.v *= b.v; break;
    case MS_RED_MAX: case MS_RED_MIN: red_add(op, a, b.v, 0); break;
    case MS_RED_ARGMAX: case MS_RED_ARGMIN:
        if (b.i < 0) break;
        if (a.i < 0) { a = b; break; }
        {
            bool nan_a = a.v != a.v, nan_b = b.v != b.v;
            bool better = op == MS_RED_ARGMAX ? b.v > a.v : b.v < a.v;
            if ((nan_b && !nan_a) || (!nan_a && better) || ((b.v == a.v || (nan_a && nan_b)) && b.i < a.i)) a = b;
        }
        break;
    case MS_RED_LOGSUMEXP:
        if (b.v == -INFINITY) break;
        if (a.v == -INFINITY) { a = b; break; }
        if (b.v > a.v) { a.s = a.s * exp(a.v - b.v) + b.s; a.v = b.v; }
        else a.s += b.s * exp(b.v - a.v);
        break;
    }
}

__device__ __forceinline__ double red_final(int op, const red_state &r, long long n) {
    switch (op) {
    case MS_RED_MEAN: return r.v / (double)n;
    case MS_RED_ARGMAX: case MS_RED_ARGMIN: return (double)(r.i < 0 ? 0 : r.i);
    case MS_RED_LOGSUMEXP: return r.v == -INFINITY ? -INFINITY : r.v + log(r.s);
    default: return r.v;
    }
}

__device__ __forceinline__ red_state shfl_state(const red_state &r, int src) {
    red_state o;
    o.v = __shfl_down_sync(0xffffffffu, r.v, src);
    o.s = __shfl_down_sync(0xffffffffu, r.s, src);
    o.i = __shfl_down_sync(0xffffffffu, r.i, src);
    return o;
}

// one warp per row of n contiguous elements
__global__ void reduce_rows_kernel(void *out, int dto, const void *in, int dti, long long rows, long long n, int op) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    red_state r = red_init(op);
    // each lane folds a contiguous stretch so that argmax ties keep the first index
    long long per = (n + 31) / 32, lo = lane * per, hi = lo + per < n ? lo + per : n;
    for (long long k = lo; k < hi; k++) red_add(op, r, ld_any(in, dti, row * n + k), k);
    for (int off = 1; off < 32; off *= 2) {
        red_state o = shfl_state(r, off);
        if ((lane & (2 * off - 1)) == 0 && lane + off < 32) red_merge(op, r, o);
    }
    if (lane == 0) st_any(out, dto, row, red_final(op, r, n));
}

// one thread per (outer, inner) output, walking n with stride inner
__global__ void reduce_cols_kernel(void *out, int dto, const void *in, int dti, long long outer, long long n,
                                   long long inner, int op) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= outer * inner) return;
    long long o = j / inner, i = j - o * inner;
    red_state r = red_init(op);
    const long long base = o * n * inner + i;
    for (long long k = 0; k < n; k++) red_add(op, r, ld_any(in, dti, base + k * inner), k);
    st_any(out, dto, j, red_final(op, r, n));
}

// Two passes for few, long columns (a bias gradient: (B*T, C) summed over
// the rows): pass 1 splits the n rows into `groups` slices, one thread per
// (output, slice) folding its slice into a partial state; pass 2 merges the
// partial states of each output in slice order — deterministic, and enough
// threads to fill the GPU where one thread per output would not.
__global__ void reduce_cols_partial_kernel(red_state *part, const void *in, int dti, long long outer, long long n,
                                           long long inner, int op, long long groups) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long g = blockIdx.y;
    if (j >= outer * inner) return;
    long long o = j / inner, i = j - o * inner;
    long long per = (n + groups - 1) / groups, lo = g * per, hi = lo + per < n ? lo + per : n;
    red_state r = red_init(op);
    const long long base = o * n * inner + i;
    for (long long k = lo; k < hi; k++) red_add(op, r, ld_any(in, dti, base + k * inner), k);
    part[g * outer * inner + j] = r;
}

__global__ void reduce_cols_final_kernel(void *out, int dto, const red_state *part, long long nout, long long n,
                                         int op, long long groups) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= nout) return;
    red_state r = part[j];
    for (long long g = 1; g < groups; g++) red_merge(op, r, part[g * nout + j]);
    st_any(out, dto, j, red_final(op, r, n));
}

// Few, long rows (a sum over all of a big tensor): pass 1 gives each
// (slice, row) a block: thread t folds elements lo + t, lo + t + 256, ...
// of its slice, then the block merges the 256 states in a fixed tree;
// pass 2 merges a row's slice states the same way in one block. The same
// bits every run (before this, one thread a slice and one thread merging
// 65535 slices: 12.9 ms for a sum of 16.7M bf16 on an H200).
__device__ void block_merge(int op, red_state *sh) {
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w) red_merge(op, sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
}

__global__ void __launch_bounds__(256) reduce_long_partial_kernel(red_state *part, const void *in, int dti, long long n,
                                                                  int op, long long groups) {
    __shared__ red_state sh[256];
    long long g = blockIdx.x, row = blockIdx.y;
    long long per = (n + groups - 1) / groups, lo = g * per, hi = lo + per < n ? lo + per : n;
    red_state r = red_init(op);
    for (long long k = lo + threadIdx.x; k < hi; k += blockDim.x) red_add(op, r, ld_any(in, dti, row * n + k), k);
    sh[threadIdx.x] = r;
    __syncthreads();
    block_merge(op, sh);
    if (threadIdx.x == 0) part[row * groups + g] = sh[0];
}

__global__ void __launch_bounds__(256) reduce_long_final_kernel(void *out, int dto, const red_state *part, long long n,
                                                                int op, long long groups) {
    __shared__ red_state sh[256];
    long long row = blockIdx.x;
    red_state r = red_init(op);
    for (long long g = threadIdx.x; g < groups; g += blockDim.x) red_merge(op, r, part[row * groups + g]);
    sh[threadIdx.x] = r;
    __syncthreads();
    block_merge(op, sh);
    if (threadIdx.x == 0) st_any(out, dto, row, red_final(op, sh[0], n));
}

// Sums over a middle dim with a contiguous inner part (a bias gradient: the
// column sums of (N, C)): a thread owns V neighbouring columns (one 16-byte
// load per row), 8 row-lanes per block walk the rows of one group, the
// lanes are added in order through shared memory; groups of rows write f64
// partial sums that a second kernel adds in order (no atomics: the same
// bits every run). grid (ceil(inner / (32 V)), groups, outer).
template <typename T>
__global__ void __launch_bounds__(256) colsum_vec_partial_kernel(double *part, const T *in, long long outer, long long n,
                                                                 long long inner, long long groups) {
    const int V = 16 / sizeof(T);
    __shared__ double sh[8][32][V + 1];
    const long long c0 = (blockIdx.x * 32LL + threadIdx.x) * V, o = blockIdx.z, g = blockIdx.y;
    const long long per = (n + groups - 1) / groups, lo = g * per, hi = lo + per < n ? lo + per : n;
    double acc[V];
#pragma unroll
    for (int j = 0; j < V; j++) acc[j] = 0;
    if (c0 < inner) {
        const T *base = in + o * n * inner + c0;
        for (long long k = lo + threadIdx.y; k < hi; k += 8) {
            float v[V];
            load_v<float, T, V>(v, base + k * inner);
#pragma unroll
            for (int j = 0; j < V; j++) acc[j] += v[j];
        }
    }
#pragma unroll
    for (int j = 0; j < V; j++) sh[threadIdx.y][threadIdx.x][j] = acc[j];
    __syncthreads();
    if (threadIdx.y == 0 && c0 < inner) {
#pragma unroll
        for (int j = 0; j < V; j++) {
            double t = 0;
            for (int y = 0; y < 8; y++) t += sh[y][threadIdx.x][j];
            part[(g * outer + o) * inner + c0 + j] = t;
        }
    }
}

__global__ void colsum_vec_final_kernel(void *out, int dto, const double *part, long long nout, long long n, int mean,
                                        long long groups) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= nout) return;
    double t = 0;
    for (long long g = 0; g < groups; g++) t += part[g * nout + j];
    st_any(out, dto, j, mean ? t / (double)n : t);
}

// softmax over rows (inner == 1): warp per row, online max/sum then write
__global__ void softmax_rows_kernel(void *out, const void *in, int dt, long long rows, long long n, int lg) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    red_state r = red_init(MS_RED_LOGSUMEXP);
    for (long long k = lane; k < n; k += 32) red_add(MS_RED_LOGSUMEXP, r, ld_any(in, dt, row * n + k), k);
    for (int off = 16; off > 0; off /= 2) {
        red_state o = shfl_state(r, off);
        red_merge(MS_RED_LOGSUMEXP, r, o);
    }
    double m = __shfl_sync(0xffffffffu, r.v, 0), s = __shfl_sync(0xffffffffu, r.s, 0);
    double lse = m + log(s);
    for (long long k = lane; k < n; k += 32) {
        double x = ld_any(in, dt, row * n + k);
        st_any(out, dt, row * n + k, lg ? x - lse : exp(x - lse));
    }
}

__global__ void softmax_cols_kernel(void *out, const void *in, int dt, long long outer, long long n,
                                    long long inner, int lg) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= outer * inner) return;
    long long o = j / inner, i = j - o * inner, base = o * n * inner + i;
    red_state r = red_init(MS_RED_LOGSUMEXP);
    for (long long k = 0; k < n; k++) red_add(MS_RED_LOGSUMEXP, r, ld_any(in, dt, base + k * inner), k);
    double lse = r.v + log(r.s);
    for (long long k = 0; k < n; k++) {
        double x = ld_any(in, dt, base + k * inner);
        st_any(out, dt, base + k * inner, lg ? x - lse : exp(x - lse));
    }
}

// softmax backward: dx = y*(g - sum(g*y)); log_softmax: dx = g - exp(y)*sum(g)
__global__ void softmax_bwd_kernel(void *out, const void *y, const void *g, int dt, long long outer, long long n,
                                   long long inner, int lg) {
    long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= outer * inner) return;
    long long o = j / inner, i = j - o * inner, base = o * n * inner + i;
    double dot = 0;
    for (long long k = 0; k < n; k++) {
        long long e = base + k * inner;
        dot += lg ? ld_any(g, dt, e) : ld_any(g, dt, e) * ld_any(y, dt, e);
    }
    for (long long k = 0; k < n; k++) {
        long long e = base + k * inner;
        double yv = ld_any(y, dt, e), gv = ld_any(g, dt, e);
        st_any(out, dt, e, lg ? gv - exp(yv) * dot : yv * (gv - dot));
    }
}

// softmax backward over contiguous rows (inner == 1): warp per row
__global__ void softmax_bwd_rows_kernel(void *out, const void *y, const void *g, int dt, long long rows, long long n,
                                        int lg) {
    long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const long long base = row * n;
    double dot = 0;
    for (long long k = lane; k < n; k += 32)
        dot += lg ? ld_any(g, dt, base + k) : ld_any(g, dt, base + k) * ld_any(y, dt, base + k);
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    for (long long k = lane; k < n; k += 32) {
        double yv = ld_any(y, dt, base + k), gv = ld_any(g, dt, base + k);
        st_any(out, dt, base + k, lg ? gv - exp(yv) * dot : yv * (gv - dot));
    }
}

// -------------------------------------------------------------- launchers

namespace {

// (outer, n, inner) of a contiguous tensor around dim (-1000: all)
void split_dims(const ms_tensor *a, int dim, long long *outer, long long *n, long long *inner) {
    *outer = 1; *n = 1; *inner = 1;
    if (dim == MS_ALL_DIMS) {
        *n = ms_tensor_numel(a);
        return;
    }
    for (int i = 0; i < a->ndim; i++) {
        if (i < dim) *outer *= a->sizes[i];
        else if (i == dim) *n = a->sizes[i];
        else *inner *= a->sizes[i];
    }
}

struct contig_input {
    ms_tensor *t = nullptr;
    ~contig_input() { ms_tensor_free(t); }
};

}  // namespace

extern "C" int ms_cuda_reduce(ms_tensor *out, int op, const ms_tensor *a, int dim) {
    contig_input c;
    if (ms_tensor_contiguous(&c.t, a)) return -1;
    long long outer, n, inner;
    split_dims(c.t, dim, &outer, &n, &inner);
    long long nout = outer * inner;
    if (nout == 0) return 0;
    if (ms_cuda_activate(out->device_id)) return -1;
    cudaStream_t s = ms_cuda_stream_of(out->device_id);
    // out may be non-contiguous only when the caller passed one; write a
    // contiguous temporary then
    contig_input tmp;
    ms_tensor *dst = out;
    if (!ms_tensor_is_contiguous(out)) {
        if (ms_tensor_empty(&tmp.t, out->ndim, out->sizes, out->dtype_id, out->device_id)) return -1;
        dst = tmp.t;
    }
    int es = ms_dtype_size(c.t->dtype_id);
    if ((op == MS_RED_SUM || op == MS_RED_MEAN) && inner > 1 && n >= 64 && outer <= 65535 &&
        (c.t->dtype_id == MS_F32 || c.t->dtype_id == MS_BF16 || c.t->dtype_id == MS_F16) &&
        (inner * es) % 16 == 0 && ms_aligned16(ms_tensor_data(c.t))) {
        const long long cols_per_block = 32LL * (16 / es);
        long long bx = (inner + cols_per_block - 1) / cols_per_block;
        long long groups = (4LL * ms_sm_count(out->device_id)) / (bx * outer);
        if (groups > n / 64) groups = n / 64;
        if (groups > 65535) groups = 65535;
        if (groups < 1) groups = 1;
        contig_input part;
        int64_t pn = (int64_t)(groups * nout);
        if (ms_tensor_empty(&part.t, 1, &pn, MS_F64, out->device_id)) return -1;
        dim3 grid((unsigned)bx, (unsigned)groups, (unsigned)outer), block(32, 8);
        double *pp = (double *)ms_tensor_data(part.t);
        switch (c.t->dtype_id) {
        case MS_F32:
            colsum_vec_partial_kernel<float><<<grid, block, 0, s>>>(pp, (const float *)ms_tensor_data(c.t), outer, n,
                                                                     inner, groups);
            break;
        case MS_BF16:
            colsum_vec_partial_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(
                pp, (const __nv_bfloat16 *)ms_tensor_data(c.t), outer, n, inner, groups);
            break;
        default:
            colsum_vec_partial_kernel<__half><<<grid, block, 0, s>>>(pp, (const __half *)ms_tensor_data(c.t), outer,
                                                                      n, inner, groups);
        }
        LAUNCH_CHECK("colsum_vec_partial_kernel");
        colsum_vec_final_kernel<<<(unsigned)((nout + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), dst->dtype_id, pp, nout, n, op == MS_RED_MEAN, groups);
        LAUNCH_CHECK("colsum_vec_final_kernel");
        if (dst != out) return ms_cuda_convert(out, dst);
        return 0;
    }
    bool long_rows = inner == 1 && nout < 1024 && n >= 65536;  // e.g. a sum over all of a big tensor
    if (inner == 1 && !long_rows) {
        long long threads = nout * 32;
        reduce_rows_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), dst->dtype_id, ms_tensor_data(c.t), c.t->dtype_id, nout, n, op);
        LAUNCH_CHECK("reduce_rows_kernel");
    } else if (long_rows) {
        long long groups = n / 4096;
        if (groups > 1024) groups = 1024;
        if (groups < 1) groups = 1;
        contig_input part;
        int64_t bytes = (int64_t)(groups * nout * (long long)sizeof(red_state));
        if (ms_tensor_empty(&part.t, 1, &bytes, MS_U8, out->device_id)) return -1;
        reduce_long_partial_kernel<<<dim3((unsigned)groups, (unsigned)nout), 256, 0, s>>>(
            (red_state *)ms_tensor_data(part.t), ms_tensor_data(c.t), c.t->dtype_id, n, op, groups);
        LAUNCH_CHECK("reduce_long_partial_kernel");
        reduce_long_final_kernel<<<(unsigned)nout, 256, 0, s>>>(ms_tensor_data(dst), dst->dtype_id,
                                                                (const red_state *)ms_tensor_data(part.t), n, op, groups);
        LAUNCH_CHECK("reduce_long_final_kernel");
    } else if (nout < 32768 && n >= 256) {
        long long groups = (65536 * 4) / nout;
        if (groups > n / 64) groups = n / 64;
        if (groups > 65535) groups = 65535;
        if (groups < 2) groups = 2;
        contig_input part;
        int64_t bytes = (int64_t)(groups * nout * (long long)sizeof(red_state));
        if (ms_tensor_empty(&part.t, 1, &bytes, MS_U8, out->device_id)) return -1;
        dim3 grid((unsigned)((nout + 255) / 256), (unsigned)groups);
        reduce_cols_partial_kernel<<<grid, 256, 0, s>>>((red_state *)ms_tensor_data(part.t), ms_tensor_data(c.t),
                                                        c.t->dtype_id, outer, n, inner, op, groups);
        LAUNCH_CHECK("reduce_cols_partial_kernel");
        reduce_cols_final_kernel<<<(unsigned)((nout + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), dst->dtype_id, (const red_state *)ms_tensor_data(part.t), nout, n, op, groups);
        LAUNCH_CHECK("reduce_cols_final_kernel");
    } else {
        reduce_cols_kernel<<<(unsigned)((nout + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), dst->dtype_id, ms_tensor_data(c.t), c.t->dtype_id, outer, n, inner, op);
        LAUNCH_CHECK("reduce_cols_kernel");
    }
    if (dst != out) return ms_cuda_convert(out, dst);
    return 0;
}

extern "C" int ms_cuda_softmax(ms_tensor *out, const ms_tensor *a, int dim, int log) {
    contig_input c, tmp;
    if (ms_tensor_contiguous(&c.t, a)) return -1;
    long long outer, n, inner;
    split_dims(c.t, dim, &outer, &n, &inner);
    long long nout = outer * inner;
    if (nout == 0 || n == 0) return 0;
    ms_tensor *dst = out;
    if (!ms_tensor_is_contiguous(out)) {
        if (ms_tensor_empty(&tmp.t, out->ndim, out->sizes, out->dtype_id, out->device_id)) return -1;
        dst = tmp.t;
    }
    if (ms_cuda_activate(out->device_id)) return -1;
    cudaStream_t s = ms_cuda_stream_of(out->device_id);
    if (inner == 1) {
        long long threads = nout * 32;
        softmax_rows_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), ms_tensor_data(c.t), c.t->dtype_id, nout, n, log);
        LAUNCH_CHECK("softmax_rows_kernel");
    } else {
        softmax_cols_kernel<<<(unsigned)((nout + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), ms_tensor_data(c.t), c.t->dtype_id, outer, n, inner, log);
        LAUNCH_CHECK("softmax_cols_kernel");
    }
    if (dst != out) return ms_cuda_convert(out, dst);
    return 0;
}

extern "C" int ms_cuda_softmax_backward(ms_tensor *out, const ms_tensor *y, const ms_tensor *g, int dim, int log) {
    contig_input cy, cg, tmp;
    if (ms_tensor_contiguous(&cy.t, y) || ms_tensor_contiguous(&cg.t, g)) return -1;
    long long outer, n, inner;
    split_dims(cy.t, dim, &outer, &n, &inner);
    long long nout = outer * inner;
    if (nout == 0 || n == 0) return 0;
    ms_tensor *dst = out;
    if (!ms_tensor_is_contiguous(out)) {
        if (ms_tensor_empty(&tmp.t, out->ndim, out->sizes, out->dtype_id, out->device_id)) return -1;
        dst = tmp.t;
    }
    if (ms_cuda_activate(out->device_id)) return -1;
    cudaStream_t s = ms_cuda_stream_of(out->device_id);
    if (inner == 1) {
        long long threads = nout * 32;
        softmax_bwd_rows_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), ms_tensor_data(cy.t), ms_tensor_data(cg.t), cy.t->dtype_id, nout, n, log);
        LAUNCH_CHECK("softmax_bwd_rows_kernel");
    } else {
        softmax_bwd_kernel<<<(unsigned)((nout + 255) / 256), 256, 0, s>>>(
            ms_tensor_data(dst), ms_tensor_data(cy.t), ms_tensor_data(cg.t), cy.t->dtype_id, outer, n, inner, log);
        LAUNCH_CHECK("softmax_bwd_kernel");
    }
    if (dst != out) return ms_cuda_convert(out, dst);
    return 0;
}
