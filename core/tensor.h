/* core/tensor.h — moonshard tensors: refcounted storage, dtypes, devices,
 * shape/stride views.
 *
 * A tensor is a view (shape, strides, offset — all in elements) of a storage.
 * Storages are refcounted; a tensor handle owns one reference. Views share
 * the storage of their base, so writing through a view changes the base.
 *
 *   int64_t shape[2] = {2, 3};
 *   ms_tensor *t = NULL;
 *   if (ms_tensor_empty(&t, 2, shape, MS_F32, MS_CPU) != 0)
 *       fprintf(stderr, "%s\n", ms_last_error());
 *   ms_tensor *tt = NULL;
 *   ms_tensor_transpose(&tt, t, 0, 1);   // (3, 2) view of the same storage
 *   ms_tensor_free(tt); ms_tensor_free(t);
 *
 * Errors are values: every fallible call returns 0 on success and -1 on
 * failure, and ms_last_error() holds "op: what failed, with shapes/dtypes".
 * Nothing here calls exit() or abort() on a user error.
 *
 * Dims are 0-based here (the Lua face is 1-based). Sizes are int64_t.
 * The text between FFI-BEGIN and FFI-END is what the Lua FFI sees: the build
 * extracts it (tools/gen_ffi.lua), so no #if may appear inside it.
 */
#ifndef MS_TENSOR_H
#define MS_TENSOR_H

#include <stdint.h>
#include <stddef.h>

#define MS_MAX_DIMS 8
#define MS_CPU (-1)

/* FFI-BEGIN */
enum {
    MS_F64 = 0, MS_F32 = 1, MS_BF16 = 2, MS_F16 = 3,
    MS_I64 = 4, MS_I32 = 5, MS_U8 = 6, MS_BOOL = 7,
    /* 8-bit floats (core/fp8.h): storage, copies, views and the float8 ops
     * only (ms_amax, ms_float8_cast, ms_scaled_matmul); other ops refuse them */
    MS_F8E4M3 = 8, MS_F8E5M2 = 9,
    MS_NUM_DTYPES = 10
};

/* device: -1 is the CPU, N >= 0 is cuda:N */
typedef struct ms_storage {
    void *data;
    int64_t nbytes;
    int64_t refcount;
    int32_t device;
    int32_t external;   /* 1: data is not ours to free (mmap, borrowed) */
    uint32_t version;   /* bumped by the Lua face's in-place writes (autograd's
                           check of saved tensors); the core never reads it */
    uint32_t init_id;   /* the Lua face's deferred-initialisation record
                           (nn.deferred_init; 0: none) */
} ms_storage;

/* Field names avoid the Lua face's property and method names (t.shape,
 * t.dtype, t.device, t:stride()), since the Lua Tensor is this very struct
 * with an ffi.metatype. */
typedef struct ms_tensor {
    ms_storage *storage; /* NULL once released (t:free()) */
    int64_t offset;      /* in elements */
    int64_t sizes[8];
    int64_t strides[8];  /* in elements */
    int32_t ndim;
    int32_t dtype_id;
    int32_t device_id;   /* -1 cpu, N cuda:N */
    int32_t flags;       /* bits for the Lua face (requires_grad, ...) */
    int64_t id;          /* unique per handle; keys Lua-side metadata */
} ms_tensor;

const char *ms_last_error(void);
void ms_set_error(const char *msg);
int ms_dtype_size(int dtype);
const char *ms_dtype_name(int dtype);
int64_t ms_live_storages(void);   /* storages allocated and not yet freed */
int64_t ms_live_bytes(int device);   /* device -1: CPU; >= 0: all CUDA devices */
int64_t ms_bytes_allocated_total(void); /* bytes ever allocated (drives the Lua GC nudge) */

/* creation and lifetime */
int ms_tensor_empty(ms_tensor **out, int ndim, const int64_t *shape, int dtype, int device);
void ms_tensor_free(ms_tensor *t);      /* drops the storage ref and the handle */
void ms_tensor_release(ms_tensor *t);   /* drops the storage ref only; safe twice */
int64_t ms_tensor_numel(const ms_tensor *t);
int ms_tensor_is_contiguous(const ms_tensor *t);
void *ms_tensor_data(const ms_tensor *t); /* address of element 0 of the view */
int ms_tensor_check_live(const ms_tensor *t, const char *op);
/* the value of a one-element tensor (any dtype, any device) as a double,
 * returned by value, not through a pointer into a host copy: LuaJIT may
 * fuse a load through a pointer into the instruction that uses the value,
 * after a later call has freed the memory. *err = 0, or -1 with the error
 * set (and NaN returned). */
double ms_tensor_item(const ms_tensor *t, int *err);

/* Releasing a storage's data but keeping the storage (FSDP's reshard): every
 * tensor on it stays a valid handle, but any use of its data is an error
 * ("... was released by ms_storage_free_data ...") until ms_storage_alloc_data
 * gives the same storage new data (uninitialised; on CUDA from the caching
 * allocator, stream-ordered as any free/alloc). Both are no-ops when there is
 * nothing to do; an external (mmap, borrowed) storage cannot be released.
 * ms_live_bytes counts the released bytes out and the new ones in. */
int ms_storage_free_data(ms_tensor *t);
int ms_storage_alloc_data(ms_tensor *t);
int ms_storage_has_data(const ms_tensor *t);
/* while on, ms_storage_new makes storages without data (nothing allocated,
 * nothing counted live): the tensors of nn.deferred_init, given data later
 * by ms_storage_alloc_data */
void ms_set_defer_alloc(int on);   /* 1: data present (or 0 bytes) */

/* views (share storage) */
int ms_tensor_as_strided(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset);
int ms_tensor_view(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape);
int ms_tensor_narrow(ms_tensor **out, const ms_tensor *t, int dim, int64_t start, int64_t length);
int ms_tensor_transpose(ms_tensor **out, const ms_tensor *t, int d0, int d1);
int ms_tensor_permute(ms_tensor **out, const ms_tensor *t, int ndim, const int *perm);
int ms_tensor_expand(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape);
int ms_tensor_squeeze(ms_tensor **out, const ms_tensor *t, int dim);  /* dim -1000: all */
int ms_tensor_unsqueeze(ms_tensor **out, const ms_tensor *t, int dim);
int ms_tensor_alias(ms_tensor **out, const ms_tensor *t);            /* same view, new handle */

/* copies */
int ms_tensor_reshape(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape);
int ms_tensor_contiguous(ms_tensor **out, const ms_tensor *t); /* alias when already contiguous */
int ms_tensor_clone(ms_tensor **out, const ms_tensor *t);
int ms_tensor_to(ms_tensor **out, const ms_tensor *t, int dtype, int device);
/* dst[...] = src broadcast to dst's shape, converting dtype (bf16/f16 round
 * to nearest even); dst and src may be on different devices when both are
 * contiguous */
int ms_tensor_copy_(ms_tensor *dst, const ms_tensor *src);

/* scalar conversion helpers (round-to-nearest-even) */
uint16_t ms_f32_to_bf16(float x);
float ms_bf16_to_f32(uint16_t h);
uint16_t ms_f32_to_f16(float x);
float ms_f16_to_f32(uint16_t h);
/* f32 <-> f8e4m3 (e5m2 = 0) / f8e5m2 (e5m2 = 1), round to nearest even;
 * sat = 0: overflow to NaN (e4m3) or infinity (e5m2) as torch's .to();
 * sat = 1: to the largest finite value (core/fp8.h has the details) */
uint8_t ms_f32_to_f8(float x, int e5m2, int sat);
float ms_f8_to_f32(uint8_t c, int e5m2);
double ms_tensor_get(const ms_tensor *t, const int64_t *index);
int ms_tensor_set(ms_tensor *t, const int64_t *index, double value);

/* raw file access used by the safetensors reader/writer:
 * read nbytes at offset of path into dst's contiguous storage */
int ms_file_read_into(const char *path, int64_t offset, int64_t nbytes, ms_tensor *dst);
/* FFI-END */

#endif
