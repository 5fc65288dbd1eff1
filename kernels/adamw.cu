// kernels/adamw.cu — the fused AdamW step over a list of tensors, and the
// sum of squares behind the global grad norm (contracts in core/ops.h; CPU
// references core/adamw_cpu.c).
//
// AdamW: for every element of every tensor of the list, in one pass,
//   p <- p·(1 - lr·wd);  m <- β1·m + (1-β1)·g;  v <- β2·v + (1-β2)·g²
//   p <- p - lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
// Why fused: the composed update is a dozen elementwise ops per tensor
// (each a launch and a pass over memory); here each element is read once
// (p, g, m, v) and written once (p, m, v), and a whole parameter group
// (GPT-2 124M: 148 tensors) is one launch. Bytes per element: |p|+|g|+8
// read, |p|+8 written (f32 p, bf16 g: 18 + 12). Math in f32 (f64 for f64
// parameters); bf16/f16 parameters are updated in f32 and rounded once.
//
// Layout: a launch takes up to MAX_TENSORS tensors of one (param, grad)
// dtype pair, their pointers and sizes passed by value; each block owns a
// CHUNK of one tensor (block_start maps blocks to tensors) and each thread
// ILP elements spaced a block apart, so loads stay coalesced for any
// alignment. Longer or mixed lists take several launches.
//
// Sum of squares: the same list walk; each block adds its chunk's squares
// in f64 (threads, then warps in order) into one slot of a partial array,
// and one block adds the partials in a fixed order into the 0-dim f64
// result. No atomics: the result is the same on every run. Bytes: one read
// of every element.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <math.h>

namespace {

const int MAX_TENSORS = 48;   // per launch: pointers and sizes fit the kernel's parameter space
const int CHUNK = 16384;      // elements per block
const int THREADS = 512;
const int ILP = 4;            // elements per thread per step, a block apart

struct adam_list {
    void *p[MAX_TENSORS];
    const void *g[MAX_TENSORS];
    void *m[MAX_TENSORS];
    void *v[MAX_TENSORS];
    void *w[MAX_TENSORS];   // the f32 master of p (or NULL): read and written instead of p
    long long n[MAX_TENSORS];
    int block_start[MAX_TENSORS + 1];  // block_start[count] = blocks of the launch
    int count;
};

struct sq_list {
    const void *t[MAX_TENSORS];
    long long n[MAX_TENSORS];
    int block_start[MAX_TENSORS + 1];
    int count;
};

}  // namespace

// ---------------------------------------------------------------- kernels

// the tensor of block b (block_start is sorted; at most MAX_TENSORS entries)
__device__ __forceinline__ int tensor_of(const int *block_start, int count, int b) {
    int t = 0;
    while (t + 1 < count && block_start[t + 1] <= b) t++;
    return t;
}

// Each block's pointers are moved to its chunk's start once, so a thread's
// elements sit at 32-bit offsets THREADS apart: one 64-bit address per array
// and immediate offsets (a 64-bit index per element and array took 70
// registers, one block of 512 threads an SM, 61-65% of the copy bandwidth
// with bf16 parameters or gradients; bench/fused_kernels.lua).
template <typename P, typename G, typename S>
__global__ void __launch_bounds__(THREADS, 2) adamw_kernel(adam_list L, S beta1, S beta2, S eps, S decay,
                                                        S step_size, S bc2_sqrt, const double *__restrict__ gscale) {
    const int t = tensor_of(L.block_start, L.count, blockIdx.x);
    // the clip coefficient (or 1): g·round_G(scale), rounded to G, as a
    // multiply of the stored gradient would have left it
    const S sc = gscale ? (S)conv<G>::load(conv<G>::store((S)gscale[0])) : (S)1;
    const long long lo = (long long)(blockIdx.x - L.block_start[t]) * CHUNK;
    const int len = (int)(L.n[t] - lo < CHUNK ? L.n[t] - lo : CHUNK);
    P *__restrict__ p = (P *)L.p[t] + lo;
    const G *__restrict__ g = (const G *)L.g[t] + lo;
    S *__restrict__ m = (S *)L.m[t] + lo;
    S *__restrict__ v = (S *)L.v[t] + lo;
    S *__restrict__ w = L.w[t] ? (S *)L.w[t] + lo : nullptr;
    for (int base = threadIdx.x; base < len; base += THREADS * ILP) {
        S gi[ILP], mi[ILP], vi[ILP], pi[ILP];
#pragma unroll
        for (int k = 0; k < ILP; k++) {
            const int i = base + k * THREADS;
            if (i < len) {
                gi[k] = (S)conv<G>::load(g[i]);
                if (gscale) gi[k] = (S)conv<G>::load(conv<G>::store(gi[k] * sc));
                mi[k] = m[i];
                vi[k] = v[i];
                pi[k] = w ? w[i] : (S)conv<P>::load(p[i]);
            }
        }
#pragma unroll
        for (int k = 0; k < ILP; k++) {
            const int i = base + k * THREADS;
            if (i < len) {
                const S mk = beta1 * mi[k] + ((S)1 - beta1) * gi[k];
                const S vk = beta2 * vi[k] + ((S)1 - beta2) * gi[k] * gi[k];
                const S pk = pi[k] * decay - step_size * mk / (sqrt(vk) / bc2_sqrt + eps);
                m[i] = mk;
                v[i] = vk;
                if (w) w[i] = pk;
                p[i] = conv<P>::store(pk);
            }
        }
    }
}

template <typename T>
__global__ void sum_squares_kernel(sq_list L, double *__restrict__ partial) {
    __shared__ double red[32];
    const int t = tensor_of(L.block_start, L.count, blockIdx.x);
    const T *x = (const T *)L.t[t];
    const long long lo = (long long)(blockIdx.x - L.block_start[t]) * CHUNK;
    const long long hi = lo + CHUNK < L.n[t] ? lo + CHUNK : L.n[t];
    // ILP loads in flight a thread (one at a time read bf16 at 31% of the
    // copy bandwidth); the order of the adds is fixed, so is the result
    double s = 0;
    for (long long base = lo + threadIdx.x; base < hi; base += (long long)THREADS * ILP) {
        double e[ILP];
#pragma unroll
        for (int k = 0; k < ILP; k++) {
            const long long i = base + (long long)k * THREADS;
            e[k] = i < hi ? (double)conv<T>::load(x[i]) : 0.0;
        }
#pragma unroll
        for (int k = 0; k < ILP; k++) s += e[k] * e[k];
    }
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0;
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) tot += red[k];
        partial[blockIdx.x] = tot;
    }
}

// out[0] = Σ partial[0..n) in a fixed order (one block of 1024 threads)
__global__ void sum_partials_kernel(double *__restrict__ out, const double *__restrict__ partial, long long n) {
    __shared__ double red[32];
    double s = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0;
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) tot += red[k];
        out[0] = tot;
    }
}

// -------------------------------------------------------------- launchers

namespace {

long long blocks_for(long long n) { return (n + CHUNK - 1) / CHUNK; }

template <typename P, typename G, typename S>
int launch_adamw(const adam_list &L, double beta1, double beta2, double eps, double decay, double step_size,
                 double bc2_sqrt, const double *gscale, cudaStream_t s) {
    adamw_kernel<P, G, S><<<L.block_start[L.count], THREADS, 0, s>>>(L, (S)beta1, (S)beta2, (S)eps, (S)decay,
                                                                     (S)step_size, (S)bc2_sqrt, gscale);
    LAUNCH_CHECK("adamw_kernel");
    return 0;
}

int adamw_batch(const adam_list &L, int pdt, int gdt, double beta1, double beta2, double eps, double decay,
                double step_size, double bc2_sqrt, const double *gs, cudaStream_t s) {
    if (L.count == 0 || L.block_start[L.count] == 0) return 0;
    if (pdt == MS_F64) {
        if (gdt != MS_F64) return ms_errorf("adamw_: an f64 parameter takes an f64 gradient on cuda, got %s",
                                            ms_dtype_name(gdt));
        return launch_adamw<double, double, double>(L, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, s);
    }
    return with_float32_type(pdt, "adamw_", [&](auto pt) {
        using P = decltype(pt);
        return with_float32_type(gdt, "adamw_", [&](auto gt) {
            using G = decltype(gt);
            return launch_adamw<P, G, float>(L, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, s);
        });
    });
}

int sq_batch(const sq_list &L, int dt, double *partial, cudaStream_t s) {
    if (L.count == 0 || L.block_start[L.count] == 0) return 0;
    const unsigned nb = (unsigned)L.block_start[L.count];
    switch (dt) {
    case MS_F64: sum_squares_kernel<double><<<nb, THREADS, 0, s>>>(L, partial); break;
    case MS_F32: sum_squares_kernel<float><<<nb, THREADS, 0, s>>>(L, partial); break;
    case MS_BF16: sum_squares_kernel<__nv_bfloat16><<<nb, THREADS, 0, s>>>(L, partial); break;
    case MS_F16: sum_squares_kernel<__half><<<nb, THREADS, 0, s>>>(L, partial); break;
    default: return ms_errorf("sum_squares: dtype %s is not supported by the kernel", ms_dtype_name(dt));
    }
    LAUNCH_CHECK("sum_squares_kernel");
    return 0;
}

// a launch holds at most MAX_TENSORS tensors and 2^30 blocks
const long long MAX_BLOCKS = 1LL << 30;

}  // namespace

extern "C" int ms_cuda_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m,
                             ms_tensor *const *v, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int64_t step, ms_tensor *const *w, const double *gs) {
    const int dev = p[0]->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t s = ms_cuda_stream_of(dev);
    const double decay = 1.0 - lr * weight_decay;
    const double step_size = lr / (1.0 - pow(beta1, (double)step));
    const double bc2_sqrt = sqrt(1.0 - pow(beta2, (double)step));
    adam_list L;
    L.count = 0;
    L.block_start[0] = 0;
    int pdt = -1, gdt = -1;
    for (int i = 0; i < n; i++) {
        long long numel = ms_tensor_numel(p[i]);
        if (numel == 0) continue;
        long long nb = blocks_for(numel);
        bool fits = L.count < MAX_TENSORS && L.block_start[L.count] + nb <= MAX_BLOCKS;
        if (L.count > 0 && (!fits || p[i]->dtype_id != pdt || g[i]->dtype_id != gdt)) {
            if (adamw_batch(L, pdt, gdt, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, s)) return -1;
            L.count = 0;
        }
        if (nb > MAX_BLOCKS) return ms_errorf("adamw_: a tensor of %lld elements is too large for one launch", numel);
        pdt = p[i]->dtype_id;
        gdt = g[i]->dtype_id;
        int k = L.count++;
        L.p[k] = ms_tensor_data(p[i]);
        L.g[k] = ms_tensor_data(g[i]);
        L.m[k] = ms_tensor_data(m[i]);
        L.v[k] = ms_tensor_data(v[i]);
        L.w[k] = w && w[i] ? ms_tensor_data(w[i]) : nullptr;
        L.n[k] = numel;
        L.block_start[k + 1] = L.block_start[k] + (int)nb;
    }
    return adamw_batch(L, pdt, gdt, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, s);
}

extern "C" int ms_cuda_sum_squares(ms_tensor *out, int n, ms_tensor *const *ts) {
    const int dev = out->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t s = ms_cuda_stream_of(dev);
    long long total = 0;
    for (int i = 0; i < n; i++) total += blocks_for(ms_tensor_numel(ts[i]));
    if (total == 0) return ms_cuda_fill(out, 0);
    ms_tensor *part = nullptr;
    int64_t ps[1] = {total};
    if (ms_tensor_empty(&part, 1, ps, MS_F64, dev)) return -1;
    double *partial = (double *)ms_tensor_data(part);
    sq_list L;
    L.count = 0;
    L.block_start[0] = 0;
    long long offset = 0;  // first partial slot of the current launch
    int dt = -1, rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        long long numel = ms_tensor_numel(ts[i]);
        if (numel == 0) continue;
        long long nb = blocks_for(numel);
        bool fits = L.count < MAX_TENSORS && L.block_start[L.count] + nb <= MAX_BLOCKS;
        if (L.count > 0 && (!fits || ts[i]->dtype_id != dt)) {
            rc = sq_batch(L, dt, partial + offset, s);
            offset += L.block_start[L.count];
            L.count = 0;
        }
        if (rc) break;
        if (nb > MAX_BLOCKS) {
            rc = ms_errorf("sum_squares: a tensor of %lld elements is too large for one launch", numel);
            break;
        }
        dt = ts[i]->dtype_id;
        int k = L.count++;
        L.t[k] = ms_tensor_data(ts[i]);
        L.n[k] = numel;
        L.block_start[k + 1] = L.block_start[k] + (int)nb;
    }
    if (!rc) rc = sq_batch(L, dt, partial + offset, s);
    if (!rc) {
        sum_partials_kernel<<<1, 1024, 0, s>>>((double *)ms_tensor_data(out), partial, total);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess)
            rc = ms_errorf("%s:%d: launch of sum_partials_kernel failed: %s", __FILE__, __LINE__,
                           cudaGetErrorString(err));
    }
    ms_tensor_free(part);
    return rc;
}
