/* core/tensor.c — storage, tensor handles, views, copies, dtype conversion. */
#include "internal.h"
#include "cuda.h"
#include "prof.h"
#include "fp8.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- errors */

static __thread char g_error[1024];

const char *ms_last_error(void) { return g_error; }

void ms_set_error(const char *msg) {
    snprintf(g_error, sizeof g_error, "%s", msg ? msg : "");
}

int ms_errorf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    return -1;
}

const char *ms_dims_str(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "(");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, ")");
    return buf;
}

const char *ms_shape_str(const ms_tensor *t, char *buf, size_t n) {
    return ms_dims_str(t->ndim, t->sizes, buf, n);
}

const char *ms_device_str(int device, char *buf, size_t n) {
    if (device < 0) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", device);
    return buf;
}

const char *ms_desc(const ms_tensor *t, char *buf, size_t n) {
    char s[160], d[32];
    snprintf(buf, n, "%s %s %s", ms_dtype_name(t->dtype_id), ms_shape_str(t, s, sizeof s),
             ms_device_str(t->device_id, d, sizeof d));
    return buf;
}

/* ---------------------------------------------------------------- dtypes */

static const int g_sizes[MS_NUM_DTYPES] = {8, 4, 2, 2, 8, 4, 1, 1, 1, 1};
static const char *g_names[MS_NUM_DTYPES] = {"f64", "f32", "bf16", "f16", "i64", "i32", "u8", "bool",
                                             "f8e4m3", "f8e5m2"};

int ms_dtype_size(int dtype) {
    return (dtype >= 0 && dtype < MS_NUM_DTYPES) ? g_sizes[dtype] : 0;
}

const char *ms_dtype_name(int dtype) {
    return (dtype >= 0 && dtype < MS_NUM_DTYPES) ? g_names[dtype] : "invalid";
}

/* the float dtypes ops compute with; the 8-bit floats are storage formats
 * (ms_is_float8) that only copies and the float8 ops take */
int ms_is_float(int dtype) { return dtype >= MS_F64 && dtype <= MS_F16; }
int ms_is_float8(int dtype) { return dtype == MS_F8E4M3 || dtype == MS_F8E5M2; }
int ms_is_int(int dtype) { return dtype >= MS_I64 && dtype <= MS_BOOL; }

/* float beats int; wider float beats narrower; bf16 with f16 gives f32;
 * among ints the wider wins; bool loses to everything */
int ms_promote(int a, int b) {
    if (a == b) return a;
    if (ms_is_float(a) && ms_is_float(b)) {
        if (a == MS_F64 || b == MS_F64) return MS_F64;
        return MS_F32; /* f32 with anything, or bf16 with f16 */
    }
    if (ms_is_float(a)) return a;
    if (ms_is_float(b)) return b;
    /* both integer: i64 > i32 > u8 > bool */
    static const int rank[MS_NUM_DTYPES] = {0, 0, 0, 0, 4, 3, 2, 1, 0, 0};
    return rank[a] >= rank[b] ? a : b;
}

/* round-to-nearest-even float32 -> bfloat16; NaN stays NaN */
uint16_t ms_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7fffu + lsb;
    return (uint16_t)(u >> 16);
}

float ms_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* round-to-nearest-even float32 -> IEEE half, with subnormals and overflow to inf */
uint16_t ms_f32_to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t ax = u & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* overflow (>= 65520) -> inf */
    if (ax < 0x38800000u) {                                        /* below 2^-14: subnormal */
        if (ax < 0x33000000u) return (uint16_t)sign;               /* < 2^-25: rounds to 0 */
        uint32_t e = ax >> 23;                                     /* 102..112 */
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;                                  /* 14..24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);                  /* RNE at bit 13 */
    r -= 0x38000000u;                                              /* rebias 127 -> 15 */
    return (uint16_t)(sign | (r >> 13));
}

float ms_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0) {
        if (m == 0) u = sign;
        else { /* subnormal: m * 2^-24 */
            float f = (float)m * 5.9604644775390625e-8f;
            memcpy(&u, &f, 4);
            u |= sign;
        }
    } else if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else u = sign | ((e + 112) << 23) | (m << 13);
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint8_t ms_f32_to_f8(float x, int e5m2, int sat) { return ms_fp8_from_f32(x, e5m2 != 0, sat != 0); }
float ms_f8_to_f32(uint8_t c, int e5m2) { return ms_fp8_to_f32(c, e5m2 != 0); }

double ms_load(const void *p, int dtype) {
    switch (dtype) {
    case MS_F64: return *(const double *)p;
    case MS_F32: return *(const float *)p;
    case MS_BF16: return ms_bf16_to_f32(*(const uint16_t *)p);
    case MS_F16: return ms_f16_to_f32(*(const uint16_t *)p);
    case MS_I64: return (double)*(const int64_t *)p;
    case MS_I32: return *(const int32_t *)p;
    case MS_U8: return *(const uint8_t *)p;
    case MS_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    case MS_F8E4M3: return ms_fp8_to_f32(*(const uint8_t *)p, 0);
    case MS_F8E5M2: return ms_fp8_to_f32(*(const uint8_t *)p, 1);
    }
    return 0;
}

/* f64 -> f32 rounding to odd: when v is not exact in f32, the result is the
 * f32 neighbour toward zero with its lowest bit set. Rounding that to bf16 or
 * f16 (nearest even) then equals rounding v once, with no double rounding,
 * because f32 keeps more than two extra bits of both. */
static float f64_to_f32_odd(double v) {
    float f = (float)v;
    if ((double)f == v || v != v) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    if (fabs((double)f) > fabs(v)) u -= 1; /* rounded away from zero: step back */
    u |= 1u;
    memcpy(&f, &u, 4);
    return f;
}

void ms_store(void *p, int dtype, double v) {
    switch (dtype) {
    case MS_F64: *(double *)p = v; break;
    case MS_F32: *(float *)p = (float)v; break;
    case MS_BF16: *(uint16_t *)p = ms_f32_to_bf16(f64_to_f32_odd(v)); break;
    case MS_F16: *(uint16_t *)p = ms_f32_to_f16(f64_to_f32_odd(v)); break;
    case MS_I64: *(int64_t *)p = (int64_t)v; break;
    case MS_I32: *(int32_t *)p = (int32_t)v; break;
    case MS_U8: *(uint8_t *)p = (uint8_t)(int64_t)v; break;
    case MS_BOOL: *(uint8_t *)p = v != 0; break;
    case MS_F8E4M3: *(uint8_t *)p = ms_fp8_from_f64(v, 0, 0); break;
    case MS_F8E5M2: *(uint8_t *)p = ms_fp8_from_f64(v, 1, 0); break;
    }
}

/* --------------------------------------------------------------- storage */

ms_device_backend *ms_cuda_backend = NULL;
static int64_t g_live_storages = 0;
static int64_t g_live_bytes_cpu = 0;
static int64_t g_live_bytes_dev = 0;   /* all devices together */
static int64_t g_alloc_total = 0;      /* bytes ever allocated, all devices */

int64_t ms_bytes_allocated_total(void) { return __atomic_load_n(&g_alloc_total, __ATOMIC_RELAXED); }

int64_t ms_live_storages(void) { return __atomic_load_n(&g_live_storages, __ATOMIC_RELAXED); }
int64_t ms_live_bytes(int device) {
    if (device >= 0) return __atomic_load_n(&g_live_bytes_dev, __ATOMIC_RELAXED);
    return __atomic_load_n(&g_live_bytes_cpu, __ATOMIC_RELAXED);
}

/* the data of a storage of nbytes on device (64-byte aligned on the CPU;
 * the caching allocator on CUDA) */
static int storage_data_alloc(void **out, int64_t nbytes, int device) {
    char d[32];
    *out = NULL;
    if (device < 0) {
        size_t n = (size_t)((nbytes + 63) / 64 * 64);
        if (n == 0) n = 64;
#ifdef __SANITIZE_ADDRESS__
        /* the exact size, so AddressSanitizer sees any access past nbytes */
        if (posix_memalign(out, 64, nbytes ? (size_t)nbytes : 1) != 0) *out = NULL;
        (void)n;
#else
        *out = aligned_alloc(64, n);
#endif
        if (!*out) return ms_errorf("alloc: out of host memory allocating %lld bytes", (long long)nbytes);
        return 0;
    }
    if (!ms_cuda_backend)
        return ms_errorf("alloc: device %s requested but moonshard was built without CUDA",
                         ms_device_str(device, d, sizeof d));
    return ms_cuda_backend->alloc(out, nbytes, device) != 0 ? -1 : 0;
}

static int g_defer_alloc = 0;
void ms_set_defer_alloc(int on) { g_defer_alloc = on != 0; }

int ms_storage_new(ms_storage **out, int64_t nbytes, int device) {
    if (nbytes < 0) return ms_errorf("alloc: negative size %lld", (long long)nbytes);
    ms_storage *s = calloc(1, sizeof *s);
    if (!s) return ms_errorf("alloc: out of host memory for a storage header");
    s->nbytes = nbytes;
    s->refcount = 1;
    s->device = device;
    if (g_defer_alloc && nbytes > 0) {   /* data later: ms_storage_alloc_data */
        __atomic_add_fetch(&g_live_storages, 1, __ATOMIC_RELAXED);
        *out = s;
        return 0;
    }
    if (storage_data_alloc(&s->data, nbytes, device)) {
        free(s);
        return -1;
    }
    __atomic_add_fetch(device < 0 ? &g_live_bytes_cpu : &g_live_bytes_dev, nbytes, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_live_storages, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_alloc_total, nbytes, __ATOMIC_RELAXED);
    *out = s;
    return 0;
}

void ms_storage_retain(ms_storage *s) { __atomic_add_fetch(&s->refcount, 1, __ATOMIC_RELAXED); }

void ms_storage_release(ms_storage *s) {
    if (!s) return;
    if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
    if (!s->external && s->data) {   /* no data: released by ms_storage_free_data */
        if (s->device < 0) {
            free(s->data);
            __atomic_sub_fetch(&g_live_bytes_cpu, s->nbytes, __ATOMIC_RELAXED);
        } else if (ms_cuda_backend) {
            ms_cuda_backend->free(s->data, s->nbytes, s->device);
            __atomic_sub_fetch(&g_live_bytes_dev, s->nbytes, __ATOMIC_RELAXED);
        }
    }
    __atomic_sub_fetch(&g_live_storages, 1, __ATOMIC_RELAXED);
    free(s);
}

/* ---------------------------------------------------------------- tensors */

static int64_t g_next_id = 1;

static ms_tensor *tensor_handle(void) {
    ms_tensor *t = calloc(1, sizeof *t);
    if (t) t->id = __atomic_fetch_add(&g_next_id, 1, __ATOMIC_RELAXED);
    return t;
}

static int check_dims(const char *op, int ndim, const int64_t *shape) {
    char s[160];
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms_errorf("%s: %d dims requested, at most %d are supported", op, ndim, MS_MAX_DIMS);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return ms_errorf("%s: negative size in shape %s", op, ms_dims_str(ndim, shape, s, sizeof s));
    return 0;
}

int ms_tensor_empty(ms_tensor **out, int ndim, const int64_t *shape, int dtype, int device) {
    if (check_dims("empty", ndim, shape)) return -1;
    if (dtype < 0 || dtype >= MS_NUM_DTYPES) return ms_errorf("empty: invalid dtype %d", dtype);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] && n > INT64_MAX / 16 / shape[i]) {
            char s[160];
            return ms_errorf("empty: shape %s is too large", ms_dims_str(ndim, shape, s, sizeof s));
        }
        n *= shape[i];
    }
    ms_tensor *t = tensor_handle();
    if (!t) return ms_errorf("empty: out of host memory");
    if (ms_storage_new(&t->storage, n * ms_dtype_size(dtype), device)) {
        free(t);
        return -1;
    }
    t->ndim = ndim;
    t->dtype_id = dtype;
    t->device_id = device;
    int64_t st = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->sizes[i] = shape[i];
        t->strides[i] = st;
        st *= shape[i] ? shape[i] : 1;
    }
    *out = t;
    return 0;
}

void ms_tensor_release(ms_tensor *t) {
    if (!t) return;
    ms_storage *s = t->storage;
    t->storage = NULL;
    ms_storage_release(s);
}

void ms_tensor_free(ms_tensor *t) {
    if (!t) return;
    ms_tensor_release(t);
    free(t);
}

int64_t ms_tensor_numel(const ms_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->sizes[i];
    return n;
}

int ms_tensor_is_contiguous(const ms_tensor *t) {
    for (int i = 0; i < t->ndim; i++)
        if (t->sizes[i] == 0) return 1; /* no element: any strides will do (as torch) */
    int64_t st = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->sizes[i] != 1 && t->strides[i] != st) return 0;
        st *= t->sizes[i];
    }
    return 1;
}

void *ms_tensor_data(const ms_tensor *t) {
    if (!t->storage) return NULL;
    return (char *)t->storage->data + t->offset * ms_dtype_size(t->dtype_id);
}

int ms_tensor_check_live(const ms_tensor *t, const char *op) {
    if (!t) return ms_errorf("%s: tensor is nil", op);
    if (!t->storage) return ms_errorf("%s: tensor was freed", op);
    if (!t->storage->data && t->storage->nbytes > 0 && t->storage->init_id)
        return ms_errorf("%s: the tensor (%lld bytes) has no data yet: it was made under nn.deferred_init "
                         "(give it data with nn.materialize(model), or shard the model with fsdp.fully_shard)",
                         op, (long long)t->storage->nbytes);
    if (!t->storage->data && t->storage->nbytes > 0)
        return ms_errorf("%s: the tensor's storage data (%lld bytes) was released by ms_storage_free_data "
                         "(a resharded FSDP unit's parameter? unshard it first)",
                         op, (long long)t->storage->nbytes);
    return 0;
}

double ms_tensor_item(const ms_tensor *t, int *err) {
    ms_tensor *h = NULL;
    *err = -1;
    if (ms_tensor_check_live(t, "item")) return NAN;
    if (t->device_id >= 0 && ms_cuda_capturing() >= 0) {
        ms_errorf("item: reads a device value on the host during CUDA graph capture on cuda:%d: the host would "
                  "wait for work that is only being recorded; read the graph's outputs after replay() (the "
                  "capture is aborted; docs/cuda-graphs.md)", ms_cuda_capturing());
        return NAN;
    }
    if (ms_tensor_numel(t) != 1) {
        ms_errorf("item: a tensor with %lld elements cannot be converted to a number", (long long)ms_tensor_numel(t));
        return NAN;
    }
    if (ms_tensor_to(&h, t, MS_F64, -1)) return NAN;
    double v = *(const double *)ms_tensor_data(h);
    ms_tensor_free(h);
    *err = 0;
    return v;
}

/* ------------------------------------------------- storage data release */

int ms_storage_has_data(const ms_tensor *t) {
    return t && t->storage && (t->storage->data != NULL || t->storage->nbytes == 0);
}

int ms_storage_free_data(ms_tensor *t) {
    if (!t || !t->storage) return ms_errorf("storage_free_data: tensor was freed");
    ms_storage *s = t->storage;
    if (s->external) return ms_errorf("storage_free_data: the storage's data is not ours (mmap or borrowed)");
    if (!s->data || s->nbytes == 0) return 0;
    if (s->device < 0) {
        free(s->data);
        __atomic_sub_fetch(&g_live_bytes_cpu, s->nbytes, __ATOMIC_RELAXED);
    } else {
        if (!ms_cuda_backend) return ms_errorf("storage_free_data: a CUDA storage in a build without CUDA");
        ms_cuda_backend->free(s->data, s->nbytes, s->device);
        __atomic_sub_fetch(&g_live_bytes_dev, s->nbytes, __ATOMIC_RELAXED);
    }
    s->data = NULL;
    return 0;
}

int ms_storage_alloc_data(ms_tensor *t) {
    if (!t || !t->storage) return ms_errorf("storage_alloc_data: tensor was freed");
    ms_storage *s = t->storage;
    if (s->data || s->nbytes == 0) return 0;
    void *p = NULL;
    if (storage_data_alloc(&p, s->nbytes, s->device)) return -1;
    s->data = p;
    __atomic_add_fetch(s->device < 0 ? &g_live_bytes_cpu : &g_live_bytes_dev, s->nbytes, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_alloc_total, s->nbytes, __ATOMIC_RELAXED);
    return 0;
}

/* ------------------------------------------------------------------ views */

static int new_view(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape,
                    const int64_t *stride, int64_t offset) {
    ms_tensor *v = tensor_handle();
    if (!v) return ms_errorf("view: out of host memory");
    v->storage = t->storage;
    ms_storage_retain(t->storage);
    v->offset = offset;
    v->ndim = ndim;
    v->dtype_id = t->dtype_id;
    v->device_id = t->device_id;
    for (int i = 0; i < ndim; i++) {
        v->sizes[i] = shape[i];
        v->strides[i] = stride[i];
    }
    *out = v;
    return 0;
}

int ms_tensor_alias(ms_tensor **out, const ms_tensor *t) {
    if (ms_tensor_check_live(t, "alias")) return -1;
    return new_view(out, t, t->ndim, t->sizes, t->strides, t->offset);
}

int ms_tensor_as_strided(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset) {
    char s[160];
    if (ms_tensor_check_live(t, "as_strided") || check_dims("as_strided", ndim, shape)) return -1;
    /* every reachable element must lie inside the storage */
    int64_t lo = offset, hi = offset, n = 1;
    for (int i = 0; i < ndim; i++) {
        n *= shape[i];
        if (shape[i] == 0) continue;
        if (stride[i] >= 0) hi += stride[i] * (shape[i] - 1);
        else lo += stride[i] * (shape[i] - 1);
    }
    int64_t cap = t->storage->nbytes / ms_dtype_size(t->dtype_id);
    if (n > 0 && (lo < 0 || hi >= cap))
        return ms_errorf("as_strided: view %s at offset %lld reaches outside a storage of %lld elements",
                         ms_dims_str(ndim, shape, s, sizeof s), (long long)offset, (long long)cap);
    return new_view(out, t, ndim, shape, stride, offset);
}

int ms_wrap_dim(const char *op, int dim, int ndim, int *res) {
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim || ndim == 0)
        return ms_errorf("%s: dim %d out of range for a tensor of %d dims", op, dim, ndim);
    *res = d;
    return 0;
}

/* strides of `shape` viewing t without a copy; 0 if impossible. Groups t's
 * dims into chunks that are contiguous among themselves and matches view
 * dims to chunks by element count (the rule numpy and PyTorch use). */
static int view_strides(const ms_tensor *t, int ndim, const int64_t *shape, int64_t *stride) {
    if (ms_tensor_numel(t) == 0 || t->ndim == 0) {
        int64_t st = 1;
        for (int i = ndim - 1; i >= 0; i--) { stride[i] = st; st *= shape[i] ? shape[i] : 1; }
        return 1;
    }
    int vd = ndim - 1;
    int64_t base = t->strides[t->ndim - 1], tn = 1, vn = 1;
    for (int td = t->ndim - 1; td >= 0; td--) {
        tn *= t->sizes[td];
        if (td == 0 || (t->sizes[td - 1] != 1 && t->strides[td - 1] != tn * base)) {
            while (vd >= 0 && (vn < tn || shape[vd] == 1)) {
                stride[vd] = vn * base;
                vn *= shape[vd];
                vd--;
            }
            if (vn != tn) return 0;
            if (td > 0) { base = t->strides[td - 1]; tn = 1; vn = 1; }
        }
    }
    return vd == -1;
}

static int resolve_shape(const char *op, const ms_tensor *t, int ndim, const int64_t *shape_in,
                         int64_t *shape) {
    char s[160], s2[160];
    if (check_dims(op, 0, NULL)) return -1;
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms_errorf("%s: %d dims requested, at most %d are supported", op, ndim, MS_MAX_DIMS);
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < ndim; i++) {
        shape[i] = shape_in[i];
        if (shape[i] == -1) {
            if (infer >= 0) return ms_errorf("%s: only one dim may be -1 in %s", op,
                                             ms_dims_str(ndim, shape_in, s, sizeof s));
            infer = i;
        } else if (shape[i] < 0) {
            return ms_errorf("%s: invalid size in %s", op, ms_dims_str(ndim, shape_in, s, sizeof s));
        } else known *= shape[i];
    }
    int64_t n = ms_tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || n % known)
            return ms_errorf("%s: shape %s is invalid for a tensor of shape %s (%lld elements)", op,
                             ms_dims_str(ndim, shape_in, s, sizeof s), ms_shape_str(t, s2, sizeof s2),
                             (long long)n);
        shape[infer] = n / known;
        known *= shape[infer];
    }
    if (known != n)
        return ms_errorf("%s: shape %s is invalid for a tensor of shape %s (%lld elements)", op,
                         ms_dims_str(ndim, shape_in, s, sizeof s), ms_shape_str(t, s2, sizeof s2),
                         (long long)n);
    return 0;
}

int ms_tensor_view(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape_in) {
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    char s[160], s2[160];
    if (ms_tensor_check_live(t, "view") || resolve_shape("view", t, ndim, shape_in, shape)) return -1;
    if (!view_strides(t, ndim, shape, stride))
        return ms_errorf("view: a tensor of shape %s with these strides cannot be viewed as %s without "
                         "a copy; use reshape or contiguous", ms_shape_str(t, s, sizeof s),
                         ms_dims_str(ndim, shape, s2, sizeof s2));
    return new_view(out, t, ndim, shape, stride, t->offset);
}

int ms_tensor_reshape(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape_in) {
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    if (ms_tensor_check_live(t, "reshape") || resolve_shape("reshape", t, ndim, shape_in, shape))
        return -1;
    if (view_strides(t, ndim, shape, stride)) return new_view(out, t, ndim, shape, stride, t->offset);
    ms_tensor *c = NULL;
    if (ms_tensor_contiguous(&c, t)) return -1;
    int rc = ms_tensor_view(out, c, ndim, shape);
    ms_tensor_free(c);
    return rc;
}

int ms_tensor_narrow(ms_tensor **out, const ms_tensor *t, int dim, int64_t start, int64_t length) {
    int d;
    char s[160];
    if (ms_tensor_check_live(t, "narrow") || ms_wrap_dim("narrow", dim, t->ndim, &d)) return -1;
    if (start < 0 || length < 0 || start + length > t->sizes[d])
        return ms_errorf("narrow: start %lld length %lld out of range for dim %d of size %lld (shape %s)",
                         (long long)start, (long long)length, dim, (long long)t->sizes[d],
                         ms_shape_str(t, s, sizeof s));
    int64_t shape[MS_MAX_DIMS];
    memcpy(shape, t->sizes, sizeof shape);
    shape[d] = length;
    return new_view(out, t, t->ndim, shape, t->strides, t->offset + (length ? start * t->strides[d] : 0));
}

int ms_tensor_transpose(ms_tensor **out, const ms_tensor *t, int d0, int d1) {
    int a, b;
    if (ms_tensor_check_live(t, "transpose") || ms_wrap_dim("transpose", d0, t->ndim, &a) ||
        ms_wrap_dim("transpose", d1, t->ndim, &b))
        return -1;
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    memcpy(shape, t->sizes, sizeof shape);
    memcpy(stride, t->strides, sizeof stride);
    shape[a] = t->sizes[b]; shape[b] = t->sizes[a];
    stride[a] = t->strides[b]; stride[b] = t->strides[a];
    return new_view(out, t, t->ndim, shape, stride, t->offset);
}

int ms_tensor_permute(ms_tensor **out, const ms_tensor *t, int ndim, const int *perm) {
    char s[160];
    if (ms_tensor_check_live(t, "permute")) return -1;
    if (ndim != t->ndim)
        return ms_errorf("permute: %d dims given for a tensor of shape %s", ndim, ms_shape_str(t, s, sizeof s));
    int seen[MS_MAX_DIMS] = {0};
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        int d;
        if (ms_wrap_dim("permute", perm[i], ndim, &d)) return -1;
        if (seen[d]++) return ms_errorf("permute: dim %d repeated", perm[i]);
        shape[i] = t->sizes[d];
        stride[i] = t->strides[d];
    }
    return new_view(out, t, ndim, shape, stride, t->offset);
}

int ms_tensor_expand(ms_tensor **out, const ms_tensor *t, int ndim, const int64_t *shape_in) {
    char s[160], s2[160];
    if (ms_tensor_check_live(t, "expand")) return -1;
    if (ndim < t->ndim || ndim > MS_MAX_DIMS)
        return ms_errorf("expand: cannot expand shape %s to %s", ms_shape_str(t, s, sizeof s),
                         ms_dims_str(ndim, shape_in, s2, sizeof s2));
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    int lead = ndim - t->ndim;
    for (int i = 0; i < ndim; i++) {
        int64_t want = shape_in[i];
        if (i < lead) {
            if (want < 0) return ms_errorf("expand: -1 not allowed for a new leading dim in %s",
                                           ms_dims_str(ndim, shape_in, s2, sizeof s2));
            shape[i] = want;
            stride[i] = 0;
            continue;
        }
        int64_t have = t->sizes[i - lead];
        if (want == -1 || want == have) {
            shape[i] = have;
            stride[i] = t->strides[i - lead];
        } else if (have == 1 && want >= 0) {
            shape[i] = want;
            stride[i] = 0;
        } else {
            return ms_errorf("expand: cannot expand shape %s to %s", ms_shape_str(t, s, sizeof s),
                             ms_dims_str(ndim, shape_in, s2, sizeof s2));
        }
    }
    return new_view(out, t, ndim, shape, stride, t->offset);
}

int ms_tensor_squeeze(ms_tensor **out, const ms_tensor *t, int dim) {
    if (ms_tensor_check_live(t, "squeeze")) return -1;
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    int n = 0, d = -1;
    if (dim != MS_ALL_DIMS && ms_wrap_dim("squeeze", dim, t->ndim, &d)) return -1;
    for (int i = 0; i < t->ndim; i++) {
        int drop = (dim == MS_ALL_DIMS) ? t->sizes[i] == 1 : (i == d && t->sizes[i] == 1);
        if (drop) continue;
        shape[n] = t->sizes[i];
        stride[n] = t->strides[i];
        n++;
    }
    return new_view(out, t, n, shape, stride, t->offset);
}

int ms_tensor_unsqueeze(ms_tensor **out, const ms_tensor *t, int dim) {
    int d;
    if (ms_tensor_check_live(t, "unsqueeze")) return -1;
    if (t->ndim >= MS_MAX_DIMS) return ms_errorf("unsqueeze: tensor already has %d dims", MS_MAX_DIMS);
    if (ms_wrap_dim("unsqueeze", dim, t->ndim + 1, &d)) return -1;
    int64_t shape[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    for (int i = 0, j = 0; i < t->ndim + 1; i++) {
        if (i == d) {
            shape[i] = 1;
            stride[i] = (j < t->ndim) ? t->strides[j] * t->sizes[j] : 1;
        } else {
            shape[i] = t->sizes[j];
            stride[i] = t->strides[j];
            j++;
        }
    }
    return new_view(out, t, t->ndim + 1, shape, stride, t->offset);
}

/* ----------------------------------------------------------------- copies */

static int copy_named(ms_tensor *dst, const ms_tensor *src, const char *name);

/* to/clone/contiguous: a new tensor and one copy, counted (core/prof.h) under
 * the name the caller used */
static int to_named(ms_tensor **out, const ms_tensor *t, int dtype, int device, const char *name) {
    ms_tensor *r = NULL;
    if (ms_tensor_check_live(t, name)) return -1;
    if (ms_tensor_empty(&r, t->ndim, t->sizes, dtype, device)) return -1;
    if (copy_named(r, t, name)) {
        ms_tensor_free(r);
        return -1;
    }
    *out = r;
    return 0;
}

int ms_tensor_contiguous(ms_tensor **out, const ms_tensor *t) {
    if (ms_tensor_check_live(t, "contiguous")) return -1;
    if (ms_tensor_is_contiguous(t)) return ms_tensor_alias(out, t);
    return to_named(out, t, t->dtype_id, t->device_id, "contiguous");
}

int ms_tensor_clone(ms_tensor **out, const ms_tensor *t) {
    return to_named(out, t, t ? t->dtype_id : 0, t ? t->device_id : 0, "clone");
}

int ms_tensor_to(ms_tensor **out, const ms_tensor *t, int dtype, int device) {
    return to_named(out, t, dtype, device, "to");
}

/* typed fast paths for the common same-layout conversions */
static void convert_contig(void *dst, int ddt, const void *src, int sdt, int64_t n) {
    if (ddt == sdt) {
        memcpy(dst, src, (size_t)(n * ms_dtype_size(ddt)));
        return;
    }
    if (sdt == MS_F32 && ddt == MS_BF16) {
        const float *s = src; uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = ms_f32_to_bf16(s[i]);
    } else if (sdt == MS_BF16 && ddt == MS_F32) {
        const uint16_t *s = src; float *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = ms_bf16_to_f32(s[i]);
    } else if (sdt == MS_F32 && ddt == MS_F64) {
        const float *s = src; double *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = s[i];
    } else if (sdt == MS_F64 && ddt == MS_F32) {
        const double *s = src; float *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = (float)s[i];
    } else if (sdt == MS_F64 && (ddt == MS_BF16 || ddt == MS_F16)) {
        /* round once from f64 through f32 is double rounding; go via exact path */
        const double *s = src;
        for (int64_t i = 0; i < n; i++) ms_store((char *)dst + 2 * i, ddt, s[i]);
    } else {
        int ss = ms_dtype_size(sdt), ds = ms_dtype_size(ddt);
        for (int64_t i = 0; i < n; i++)
            ms_store((char *)dst + i * ds, ddt, ms_load((const char *)src + i * ss, sdt));
    }
}

/* copies that involve a device: on one device the backend's convert kernel
 * does strides and dtypes; across devices the data is first made contiguous
 * in dst's dtype on the source side, moved as bytes, then converted into
 * dst's strides on the destination side. */
static int device_copy(ms_tensor *dst, const ms_tensor *src) {
    char a[200], b[200];
    if (!ms_cuda_backend)
        return ms_errorf("copy_: %s to %s needs CUDA, and moonshard was built without it",
                         ms_desc(src, a, sizeof a), ms_desc(dst, b, sizeof b));
    if (dst->device_id == src->device_id) return ms_cuda_backend->convert(dst, src);
    int rc = -1;
    ms_tensor *s = NULL, *d = NULL;
    /* s: src's values in dst's dtype, contiguous, on src's device */
    if (src->dtype_id == dst->dtype_id && ms_tensor_is_contiguous(src)) {
        if (ms_tensor_alias(&s, src)) return -1;
    } else if (ms_tensor_to(&s, src, dst->dtype_id, src->device_id)) {
        return -1;
    }
    /* d: a contiguous buffer on dst's device (dst itself when contiguous) */
    if (ms_tensor_is_contiguous(dst)) {
        if (ms_tensor_alias(&d, dst)) goto out;
    } else if (ms_tensor_empty(&d, dst->ndim, dst->sizes, dst->dtype_id, dst->device_id)) {
        goto out;
    }
    if (ms_cuda_backend->copy(ms_tensor_data(d), d->device_id, ms_tensor_data(s), s->device_id,
                              ms_tensor_numel(d) * ms_dtype_size(d->dtype_id)))
        goto out;
    rc = (d->storage == dst->storage && d->offset == dst->offset) ? 0 : ms_tensor_copy_(dst, d);
out:
    ms_tensor_free(s);
    ms_tensor_free(d);
    return rc;
}

int ms_tensor_copy_(ms_tensor *dst, const ms_tensor *src) { return copy_named(dst, src, "copy_"); }

static int copy_named(ms_tensor *dst, const ms_tensor *src, const char *name) {
    char a[200], b[200];
    if (ms_tensor_check_live(dst, "copy_") || ms_tensor_check_live(src, "copy_")) return -1;
    MS_PROF_NOTE(name, dst);
    /* broadcast src to dst */
    ms_tensor *e = NULL;
    int same = src->ndim == dst->ndim;
    for (int i = 0; same && i < src->ndim; i++) same = src->sizes[i] == dst->sizes[i];
    if (!same) {
        if (ms_tensor_expand(&e, src, dst->ndim, dst->sizes))
            return ms_errorf("copy_: source %s does not broadcast to destination %s",
                             ms_desc(src, a, sizeof a), ms_desc(dst, b, sizeof b));
        src = e;
    }
    int64_t n = ms_tensor_numel(dst);
    int rc = 0;
    if (n == 0) goto done;
    if (dst->device_id != src->device_id || dst->device_id >= 0) {
        rc = device_copy(dst, src);
        goto done;
    }
    if (ms_tensor_is_contiguous(dst) && ms_tensor_is_contiguous(src)) {
        convert_contig(ms_tensor_data(dst), dst->dtype_id, ms_tensor_data(src), src->dtype_id, n);
        goto done;
    }
    /* general strided copy: iterate dst in row-major order */
    {
        int nd = dst->ndim;
        int64_t idx[MS_MAX_DIMS] = {0};
        int ds = ms_dtype_size(dst->dtype_id), ss = ms_dtype_size(src->dtype_id);
        char *dbase = ms_tensor_data(dst);
        const char *sbase = ms_tensor_data(src);
        int64_t inner = nd ? dst->sizes[nd - 1] : 1;
        int64_t dst_in = nd ? dst->strides[nd - 1] : 0, src_in = nd ? src->strides[nd - 1] : 0;
        for (int64_t done_ = 0; done_ < n; done_ += inner) {
            int64_t doff = 0, soff = 0;
            for (int i = 0; i < nd - 1; i++) {
                doff += idx[i] * dst->strides[i];
                soff += idx[i] * src->strides[i];
            }
            if (dst->dtype_id == src->dtype_id && ds == 4) {
                for (int64_t j = 0; j < inner; j++)
                    ((uint32_t *)dbase)[doff + j * dst_in] = ((const uint32_t *)sbase)[soff + j * src_in];
            } else {
                for (int64_t j = 0; j < inner; j++)
                    ms_store(dbase + (doff + j * dst_in) * ds, dst->dtype_id,
                             ms_load(sbase + (soff + j * src_in) * ss, src->dtype_id));
            }
            for (int i = nd - 2; i >= 0; i--) {
                if (++idx[i] < dst->sizes[i]) break;
                idx[i] = 0;
            }
        }
    }
done:
    if (e) ms_tensor_free(e);
    return rc;
}

/* element access for item()/totable()/printing of CPU tensors */
static int elem_offset(const ms_tensor *t, const int64_t *index, int64_t *off) {
    char s[160];
    int64_t o = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        if (index[i] < 0 || index[i] >= t->sizes[i])
            return ms_errorf("index: index %lld out of range for dim %d of shape %s", (long long)index[i],
                             i, ms_shape_str(t, s, sizeof s));
        o += index[i] * t->strides[i];
    }
    *off = o;
    return 0;
}

double ms_tensor_get(const ms_tensor *t, const int64_t *index) {
    int64_t o = 0;
    if (!t || !t->storage || !t->storage->data || t->device_id >= 0 || elem_offset(t, index, &o)) return NAN;
    return ms_load((char *)t->storage->data + o * ms_dtype_size(t->dtype_id), t->dtype_id);
}

int ms_tensor_set(ms_tensor *t, const int64_t *index, double value) {
    int64_t o = 0;
    if (ms_tensor_check_live(t, "set")) return -1;
    if (t->device_id >= 0) return ms_errorf("set: element access needs a CPU tensor");
    if (elem_offset(t, index, &o)) return -1;
    ms_store((char *)t->storage->data + o * ms_dtype_size(t->dtype_id), t->dtype_id, value);
    return 0;
}

int ms_file_read_into(const char *path, int64_t offset, int64_t nbytes, ms_tensor *dst) {
    char d[200];
    if (ms_tensor_check_live(dst, "read")) return -1;
    if (dst->device_id >= 0 || !ms_tensor_is_contiguous(dst))
        return ms_errorf("read: destination must be a contiguous CPU tensor, got %s", ms_desc(dst, d, sizeof d));
    if (nbytes != ms_tensor_numel(dst) * ms_dtype_size(dst->dtype_id))
        return ms_errorf("read: %s: %lld bytes do not fill %s", path, (long long)nbytes, ms_desc(dst, d, sizeof d));
    FILE *f = fopen(path, "rb");
    if (!f) return ms_errorf("read: cannot open %s: %s", path, strerror(errno));
    int rc = 0;
    if (fseeko(f, offset, SEEK_SET) != 0) rc = ms_errorf("read: %s: cannot seek to %lld", path, (long long)offset);
    else if (nbytes && fread(ms_tensor_data(dst), 1, (size_t)nbytes, f) != (size_t)nbytes)
        rc = ms_errorf("read: %s: file ends before byte %lld (truncated?)", path, (long long)(offset + nbytes));
    fclose(f);
    return rc;
}
