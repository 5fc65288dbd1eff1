// kernels/convert_many.cu — many contiguous tensors converted into one
// contiguous destination, one after the other, in a launch per 64 tensors
// (core/ops.c ms_cast_flat: a MoE layer's 3 x E expert weights cast to bf16
// at once instead of a kernel, an allocation and a Lua object each), and the
// way back: one contiguous source split into many destinations
// (ms_split_flat_: a packed gradient bucket copied back into its
// gradients after its all-reduce, dist.all_reduce_coalesced).
//
// Every source is a float dtype (f32, bf16, f16), all of one dtype, and the
// destination one of them too. The table of (source, count, offset) travels
// as a kernel parameter with each tensor's first block; a block finds its
// tensor by binary search over the first blocks and moves CHUNK elements of
// it, 4 a thread per step (16-byte f32 loads where the source allows, else
// element by element). Bytes: each source read once, the destination
// written once. Also: many byte copies in one launch (copy_bytes_many).
#include "common.cuh"
#include "kernels.h"
#include "vec.cuh"

namespace {

const int CM_MAX = 64;            // tensors a launch
const int CM_THREADS = 256;
const int64_t CM_CHUNK = 8192;    // elements a block

struct cm_args {
    const void *src[CM_MAX];
    int64_t n[CM_MAX];
    int64_t off[CM_MAX];          // where tensor i starts in dst (elements)
    int64_t first[CM_MAX + 1];    // tensor i's first block; first[count] = the grid
    int count;
};

// SPLIT false: a.src[i] is source i, flat the destination (cast_flat);
// SPLIT true: a.src[i] is destination i (written), flat the source
// (split_flat_, the way back)
template <typename S, typename D, bool SPLIT>
__global__ void convert_many_kernel(const __grid_constant__ cm_args a, void *flat) {
    const int64_t b = blockIdx.x;
    int lo = 0, hi = a.count - 1;   // the last i with first[i] <= b
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (a.first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const S *s = SPLIT ? (const S *)flat + a.off[lo] : (const S *)a.src[lo];
    D *d = SPLIT ? (D *)(uintptr_t)a.src[lo] : (D *)flat + a.off[lo];
    const int64_t start = (b - a.first[lo]) * CM_CHUNK;
    const int64_t end = min(start + CM_CHUNK, a.n[lo]);
    // 4 elements a thread where both ends are aligned to 4 elements' bytes
    const bool vec = ((uintptr_t)(s + start) % (4 * sizeof(S)) == 0) && ((uintptr_t)(d + start) % (4 * sizeof(D)) == 0);
    if (vec) {
        int64_t i = start + 4 * (int64_t)threadIdx.x;
        for (; i + 4 <= end; i += 4 * CM_THREADS) {
            float v[4];
            load_v<float, S, 4>(v, s + i);
            store_v<D, 4, float>(d + i, v);
        }
        // the one thread whose 4 run past the end takes what is left
        for (int64_t j = i; j < end && j < i + 4; j++) d[j] = conv<D>::store(conv<S>::load(s[j]));
    } else {
        for (int64_t j = start + threadIdx.x; j < end; j += CM_THREADS) d[j] = conv<D>::store(conv<S>::load(s[j]));
    }
}

// the launches over `list` (n tensors, one float dtype) and the contiguous
// `flat` (flat_dtype), 64 tensors each: cast_flat (SPLIT false) or
// split_flat_ (SPLIT true)
template <bool SPLIT>
int convert_many(ms_tensor **list, int n, void *flat, int flat_dtype, cudaStream_t st, const char *name) {
    const int sdt = SPLIT ? flat_dtype : list[0]->dtype_id, ddt = SPLIT ? list[0]->dtype_id : flat_dtype;
    return with_float32_type(sdt, name, [&](auto s0) -> int {
        using S = decltype(s0);
        return with_float32_type(ddt, name, [&](auto d0) -> int {
            using D = decltype(d0);
            const int64_t es = SPLIT ? (int64_t)sizeof(S) : (int64_t)sizeof(D);   // the flat side's element
            int64_t off = 0;
            for (int i0 = 0; i0 < n; i0 += CM_MAX) {
                cm_args a;
                a.count = 0;
                int64_t blocks = 0;
                int64_t off0 = off;
                for (int i = i0; i < n && i < i0 + CM_MAX; i++) {
                    int64_t m = ms_tensor_numel(list[i]);
                    if (m > 0) {
                        a.src[a.count] = ms_tensor_data(list[i]);
                        a.n[a.count] = m;
                        a.off[a.count] = off - off0;
                        a.first[a.count] = blocks;
                        blocks += (m + CM_CHUNK - 1) / CM_CHUNK;
                        a.count++;
                    }
                    off += m;
                }
                if (a.count == 0) continue;
                a.first[a.count] = blocks;
                if (blocks > 0x7fffffffLL) return ms_errorf("%s: %lld blocks in one launch", name, (long long)blocks);
                convert_many_kernel<S, D, SPLIT><<<(unsigned)blocks, CM_THREADS, 0, st>>>(a, (char *)flat + off0 * es);
                LAUNCH_CHECK("convert_many_kernel");
            }
            return 0;
        });
    });
}


// ---------------------------------------------------- copy_bytes_many
// n byte copies (core/ops.h ms_copy_bytes_many: FSDP's f8 gathers pack a
// unit's other parameters into the f8 shard and unpack them from the
// gathered bytes), a launch a CB_MAX copies: the table travels as the
// kernel's parameter, a block finds its copy by binary search over the
// first blocks and moves CB_CHUNK bytes of it, 16 a thread per step where
// both ends are 16-byte aligned, else byte by byte. Bytes: each read once,
// written once.
const int CB_MAX = 128;
const int64_t CB_CHUNK = 16384;   // bytes a block (a multiple of 16)

struct cb_args {
    char *dst[CB_MAX];
    const char *src[CB_MAX];
    int64_t n[CB_MAX];
    int64_t first[CB_MAX + 1];    // copy i's first block; first[count] = the grid
    int count;
};

__global__ void copy_bytes_many_kernel(const __grid_constant__ cb_args a) {
    const int64_t b = blockIdx.x;
    int lo = 0, hi = a.count - 1;   // the last i with first[i] <= b
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (a.first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    const char *s = a.src[lo];
    char *d = a.dst[lo];
    const int64_t start = (b - a.first[lo]) * CB_CHUNK;
    const int64_t end = min(start + CB_CHUNK, a.n[lo]);
    if ((((uintptr_t)(s + start)) | ((uintptr_t)(d + start))) % 16 == 0) {
        const int64_t nv = (end - start) / 16;
        for (int64_t v = threadIdx.x; v < nv; v += CM_THREADS)
            reinterpret_cast<uint4 *>(d + start)[v] = reinterpret_cast<const uint4 *>(s + start)[v];
        for (int64_t j = start + nv * 16 + threadIdx.x; j < end; j += CM_THREADS) d[j] = s[j];
    } else {
        for (int64_t j = start + threadIdx.x; j < end; j += CM_THREADS) d[j] = s[j];
    }
}

}  // namespace

// the n destinations (contiguous, one float dtype) = src's elements in turn, converted
extern "C" int ms_cuda_split_many(ms_tensor **dst, int n, const ms_tensor *src) {
    if (n == 0 || ms_tensor_numel(src) == 0) return 0;
    if (ms_cuda_activate(src->device_id)) return -1;
    return convert_many<true>(dst, n, ms_tensor_data(src), src->dtype_id, ms_cuda_stream_of(src->device_id),
                              "split_flat_");
}

// dst (contiguous, n_total elements) = the n sources in turn, converted
extern "C" int ms_cuda_convert_many(ms_tensor *dst, ms_tensor **src, int n) {
    if (n == 0 || ms_tensor_numel(dst) == 0) return 0;
    if (ms_cuda_activate(dst->device_id)) return -1;
    return convert_many<false>(src, n, ms_tensor_data(dst), dst->dtype_id, ms_cuda_stream_of(dst->device_id),
                               "cast_flat");
}

// the n byte copies (checked by core/ops.c ms_copy_bytes_many)
extern "C" int ms_cuda_copy_bytes_many(ms_tensor **dst, ms_tensor **src, const int64_t *spec, int n, int dev) {
    if (ms_cuda_activate(dev)) return -1;
    cudaStream_t st = ms_cuda_stream_of(dev);
    cb_args a;
    int i = 0;
    while (i < n) {
        a.count = 0;
        int64_t blocks = 0;
        for (; i < n && a.count < CB_MAX; i++) {
            const int64_t m = spec[3 * i + 2];
            if (m == 0) continue;
            a.dst[a.count] = (char *)ms_tensor_data(dst[i]) + spec[3 * i];
            a.src[a.count] = (const char *)ms_tensor_data(src[i]) + spec[3 * i + 1];
            a.n[a.count] = m;
            a.first[a.count] = blocks;
            blocks += (m + CB_CHUNK - 1) / CB_CHUNK;
            a.count++;
        }
        if (a.count == 0) continue;
        a.first[a.count] = blocks;
        if (blocks > 0x7fffffffLL) return ms_errorf("copy_bytes_many: %lld blocks in one launch", (long long)blocks);
        copy_bytes_many_kernel<<<(unsigned)blocks, CM_THREADS, 0, st>>>(a);
        LAUNCH_CHECK("copy_bytes_many_kernel");
    }
    return 0;
}
