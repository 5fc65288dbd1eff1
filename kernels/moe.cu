// kernels/moe.cu — the row moves of a mixture-of-experts layer (core/ops.h,
// core/moe.c has the CPU reference): a gather of rows with zeros at the
// padding, the weighted sum of each token's k rows, and that sum's
// backward (each row the token's gradient times its weight, and the
// weight's gradient, a dot product). One block a row; the threads stride
// over the row's H elements (coalesced), sums in f32 (f64 for f64). Ids out
// of range set the device flag (raised at the next sync point) and are
// skipped: nothing is read or written out of bounds. Also the routing's
// choice (one thread a token) and the slots' sort by expert (a counting
// sort in three launches; its own section below), so that a layer's
// routing needs only the experts' counts on the host.
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

#include <type_traits>

namespace {

__device__ __forceinline__ double ld(const double *p) { return *p; }
__device__ __forceinline__ float ld(const float *p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ void st(double *p, double v) { *p = v; }
__device__ __forceinline__ void st(float *p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half *p, float v) { *p = __float2half_rn(v); }

template <typename T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

__device__ __forceinline__ void flag_bad(ms_device_flag *f, long long pos, long long v, long long lim) {
    if (atomicCAS(&f->code, 0, 1) == 0) {
        f->position = pos;
        f->value = v;
        f->limit = lim;
    }
}

template <typename T>
__global__ void gather_rows_kernel(T *out, const T *x, const long long *idx, long long N, long long H,
                                   ms_device_flag *flag) {
    long long r = blockIdx.x;
    long long id = idx[r];
    T *o = out + r * H;
    if (id < 0 || id > N) {
        if (threadIdx.x == 0) flag_bad(flag, r, id, N + 1);
        id = N;
    }
    if (id == N) {
        for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = T(0.0f);
        return;
    }
    const T *s = x + id * H;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = s[h];
}

template <typename T>
__global__ void combine_kernel(T *out, const T *ys, const long long *inv, const T *w, int k, long long M, long long H,
                               ms_device_flag *flag) {
    typedef typename acc_of<T>::type A;
    long long n = blockIdx.x;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) {
        A acc = 0;
        for (int j = 0; j < k; j++) {
            long long s = n * k + j, r = inv[s];
            if (r < 0 || r >= M) {
                if (h == threadIdx.x && threadIdx.x == 0) flag_bad(flag, s, r, M);
                continue;
            }
            A wv = w ? (A)ld(w + s) : (A)1;
            acc += wv * (A)ld(ys + r * H + h);
        }
        st(out + n * H + h, acc);
    }
}

template <typename T>
__global__ void combine_backward_kernel(T *gys, T *gw, const T *g, const T *ys, const long long *back, const T *w,
                                        int k, long long Nk, long long H, ms_device_flag *flag) {
    typedef typename acc_of<T>::type A;
    __shared__ A part[32];
    long long r = blockIdx.x;
    long long s = back[r];
    T *o = gys + r * H;
    if (s < 0 || s > Nk) {
        if (threadIdx.x == 0) flag_bad(flag, r, s, Nk + 1);
        s = Nk;
    }
    if (s == Nk) {
        for (long long h = threadIdx.x; h < H; h += blockDim.x) o[h] = T(0.0f);
        return;
    }
    const T *gr = g + (s / k) * H, *yr = ys + r * H;
    A wv = (A)ld(w + s), dot = 0;
    for (long long h = threadIdx.x; h < H; h += blockDim.x) {
        A gv = (A)ld(gr + h);
        st(o + h, wv * gv);
        dot += gv * (A)ld(yr + h);
    }
    if (!gw) return;
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, off);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) part[wid] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
        A t = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) t += part[i];
        st(gw + s, t);
    }
}

// SwiGLU on a gate-and-up product gu (M, 2 I): h = silu(gate) up, and its
// backward into d13 (M, 2 I): d gate = silu'(gate) dh up, d up = silu(gate)
// dh. One block a row, f32 math (f64 for f64), each element read and
// written once.
template <typename A> __device__ __forceinline__ A sigmoid_a(A x) { return A(1) / (A(1) + exp(-x)); }

template <typename T>
__global__ void swiglu_kernel(T *h, const T *gu, long long I) {
    typedef typename acc_of<T>::type A;
    const long long r = blockIdx.x;
    const T *g = gu + r * 2 * I, *u = g + I;
    T *o = h + r * I;
    for (long long c = threadIdx.x; c < I; c += blockDim.x) {
        A x = ld(g + c);
        st(o + c, x * sigmoid_a(x) * (A)ld(u + c));
    }
}

template <typename T>
__global__ void swiglu_backward_kernel(T *d13, const T *gu, const T *dh, long long I) {
    typedef typename acc_of<T>::type A;
    const long long r = blockIdx.x;
    const T *g = gu + r * 2 * I, *u = g + I, *d = dh + r * I;
    T *dg = d13 + r * 2 * I, *du = dg + I;
    for (long long c = threadIdx.x; c < I; c += blockDim.x) {
        A x = ld(g + c), y = ld(d + c), s = sigmoid_a(x);
        st(du + c, x * s * y);
        st(dg + c, y * (A)ld(u + c) * s * (A(1) + x * (A(1) - s)));
    }
}

const int kThreads = 256;
const int kThreadsVec = 256;

// the same with 16-byte vectors (8 bf16, 4 f32) where I is a multiple of
// a vector and the tensors are 16-byte aligned: a grid-stride loop over
// the vectors, IX the index type (32-bit when the count fits)
template <typename T, typename IX>
__global__ void swiglu_vec_kernel(T *h, const T *gu, IX n, IX iv) {
    typedef typename acc_of<T>::type A;
    const int V = 16 / sizeof(T);
    for (IX i = blockIdx.x * (IX)blockDim.x + threadIdx.x; i < n; i += (IX)gridDim.x * blockDim.x) {
        const IX r = i / iv, c = (i - r * iv) * V, I = iv * V;
        A g[V], u[V], o[V];
        load_v<A, T, V>(g, gu + r * 2 * I + c);
        load_v<A, T, V>(u, gu + r * 2 * I + I + c);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] * sigmoid_a(g[k]) * u[k];
        store_v<T, V, A>(h + r * I + c, o);
    }
}

template <typename T, typename IX>
__global__ void swiglu_backward_vec_kernel(T *d13, const T *gu, const T *dh, IX n, IX iv) {
    typedef typename acc_of<T>::type A;
    const int V = 16 / sizeof(T);
    for (IX i = blockIdx.x * (IX)blockDim.x + threadIdx.x; i < n; i += (IX)gridDim.x * blockDim.x) {
        const IX r = i / iv, c = (i - r * iv) * V, I = iv * V;
        A g[V], u[V], d[V], dg[V], du[V];
        load_v<A, T, V>(g, gu + r * 2 * I + c);
        load_v<A, T, V>(u, gu + r * 2 * I + I + c);
        load_v<A, T, V>(d, dh + r * I + c);
#pragma unroll
        for (int k = 0; k < V; k++) {
            A s = sigmoid_a(g[k]);
            du[k] = g[k] * s * d[k];
            dg[k] = d[k] * u[k] * s * (A(1) + g[k] * (A(1) - s));
        }
        store_v<T, V, A>(d13 + r * 2 * I + c, dg);
        store_v<T, V, A>(d13 + r * 2 * I + I + c, du);
    }
}

// blocks for n vectors: enough to fill the device a few times over
static unsigned vec_blocks(long long n, int device) {
    long long b = (n + kThreadsVec - 1) / kThreadsVec, cap = 16LL * ms_sm_count(device);
    return (unsigned)(b < cap ? b : cap);
}


template <typename F> int by_dtype(int dt, F f) {
    switch (dt) {
    case MS_F64: return f((double *)nullptr);
    case MS_F32: return f((float *)nullptr);
    case MS_BF16: return f((__nv_bfloat16 *)nullptr);
    case MS_F16: return f((__half *)nullptr);
    default: return ms_errorf("moe rows: a float dtype is needed, got %d", dt);
    }
}

// (value, index) a before b: the higher value, then the lower index
template <typename T> __device__ __forceinline__ bool sel_before(T va, int ia, T vb, int ib) {
    return va > vb || (va == vb && ia < ib);
}
// (v, i) into the n best so far (best first, at most cap); returns the count
template <typename T> __device__ __forceinline__ int sel_insert(T *bv, int *bi, int n, int cap, T v, int i) {
    if (n == cap && !sel_before(v, i, bv[n - 1], bi[n - 1])) return n;
    int at = n < cap ? n : cap - 1;
    while (at > 0 && sel_before(v, i, bv[at - 1], bi[at - 1])) {
        bv[at] = bv[at - 1];
        bi[at] = bi[at - 1];
        at--;
    }
    bv[at] = v;
    bi[at] = i;
    return n < cap ? n + 1 : n;
}

// one token a thread: core/ops.h ms_moe_select (core/moe.c is the reference)
template <typename T>
__global__ void select_kernel(long long *ids, const T *scores, const T *bias, long long N, int E, int G, int TG,
                              int how, int k) {
    const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const T *row = scores + n * E;
    const int per = E / G;
    unsigned long long keep = ~0ull;
    if (G > 1) {
        T gv[MS_MOE_SELECT_MAX];
        int gi[MS_MOE_SELECT_MAX];
        int ng = 0;
        for (int g = 0; g < G; g++) {
            T b1 = -INFINITY, b2 = -INFINITY;
            for (int j = 0; j < per; j++) {
                const int e = g * per + j;
                const T v = row[e] + (bias ? bias[e] : T(0));
                if (v > b1) b2 = b1, b1 = v;
                else if (v > b2) b2 = v;
            }
            ng = sel_insert(gv, gi, ng, TG, how == 0 ? T(b1 + b2) : b1, g);
        }
        keep = 0;
        for (int t = 0; t < ng; t++) keep |= 1ull << gi[t];
    }
    T bv[MS_MOE_SELECT_MAX];
    int bi[MS_MOE_SELECT_MAX];
    int nb = 0;
    for (int e = 0; e < E; e++)
        if (keep >> (e / per) & 1) nb = sel_insert(bv, bi, nb, k, T(row[e] + (bias ? bias[e] : T(0))), e);
    for (int j = 0; j < k; j++) ids[n * k + j] = j < nb ? bi[j] : 0;
}

// ---- the slots sorted by expert (core/ops.h ms_moe_sort; core/moe.c's
// ms_moe_sort_slots is the reference) ----
//
// A counting sort in three launches, the n = N k slots cut into C chunks of
// S consecutive slots (C about two a multiprocessor; S at least 1024):
//   1. sort_count_kernel, a block a chunk: the chunk's slots of each expert
//      (a histogram in shared memory, one atomic a run of equal ids in a
//      warp), and the chunk's first bad slot;
//   2. sort_scan_kernel, one block: each expert's count and padded rows,
//      their prefix sums over the experts (where its slots and its rows
//      start), and each chunk's first order position for each expert (a
//      prefix over the chunks); the padding rows' tok and back; info;
//   3. sort_scatter_kernel, a block a chunk again: the chunk's slots in
//      tiles of 256, each slot's place = the chunk's next position for its
//      expert + the tile's earlier slots of that expert (its warp's lower
//      lanes by __match_any_sync, the lower warps' counts in shared memory),
//      and order, inv, tok, back written there.
// Why this and not a radix sort of (expert, slot) pairs (cub): the counts
// and the per-chunk prefix are what the padded layout needs anyway, every
// slot is read twice and each output written once (~40 bytes a slot: tens
// of microseconds at 10^6 slots), stability comes from the chunk and tile
// order without a second key, and no temporary of the sort's size is
// needed. Positions are 32-bit (n + E (align - 1) < 2^31, checked in core).
// A bad id is counted nowhere and written nowhere: the lowest such slot
// goes to info (the caller raises it), so nothing is out of bounds.
const int kSortThreads = 256;                    // count and scatter blocks
const int kSortWarps = kSortThreads / 32;
const int kScanThreads = MS_MOE_SORT_MAX_E;      // the scan's one block: E <= this
const long long kNoSlot = 0x7fffffffffffffffLL;  // (no bad slot yet)

__global__ void sort_count_kernel(const long long *ids, long long n, int E, long long S, int *cnt, long long *bad) {
    extern __shared__ int hist[];
    __shared__ long long first;
    const long long c = blockIdx.x, lo = c * S, hi = lo + S < n ? lo + S : n;
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    if (threadIdx.x == 0) first = kNoSlot;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (long long base = lo; base < hi; base += blockDim.x) {   // (the same trips for every lane)
        const long long s = base + threadIdx.x;
        const long long id = s < hi ? ids[s] : 0;
        int key = -1;
        if (s < hi) {
            if (id >= 0 && id < E) key = (int)id;
            else atomicMin(&first, s);
        }
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        if (key >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[key], __popc(peers));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[c * E + e] = hist[e];
    if (threadIdx.x == 0) bad[c] = first;
}

// cnt (C x E): in, each chunk's slots of each expert; out, each chunk's
// first order position for each expert. delta (E): an expert's first row
// less its first order position. G = blockDim / E groups of E threads,
// each over a range of chunks.
__global__ void sort_scan_kernel(int *cnt, const long long *bad, int C, int E, long long align, long long n, int k,
                                 const long long *ids, long long *delta, long long *info, long long *tok,
                                 long long *back) {
    __shared__ int part[kScanThreads];                  // (G, E): a group's slots of an expert, then their prefix
    __shared__ long long cs[kScanThreads], rs[kScanThreads], ce[kScanThreads];
    __shared__ long long low[32];
    const int t = threadIdx.x, G = blockDim.x / E, g = t / E, e = t % E;
    const int c0 = g < G ? (int)((long long)C * g / G) : 0, c1 = g < G ? (int)((long long)C * (g + 1) / G) : 0;
    int sum = 0;
#pragma unroll 4
    for (int c = c0; c < c1; c++) sum += cnt[(long long)c * E + e];
    if (g < G) part[t] = sum;
    __syncthreads();
    if (t < E) {
        long long acc = 0;
        for (int j = 0; j < G; j++) {
            const int v = part[j * E + t];
            part[j * E + t] = (int)acc;
            acc += v;
        }
        ce[t] = acc;
        cs[t] = acc;
        rs[t] = (acc + align - 1) / align * align;
    }
    __syncthreads();
    for (int off = 1; off < E; off <<= 1) {   // inclusive prefix sums over the experts (Hillis and Steele)
        long long a = 0, b = 0;
        if (t < E && t >= off) a = cs[t - off], b = rs[t - off];
        __syncthreads();
        if (t < E && t >= off) cs[t] += a, rs[t] += b;
        __syncthreads();
    }
    if (t < E) {
        const long long rows = (ce[t] + align - 1) / align * align;
        if (t == E - 1) info[2 * E] = rs[t];
        cs[t] -= ce[t];   // where the expert's slots start in order
        rs[t] -= rows;    // where its rows start
        info[t] = ce[t];
        info[E + t] = rows;
        delta[t] = rs[t] - cs[t];
    }
    __syncthreads();
    if (g < G) {
        long long at = cs[e] + part[t];
        for (int c = c0; c < c1; c++) {
            const long long i = (long long)c * E + e;
            const int v = cnt[i];
            cnt[i] = (int)at;
            at += v;
        }
    }
    // the padding rows: a warp an expert
    const int lane = t & 31, nw = blockDim.x >> 5;
    for (int x = t >> 5; x < E; x += nw) {
        const long long r0 = rs[x] + ce[x], r1 = rs[x] + (ce[x] + align - 1) / align * align;
        for (long long r = r0 + lane; r < r1; r += 32) tok[r] = n / k, back[r] = n;
    }
    // the lowest bad slot of all the chunks
    long long m = kNoSlot;
    for (int c = t; c < C; c += blockDim.x) m = bad[c] < m ? bad[c] : m;
    for (int off = 16; off > 0; off >>= 1) {
        const long long o = __shfl_down_sync(0xffffffffu, m, off);
        m = o < m ? o : m;
    }
    if (lane == 0) low[t >> 5] = m;
    __syncthreads();
    if (t == 0) {
        for (int w = 1; w < nw; w++) m = low[w] < m ? low[w] : m;
        info[2 * E + 1] = m == kNoSlot ? -1 : m;
        info[2 * E + 2] = m == kNoSlot ? 0 : ids[m];
    }
}

__global__ void sort_scatter_kernel(const long long *ids, long long n, int k, int E, long long S, const int *first,
                                    const long long *delta, long long *order, long long *inv, long long *tok,
                                    long long *back) {
    extern __shared__ long long dsh[];
    long long *dl = dsh;                   // E: delta
    int *run = (int *)(dsh + E);           // E: the chunk's next order position for each expert
    int *wc = run + E;                     // (kSortWarps, E): this tile's slots of each expert by warp
    const int t = threadIdx.x, lane = t & 31, w = t >> 5;
    const long long c = blockIdx.x, lo = c * S, hi = lo + S < n ? lo + S : n;
    for (int e = t; e < E; e += blockDim.x) dl[e] = delta[e], run[e] = first[c * E + e];
    for (int i = t; i < kSortWarps * E; i += blockDim.x) wc[i] = 0;
    __syncthreads();
    const unsigned below = (1u << lane) - 1;
    for (long long base = lo; base < hi; base += blockDim.x) {
        const long long s = base + t;
        const long long id = s < hi ? ids[s] : -1;
        const int key = id >= 0 && id < E ? (int)id : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        const int rank = __popc(peers & below), many = __popc(peers);
        const bool lead = key >= 0 && rank == 0;
        if (lead) wc[w * E + key] = many;
        __syncthreads();
        if (key >= 0) {
            long long j = run[key] + rank;
            for (int v = 0; v < w; v++) j += wc[v * E + key];
            const long long r = j + dl[key];
            order[j] = s;
            inv[s] = r;
            tok[r] = s / k;
            back[r] = s;
        }
        __syncthreads();
        if (lead) {
            atomicAdd(&run[key], many);
            wc[w * E + key] = 0;
        }
        __syncthreads();
    }
}

}  // namespace

extern "C" int ms_cuda_moe_select(ms_tensor *ids, const ms_tensor *scores, const ms_tensor *bias, int G, int TG,
                                  int how, int k) {
    const long long N = scores->sizes[0];
    const int E = (int)scores->sizes[1];
    if (ms_cuda_activate(scores->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(scores->device_id);
    const unsigned blocks = (unsigned)((N + 127) / 128);
    if (scores->dtype_id == MS_F64) {
        select_kernel<double><<<blocks, 128, 0, st_>>>((long long *)ms_tensor_data(ids),
                                                       (const double *)ms_tensor_data(scores),
                                                       bias ? (const double *)ms_tensor_data(bias) : nullptr, N, E, G,
                                                       TG, how, k);
    } else {
        select_kernel<float><<<blocks, 128, 0, st_>>>((long long *)ms_tensor_data(ids),
                                                      (const float *)ms_tensor_data(scores),
                                                      bias ? (const float *)ms_tensor_data(bias) : nullptr, N, E, G, TG,
                                                      how, k);
    }
    LAUNCH_CHECK("moe select_kernel");
    return 0;
}

extern "C" int ms_cuda_moe_gather_rows(ms_tensor *out, const ms_tensor *x, const ms_tensor *idx) {
    long long M = out->sizes[0], N = x->sizes[0], H = x->sizes[1];
    if (M == 0 || H == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(x->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(x->device_id);
    return by_dtype(x->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        gather_rows_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>((T *)ms_tensor_data(out), (const T *)ms_tensor_data(x),
                                                                (const long long *)ms_tensor_data(idx), N, H, flag);
        LAUNCH_CHECK("moe gather_rows_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_combine(ms_tensor *out, const ms_tensor *ys, const ms_tensor *inv, const ms_tensor *w, int k) {
    long long N = out->sizes[0], M = ys->sizes[0], H = ys->sizes[1];
    if (N == 0 || H == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(ys->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(ys->device_id);
    return by_dtype(ys->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        combine_kernel<T><<<(unsigned)N, kThreads, 0, st_>>>((T *)ms_tensor_data(out), (const T *)ms_tensor_data(ys),
                                                            (const long long *)ms_tensor_data(inv),
                                                            w ? (const T *)ms_tensor_data(w) : nullptr, k, M, H, flag);
        LAUNCH_CHECK("moe combine_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_combine_backward(ms_tensor *gys, ms_tensor *gw, const ms_tensor *g, const ms_tensor *ys,
                                            const ms_tensor *back, const ms_tensor *w, int k) {
    long long M = ys->sizes[0], H = ys->sizes[1], Nk = (long long)g->sizes[0] * k;
    if (M == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(ys->device_id);
    if (!flag) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(ys->device_id);
    return by_dtype(ys->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        combine_backward_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(
            (T *)ms_tensor_data(gys), gw ? (T *)ms_tensor_data(gw) : nullptr, (const T *)ms_tensor_data(g),
            (const T *)ms_tensor_data(ys), (const long long *)ms_tensor_data(back), (const T *)ms_tensor_data(w), k, Nk,
            H, flag);
        LAUNCH_CHECK("moe combine_backward_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_swiglu(ms_tensor *h, const ms_tensor *gu) {
    long long M = h->sizes[0], I = h->sizes[1];
    if (M == 0 || I == 0) return 0;
    if (ms_cuda_activate(h->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(h->device_id);
    return by_dtype(h->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        const int V = 16 / sizeof(T);
        T *ph = (T *)ms_tensor_data(h);
        const T *pg = (const T *)ms_tensor_data(gu);
        if (I % V == 0 && ms_aligned16(ph) && ms_aligned16(pg)) {
            const long long n = M * (I / V);
            if ((long long)M * 2 * I < (1LL << 31))   // (every offset, d13 and gu the largest, in 32 bits)
                swiglu_vec_kernel<T, unsigned><<<vec_blocks(n, h->device_id), kThreadsVec, 0, st_>>>(ph, pg, (unsigned)n, (unsigned)(I / V));
            else
                swiglu_vec_kernel<T, long long><<<vec_blocks(n, h->device_id), kThreadsVec, 0, st_>>>(ph, pg, n, I / V);
            LAUNCH_CHECK("moe swiglu_vec_kernel");
            return 0;
        }
        swiglu_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(ph, pg, I);
        LAUNCH_CHECK("moe swiglu_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_swiglu_backward(ms_tensor *d13, const ms_tensor *gu, const ms_tensor *dh) {
    long long M = dh->sizes[0], I = dh->sizes[1];
    if (M == 0 || I == 0) return 0;
    if (ms_cuda_activate(dh->device_id)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(dh->device_id);
    return by_dtype(dh->dtype_id, [&](auto *tag) {
        typedef typename std::remove_pointer<decltype(tag)>::type T;
        const int V = 16 / sizeof(T);
        T *pd = (T *)ms_tensor_data(d13);
        const T *pg = (const T *)ms_tensor_data(gu), *ph = (const T *)ms_tensor_data(dh);
        if (I % V == 0 && ms_aligned16(pd) && ms_aligned16(pg) && ms_aligned16(ph)) {
            const long long n = M * (I / V);
            const unsigned nb = vec_blocks(n, dh->device_id);
            if ((long long)M * 2 * I < (1LL << 31))   // (every offset, d13 and gu the largest, in 32 bits)
                swiglu_backward_vec_kernel<T, unsigned><<<nb, kThreadsVec, 0, st_>>>(pd, pg, ph, (unsigned)n, (unsigned)(I / V));
            else
                swiglu_backward_vec_kernel<T, long long><<<nb, kThreadsVec, 0, st_>>>(pd, pg, ph, n, I / V);
            LAUNCH_CHECK("moe swiglu_backward_vec_kernel");
            return 0;
        }
        swiglu_backward_kernel<T><<<(unsigned)M, kThreads, 0, st_>>>(pd, pg, ph, I);
        LAUNCH_CHECK("moe swiglu_backward_kernel");
        return 0;
    });
}

extern "C" int ms_cuda_moe_sort(const ms_tensor *ids, int k, int E, long long align, ms_tensor *order, ms_tensor *inv,
                                ms_tensor *tok, ms_tensor *back, ms_tensor *info) {
    const int device = ids->device_id;
    const long long n = ms_tensor_numel(ids);
    if (ms_cuda_activate(device)) return -1;
    cudaStream_t st_ = ms_cuda_stream_of(device);
    // chunks: about two a multiprocessor, of 1024 slots or more (a multiple of the block)
    const long long want = 2LL * ms_sm_count(device);
    long long S = (n + want - 1) / want;
    S = S < 1024 ? 1024 : (S + kSortThreads - 1) / kSortThreads * kSortThreads;
    const long long C = n == 0 ? 1 : (n + S - 1) / S;
    // the workspace: bad (C i64), delta (E i64), cnt (C x E i32)
    ms_tmp ws;
    int64_t bytes = (C + E) * 8 + C * E * 4;
    if (ms_tensor_empty(&ws.t, 1, &bytes, MS_U8, device)) return -1;
    long long *bad = (long long *)ms_tensor_data(ws.t), *delta = bad + C;
    int *cnt = (int *)(delta + E);
    const long long *pi = (const long long *)ms_tensor_data(ids);
    long long *po = (long long *)ms_tensor_data(order), *pv = (long long *)ms_tensor_data(inv);
    long long *pt = (long long *)ms_tensor_data(tok), *pb = (long long *)ms_tensor_data(back);
    sort_count_kernel<<<(unsigned)C, kSortThreads, (size_t)E * 4, st_>>>(pi, n, E, S, cnt, bad);
    LAUNCH_CHECK("moe sort_count_kernel");
    sort_scan_kernel<<<1, kScanThreads, 0, st_>>>(cnt, bad, (int)C, E, align, n, k, pi, delta,
                                                  (long long *)ms_tensor_data(info), pt, pb);
    LAUNCH_CHECK("moe sort_scan_kernel");
    sort_scatter_kernel<<<(unsigned)C, kSortThreads, (size_t)E * (8 + 4 + 4 * kSortWarps), st_>>>(
        pi, n, k, E, S, cnt, delta, po, pv, pt, pb);
    LAUNCH_CHECK("moe sort_scatter_kernel");
    return 0;
}
