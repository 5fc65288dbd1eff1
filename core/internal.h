/* core/internal.h — helpers shared by the core's .c files; not part of the
 * public API and not seen by the FFI. */
#ifndef MS_INTERNAL_H
#define MS_INTERNAL_H

#include "tensor.h"
#include "ops.h"

/* set the error message (printf-style) and return -1 */
int ms_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "(2,3)" into buf; returns buf */
const char *ms_shape_str(const ms_tensor *t, char *buf, size_t n);
const char *ms_dims_str(int ndim, const int64_t *shape, char *buf, size_t n);
const char *ms_device_str(int device, char *buf, size_t n);
/* short description "f32 (2,3) cpu" for error messages */
const char *ms_desc(const ms_tensor *t, char *buf, size_t n);

int ms_is_float(int dtype);
int ms_is_float8(int dtype);   /* f8e4m3, f8e5m2 */
int ms_is_int(int dtype);
int ms_promote(int a, int b);

/* storage allocation by device (CPU: 64-byte aligned; CUDA: caching allocator) */
int ms_storage_new(ms_storage **out, int64_t nbytes, int device);
void ms_storage_retain(ms_storage *s);
void ms_storage_release(ms_storage *s);

/* allocate *out (when NULL) with the given shape/dtype/device, or check that
 * the given *out matches; op names the caller for messages */
/* ms_gemm_'s checks of its operands and its given out (core/ops.c), 0 when
 * they hold, else the error set: shapes, dtypes, devices, overlaps */
int ms_gemm_check(const ms_tensor *out, const ms_tensor *a, const ms_tensor *b, int transa, int transb);
int ms_prepare_out(ms_tensor **out, const char *op, int ndim, const int64_t *shape,
                   int dtype, int device);
/* the same for an op's further outputs (the op counter, core/prof.h, counts
 * the call once) */
int ms_prepare_more(ms_tensor **out, const char *op, int ndim, const int64_t *shape,
                    int dtype, int device);
/* canonical dim in [0, ndim) or error */
int ms_wrap_dim(const char *op, int dim, int ndim, int *res);

/* element load/store as double, any dtype */
double ms_load(const void *p, int dtype);
void ms_store(void *p, int dtype, double v);

/* hooks filled in by the CUDA backend; CPU-only builds leave them NULL */
typedef struct ms_device_backend {
    int (*alloc)(void **ptr, int64_t nbytes, int device);
    void (*free)(void *ptr, int64_t nbytes, int device);
    int (*copy)(void *dst, int dst_device, const void *src, int src_device, int64_t nbytes);
    /* dst = src (same device, same shape after broadcasting), any strides and dtypes */
    int (*convert)(ms_tensor *dst, const ms_tensor *src);
} ms_device_backend;
extern ms_device_backend *ms_cuda_backend;

#endif
