// kernels/index.cu — index_select (embedding forward), index_add
// (embedding backward), gather and scatter_add.
//
// Every op views its tensors as (outer, size-along-dim, inner) after making
// them contiguous. Ids are checked on the device: an id outside [0, size)
// sets the device error flag (position, value, size) and the element is
// skipped, so nothing is read or written out of bounds; the host raises the
// error at its next sync point (item(), a copy to the host, synchronize).
//
// index_add is deterministic (no float atomics): the (id, position) pairs
// are sorted by id with CUB's stable radix sort, so each destination row is
// summed by one block in position order — the same bits on every run.
// Cost: one read of src and ids, one read+write of the touched dst rows,
// plus the sort of N ids.
#include "common.cuh"
#include "kernels.h"

#include <cub/cub.cuh>

// ---------------------------------------------------------------- kernels

__device__ __forceinline__ long long ld_id(const void *idx, int dtype, long long i) {
    return dtype == MS_I64 ? ((const long long *)idx)[i] : (long long)((const int *)idx)[i];
}

__device__ __forceinline__ void flag_bad(ms_device_flag *f, long long pos, long long v, long long lim) {
    if (atomicCAS(&f->code, 0, 1) == 0) {
        f->position = pos;
        f->value = v;
        f->limit = lim;
    }
}

// out (outer, n, inner) = a (outer, size, inner)[:, idx, :]
__global__ void index_select_kernel(void *out, const void *a, int dt, const void *idx, int idt, long long outer,
                                    long long size, long long n, long long inner, ms_device_flag *flag) {
    long long total = outer * n * inner;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long in = e % inner, t = e / inner, i = t % n, o = t / n;
        long long id = ld_id(idx, idt, i);
        if (id < 0 || id >= size) {
            if (in == 0 && o == 0) flag_bad(flag, i, id, size);
            st_any(out, dt, e, 0.0);
            continue;
        }
        st_any(out, dt, e, ld_any(a, dt, (o * size + id) * inner + in));
    }
}

__global__ void ids_to_keys_kernel(const void *idx, int idt, long long n, long long size, unsigned int *keys,
                                   unsigned int *pos, ms_device_flag *flag) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long id = ld_id(idx, idt, i);
    if (id < 0 || id >= size) {
        flag_bad(flag, i, id, size);
        id = size;  // sorts past every real row; skipped below
    }
    keys[i] = (unsigned int)id;
    pos[i] = (unsigned int)i;
}

// one block per run of equal sorted keys: dst[o, key, in] += sum src[o, pos, in]
__global__ void index_add_segments_kernel(void *dst, const void *src, int dt, const unsigned int *keys,
                                          const unsigned int *pos, long long n, long long outer, long long size,
                                          long long inner) {
    long long start = blockIdx.x;
    if (start >= n) return;
    // only the first element of a run starts a block's work
    if (start > 0 && keys[start - 1] == keys[start]) return;
    unsigned int key = keys[start];
    if (key >= size) return;
    long long end = start + 1;
    while (end < n && keys[end] == key) end++;
    for (long long c = threadIdx.x; c < outer * inner; c += blockDim.x) {
        long long o = c / inner, in = c % inner;
        long long d = (o * size + key) * inner + in;
        double acc = ld_any(dst, dt, d);
        for (long long r = start; r < end; r++) acc += ld_any(src, dt, (o * n + pos[r]) * inner + in);
        st_any(dst, dt, d, acc);
    }
}

// gather: out[o, i, in] = a[o, idx[o, i, in], in] with idx shaped like out
__global__ void gather_kernel(void *out, const void *a, int dt, const void *idx, int idt, long long outer,
                              long long size, long long n, long long inner, ms_device_flag *flag) {
    long long total = outer * n * inner;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long in = e % inner, o = e / inner / n;
        long long id = ld_id(idx, idt, e);
        if (id < 0 || id >= size) {
            flag_bad(flag, e, id, size);
            st_any(out, dt, e, 0.0);
            continue;
        }
        st_any(out, dt, e, ld_any(a, dt, (o * size + id) * inner + in));
    }
}

// scatter_add: dst[o, idx[o, i, in], in] += src[o, i, in]. Float atomics:
// the sum order of colliding ids is not fixed (documented in core/ops.h)
template <typename T>
__global__ void scatter_add_kernel(T *dst, const T *src, const void *idx, int idt, long long outer, long long size,
                                   long long n, long long inner, ms_device_flag *flag) {
    long long total = outer * n * inner;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        long long in = e % inner, o = e / inner / n;
        long long id = ld_id(idx, idt, e);
        if (id < 0 || id >= size) {
            flag_bad(flag, e, id, size);
            continue;
        }
        atomicAdd(&dst[(o * size + id) * inner + in], src[e]);
    }
}

// -------------------------------------------------------------- launchers

namespace {

typedef ms_tmp holder;

// gather/scatter_add here need idx shaped like `like` except along dim
int same_but_dim(const char *op, const ms_tensor *idx, const ms_tensor *like, int dim) {
    char a[160], b[160];
    bool ok = idx->ndim == like->ndim;
    for (int i = 0; ok && i < idx->ndim; i++)
        if (i != dim && idx->sizes[i] != like->sizes[i]) ok = false;
    if (!ok)
        return ms_errorf("%s: on cuda the index %s must match %s except along dim %d", op,
                         ms_shape_str(idx, a, sizeof a), ms_shape_str(like, b, sizeof b), dim);
    return 0;
}

void split3(const ms_tensor *t, int dim, long long *outer, long long *size, long long *inner) {
    *outer = 1; *inner = 1; *size = t->ndim ? t->sizes[dim] : 1;
    for (int i = 0; i < t->ndim; i++) {
        if (i < dim) *outer *= t->sizes[i];
        if (i > dim) *inner *= t->sizes[i];
    }
}

// out must be written contiguous; returns the tensor to write and whether a copy back is needed
int contiguous_out(ms_tensor *out, holder &tmp, ms_tensor **dst, bool keep_values) {
    if (ms_tensor_is_contiguous(out)) {
        *dst = out;
        return 0;
    }
    if (keep_values ? ms_tensor_clone(&tmp.t, out)
                    : ms_tensor_empty(&tmp.t, out->ndim, out->sizes, out->dtype_id, out->device_id))
        return -1;
    *dst = tmp.t;
    return 0;
}

}  // namespace

extern "C" int ms_cuda_index_select(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    holder ca, ci, co;
    ms_tensor *dst;
    if (ms_tensor_contiguous(&ca.t, a) || ms_tensor_contiguous(&ci.t, idx) || contiguous_out(out, co, &dst, false))
        return -1;
    long long outer, size, inner;
    split3(ca.t, dim, &outer, &size, &inner);
    long long n = ms_tensor_numel(ci.t), total = outer * n * inner;
    if (total == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(out->device_id);
    if (!flag) return -1;
    index_select_kernel<<<ms_grid(total, 256), 256, 0, ms_cuda_stream_of(out->device_id)>>>(
        ms_tensor_data(dst), ms_tensor_data(ca.t), a->dtype_id, ms_tensor_data(ci.t), idx->dtype_id, outer, size, n,
        inner, flag);
    LAUNCH_CHECK("index_select_kernel");
    return dst != out ? ms_cuda_convert(out, dst) : 0;
}

extern "C" int ms_cuda_index_add(ms_tensor *dst_in, int dim, const ms_tensor *idx, const ms_tensor *src) {
    holder cs, ci, cd, keys, pos, keys2, pos2, temp;
    ms_tensor *dst;
    if (ms_tensor_contiguous(&cs.t, src) || ms_tensor_contiguous(&ci.t, idx) || contiguous_out(dst_in, cd, &dst, true))
        return -1;
    long long outer, size, inner;
    split3(dst, dim, &outer, &size, &inner);
    long long n = ms_tensor_numel(ci.t);
    if (n == 0 || outer * inner == 0) return 0;
    if (size >= (1ll << 31) || n >= (1ll << 31))
        return ms_errorf("index_add: %lld ids into a dim of %lld rows is beyond this kernel's 32-bit sort", n, size);
    int device = dst->device_id;
    cudaStream_t s = ms_cuda_stream_of(device);
    ms_device_flag *flag = ms_cuda_device_flag(device);
    if (!flag) return -1;
    int64_t nn = n;
    if (ms_tensor_empty(&keys.t, 1, &nn, MS_I32, device) || ms_tensor_empty(&pos.t, 1, &nn, MS_I32, device) ||
        ms_tensor_empty(&keys2.t, 1, &nn, MS_I32, device) || ms_tensor_empty(&pos2.t, 1, &nn, MS_I32, device))
        return -1;
    unsigned int *k1 = (unsigned int *)ms_tensor_data(keys.t), *p1 = (unsigned int *)ms_tensor_data(pos.t);
    unsigned int *k2 = (unsigned int *)ms_tensor_data(keys2.t), *p2 = (unsigned int *)ms_tensor_data(pos2.t);
    ids_to_keys_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(ms_tensor_data(ci.t), idx->dtype_id, n, size, k1,
                                                                    p1, flag);
    LAUNCH_CHECK("ids_to_keys_kernel");
    int end_bit = 1;
    while (end_bit < 32 && (1ll << end_bit) <= size) end_bit++;
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, k1, k2, p1, p2, (int)n, 0, end_bit, s));
    int64_t tb = (int64_t)temp_bytes;
    if (ms_tensor_empty(&temp.t, 1, &tb, MS_U8, device)) return -1;
    CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ms_tensor_data(temp.t), temp_bytes, k1, k2, p1, p2, (int)n, 0, end_bit,
                                               s));
    index_add_segments_kernel<<<(unsigned)n, 128, 0, s>>>(ms_tensor_data(dst), ms_tensor_data(cs.t), dst->dtype_id, k2,
                                                           p2, n, outer, size, inner);
    LAUNCH_CHECK("index_add_segments_kernel");
    return dst != dst_in ? ms_cuda_convert(dst_in, dst) : 0;
}

extern "C" int ms_cuda_gather(ms_tensor *out, const ms_tensor *a, int dim, const ms_tensor *idx) {
    holder ca, ci, co;
    ms_tensor *dst;
    if (same_but_dim("gather", idx, a, dim)) return -1;
    if (ms_tensor_contiguous(&ca.t, a) || ms_tensor_contiguous(&ci.t, idx) || contiguous_out(out, co, &dst, false))
        return -1;
    long long outer, size, inner, n;
    split3(ca.t, dim, &outer, &size, &inner);
    n = ci.t->ndim ? ci.t->sizes[dim] : 1;
    long long total = ms_tensor_numel(ci.t);
    if (total == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(out->device_id);
    if (!flag) return -1;
    gather_kernel<<<ms_grid(total, 256), 256, 0, ms_cuda_stream_of(out->device_id)>>>(
        ms_tensor_data(dst), ms_tensor_data(ca.t), a->dtype_id, ms_tensor_data(ci.t), idx->dtype_id, outer, size, n,
        inner, flag);
    LAUNCH_CHECK("gather_kernel");
    return dst != out ? ms_cuda_convert(out, dst) : 0;
}

extern "C" int ms_cuda_scatter_add(ms_tensor *dst_in, int dim, const ms_tensor *idx, const ms_tensor *src) {
    holder cs, ci, cd;
    ms_tensor *dst;
    if (same_but_dim("scatter_add", idx, dst_in, dim) || same_but_dim("scatter_add", src, idx, -1)) return -1;
    if (ms_tensor_contiguous(&cs.t, src) || ms_tensor_contiguous(&ci.t, idx) || contiguous_out(dst_in, cd, &dst, true))
        return -1;
    if (dst->dtype_id != MS_F32 && dst->dtype_id != MS_F64)
        return ms_errorf("scatter_add: cuda supports f32 and f64, got %s", ms_dtype_name(dst->dtype_id));
    long long outer, size, inner, n;
    split3(dst, dim, &outer, &size, &inner);
    n = ci.t->ndim ? ci.t->sizes[dim] : 1;
    long long total = ms_tensor_numel(ci.t);
    if (total == 0) return 0;
    ms_device_flag *flag = ms_cuda_device_flag(dst->device_id);
    if (!flag) return -1;
    cudaStream_t s = ms_cuda_stream_of(dst->device_id);
    if (dst->dtype_id == MS_F32)
        scatter_add_kernel<float><<<ms_grid(total, 256), 256, 0, s>>>(
            (float *)ms_tensor_data(dst), (const float *)ms_tensor_data(cs.t), ms_tensor_data(ci.t), idx->dtype_id,
            outer, size, n, inner, flag);
    else
        scatter_add_kernel<double><<<ms_grid(total, 256), 256, 0, s>>>(
            (double *)ms_tensor_data(dst), (const double *)ms_tensor_data(cs.t), ms_tensor_data(ci.t),
            idx->dtype_id, outer, size, n, inner, flag);
    LAUNCH_CHECK("scatter_add_kernel");
    return dst != dst_in ? ms_cuda_convert(dst_in, dst) : 0;
}
