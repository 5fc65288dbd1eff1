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
// alignment; a tensor whose arrays are all aligned for two elements a load
// goes in pairs of adjacent elements (PILP pairs a thread a step), the same
// math. Longer or mixed lists take several launches.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

const int MAX_TENSORS = 48;   // per launch: pointers and sizes fit the kernel's parameter space
const int CHUNK = 16384;      // elements per block
const int THREADS = 512;
const int ILP = 4;            // elements per thread per step, a block apart
const int PILP = 2;           // pairs of adjacent elements per thread per step (the paired form)

struct adam_list {
    void *p[MAX_TENSORS];
    const void *g[MAX_TENSORS];
    void *m[MAX_TENSORS];
    void *v[MAX_TENSORS];
    void *w[MAX_TENSORS];   // the f32 master of p (or NULL): read and written instead of p
    long long n[MAX_TENSORS];
    unsigned char pairs[MAX_TENSORS];  // every array aligned for two elements a load: the paired form
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

// the constants of a launch
template <typename S> struct adam_k {
    S beta1, beta2, eps, decay, step_size, bc2_sqrt, sc;
    bool scaled;
};

// one element: its stored gradient, moments and value in; the moments
// updated in place, the new value returned (f32 math; f64 for f64)
template <typename G, typename S>
__device__ __forceinline__ S adam_one(G gs, S &m, S &v, S p, const adam_k<S> &k) {
    S g = (S)conv<G>::load(gs);
    if (k.scaled) g = (S)conv<G>::load(conv<G>::store(g * k.sc));
    m = k.beta1 * m + ((S)1 - k.beta1) * g;
    v = k.beta2 * v + ((S)1 - k.beta2) * g * g;
    return p * k.decay - k.step_size * m / (sqrt(v) / k.bc2_sqrt + k.eps);
}

// two adjacent elements, loaded and stored as one (8 bytes of f32, 4 of bf16)
template <typename T> struct alignas(2 * sizeof(T)) pair_of {
    T a, b;
};

// Each block's pointers are moved to its chunk's start once, so a thread's
// elements sit at 32-bit offsets THREADS apart: one 64-bit address per array
// and immediate offsets (a 64-bit index per element and array took 70
// registers, one block of 512 threads an SM, 61-65% of the copy bandwidth
// with bf16 parameters or gradients; bench/fused_kernels.lua). A tensor
// whose arrays are all aligned for it is taken in pairs of adjacent
// elements (L.pairs): one load or store of two, so a bf16 store moves 4
// bytes a thread instead of 2; the math and the bits are the same.
template <typename P, typename G, typename S>
__global__ void __launch_bounds__(THREADS, 2) adamw_kernel(adam_list L, adam_k<S> K, const double *__restrict__ gscale,
                                                          const double *__restrict__ kdev) {
    const int t = tensor_of(L.block_start, L.count, blockIdx.x);
    // the step's constants from the device (a graph's replay): the same
    // roundings of the same doubles as the host's arguments
    if (kdev) {
        K.decay = (S)kdev[0];
        K.step_size = (S)kdev[1];
        K.bc2_sqrt = (S)kdev[2];
    }
    // the clip coefficient (or 1): g·round_G(scale), rounded to G, as a
    // multiply of the stored gradient would have left it
    if (gscale) K.sc = (S)conv<G>::load(conv<G>::store((S)gscale[0]));
    K.scaled = gscale != nullptr;
    const long long lo = (long long)(blockIdx.x - L.block_start[t]) * CHUNK;
    const int len = (int)(L.n[t] - lo < CHUNK ? L.n[t] - lo : CHUNK);
    P *__restrict__ p = (P *)L.p[t] + lo;
    const G *__restrict__ g = (const G *)L.g[t] + lo;
    S *__restrict__ m = (S *)L.m[t] + lo;
    S *__restrict__ v = (S *)L.v[t] + lo;
    S *__restrict__ w = L.w[t] ? (S *)L.w[t] + lo : nullptr;
    int done = 0;   // elements taken in pairs
    if (L.pairs[t]) {
        const int np = len >> 1;
        const pair_of<G> *g2 = (const pair_of<G> *)g;
        pair_of<S> *m2 = (pair_of<S> *)m, *v2 = (pair_of<S> *)v, *w2 = (pair_of<S> *)w;
        pair_of<P> *p2 = (pair_of<P> *)p;
        for (int base = threadIdx.x; base < np; base += THREADS * PILP) {
            pair_of<G> gi[PILP];
            pair_of<S> mi[PILP], vi[PILP], pi[PILP];
#pragma unroll
            for (int k = 0; k < PILP; k++) {
                const int j = base + k * THREADS;
                if (j < np) {
                    gi[k] = g2[j];
                    mi[k] = m2[j];
                    vi[k] = v2[j];
                    if (w) {
                        pi[k] = w2[j];
                    } else {
                        const pair_of<P> q = p2[j];
                        pi[k].a = (S)conv<P>::load(q.a);
                        pi[k].b = (S)conv<P>::load(q.b);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < PILP; k++) {
                const int j = base + k * THREADS;
                if (j < np) {
                    pair_of<S> r;
                    r.a = adam_one<G, S>(gi[k].a, mi[k].a, vi[k].a, pi[k].a, K);
                    r.b = adam_one<G, S>(gi[k].b, mi[k].b, vi[k].b, pi[k].b, K);
                    m2[j] = mi[k];
                    v2[j] = vi[k];
                    if (w) w2[j] = r;
                    pair_of<P> q;
                    q.a = conv<P>::store(r.a);
                    q.b = conv<P>::store(r.b);
                    p2[j] = q;
                }
            }
        }
        done = np * 2;
    }
    // the rest one element at a time (all of it without pairs; an odd
    // chunk's last element with them)
    for (int base = done + threadIdx.x; base < len; base += THREADS * ILP) {
        G gi[ILP];
        S mi[ILP], vi[ILP], pi[ILP];
#pragma unroll
        for (int k = 0; k < ILP; k++) {
            const int i = base + k * THREADS;
            if (i < len) {
                gi[k] = g[i];
                mi[k] = m[i];
                vi[k] = v[i];
                pi[k] = w ? w[i] : (S)conv<P>::load(p[i]);
            }
        }
#pragma unroll
        for (int k = 0; k < ILP; k++) {
            const int i = base + k * THREADS;
            if (i < len) {
                const S pk = adam_one<G, S>(gi[k], mi[k], vi[k], pi[k], K);
                m[i] = mi[k];
                v[i] = vi[k];
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

__global__ void adamw_constants_kernel(double *dst, double k0, double k1, double k2) {
    dst[0] = k0;
    dst[1] = k1;
    dst[2] = k2;
}

// -------------------------------------------------------------- launchers

namespace {

long long blocks_for(long long n) { return (n + CHUNK - 1) / CHUNK; }

template <typename P, typename G, typename S>
int launch_adamw(const adam_list &L, double beta1, double beta2, double eps, double decay, double step_size,
                 double bc2_sqrt, const double *gscale, const double *kdev, cudaStream_t s) {
    adam_k<S> K;
    K.beta1 = (S)beta1;
    K.beta2 = (S)beta2;
    K.eps = (S)eps;
    K.decay = (S)decay;
    K.step_size = (S)step_size;
    K.bc2_sqrt = (S)bc2_sqrt;
    K.sc = (S)1;
    K.scaled = false;
    adamw_kernel<P, G, S><<<L.block_start[L.count], THREADS, 0, s>>>(L, K, gscale, kdev);
    LAUNCH_CHECK("adamw_kernel");
    return 0;
}

int adamw_batch(const adam_list &L, int pdt, int gdt, double beta1, double beta2, double eps, double decay,
                double step_size, double bc2_sqrt, const double *gs, const double *kdev, cudaStream_t s) {
    if (L.count == 0 || L.block_start[L.count] == 0) return 0;
    if (pdt == MS_F64) {
        if (gdt != MS_F64) return ms_errorf("adamw_: an f64 parameter takes an f64 gradient on cuda, got %s",
                                            ms_dtype_name(gdt));
        return launch_adamw<double, double, double>(L, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, kdev, s);
    }
    return with_float32_type(pdt, "adamw_", [&](auto pt) {
        using P = decltype(pt);
        return with_float32_type(gdt, "adamw_", [&](auto gt) {
            using G = decltype(gt);
            return launch_adamw<P, G, float>(L, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, kdev, s);
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

bool aligned(const void *a, size_t b) { return (uintptr_t)a % b == 0; }
// MS_ADAMW_PAIRS=0: one element at a time everywhere (to compare)
bool use_pairs() {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("MS_ADAMW_PAIRS");
        on = !(e && !strcmp(e, "0"));
    }
    return on == 1;
}

}  // namespace

extern "C" int ms_cuda_adamw(int n, ms_tensor *const *p, ms_tensor *const *g, ms_tensor *const *m,
                             ms_tensor *const *v, double beta1, double beta2, double eps, const double k[3],
                             const double *kdev, ms_tensor *const *w, const double *gs) {
    const int dev = p[0]->device_id;
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t s = ms_cuda_stream_of(dev);
    const double decay = k[0], step_size = k[1], bc2_sqrt = k[2];
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
            if (adamw_batch(L, pdt, gdt, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, kdev, s)) return -1;
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
        // (chunks start at multiples of CHUNK, an even count: the arrays'
        // starts decide every chunk's alignment)
        const size_t psz = (size_t)ms_dtype_size(pdt), gsz = (size_t)ms_dtype_size(gdt),
                     ssz = (size_t)ms_dtype_size(m[i]->dtype_id);
        L.pairs[k] = use_pairs() && aligned(L.p[k], 2 * psz) && aligned(L.g[k], 2 * gsz) &&
                     aligned(L.m[k], 2 * ssz) && aligned(L.v[k], 2 * ssz) && (!L.w[k] || aligned(L.w[k], 2 * ssz));
        L.block_start[k + 1] = L.block_start[k] + (int)nb;
    }
    return adamw_batch(L, pdt, gdt, beta1, beta2, eps, decay, step_size, bc2_sqrt, gs, kdev, s);
}

extern "C" int ms_cuda_adamw_constants(ms_tensor *dst, const double k[3]) {
    const int dev = dst->device_id;
    if (ms_cuda_activate(dev)) return -1;
    adamw_constants_kernel<<<1, 1, 0, ms_cuda_stream_of(dev)>>>((double *)ms_tensor_data(dst), k[0], k[1], k[2]);
    LAUNCH_CHECK("adamw_constants_kernel");
    return 0;
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
