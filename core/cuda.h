/* core/cuda.h — the CUDA runtime of moonshard: devices, the caching
 * allocator, streams and events. Kernels live in kernels/ (one .cu file per op).
 *
 *   if (ms_cuda_device_count() > 0) {
 *       ms_tensor *t = NULL;
 *       int64_t shape[1] = {1024};
 *       ms_tensor_empty(&t, 1, shape, MS_BF16, 0);   // cuda:0, from the cache
 *       ms_cuda_memory_stats st; ms_cuda_get_memory_stats(0, &st);
 *   }
 *
 * Allocator: requests are rounded up to a size class (512 B minimum, then
 * four classes per power of two, so at most 25% is wasted); a freed block
 * goes back to its class's free list and is reused by the next request of
 * that class without a cudaMalloc. Blocks are stream-ordered: a block is
 * reused on the stream it was allocated for; when another stream used it
 * (ms_cuda_record_stream), its reuse waits for an event recorded on that
 * stream at free time. On cudaMalloc failure the cache is emptied and the
 * request retried once; a second failure is an error stating the request
 * and the stats — the process stays usable.
 *
 * Streams: each device has one compute stream (non-blocking), the default
 * for every kernel launch; ms_cuda_set_current_stream switches it. Nothing
 * here synchronises the host except ms_cuda_synchronize, event waits on the
 * host, and device-to-host copies.
 *
 * In a build without CUDA these functions exist and report no devices.
 */
#ifndef MS_CUDA_H
#define MS_CUDA_H

#include <stdint.h>
#include "tensor.h"

/* FFI-BEGIN */
typedef struct ms_cuda_memory_stats {
    int64_t allocated;       /* bytes in live blocks (rounded sizes) */
    int64_t requested;       /* bytes asked for by live blocks */
    int64_t reserved;        /* bytes obtained with cudaMalloc and not released */
    int64_t peak_allocated;
    int64_t peak_reserved;
    int64_t num_mallocs;     /* cudaMalloc calls */
    int64_t num_frees;       /* cudaFree calls */
    int64_t num_allocs;      /* allocation requests served */
    int64_t num_ooms;        /* requests that failed even after emptying the cache */
    int64_t num_host_syncs;  /* times a copy between host and device blocked the host
                                on the stream (the training step should make none) */
    int64_t host_sync_ns;    /* the time those copies blocked the host, in all */
    int64_t graph_pool;      /* bytes of reserved owned by CUDA graphs' private pools (live or idle) */
} ms_cuda_memory_stats;

typedef struct ms_cuda_stream ms_cuda_stream;  /* opaque */
typedef struct ms_cuda_event ms_cuda_event;    /* opaque */
typedef struct ms_cuda_graph ms_cuda_graph;    /* opaque */

int ms_cuda_available(void);           /* 1 when built with CUDA and a device is present */
int ms_cuda_device_count(void);
int ms_cuda_set_device(int device);
int ms_cuda_get_device(void);
int ms_cuda_device_name(int device, char *buf, int n);
int ms_cuda_device_capability(int device, int *major, int *minor);  /* e.g. 9, 0 on an H100 */
int ms_cuda_synchronize(int device);
int ms_cuda_get_memory_stats(int device, ms_cuda_memory_stats *out);
int ms_cuda_reset_peak_stats(int device);
int ms_cuda_empty_cache(int device);
/* check and clear a sticky device-side error flag (bad token ids, bad
 * targets): returns 0 when clear, -1 with the message set otherwise */
int ms_cuda_check_device_flags(int device);

int ms_cuda_stream_new(ms_cuda_stream **out, int device, int priority);
void ms_cuda_stream_free(ms_cuda_stream *s);
ms_cuda_stream *ms_cuda_current_stream(int device);
int ms_cuda_set_current_stream(ms_cuda_stream *s);   /* NULL: back to the compute stream */
int ms_cuda_stream_synchronize(ms_cuda_stream *s);
int ms_cuda_stream_wait_event(ms_cuda_stream *s, ms_cuda_event *e);

int ms_cuda_event_new(ms_cuda_event **out, int device, int timing);
void ms_cuda_event_free(ms_cuda_event *e);
int ms_cuda_event_record(ms_cuda_event *e, ms_cuda_stream *s);   /* NULL: current stream */
int ms_cuda_event_synchronize(ms_cuda_event *e);
int ms_cuda_event_query(ms_cuda_event *e);                        /* 1 done, 0 pending, -1 error */
int ms_cuda_event_elapsed_ms(ms_cuda_event *start, ms_cuda_event *end, float *ms);

/* the storage of t was used on stream s: its reuse after free waits for s */
int ms_cuda_record_stream(const struct ms_tensor *t, ms_cuda_stream *s);

/* CUDA graphs (docs/cuda-graphs.md): the work this thread queues on the
 * device's compute stream between begin and end is recorded, not run, and
 * each replay runs it all with one launch on the compute stream.
 *   begin: capture starts (cudaStreamCaptureModeThreadLocal); every
 *     allocation of this thread on the device comes from the graph's
 *     private pool, and every block freed joins it, until the graph is
 *     freed: the addresses the graph holds stay its own. Refused while
 *     capturing (with an error naming the op; the caller then ends the
 *     capture with keep = 0): host <-> device copies (item()), syncs,
 *     empty_cache, random draws, CPU tensor ops, and a GEMM whose plan would
 *     be tuned (timed).
 *   end: keep = 1 instantiates the graph (an error when the capture
 *     failed); keep = 0 discards it and gives its pool back.
 *   free: waits for its last replay, then gives its pool back to the
 *     general cache; safe on NULL. Called during a capture (Lua's
 *     collector), it is done when the capture ends. */
int ms_cuda_graph_begin(ms_cuda_graph **out, int device);
int ms_cuda_graph_end(ms_cuda_graph *g, int keep);
int ms_cuda_graph_replay(ms_cuda_graph *g);
void ms_cuda_graph_free(ms_cuda_graph *g);
/* the device this thread is capturing a graph on, or -1 */
int ms_cuda_capturing(void);
/* while on (1), this thread's allocations during its capture take no block
 * freed earlier in the capture: for a tensor the host writes between
 * replays (AdamW's constants); returns the previous setting */
int ms_cuda_capture_fresh(int on);

/* page-locked host memory for fast, asynchronous transfers */
int ms_cuda_host_alloc(void **out, int64_t nbytes);
void ms_cuda_host_free(void *p);
/* dst <- src between the host and a device (either way), contiguous, the
 * same bytes, queued on the device's current stream without the host
 * waiting: the host side must be page-locked (ms_cuda_host_alloc), stay
 * alive and not be touched until the copy is done (an event recorded after
 * it, then waited for). A pageable host side is refused, since CUDA would
 * run that copy synchronously. */
int ms_cuda_copy_async(struct ms_tensor *dst, const struct ms_tensor *src);

/* which kernels run ms_attention on CUDA (kernels/attention.cu): for bf16/f16,
 * WGMMA (Hopper's wgmma FlashAttention-2; head dim 64, sm_90 devices), MMA
 * (mma.sync FlashAttention-2; head dims 64, 128), WMMA (head dims 16, 32,
 * 64, 128) or SIMT (any head dim up to 128); f32 always runs SIMT. AUTO: the
 * environment's MS_ATTENTION_IMPL=wgmma|mma|wmma|simt (or MS_ATTENTION_SIMT=1),
 * else the fastest that fits. A forced one that does not fit a call falls back
 * WGMMA -> MMA -> WMMA -> SIMT; last_impl says what the latest call ran. */
enum { MS_ATTENTION_AUTO = 0, MS_ATTENTION_MMA, MS_ATTENTION_WMMA, MS_ATTENTION_SIMT, MS_ATTENTION_WGMMA };
int ms_cuda_attention_set_impl(int impl);   /* 0, or -1 for a value not above */
int ms_cuda_attention_get_impl(void);
/* 1: the mma backward in one pass (FA2: dq through f32 atomics inside the
 * dk/dv kernel), 0: two deterministic kernels (the default; the environment's
 * MS_ATTENTION_BWD=onepass chooses the first); returns the previous one */
int ms_cuda_attention_set_onepass(int on);
/* 1: the wgmma backward (sm_90a, bf16/f16, D = 64) in one pass, dq added
 * inside the dk/dv kernel in a fixed order (deterministic; for causal
 * attention with Tk >= Tq: other shapes and the column-sum option keep two
 * kernels; measured slower, docs/perf-notes.md), 0: two kernels (the
 * default; the environment's MS_ATTENTION_WG_BWD=onepass chooses the
 * first); returns the previous one */
int ms_cuda_attention_set_wg_onepass(int on);
/* 1 (default; env MS_ATTENTION_FUSED_DELTA=0 for 0): the wgmma backward's dq
 * kernel computes Delta = rowsum(out * dout) and runs before the dk/dv kernel;
 * 0: a delta kernel first. Returns the previous setting. */
int ms_cuda_attention_set_fused_delta(int on);
/* FLCE's plain row pass: 4 loads four 16-byte packs a thread before using
 * them, 1 one at a time, 0 (the default) 1 when the row is cached in shared
 * memory and 4 when not (MS_FLCE_ROW_UNROLL=1 or 4 forces one); the same
 * bits; other values leave it; returns the previous one */
int ms_cuda_flce_set_row_unroll(int u);
/* 1 (default; env MS_FLCE_ROW_PREFETCH=0 for 0): FLCE's plain row pass
 * copies a row that fits its shared-memory cache whole (cp.async) before pass
 * 1; 0: pass 1 reads it from device memory pack by pack. The same bits.
 * Returns the previous setting. */
int ms_cuda_flce_set_row_prefetch(int on);
/* which cuBLASLt epilogues run where they apply, a mask of: BIAS (bias and
 * bias gradient), GELU (GELU_AUX_BIAS forward), DGELU (DGELU_BGRAD backward);
 * a path left out runs as separate passes. Default BIAS|GELU; the
 * environment's MS_GEMM_EPILOGUE=<mask> (0: none) overrides it, -1 restores
 * it. Returns the previous mask. */
enum { MS_GEMM_EPI_BIAS = 1, MS_GEMM_EPI_GELU = 2, MS_GEMM_EPI_DGELU = 4, MS_GEMM_EPI_ALL = 7,
       MS_GEMM_EPI_DEFAULT = 3 };
int ms_cuda_gemm_set_epilogue(int mask);
/* SMs the GEMMs leave free (cuBLASLt's SM count target = the device's SMs
 * less this), for collectives running beside them: a GEMM sized for every
 * SM that finds some taken by NCCL runs a second, mostly empty wave. 0 (the
 * default, or the environment's MS_GEMM_SM_MARGIN) leaves it to cuBLASLt.
 * Returns the previous margin. */
int ms_cuda_gemm_set_sm_margin(int sms);
/* GEMM tuning: on (the default; the environment's MS_GEMM_TUNE=0 turns it
 * off), the first GEMM of each new shape/layout/epilogue times the
 * cuBLASLt heuristic's candidates (up to 8) on the current stream and keeps
 * the fastest if it beats the heuristic's first by 5%; off, the first is
 * taken untimed. A choice holds for the process's life: the same bits run
 * to run within a process, not necessarily across processes (turn it off
 * for that). Returns the previous setting (-1: restore the default). */
int ms_cuda_gemm_set_tune(int on);
/* out[0] plans tuned, out[1] of them not on the heuristic's first, out[2]
 * host microseconds spent tuning, out[3] plans whose choice came from the
 * tuning file */
void ms_cuda_gemm_tune_stats(int64_t *out);
/* the tuning file (MS_GEMM_TUNE_FILE sets the first; NULL or "": none):
 * tuned choices are appended to it and read back, so later runs (and the
 * other ranks) take the same algorithms untimed (core/gemm_tune.c has the
 * format). Made if missing; an error naming it if it cannot be. Plans made
 * before keep their algorithm (ms_cuda_gemm_clear_plans forgets every
 * plan). */
int ms_cuda_gemm_set_tune_file(const char *path);
int ms_cuda_gemm_clear_plans(void);
int ms_cuda_attention_last_impl(void);
/* float8's dynamic cast (ms_float8_cast_dynamic): 1 (the default; the
 * environment's MS_FLOAT8_FUSED=0 for 0) one cooperative kernel takes the
 * amax and casts (the second read of x largely from L2); 0: a memset and the
 * amax and cast kernels apart. The same bits. Returns the previous setting
 * (-1 leaves it). */
int ms_cuda_float8_set_fused(int on);
/* FFI-END */

#endif
