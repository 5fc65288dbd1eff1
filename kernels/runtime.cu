// kernels/runtime.cu — devices, the caching allocator, streams and events
// (the contract is in core/cuda.h). This file has no kernels: it is the
// host side every kernel file stands on.
//
// Allocator data structures, per device:
//   classes: request -> size class (512 B minimum; then 4 classes per power
//            of two: 2^k, 1.25*2^k, 1.5*2^k, 1.75*2^k), so waste <= 25%;
//   free lists: class size -> cached blocks (cudaMalloc'ed, idle);
//   live map: device pointer -> block (size, class, stream, pending streams);
//   pending: blocks freed while another stream may still use them, each with
//            an event; they move to the free lists once the event completes.
// No cudaMalloc/cudaFree on the steady-state path: after step 1 of a
// training loop every request finds a block of its class.
//
// CUDA graphs (the contract in core/cuda.h, docs/cuda-graphs.md): while a
// thread captures the device's compute stream, its requests are served
// from the graph's private pool: the pool's own free blocks first (freed
// earlier in the same capture: the captured work is one stream, so the
// graph runs their last use before the new one), then a block of the
// general free lists (idle on the compute stream, which the replays run
// on), then cudaMalloc. Every block freed during the capture joins the
// pool (captured work may still read it at replay), and so does every
// pool block freed later: nothing of the pool goes back to the general
// cache until the graph is freed.
#include "common.cuh"
#include "kernels.h"

#include <map>
#include <mutex>
#include <vector>

#include <stdio.h>
#include <string.h>
#include <time.h>

namespace {

struct Pool;

struct Block {
    void *ptr;
    int64_t size;       // class size (bytes obtained from cudaMalloc)
    int64_t requested;  // bytes asked for
    std::vector<cudaStream_t> used_on;  // other streams that used it
    Pool *pool = nullptr;  // the CUDA graph that owns it, or none (the general cache)
};

// the private memory of one CUDA graph
struct Pool {
    int device;
    std::multimap<int64_t, void *> reuse;  // freed, used on the compute stream only: reusable in its capture
    std::vector<Block> retired;            // freed after use on other streams: never reused while it lives
    int64_t bytes = 0;                     // class bytes it owns, live or idle
};

struct Pending {
    Block block;
    std::vector<cudaEvent_t> events;
};

struct DeviceState {
    bool ready = false;
    cudaStream_t compute = nullptr;
    cudaStream_t current = nullptr;
    std::multimap<int64_t, void *> free_blocks;   // class size -> ptr
    std::map<void *, Block> live;
    std::vector<Pending> pending;
    ms_cuda_memory_stats stats;
    ms_device_flag *flag = nullptr;                // device memory
    Pool *capture = nullptr;                       // the pool of the graph being captured
    std::vector<Pool *> pools;                     // of the graphs that live
};

const int kMaxDevices = 64;
DeviceState g_dev[kMaxDevices];
std::mutex g_mu;
int g_count = -1;
// the device this thread is capturing a graph on (-1: none); the capture
// mode is thread-local, so other threads' calls are not the capture's
thread_local int t_capture_device = -1;
// set while this thread makes a tensor that the host writes between
// replays (ms_cuda_capture_fresh): its block must be one no captured work
// touches, so not a block freed earlier in the same capture (the replay
// reruns that work, which would overwrite what the host wrote)
thread_local bool t_capture_fresh = false;
// graphs and streams freed (by Lua's collector, say) during this thread's
// capture: freeing them waits for their work, which the capture forbids,
// so they are freed when it ends
thread_local std::vector<ms_cuda_graph *> t_deferred_graphs;
thread_local std::vector<ms_cuda_stream *> t_deferred_streams;

// cudaMalloc, legal during this thread's capture too: the thread's mode is
// relaxed for the call (cudaThreadExchangeStreamCaptureMode: "in the case of
// cudaMalloc, the operation is not enqueued asynchronously to a stream, and
// is not observed by stream capture" - the memory exists at once, which is
// what the pool wants). Returns CUDA's error.
cudaError_t malloc_any(void **p, size_t n) {
    if (t_capture_device < 0) return cudaMalloc(p, n);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t e = cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) return e;
    cudaError_t r = cudaMalloc(p, n);
    e = cudaThreadExchangeStreamCaptureMode(&mode);   // (back to the capture's)
    return r != cudaSuccess ? r : e;
}

int64_t size_class(int64_t n) {
    if (n <= 512) return 512;
    int64_t p = 512;
    while (p * 2 < n) p *= 2;   // p < n <= 2p
    int64_t step = p / 4;
    return (n + step - 1) / step * step;
}

int device_count() {
    if (g_count < 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) {
            cudaGetLastError();
            n = 0;
        }
        g_count = n;
    }
    return g_count;
}

int check_device(int device, const char *op) {
    int n = device_count();
    if (device < 0 || device >= n || device >= kMaxDevices)
        return ms_errorf("%s: cuda:%d requested but %d CUDA device%s present", op, device, n,
                         n == 1 ? " is" : "s are");
    return 0;
}

int ensure_ready(int device) {
    if (check_device(device, "cuda")) return -1;
    DeviceState &d = g_dev[device];
    if (d.ready) return 0;
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaStreamCreateWithFlags(&d.compute, cudaStreamNonBlocking));
    d.current = d.compute;
    memset(&d.stats, 0, sizeof d.stats);
    CUDA_CHECK(cudaMalloc((void **)&d.flag, sizeof(ms_device_flag)));
    CUDA_CHECK(cudaMemset(d.flag, 0, sizeof(ms_device_flag)));
    d.ready = true;
    return 0;
}

// move pending blocks whose events have completed back to the free lists
void reap_pending(DeviceState &d) {
    for (size_t i = 0; i < d.pending.size();) {
        Pending &p = d.pending[i];
        bool done = true;
        for (cudaEvent_t e : p.events) {
            cudaError_t q = cudaEventQuery(e);
            if (q == cudaErrorNotReady) { done = false; break; }
            if (q != cudaSuccess) cudaGetLastError();
        }
        if (done) {
            for (cudaEvent_t e : p.events) cudaEventDestroy(e);
            d.free_blocks.emplace(p.block.size, p.block.ptr);
            d.pending[i] = d.pending.back();
            d.pending.pop_back();
        } else {
            i++;
        }
    }
}

int release_cached(int device) {
    DeviceState &d = g_dev[device];
    CUDA_CHECK(cudaSetDevice(device));
    // wait for pending blocks first: they are cached memory too
    for (Pending &p : d.pending) {
        for (cudaEvent_t e : p.events) {
            cudaEventSynchronize(e);
            cudaEventDestroy(e);
        }
        d.free_blocks.emplace(p.block.size, p.block.ptr);
    }
    d.pending.clear();
    for (auto &kv : d.free_blocks) {
        CUDA_CHECK(cudaFree(kv.second));
        d.stats.reserved -= kv.first;
        d.stats.num_frees++;
    }
    d.free_blocks.clear();
    return 0;
}

int cuda_alloc(void **ptr, int64_t nbytes, int device) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (ensure_ready(device)) return -1;
    DeviceState &d = g_dev[device];
    int64_t cls = size_class(nbytes);
    // this thread's capture: the graph's pool (no event queries while capturing)
    Pool *pool = t_capture_device == device ? d.capture : nullptr;
    if (!pool && !d.pending.empty()) reap_pending(d);
    void *p = nullptr;
    auto it = d.free_blocks.end();
    if (pool && !t_capture_fresh && (it = pool->reuse.find(cls)) != pool->reuse.end()) {
        p = it->second;
        pool->reuse.erase(it);
    } else if ((it = d.free_blocks.find(cls)) != d.free_blocks.end()) {
        p = it->second;
        d.free_blocks.erase(it);
        if (pool) {
            pool->bytes += cls;
            d.stats.graph_pool += cls;
        }
    } else {
        CUDA_CHECK(cudaSetDevice(device));
        cudaError_t err = malloc_any(&p, (size_t)cls);
        if (err != cudaSuccess) {
            cudaGetLastError();
            // (no emptying of the cache during a capture: cudaFree is not for a capturing thread)
            if (!pool) {
                if (release_cached(device)) return -1;
                err = cudaMalloc(&p, (size_t)cls);
            }
            if (err != cudaSuccess) {
                cudaGetLastError();
                d.stats.num_ooms++;
                size_t free_b = 0, total_b = 0;
                if (!pool) cudaMemGetInfo(&free_b, &total_b);
                return ms_errorf("cuda:%d out of memory: tried to allocate %lld bytes (%.2f MiB); "
                                 "allocated %.2f MiB, reserved %.2f MiB, peak %.2f MiB, "
                                 "device free %.2f of %.2f MiB",
                                 device, (long long)nbytes, nbytes / 1048576.0,
                                 d.stats.allocated / 1048576.0, d.stats.reserved / 1048576.0,
                                 d.stats.peak_allocated / 1048576.0, free_b / 1048576.0,
                                 total_b / 1048576.0);
            }
        }
        d.stats.num_mallocs++;
        d.stats.reserved += cls;
        if (d.stats.reserved > d.stats.peak_reserved) d.stats.peak_reserved = d.stats.reserved;
        if (pool) {
            pool->bytes += cls;
            d.stats.graph_pool += cls;
        }
    }
    Block b;
    b.ptr = p;
    b.size = cls;
    b.requested = nbytes;
    b.pool = pool;
    d.live[p] = b;
    d.stats.allocated += cls;
    d.stats.requested += nbytes;
    d.stats.num_allocs++;
    if (d.stats.allocated > d.stats.peak_allocated) d.stats.peak_allocated = d.stats.allocated;
    *ptr = p;
    return 0;
}

// an idle block back to the general cache: free at once, or once the
// other streams that used it are done (called outside captures only)
void release_block(DeviceState &d, int device, Block b) {
    if (b.used_on.empty()) {
        // work queued on the compute stream that uses this block runs before
        // any later work on that stream, so the block is free for it now
        d.free_blocks.emplace(b.size, b.ptr);
        return;
    }
    Pending pend;
    pend.block = b;
    cudaSetDevice(device);
    for (cudaStream_t s : b.used_on) {
        cudaEvent_t e;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            cudaStreamSynchronize(s);
            continue;
        }
        cudaEventRecord(e, s);
        pend.events.push_back(e);
    }
    pend.block.used_on.clear();
    d.pending.push_back(pend);
}

void cuda_free(void *ptr, int64_t nbytes, int device) {
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceState &d = g_dev[device];
    auto it = d.live.find(ptr);
    if (it == d.live.end()) return;
    Block b = it->second;
    d.live.erase(it);
    d.stats.allocated -= b.size;
    d.stats.requested -= b.requested;
    if (!b.pool && t_capture_device == device) {
        // freed during this thread's capture: captured work may read it at
        // every replay, so the graph's pool takes it
        b.pool = d.capture;
        b.pool->bytes += b.size;
        d.stats.graph_pool += b.size;
    }
    if (!b.pool) {
        release_block(d, device, b);
    } else if (b.used_on.empty()) {
        b.pool->reuse.emplace(b.size, b.ptr);   // (taken again only by its own capture)
    } else {
        b.pool->retired.push_back(b);
    }
}

// a graph's pool back to the general cache (the graph is gone or never
// was): its idle blocks become cached blocks, its live ones ordinary ones
void release_pool(int device, Pool *pool) {
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceState &d = g_dev[device];
    for (auto &kv : d.live)
        if (kv.second.pool == pool) kv.second.pool = nullptr;
    for (auto &kv : pool->reuse) d.free_blocks.emplace(kv.first, kv.second);
    for (Block &b : pool->retired) {
        b.pool = nullptr;
        release_block(d, device, b);
    }
    d.stats.graph_pool -= pool->bytes;
    for (size_t i = 0; i < d.pools.size(); i++)
        if (d.pools[i] == pool) {
            d.pools[i] = d.pools.back();
            d.pools.pop_back();
            break;
        }
    delete pool;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
// a copy that blocked the host: counted, with the time it waited
static void count_sync(int device, int64_t t0) {
    int64_t dt = now_ns() - t0;
    g_dev[device].stats.num_host_syncs++;   // (as the other counters of a copy: no lock)
    g_dev[device].stats.host_sync_ns += dt;
}

// the refusal of a host sync inside this thread's capture (0: none going on)
int refuse_in_capture(const char *op, const char *why) {
    if (t_capture_device < 0) return 0;
    return ms_errorf("%s during CUDA graph capture on cuda:%d: %s (the capture is aborted; docs/cuda-graphs.md)",
                     op, t_capture_device, why);
}

int cuda_copy(void *dst, int dst_device, const void *src, int src_device, int64_t nbytes) {
    if (nbytes == 0) return 0;
    if ((dst_device < 0 || src_device < 0) &&
        refuse_in_capture(dst_device < 0 ? "a copy from the device to the host (item(), :to('cpu'), printing)"
                                         : "a copy from the host to the device (a host value moved to cuda)",
                          "the host would wait for the stream, and a replay would not repeat the copy; "
                          "copy new inputs into the static tensors before replay()"))
        return -1;
    if (dst_device >= 0 && src_device >= 0) {
        cudaStream_t s = ms_cuda_stream_of(dst_device);
        if (dst_device == src_device) {
            CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDeviceToDevice, s));
        } else {
            CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, (size_t)nbytes, s));
        }
        return 0;
    }
    if (dst_device >= 0) {
        // host -> device: ordered on the compute stream; the host buffer may be
        // reused by the caller at once, so wait for the copy to finish reading it
        cudaStream_t s = ms_cuda_stream_of(dst_device);
        int64_t t0 = now_ns();   // (a pageable copy may block in cudaMemcpyAsync itself)
        CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        count_sync(dst_device, t0);
        return 0;
    }
    cudaStream_t s = ms_cuda_stream_of(src_device);
    int64_t t0 = now_ns();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    count_sync(src_device, t0);
    return ms_cuda_check_device_flags(src_device);
}

ms_device_backend g_backend = {cuda_alloc, cuda_free, cuda_copy, ms_cuda_convert};

// register the backend when the library is loaded
struct Registrar {
    Registrar() { ms_cuda_backend = &g_backend; }
} g_registrar;

}  // namespace

struct ms_cuda_stream {
    cudaStream_t s;
    int device;
    bool owned;
};

struct ms_cuda_event {
    cudaEvent_t e;
    int device;
};

struct ms_cuda_graph {
    int device;
    Pool *pool;                     // its memory; NULL once given back
    cudaGraphExec_t exec = nullptr;
    cudaEvent_t done = nullptr;     // recorded after each replay
};

cudaStream_t ms_cuda_stream_of(int device) {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    if (!g_dev[device].ready) {
        std::lock_guard<std::mutex> lock(g_mu);
        if (ensure_ready(device)) return nullptr;
    }
    return g_dev[device].current;
}

cudaError_t ms_cuda_malloc_any(void **p, size_t n) { return malloc_any(p, n); }

int ms_cuda_activate(int device) {
    int cur = -1;
    CUDA_CHECK(cudaGetDevice(&cur));
    if (cur != device) CUDA_CHECK(cudaSetDevice(device));
    std::lock_guard<std::mutex> lock(g_mu);
    return ensure_ready(device);
}

ms_device_flag *ms_cuda_device_flag(int device) {
    if (ms_cuda_activate(device)) return nullptr;
    return g_dev[device].flag;
}

extern "C" {

int ms_cuda_available(void) { return device_count() > 0; }
int ms_cuda_device_count(void) { return device_count(); }

int ms_cuda_set_device(int device) {
    if (check_device(device, "set_device")) return -1;
    CUDA_CHECK(cudaSetDevice(device));
    std::lock_guard<std::mutex> lock(g_mu);
    return ensure_ready(device);
}

int ms_cuda_get_device(void) {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess) return -1;
    return d;
}

int ms_cuda_device_name(int device, char *buf, int n) {
    if (check_device(device, "device_name")) return -1;
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, device));
    snprintf(buf, (size_t)n, "%s", p.name);
    return 0;
}

int ms_cuda_device_capability(int device, int *major, int *minor) {
    if (check_device(device, "device_capability")) return -1;
    CUDA_CHECK(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device));
    return 0;
}

int ms_cuda_synchronize(int device) {
    if (refuse_in_capture("synchronize", "the host cannot wait for work that is only being recorded")) return -1;
    if (ms_cuda_activate(device)) return -1;
    CUDA_CHECK(cudaDeviceSynchronize());
    return ms_cuda_check_device_flags(device);
}

int ms_cuda_get_memory_stats(int device, ms_cuda_memory_stats *out) {
    if (check_device(device, "memory_stats")) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_dev[device].ready) *out = g_dev[device].stats;
    else memset(out, 0, sizeof *out);
    return 0;
}

int ms_cuda_reset_peak_stats(int device) {
    if (check_device(device, "reset_peak_stats")) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceState &d = g_dev[device];
    d.stats.peak_allocated = d.stats.allocated;
    d.stats.peak_reserved = d.stats.reserved;
    return 0;
}

int ms_cuda_empty_cache(int device) {
    if (check_device(device, "empty_cache")) return -1;
    if (refuse_in_capture("empty_cache", "cudaFree is not allowed while a stream is captured")) return -1;
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_dev[device].ready) return 0;
    return release_cached(device);
}

int ms_cuda_check_device_flags(int device) {
    if (device < 0 || device >= kMaxDevices || !g_dev[device].ready) return 0;
    ms_device_flag f;
    CUDA_CHECK(cudaMemcpy(&f, g_dev[device].flag, sizeof f, cudaMemcpyDeviceToHost));
    if (f.code == 0) return 0;
    CUDA_CHECK(cudaMemset(g_dev[device].flag, 0, sizeof f));
    return ms_errorf("cuda:%d: index %lld at position %lld is out of range [0, %lld) (found by a kernel; "
                     "the results of the op that read it are invalid)",
                     device, f.value, f.position, f.limit);
}

int ms_cuda_stream_new(ms_cuda_stream **out, int device, int priority) {
    if (ms_cuda_activate(device)) return -1;
    ms_cuda_stream *s = new ms_cuda_stream;
    s->device = device;
    s->owned = true;
    cudaError_t err = cudaStreamCreateWithPriority(&s->s, cudaStreamNonBlocking, priority);
    if (err != cudaSuccess) {
        delete s;
        return ms_errorf("stream_new: cudaStreamCreateWithPriority failed: %s", cudaGetErrorString(err));
    }
    *out = s;
    return 0;
}

void ms_cuda_stream_free(ms_cuda_stream *s) {
    if (!s) return;
    if (s->owned && t_capture_device >= 0) {   // (its synchronize waits for the capture's end)
        t_deferred_streams.push_back(s);
        return;
    }
    if (s->owned) {
        std::lock_guard<std::mutex> lock(g_mu);
        DeviceState &d = g_dev[s->device];
        if (d.current == s->s) d.current = d.compute;
        // blocks that recorded this stream would record an event on it when
        // freed: finish its work and forget it (a tensor used by a NCCL
        // communicator's stream outliving dist.destroy crashed in
        // cudaEventRecord at exit)
        cudaSetDevice(s->device);
        cudaStreamSynchronize(s->s);
        cudaGetLastError();
        auto forget = [&](std::vector<cudaStream_t> &u) {
            for (size_t i = 0; i < u.size();)
                if (u[i] == s->s) {
                    u[i] = u.back();
                    u.pop_back();
                } else {
                    i++;
                }
        };
        for (auto &kv : d.live) forget(kv.second.used_on);
        for (Pool *pool : d.pools)
            for (Block &b : pool->retired) forget(b.used_on);
        cudaStreamDestroy(s->s);
    }
    delete s;
}

ms_cuda_stream *ms_cuda_current_stream(int device) {
    if (ms_cuda_activate(device)) return nullptr;
    ms_cuda_stream *s = new ms_cuda_stream;
    s->s = g_dev[device].current;
    s->device = device;
    s->owned = false;
    return s;
}

int ms_cuda_set_current_stream(ms_cuda_stream *s) {
    int device = s ? s->device : ms_cuda_get_device();
    if (ms_cuda_activate(device)) return -1;
    if (s && t_capture_device == device) {
        // work queued on a stream outside the capture would run now, once
        cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(s->s, &st));
        if (st != cudaStreamCaptureStatusActive)
            return ms_errorf("set_stream: a stream that is not part of the CUDA graph capture on cuda:%d: its work "
                             "would run once now instead of at each replay; record an event on the captured stream "
                             "and make this stream wait for it first (and join it back the same way before the "
                             "capture ends)", device);
    }
    std::lock_guard<std::mutex> lock(g_mu);
    g_dev[device].current = s ? s->s : g_dev[device].compute;
    return 0;
}

int ms_cuda_stream_synchronize(ms_cuda_stream *s) {
    if (refuse_in_capture("stream synchronize", "the host cannot wait for work that is only being recorded")) return -1;
    CUDA_CHECK(cudaStreamSynchronize(s->s));
    return ms_cuda_check_device_flags(s->device);
}

int ms_cuda_stream_wait_event(ms_cuda_stream *s, ms_cuda_event *e) {
    cudaStream_t st = s ? s->s : ms_cuda_stream_of(e->device);
    CUDA_CHECK(cudaStreamWaitEvent(st, e->e, 0));
    return 0;
}

int ms_cuda_event_new(ms_cuda_event **out, int device, int timing) {
    if (ms_cuda_activate(device)) return -1;
    ms_cuda_event *e = new ms_cuda_event;
    e->device = device;
    cudaError_t err = cudaEventCreateWithFlags(&e->e, timing ? cudaEventDefault : cudaEventDisableTiming);
    if (err != cudaSuccess) {
        delete e;
        return ms_errorf("event_new: cudaEventCreate failed: %s", cudaGetErrorString(err));
    }
    *out = e;
    return 0;
}

void ms_cuda_event_free(ms_cuda_event *e) {
    if (!e) return;
    cudaEventDestroy(e->e);
    delete e;
}

int ms_cuda_event_record(ms_cuda_event *e, ms_cuda_stream *s) {
    cudaStream_t st = s ? s->s : ms_cuda_stream_of(e->device);
    CUDA_CHECK(cudaEventRecord(e->e, st));
    return 0;
}

int ms_cuda_event_synchronize(ms_cuda_event *e) {
    if (refuse_in_capture("event synchronize", "the host cannot wait for work that is only being recorded")) return -1;
    int64_t t0 = now_ns();
    CUDA_CHECK(cudaEventSynchronize(e->e));
    count_sync(e->device, t0);   // (the host blocked, as in a host-blocking copy)
    return 0;
}

int ms_cuda_event_query(ms_cuda_event *e) {
    cudaError_t q = cudaEventQuery(e->e);
    if (q == cudaSuccess) return 1;
    if (q == cudaErrorNotReady) return 0;
    return ms_errorf("event_query: %s", cudaGetErrorString(q));
}

cudaEvent_t ms_cuda_event_raw(const ms_cuda_event *e) { return e ? e->e : nullptr; }

int ms_cuda_event_elapsed_ms(ms_cuda_event *start, ms_cuda_event *end, float *ms) {
    CUDA_CHECK(cudaEventElapsedTime(ms, start->e, end->e));
    return 0;
}

int ms_cuda_record_stream(const ms_tensor *t, ms_cuda_stream *s) {
    if (ms_tensor_check_live(t, "record_stream")) return -1;
    if (t->device_id < 0) return ms_errorf("record_stream: tensor is on the cpu");
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceState &d = g_dev[t->device_id];
    auto it = d.live.find(t->storage->data);
    if (it == d.live.end()) return 0;
    if (s->s == d.compute) return 0;
    for (cudaStream_t x : it->second.used_on)
        if (x == s->s) return 0;
    it->second.used_on.push_back(s->s);
    return 0;
}

int ms_cuda_host_alloc(void **out, int64_t nbytes) {
    CUDA_CHECK(cudaHostAlloc(out, (size_t)nbytes, cudaHostAllocDefault));
    return 0;
}

void ms_cuda_host_free(void *p) {
    if (p) cudaFreeHost(p);
}

int ms_cuda_copy_async(ms_tensor *dst, const ms_tensor *src) {
    char a[200], b[200];
    if (ms_tensor_check_live(dst, "copy_async") || ms_tensor_check_live(src, "copy_async")) return -1;
    const bool up = src->device_id < 0 && dst->device_id >= 0, down = src->device_id >= 0 && dst->device_id < 0;
    const int64_t nb = ms_tensor_numel(src) * (int64_t)ms_dtype_size(src->dtype_id);
    if (!(up || down) || !ms_tensor_is_contiguous(dst) || !ms_tensor_is_contiguous(src) ||
        ms_tensor_numel(dst) * (int64_t)ms_dtype_size(dst->dtype_id) != nb)
        return ms_errorf("copy_async: one host and one device tensor, contiguous, of the same bytes; got %s <- %s",
                         ms_desc(dst, a, sizeof a), ms_desc(src, b, sizeof b));
    const ms_tensor *host = up ? src : dst;
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, ms_tensor_data(host)) != cudaSuccess || at.type != cudaMemoryTypeHost) {
        cudaGetLastError();
        return ms_errorf("copy_async: the host tensor is not page-locked (ms_cuda_host_alloc): %s",
                         ms_desc(host, a, sizeof a));
    }
    if (nb == 0) return 0;
    const int dev = up ? dst->device_id : src->device_id;
    if (ms_cuda_activate(dev)) return -1;
    CUDA_CHECK(cudaMemcpyAsync(ms_tensor_data(dst), ms_tensor_data(src), (size_t)nb,
                               up ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, ms_cuda_stream_of(dev)));
    return 0;
}


// ------------------------------------------------------------ CUDA graphs

int ms_cuda_capturing(void) { return t_capture_device; }

int ms_cuda_capture_fresh(int on) {
    int prev = t_capture_fresh ? 1 : 0;
    t_capture_fresh = on != 0;
    return prev;
}

int ms_cuda_graph_begin(ms_cuda_graph **out, int device) {
    *out = nullptr;
    if (t_capture_device >= 0)
        return ms_errorf("graph: this thread is already capturing a CUDA graph on cuda:%d (captures do not nest)",
                         t_capture_device);
    if (ms_cuda_activate(device)) return -1;
    ms_cuda_graph *g = new ms_cuda_graph;
    g->device = device;
    g->pool = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&g->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        delete g;
        return ms_errorf("graph: cudaEventCreateWithFlags failed: %s", cudaGetErrorString(e));
    }
    {
        std::lock_guard<std::mutex> lock(g_mu);
        DeviceState &d = g_dev[device];
        const char *why = d.capture ? "another thread is capturing a graph on it"
                          : d.current != d.compute
                              ? "the current stream is not the compute stream (begin the capture outside ms.cuda.with_stream)"
                              : nullptr;
        // ThreadLocal: a potentially unsafe call of this thread (a
        // synchronous copy or memset, a sync, a cudaMalloc outside
        // malloc_any) fails and invalidates the capture, instead of running
        // once, outside the graph, as under Relaxed; other threads (NCCL's, a
        // checkpoint writer's) are not hindered, as they would be under Global
        if (!why) e = cudaStreamBeginCapture(d.compute, cudaStreamCaptureModeThreadLocal);
        if (why || e != cudaSuccess) {
            cudaGetLastError();
            cudaEventDestroy(g->done);
            delete g;
            if (why) return ms_errorf("graph: cannot capture on cuda:%d: %s", device, why);
            return ms_errorf("graph: cudaStreamBeginCapture failed: %s", cudaGetErrorString(e));
        }
        g->pool = new Pool;
        g->pool->device = device;
        d.pools.push_back(g->pool);
        d.capture = g->pool;
    }
    t_capture_device = device;
    *out = g;
    return 0;
}

int ms_cuda_graph_end(ms_cuda_graph *g, int keep) {
    if (!g || !g->pool || t_capture_device != g->device || g_dev[g->device].capture != g->pool)
        return ms_errorf("graph_end: that graph is not being captured by this thread");
    DeviceState &d = g_dev[g->device];
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(d.compute, &graph);
    {
        std::lock_guard<std::mutex> lock(g_mu);
        d.capture = nullptr;
    }
    t_capture_device = -1;
    int rc = 0;
    if (e != cudaSuccess || !graph) {
        if (keep)
            rc = ms_errorf("graph: the capture on cuda:%d failed: %s (a call the capture forbids inside it, or a "
                           "stream forked from it and not joined back before its end)",
                           g->device, e != cudaSuccess ? cudaGetErrorString(e) : "it was invalidated");
    } else if (keep) {
        e = cudaGraphInstantiate(&g->exec, graph, 0);
        if (e != cudaSuccess) {
            g->exec = nullptr;
            rc = ms_errorf("graph: cudaGraphInstantiate failed: %s", cudaGetErrorString(e));
        }
    }
    if (graph) cudaGraphDestroy(graph);   // (the executable graph keeps what it needs)
    if (!keep || rc) {
        cudaGetLastError();   // (an error of the aborted capture must not reach the next launch check)
        release_pool(g->device, g->pool);
        g->pool = nullptr;
    }
    std::vector<ms_cuda_graph *> gs;
    std::vector<ms_cuda_stream *> ss;
    gs.swap(t_deferred_graphs);
    ss.swap(t_deferred_streams);
    for (ms_cuda_graph *x : gs) ms_cuda_graph_free(x);
    for (ms_cuda_stream *x : ss) ms_cuda_stream_free(x);
    return rc;
}

int ms_cuda_graph_replay(ms_cuda_graph *g) {
    if (t_capture_device >= 0)
        return ms_errorf("graph replay during a CUDA graph capture on cuda:%d: replay after the capture ends",
                         t_capture_device);
    if (!g || !g->exec) return ms_errorf("graph replay: the graph was freed, or its capture failed");
    if (ms_cuda_activate(g->device)) return -1;
    cudaStream_t st = g_dev[g->device].compute;
    CUDA_CHECK(cudaGraphLaunch(g->exec, st));
    CUDA_CHECK(cudaEventRecord(g->done, st));
    return 0;
}

void ms_cuda_graph_free(ms_cuda_graph *g) {
    if (!g) return;
    if (t_capture_device >= 0) {
        t_deferred_graphs.push_back(g);
        return;
    }
    cudaSetDevice(g->device);
    if (g->exec) {
        cudaEventSynchronize(g->done);   // its last replay done before its memory goes back
        cudaGraphExecDestroy(g->exec);
    }
    if (g->pool) release_pool(g->device, g->pool);
    cudaEventDestroy(g->done);
    cudaGetLastError();
    delete g;
}

}  // extern "C"
