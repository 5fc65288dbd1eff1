// core/dist/nccl.cu — the NCCL backend: collectives on CUDA tensors.
//
// Each communicator has its own high-priority stream. A collective:
//   1. records `ready` on the current (compute) stream and makes the
//      communication stream wait for it: the inputs are complete;
//   2. enqueues the NCCL call on the communication stream;
//   3. records its own `end` event there, and marks every tensor it touches
//      as used on that stream (ms_cuda_record_stream), so the caching
//      allocator does not hand their memory out again before `end`.
// Waiting is cudaStreamWaitEvent(current stream, end): the host never
// blocks, and compute overlaps communication until the result is needed.
//
// Failures: communicators are blocking (see blocking_config: a non-blocking
// one costs a thread start per call); start-up gets its deadline from a
// store barrier of every member before ncclCommInitRankConfig, and
// MS_NCCL_BLOCKING=0 brings back non-blocking communicators whose every call
// is settled against a deadline.
// A watchdog thread wakes every 100 ms (MS_NCCL_WATCHDOG_MS), polls
// ncclCommGetAsyncError and the `end` event of the oldest collective in
// flight of each communicator; an error or a collective older than the
// group's time-out aborts the communicator (ncclCommAbort: NCCL's kernels
// return, so a host blocked on the compute stream wakes up), prints why on
// stderr and marks the group broken, so the next call on it fails with the
// same message.
//
// NVLink SHARP (multicast) stays off: NCCL_NVLS_ENABLE=0 is set before the
// first communicator unless the environment already chose.
//
// The CUDA runtime (kernels/runtime.cu) owns streams and devices; this file
// only adds the communicator's stream through its public API.
#include "../../kernels/common.cuh"
#include "dist_internal.h"

#ifdef MS_WITH_NCCL
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <math.h>
#include <unistd.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

namespace {

// The collective timeline (ms_dist_timing): one entry per collective
// started while it is on, owned by the log (not by the work), with timed
// events: `issued` on the compute stream where the collective was called,
// `start` and `end` on the communication stream around the NCCL call, and at
// the first wait `wait0` / `wait1` on the compute stream around the
// cudaStreamWaitEvent (wait1 - wait0 is the time the compute stream stood
// still for it). Events made per entry: benchmarks only.
struct TimedOp {
    char desc[160];
    cudaEvent_t ev[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};   // issued start end wait0 wait1
    bool waited = false;
};
std::mutex g_tl_mu;
bool g_tl_on = false;
std::vector<TimedOp *> g_tl;

void timeline_clear_locked() {
    for (TimedOp *t : g_tl) {
        for (cudaEvent_t e : t->ev)
            if (e) cudaEventDestroy(e);
        delete t;
    }
    g_tl.clear();
}

// a new entry with its events made (the caller records them), or NULL when
// the timeline is off
TimedOp *timeline_new(const char *desc, cudaError_t *err) {
    std::lock_guard<std::mutex> l(g_tl_mu);
    *err = cudaSuccess;
    if (!g_tl_on) return nullptr;
    TimedOp *t = new TimedOp;
    snprintf(t->desc, sizeof t->desc, "%s", desc);
    for (cudaEvent_t &e : t->ev) {
        *err = cudaEventCreate(&e);
        if (*err != cudaSuccess) {
            e = nullptr;
            for (cudaEvent_t x : t->ev)
                if (x) cudaEventDestroy(x);
            delete t;
            return nullptr;
        }
    }
    g_tl.push_back(t);
    return t;
}

// a copy-engine registration (ms_comm_copy_register): member r's bytes at
// src[r] (ours in place, the peers' through their IPC mappings)
struct CopyBuf {
    int64_t bytes = 0;
    std::vector<void *> src;
    std::vector<void *> opened;   // what cudaIpcOpenMemHandle returned (closed on free)
};

cudaError_t copy_gather(const CopyBuf *b, void *out, cudaStream_t s) {
    for (size_t r = 0; r < b->src.size(); r++) {
        cudaError_t e = cudaMemcpyAsync((char *)out + (int64_t)r * b->bytes, b->src[r], (size_t)b->bytes,
                                        cudaMemcpyDeviceToDevice, s);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return e;
        }
    }
    return cudaSuccess;
}

// one collective in flight: shared by its work handle and the watchdog
struct OpRec {
    TimedOp *tl = nullptr;   // its timeline entry (owned by the log), or NULL
    cudaEvent_t end = nullptr;
    int device = -1;
    double t_enq = 0;
    bool captured = false;   // recorded into a CUDA graph capture: run by its replays, not watched
    char desc[160];
    std::atomic<int> refs{1};
};

// the end events of finished collectives, per device, for the next ones (an
// event made and destroyed per collective costs host time in the enqueue,
// which the GPU waits for when the comm stream is idle)
std::mutex g_ev_mu;
std::vector<cudaEvent_t> g_ev_pool[64];

cudaError_t event_get(int device, cudaEvent_t *e) {
    {
        std::lock_guard<std::mutex> l(g_ev_mu);
        if (device >= 0 && device < 64 && !g_ev_pool[device].empty()) {
            *e = g_ev_pool[device].back();
            g_ev_pool[device].pop_back();
            return cudaSuccess;
        }
    }
    return cudaEventCreateWithFlags(e, cudaEventDisableTiming);
}

void op_release(OpRec *op) {
    if (op && --op->refs == 0) {
        if (op->end) {
            std::lock_guard<std::mutex> l(g_ev_mu);
            if (op->device >= 0 && op->device < 64 && g_ev_pool[op->device].size() < 64)
                g_ev_pool[op->device].push_back(op->end);
            else
                cudaEventDestroy(op->end);
        }
        delete op;
    }
}

// Communicators are blocking (NCCL's default, as torch.distributed's) unless
// MS_NCCL_BLOCKING=0. A non-blocking communicator launches every collective
// from a thread NCCL starts for it and returns ncclInProgress, which we then
// poll: 25-30 us of enqueue latency per call, 12% of a 64 MiB all-gather on
// two H200s. Blocking ones enqueue in the caller; what the non-blocking mode
// gave (a time-out on a hung init) comes from a store barrier of every
// member before ncclCommInitRankConfig, and hung collectives are still
// aborted by the watchdog from its thread.
int blocking_config() {
    const char *v = getenv("MS_NCCL_BLOCKING");
    return !(v && v[0] == '0');
}

// A new communicator's configuration: blocking as above; NCCL's CTA policy
// from MS_NCCL_CTA_POLICY = default | efficiency (fewer CTAs, for overlap
// with compute) | zero (copy engines where NCCL can), NCCL >= 2.27.
int make_config(ncclConfig_t *cfg, const char *what) {
    cfg->blocking = blocking_config();
    const char *p = getenv("MS_NCCL_CTA_POLICY");
    if (!p || !*p || !strcmp(p, "default")) return 0;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    if (!strcmp(p, "efficiency")) {
        cfg->CTAPolicy = NCCL_CTA_POLICY_EFFICIENCY;
        return 0;
    }
    if (!strcmp(p, "zero")) {
        cfg->CTAPolicy = NCCL_CTA_POLICY_ZERO;
        return 0;
    }
    return ms_errorf("%s: MS_NCCL_CTA_POLICY=%s (use default, efficiency or zero)", what, p);
#else
    return ms_errorf("%s: MS_NCCL_CTA_POLICY=%s needs NCCL 2.27 or later (built with %d.%d)", what, p, NCCL_MAJOR,
                     NCCL_MINOR);
#endif
}

struct NcclComm {
    ncclComm_t comm = nullptr;
    int device = -1;
    int world_rank = 0;
    ms_cuda_stream *mstream = nullptr;   // owns the stream
    cudaStream_t stream = nullptr;       // its raw handle
    cudaEvent_t ready = nullptr;
    float *barrier_buf = nullptr;        // one float for barriers
    ms_comm *owner = nullptr;            // the group (valid while registered)
    std::mutex mu;                       // enqueue and abort exclude each other
    std::deque<OpRec *> inflight;
    bool aborted = false;
    int splits = 0;                      // new_group calls on this parent (the store key's count)
    // this communicator's name among the run's: the world's is this
    // constant, a group's mixes its parent's with the split's count and
    // colour, so two groups of the same members (the world and a mesh row
    // of every rank) never share a store key (FNV-1a)
    uint64_t path = 1469598103934665603ull;
};

std::mutex g_mu;                          // g_comms and the watchdog's life
std::vector<NcclComm *> g_comms;
std::thread g_watchdog;
std::condition_variable g_cv;
bool g_stop = false;

#define NCCL_CHECK(call, comm)                                                                   \
    do {                                                                                         \
        ncclResult_t r_ = (call);                                                                \
        if (r_ != ncclSuccess && r_ != ncclInProgress) return nccl_error(r_, #call, comm, __LINE__); \
    } while (0)

int nccl_error(ncclResult_t r, const char *what, ncclComm_t comm, int line) {
    const char *last = ncclGetLastError(comm);
    return ms_errorf("%s:%d: %s failed: %s%s%s", __FILE__, line, what, ncclGetErrorString(r),
                     last && *last ? ": " : "", last ? last : "");
}

// a non-blocking communicator's call returned ncclInProgress: poll until it
// settles or the deadline passes (then ncclInProgress is returned)
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, double deadline) {
    int spins = 0;
    while (r == ncclInProgress) {
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
        if (r != ncclInProgress) break;
        if (ms_dist_now() > deadline) return ncclInProgress;
        if (spins++ < 100) {
            sched_yield();
        } else {
            struct timespec ts = {0, 100 * 1000};
            nanosleep(&ts, nullptr);
        }
    }
    return r;
}

// abort under nc->mu; the message goes to stderr and into the group
void abort_locked(NcclComm *nc, const char *msg) {
    if (nc->aborted) return;
    nc->aborted = true;
    fprintf(stderr, "moonshard dist (rank %d, cuda:%d): %s\n", nc->world_rank, nc->device, msg);
    fflush(stderr);
    ncclCommAbort(nc->comm);
    nc->comm = nullptr;
    if (nc->owner) ms_comm_fail(nc->owner, "%s", msg);
    for (OpRec *op : nc->inflight) op_release(op);
    nc->inflight.clear();
}

int watchdog_period_ms() {
    const char *v = getenv("MS_NCCL_WATCHDOG_MS");
    int ms = v ? atoi(v) : 0;
    return ms > 0 ? ms : 100;
}

void watchdog_main() {
    int period = watchdog_period_ms();
    std::unique_lock<std::mutex> lock(g_mu);
    while (!g_stop) {
        g_cv.wait_for(lock, std::chrono::milliseconds(period));
        if (g_stop) break;
        for (NcclComm *nc : g_comms) {
            std::lock_guard<std::mutex> cl(nc->mu);
            if (nc->aborted || !nc->comm) continue;
            cudaSetDevice(nc->device);
            char msg[768];
            ncclResult_t ae = ncclSuccess;
            if (ncclCommGetAsyncError(nc->comm, &ae) == ncclSuccess && ae != ncclSuccess && ae != ncclInProgress) {
                const char *last = ncclGetLastError(nc->comm);
                snprintf(msg, sizeof msg, "NCCL reported an asynchronous error on %s: %s%s%s; the communicator "
                         "was aborted", nc->owner ? nc->owner->name : "a group", ncclGetErrorString(ae),
                         last && *last ? ": " : "", last ? last : "");
                abort_locked(nc, msg);
                continue;
            }
            double timeout = nc->owner ? nc->owner->timeout_s : 600;
            while (!nc->inflight.empty()) {
                OpRec *op = nc->inflight.front();
                cudaError_t q = cudaEventQuery(op->end);
                if (q == cudaSuccess) {
                    nc->inflight.pop_front();
                    op_release(op);
                    continue;
                }
                if (q != cudaErrorNotReady) {
                    cudaGetLastError();
                    snprintf(msg, sizeof msg, "%s failed on the GPU: %s; the communicator was aborted", op->desc,
                             cudaGetErrorString(q));
                    abort_locked(nc, msg);
                } else if (ms_dist_now() - op->t_enq > timeout) {
                    snprintf(msg, sizeof msg, "%s did not complete within %g s (a rank died, hangs, or called "
                             "another collective): the communicator was aborted and the group is unusable",
                             op->desc, timeout);
                    abort_locked(nc, msg);
                }
                break;
            }
        }
    }
}

void register_comm(NcclComm *nc) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_comms.push_back(nc);
    if (!g_watchdog.joinable()) {
        g_stop = false;
        // the watchdog takes no signal meant for the main thread
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        g_watchdog = std::thread(watchdog_main);
        pthread_sigmask(SIG_SETMASK, &old, nullptr);
    }
}

void unregister_comm(NcclComm *nc) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (size_t i = 0; i < g_comms.size(); i++)
        if (g_comms[i] == nc) {
            g_comms.erase(g_comms.begin() + (long)i);
            break;
        }
}

ncclDataType_t nccl_type(int dtype) {
    switch (dtype) {
    case MS_F32: return ncclFloat32;
    case MS_F64: return ncclFloat64;
    case MS_I64: return ncclInt64;
    case MS_F8E4M3:
    case MS_F8E5M2: return ncclUint8;   // (moved as bytes: all_gather, broadcast)
    default: return ncclBfloat16;
    }
}

ncclRedOp_t nccl_op(int op) {
    switch (op) {
    case MS_REDUCE_AVG: return ncclAvg;
    case MS_REDUCE_MAX: return ncclMax;
    case MS_REDUCE_MIN: return ncclMin;
    default: return ncclSum;
    }
}

// the communicator's stream and events; nc->comm is already made
int make_streams(NcclComm *nc) {
    int lo = 0, hi = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    if (ms_cuda_stream_new(&nc->mstream, nc->device, hi)) return -1;
    // the raw handle, through the runtime's public API: make it current for
    // a moment and read it back
    ms_cuda_stream *prev = ms_cuda_current_stream(nc->device);
    if (!prev) return -1;
    int rc = ms_cuda_set_current_stream(nc->mstream);
    nc->stream = ms_cuda_stream_of(nc->device);
    ms_cuda_set_current_stream(prev);
    ms_cuda_stream_free(prev);
    if (rc) return -1;
    CUDA_CHECK(cudaEventCreateWithFlags(&nc->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaMalloc((void **)&nc->barrier_buf, sizeof(float)));
    return 0;
}

void destroy_nccl(NcclComm *nc, double timeout) {
    unregister_comm(nc);
    {
        std::lock_guard<std::mutex> cl(nc->mu);
        if (nc->comm && !nc->aborted && ms_dist_exiting_with_error) {
            ncclCommAbort(nc->comm);   // a failing process waits for no peer
            nc->comm = nullptr;
        }
        if (nc->comm && !nc->aborted) {
            cudaSetDevice(nc->device);
            // flush what was issued, then free; a peer that is gone must not
            // hang the exit: past the deadline the communicator is aborted
            ncclResult_t r = ncclCommFinalize(nc->comm);
            r = settle(nc->comm, r, ms_dist_now() + timeout);
            if (r == ncclSuccess) ncclCommDestroy(nc->comm);
            else ncclCommAbort(nc->comm);
            nc->comm = nullptr;
        }
        for (OpRec *op : nc->inflight) op_release(op);
        nc->inflight.clear();
    }
    if (nc->ready) cudaEventDestroy(nc->ready);
    if (nc->barrier_buf) cudaFree(nc->barrier_buf);
    ms_cuda_stream_free(nc->mstream);
    delete nc;
}

// NCCL connects a communicator's peers at the first collective that needs
// each algorithm, inside the enqueue. A blocking communicator would then
// wait in the host, holding nc->mu, for a peer that may never come, out of
// the watchdog's reach. So every member connects right after creation, when
// all of them are known to be here (the store barrier before the init): a
// small and a 4 MiB all-reduce (ring and tree), an all-gather, a
// reduce-scatter and a broadcast, then a sync. Later collectives are only
// enqueued, and a peer that never joins one leaves a kernel the watchdog
// can abort.
int connect_eagerly(NcclComm *nc) {
    int n = 0;
    ncclResult_t r = ncclCommCount(nc->comm, &n);
    if (r != ncclSuccess) return nccl_error(r, "ncclCommCount", nc->comm, __LINE__);
    const size_t big = (size_t)1 << 20;   // floats
    float *buf = nullptr;
    CUDA_CHECK(cudaMalloc((void **)&buf, (big + (size_t)n) * sizeof(float)));
    cudaError_t me = cudaMemsetAsync(buf, 0, (big + (size_t)n) * sizeof(float), nc->stream);
    if (me != cudaSuccess) {
        cudaFree(buf);
        return ms_errorf("connecting the peers: cudaMemsetAsync: %s", cudaGetErrorString(me));
    }
    r = ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, nc->comm, nc->stream);
    if (r == ncclSuccess) r = ncclAllReduce(buf, buf, big, ncclFloat32, ncclSum, nc->comm, nc->stream);
    if (r == ncclSuccess) r = ncclAllGather(buf, buf + 1, 1, ncclFloat32, nc->comm, nc->stream);
    if (r == ncclSuccess) r = ncclReduceScatter(buf + 1, buf, 1, ncclFloat32, ncclSum, nc->comm, nc->stream);
    if (r == ncclSuccess) r = ncclBroadcast(buf, buf, 1, ncclFloat32, 0, nc->comm, nc->stream);
    cudaError_t ce = cudaStreamSynchronize(nc->stream);
    cudaFree(buf);
    if (r != ncclSuccess) return nccl_error(r, "connecting the peers", nc->comm, __LINE__);
    if (ce != cudaSuccess) return ms_errorf("connecting the peers: %s", cudaGetErrorString(ce));
    return 0;
}

int finish_comm(ms_comm *c, NcclComm *nc, ncclComm_t comm, ncclResult_t r, double deadline, const char *what) {
    r = settle(comm, r, deadline);
    if (r == ncclInProgress) {
        ncclCommAbort(comm);
        return ms_errorf("%s: NCCL did not finish creating the communicator within the time-out (a rank died or "
                         "cannot be reached); aborted", what);
    }
    if (r != ncclSuccess) {
        int rc = nccl_error(r, what, comm, __LINE__);
        ncclCommAbort(comm);
        return rc;
    }
    nc->comm = comm;
    if (make_streams(nc) || (blocking_config() && connect_eagerly(nc))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ms_last_error());
        ncclCommAbort(comm);
        nc->comm = nullptr;
        return ms_errorf("%s: %s", what, msg);
    }
    register_comm(nc);
    return 0;
}

}  // namespace

extern "C" {

static int nccl_init_world(ms_comm *c, const ms_dist_env *e, const ms_dist_options *o, ms_store_client *store) {
    int ndev = ms_cuda_device_count();
    int device = o->device >= 0 ? o->device : e->local_rank;
    if (ndev <= 0) return ms_errorf("dist.init: backend 'nccl' needs a GPU and none is visible");
    if (device >= ndev)
        return ms_errorf("dist.init: rank %d would use cuda:%d (LOCAL_RANK=%d) but %d GPU%s visible", e->rank, device,
                         e->local_rank, ndev, ndev == 1 ? " is" : "s are");
    if (ms_cuda_set_device(device)) return -1;
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;   // checked before any rendezvous
    if (make_config(&cfg, "dist.init")) return -1;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (e->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) return nccl_error(r, "ncclGetUniqueId", nullptr, __LINE__);
        if (e->world_size > 1 && ms_store_set(store, "ms/nccl/world", &id, sizeof id)) return -1;
    } else {
        int64_t n = 0;
        if (ms_store_get(store, "ms/nccl/world", &id, sizeof id, &n, o->rendezvous_timeout_s)) return -1;
        if (n != (int64_t)sizeof id) return ms_errorf("dist.init: the NCCL id from the store has %lld bytes", (long long)n);
    }
    NcclComm *nc = new NcclComm;
    nc->device = device;
    nc->world_rank = e->rank;
    nc->owner = c;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, e->world_size, id, e->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        delete nc;
        return nccl_error(r, "ncclCommInitRankConfig", comm, __LINE__);
    }
    if (finish_comm(c, nc, comm, r, ms_dist_now() + o->rendezvous_timeout_s, "dist.init (ncclCommInitRankConfig)")) {
        delete nc;
        return -1;
    }
    c->impl = nc;
    c->device = device;
    return 0;
}

static uint64_t path_mix(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= 1099511628211ull;
    }
    return h;
}

// A new group is a communicator of its own, made like the world's: its
// first member (key 0) draws a unique id and publishes it through the
// rendezvous store under a key naming the parent (its path: not its member
// list, which another group may share, and a key read before its first
// member wrote the new id would hand back the other group's stale one), the
// parent's split count and the colour; the others read it and every member
// joins with ncclCommInitRankConfig once a store barrier saw them all
// (or, with MS_NCCL_BLOCKING=0, non-blocking and settled within the parent's
// time-out). This is what torch.distributed does by default;
// ncclCommSplit was tried first and, on NCCL 2.28 with two H200s, handed back
// a NULL communicator on one rank.
static int nccl_split(ms_comm *parent, int color, int key, int n, void **impl) {
    *impl = nullptr;
    NcclComm *p = (NcclComm *)parent->impl;
    int seq = p->splits++;   // every member of the parent calls split, in the same order
    if (color < 0) return 0;
    if (ms_cuda_activate(p->device)) return -1;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (n > 1) {
        ms_store_client *st = ms_dist_store();
        if (!st) return ms_errorf("new_group: no rendezvous store to publish the group's NCCL id (dist.init without one?)");
        uint64_t h = p->path;
        char k[128];
        snprintf(k, sizeof k, "ms/nccl/split/%016llx/%d/%d", (unsigned long long)h, seq, color);
        if (key == 0) {
            ncclResult_t r = ncclGetUniqueId(&id);
            if (r != ncclSuccess) return nccl_error(r, "new_group (ncclGetUniqueId)", nullptr, __LINE__);
            if (ms_store_set(st, k, &id, sizeof id)) return -1;
        } else {
            int64_t got = 0;
            if (ms_store_get(st, k, &id, sizeof id, &got, parent->timeout_s)) return -1;
            if (got != (int64_t)sizeof id)
                return ms_errorf("new_group: the NCCL id under %s has %lld bytes", k, (long long)got);
        }
        // a blocking init waits for every member without a time-out: first
        // make sure they all arrived (the error names the missing members)
        if (blocking_config() && ms_store_barrier(st, k, key, n, parent->timeout_s)) {
            char msg[600];
            snprintf(msg, sizeof msg, "%s", ms_last_error());
            return ms_errorf("new_group (ranks numbered within the group): %s", msg);
        }
    } else {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess) return nccl_error(r, "new_group (ncclGetUniqueId)", nullptr, __LINE__);
    }
    NcclComm *nc = new NcclComm;
    nc->device = p->device;
    nc->world_rank = p->world_rank;
    nc->path = path_mix(path_mix(p->path, (uint64_t)seq), (uint64_t)(uint32_t)color);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    if (make_config(&cfg, "new_group")) {   // dist.init checked it: cannot fail here
        delete nc;
        return -1;
    }
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, n, id, key, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        delete nc;
        return nccl_error(r, "new_group (ncclCommInitRankConfig)", comm, __LINE__);
    }
    if (finish_comm(parent, nc, comm, r, ms_dist_now() + parent->timeout_s, "new_group (ncclCommInitRankConfig)")) {
        delete nc;
        return -1;
    }
    *impl = nc;
    return 0;
}

static int nccl_start(ms_work *w, ms_tensor *out, const ms_tensor *in, int root) {
    NcclComm *nc = (NcclComm *)w->comm->impl;
    if (ms_cuda_activate(nc->device)) return -1;
    cudaStream_t compute = ms_cuda_stream_of(nc->device);
    const ms_p2p_spec *sp = w->kind == MS_COLL_P2P ? (const ms_p2p_spec *)w->aux : nullptr;
    int64_t n_in = sp ? 0 : ms_tensor_numel(in), n_out = sp ? 0 : ms_tensor_numel(out);
    ncclDataType_t t = sp ? ncclUint8 : nccl_type(out->dtype_id);
    void *po = sp ? nullptr : ms_tensor_data(out);
    const void *pi = sp ? nullptr : ms_tensor_data(in);
    // under a CUDA graph capture of the compute stream the collective is
    // recorded: `ready` forks the communication stream into the capture,
    // the wait (nccl_wait, on the compute stream) joins it back. Its `end`
    // is an event of the capture, which the watchdog must not query (the
    // query fails on a captured event) and nothing polls.
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(compute, &cs));
    const bool captured = cs == cudaStreamCaptureStatusActive;
    if (captured) {
        int v = 0;
        ncclResult_t vr = ncclGetVersion(&v);
        if (vr != ncclSuccess) return nccl_error(vr, "ncclGetVersion", nullptr, __LINE__);
        if (v < NCCL_VERSION(2, 9, 0))
            return ms_errorf("%s during CUDA graph capture: NCCL %d records collectives into graphs from 2.9 on", w->desc,
                             v);
        std::lock_guard<std::mutex> l(g_tl_mu);
        if (g_tl_on)
            return ms_errorf("%s during CUDA graph capture: the collective timeline is on (dist.timing): its timed "
                             "events cannot be recorded into a graph", w->desc);
    }
    OpRec *op = new OpRec;
    op->captured = captured;
    snprintf(op->desc, sizeof op->desc, "%s", w->desc);
    {
        std::lock_guard<std::mutex> cl(nc->mu);
        nc->owner = w->comm;   // a group made by split learns its owner at its first call
        if (nc->aborted || !nc->comm) {
            delete op;
            return ms_errorf("%s: the group is broken: %s", w->desc, w->comm->broken_msg);
        }
        cudaError_t ce = cudaEventRecord(nc->ready, compute);
        if (ce == cudaSuccess) op->tl = timeline_new(w->desc, &ce);
        if (ce == cudaSuccess && op->tl) ce = cudaEventRecord(op->tl->ev[0], compute);
        if (ce == cudaSuccess) ce = cudaStreamWaitEvent(nc->stream, nc->ready, 0);
        if (ce == cudaSuccess && op->tl) ce = cudaEventRecord(op->tl->ev[1], nc->stream);
        if (ce == cudaSuccess) ce = event_get(nc->device, &op->end);
        op->device = nc->device;
        if (ce != cudaSuccess) {
            delete op;
            return ms_errorf("%s: ordering against the compute stream failed: %s", w->desc, cudaGetErrorString(ce));
        }
        ncclResult_t r;
        switch (w->kind) {
        case MS_COLL_ALL_GATHER: r = ncclAllGather(pi, po, (size_t)n_in, t, nc->comm, nc->stream); break;
        case MS_COLL_REDUCE_SCATTER:
            r = ncclReduceScatter(pi, po, (size_t)n_out, t, nccl_op(w->op), nc->comm, nc->stream);
            break;
        case MS_COLL_ALL_REDUCE: r = ncclAllReduce(po, po, (size_t)n_out, t, nccl_op(w->op), nc->comm, nc->stream); break;
        case MS_COLL_COPY_GATHER: {
            cudaError_t me = copy_gather((const CopyBuf *)w->aux, po, nc->stream);
            if (me != cudaSuccess) {
                op_release(op);
                return ms_errorf("%s: cudaMemcpyAsync failed: %s", w->desc, cudaGetErrorString(me));
            }
            r = ncclSuccess;
            break;
        }
        case MS_COLL_P2P: {
            // one group: a send to a peer and a receive from it do not wait on each other
            r = ncclGroupStart();
            for (int i = 0; r == ncclSuccess && i < sp->n; i++) {
                ms_tensor *x = sp->t[i];
                size_t n = (size_t)ms_tensor_numel(x);
                r = sp->is_recv[i] ? ncclRecv(ms_tensor_data(x), n, nccl_type(x->dtype_id), sp->peer[i], nc->comm, nc->stream)
                                   : ncclSend(ms_tensor_data(x), n, nccl_type(x->dtype_id), sp->peer[i], nc->comm, nc->stream);
            }
            ncclResult_t re = ncclGroupEnd();
            if (r == ncclSuccess) r = re;
            break;
        }
        default: r = ncclBroadcast(po, po, (size_t)n_out, t, root, nc->comm, nc->stream); break;
        }
        r = settle(nc->comm, r, ms_dist_now() + w->comm->timeout_s);
        if (r != ncclSuccess) {
            char msg[600];
            nccl_error(r == ncclInProgress ? ncclInternalError : r, w->desc, nc->comm, __LINE__);
            snprintf(msg, sizeof msg, "%s%s", ms_last_error(), r == ncclInProgress ? " (timed out enqueuing)" : "");
            op_release(op);
            abort_locked(nc, msg);
            return -1;
        }
        ce = cudaEventRecord(op->end, nc->stream);
        if (ce == cudaSuccess && op->tl) ce = cudaEventRecord(op->tl->ev[2], nc->stream);
        if (ce != cudaSuccess) {
            op_release(op);
            return ms_errorf("%s: cudaEventRecord failed: %s", w->desc, cudaGetErrorString(ce));
        }
        op->t_enq = ms_dist_now();
        if (!captured) {
            op->refs = 2;   // the work and the watchdog
            nc->inflight.push_back(op);
        }
    }
    // the allocator must not reuse these before `end`
    w->impl = op;
    if (sp) {
        for (int i = 0; i < sp->n; i++)
            if (ms_cuda_record_stream(sp->t[i], nc->mstream)) return -1;
        return 0;
    }
    if (ms_cuda_record_stream(out, nc->mstream)) return -1;
    if (in != out && ms_cuda_record_stream(in, nc->mstream)) return -1;
    return 0;
}

static int nccl_wait(ms_work *w, int stream_only) {
    NcclComm *nc = (NcclComm *)w->comm->impl;
    OpRec *op = (OpRec *)w->impl;
    if (w->comm->broken) return ms_errorf("%s: the group is broken: %s", w->desc, w->comm->broken_msg);
    if (ms_cuda_activate(nc->device)) return -1;
    cudaStream_t compute = ms_cuda_stream_of(nc->device);
    bool timed = false;
    if (op->tl) {
        std::lock_guard<std::mutex> l(g_tl_mu);   // the log may have been cleared since
        for (TimedOp *t : g_tl)
            if (t == op->tl && !t->waited) timed = t->waited = true;
        if (!timed) op->tl = nullptr;
    }
    if (timed) CUDA_CHECK(cudaEventRecord(op->tl->ev[3], compute));
    CUDA_CHECK(cudaStreamWaitEvent(compute, op->end, 0));
    if (timed) CUDA_CHECK(cudaEventRecord(op->tl->ev[4], compute));
    return 0;
}

// ---- copy-engine gathers: every member's registered tensor, mapped here
// through CUDA IPC, copied with cudaMemcpyAsync on the communication stream

// a member's registration record, all-gathered at registration
struct CopyRec {
    int32_t ok;          // this member could export its tensor
    int32_t device;
    uint64_t host;       // a hash of the host name and boot id
    int64_t offset;      // bytes from the allocation's start
    int64_t bytes;
    cudaIpcMemHandle_t handle;
};

uint64_t host_id() {
    char buf[512] = {0};
    gethostname(buf, 255);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        size_t n = strlen(buf);
        if (!fgets(buf + n, (int)(sizeof buf - n), f)) buf[n] = 0;
        fclose(f);
    }
    uint64_t h = 1469598103934665603ull;   // FNV-1a
    for (const char *p = buf; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}

// every member's `bytes` bytes of `mine` into `all` (host memory), through
// an NCCL all-gather the host waits for (the group's deadline)
int sync_all_gather(NcclComm *nc, ms_comm *c, const void *mine, void *all, size_t bytes, const char *what) {
    if (ms_cuda_activate(nc->device)) return -1;
    char *dbuf = nullptr;
    size_t total = bytes * (size_t)(c->size + 1);
    CUDA_CHECK(cudaMalloc((void **)&dbuf, total));
    cudaError_t ce = cudaMemcpy(dbuf, mine, bytes, cudaMemcpyHostToDevice);
    cudaEvent_t done = nullptr;
    if (ce == cudaSuccess) ce = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
        cudaFree(dbuf);
        return ms_errorf("%s: %s", what, cudaGetErrorString(ce));
    }
    {
        std::lock_guard<std::mutex> cl(nc->mu);
        if (nc->aborted || !nc->comm) {
            cudaFree(dbuf);
            cudaEventDestroy(done);
            return ms_errorf("%s: the group is broken: %s", what, c->broken_msg);
        }
        ncclResult_t r = ncclAllGather(dbuf, dbuf + bytes, bytes, ncclUint8, nc->comm, nc->stream);
        r = settle(nc->comm, r, ms_dist_now() + c->timeout_s);
        if (r != ncclSuccess) {
            cudaEventDestroy(done);
            return nccl_error(r == ncclInProgress ? ncclInternalError : r, what, nc->comm, __LINE__);
        }
        ce = cudaEventRecord(done, nc->stream);
    }
    double deadline = ms_dist_now() + c->timeout_s;
    while (ce == cudaSuccess) {
        cudaError_t q = cudaEventQuery(done);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) { ce = q; break; }
        if (c->broken || ms_dist_now() > deadline) {
            cudaEventDestroy(done);
            char msg[400];
            snprintf(msg, sizeof msg, "%s on %s did not complete within %g s: the communicator was aborted", what,
                     c->name, c->timeout_s);
            std::lock_guard<std::mutex> cl(nc->mu);
            abort_locked(nc, msg);
            return -1;   // dbuf stays (NCCL may still write it)
        }
        struct timespec ts = {0, 100 * 1000};
        nanosleep(&ts, nullptr);
    }
    if (ce == cudaSuccess) ce = cudaMemcpy(all, dbuf + bytes, bytes * (size_t)c->size, cudaMemcpyDeviceToHost);
    cudaEventDestroy(done);
    cudaFree(dbuf);
    if (ce != cudaSuccess) return ms_errorf("%s: %s", what, cudaGetErrorString(ce));
    return 0;
}

static void nccl_copy_free(void *impl) {
    CopyBuf *b = (CopyBuf *)impl;
    if (!b) return;
    for (void *p : b->opened)
        if (p) cudaIpcCloseMemHandle(p);
    delete b;
}

static int nccl_copy_register(ms_comm *c, const ms_tensor *t, void **impl) {
    NcclComm *nc = (NcclComm *)c->impl;
    const char *what = "copy_register";
    if (ms_cuda_activate(nc->device)) return -1;
    // what this rank can offer: its tensor's allocation (one cudaMalloc per
    // block of the caching allocator) and the offset into it
    CopyRec mine;
    memset(&mine, 0, sizeof mine);
    mine.device = nc->device;
    mine.host = host_id();
    mine.bytes = ms_tensor_numel(t) * (int64_t)ms_dtype_size(t->dtype_id);
    mine.offset = t->offset * (int64_t)ms_dtype_size(t->dtype_id);
    cudaError_t ce = cudaIpcGetMemHandle(&mine.handle, t->storage->data);
    if (ce == cudaSuccess) mine.ok = 1;
    else cudaGetLastError();
    std::vector<CopyRec> all((size_t)c->size);
    if (sync_all_gather(nc, c, &mine, all.data(), sizeof mine, what)) return -1;
    bool ok = true;
    for (const CopyRec &r : all)
        ok = ok && r.ok && r.host == mine.host && r.bytes == mine.bytes;
    CopyBuf *b = new CopyBuf;
    b->bytes = mine.bytes;
    b->src.assign((size_t)c->size, nullptr);
    b->opened.assign((size_t)c->size, nullptr);
    for (int r = 0; ok && r < c->size; r++) {
        if (r == c->rank) {
            b->src[r] = (char *)t->storage->data + mine.offset;
            continue;
        }
        void *p = nullptr;
        ce = cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess);
        if (ce != cudaSuccess) {
            cudaGetLastError();
            ok = false;
            break;
        }
        b->opened[r] = p;
        b->src[r] = (char *)p + all[r].offset;
    }
    // every member takes the same road
    int32_t mine_ok = ok ? 1 : 0;
    std::vector<int32_t> oks((size_t)c->size);
    if (sync_all_gather(nc, c, &mine_ok, oks.data(), sizeof mine_ok, what)) {
        nccl_copy_free(b);
        return -1;
    }
    for (int32_t o : oks) ok = ok && o;
    if (!ok) {
        nccl_copy_free(b);
        return 1;
    }
    *impl = b;
    return 0;
}

static int nccl_timing_set(int on) {
    std::lock_guard<std::mutex> l(g_tl_mu);
    if (on) timeline_clear_locked();
    g_tl_on = on != 0;
    return 0;
}

static int nccl_timing_count(void) {
    std::lock_guard<std::mutex> l(g_tl_mu);
    return (int)g_tl.size();
}

static int nccl_timing_entry(int i, const void *ref, char *desc, int desc_len, double t[5]) {
    std::lock_guard<std::mutex> l(g_tl_mu);
    if (i < 0 || i >= (int)g_tl.size())
        return ms_errorf("dist timing: entry %d of %d", i, (int)g_tl.size());
    TimedOp *op = g_tl[i];
    snprintf(desc, (size_t)desc_len, "%s", op->desc);
    cudaEvent_t r = ms_cuda_event_raw((const struct ms_cuda_event *)ref);
    for (int k = 0; k < 5; k++) {
        t[k] = NAN;
        if (k >= 3 && !op->waited) continue;
        float ms = 0;
        cudaError_t e = cudaEventElapsedTime(&ms, r, op->ev[k]);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return ms_errorf("dist timing: entry %d (%s): %s (every event must have completed, and the reference "
                             "be a timed event of the same device)", i, op->desc, cudaGetErrorString(e));
        }
        t[k] = ms;
    }
    return 0;
}

static int nccl_test(ms_work *w) {
    OpRec *op = (OpRec *)w->impl;
    if (w->comm->broken) return ms_errorf("%s: the group is broken: %s", w->desc, w->comm->broken_msg);
    cudaError_t q = cudaEventQuery(op->end);
    if (q == cudaSuccess) {
        w->done = 1;
        return 1;
    }
    if (q == cudaErrorNotReady) return 0;
    cudaGetLastError();
    return ms_errorf("%s: %s", w->desc, cudaGetErrorString(q));
}

static void nccl_work_free(ms_work *w) {
    op_release((OpRec *)w->impl);
    w->impl = nullptr;
}

static int nccl_barrier(ms_comm *c) {
    NcclComm *nc = (NcclComm *)c->impl;
    if (ms_cuda_activate(nc->device)) return -1;
    cudaEvent_t done = nullptr;
    {
        std::lock_guard<std::mutex> cl(nc->mu);
        nc->owner = c;
        if (nc->aborted || !nc->comm) return ms_errorf("barrier: the group is broken: %s", c->broken_msg);
        ncclResult_t r = ncclAllReduce(nc->barrier_buf, nc->barrier_buf, 1, ncclFloat32, ncclSum, nc->comm, nc->stream);
        r = settle(nc->comm, r, ms_dist_now() + c->timeout_s);
        if (r != ncclSuccess) return nccl_error(r == ncclInProgress ? ncclInternalError : r, "barrier", nc->comm, __LINE__);
        CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventRecord(done, nc->stream));
    }
    // the host waits, with the group's deadline
    double deadline = ms_dist_now() + c->timeout_s;
    int spins = 0;
    for (;;) {
        cudaError_t q = cudaEventQuery(done);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady || c->broken || ms_dist_now() > deadline) {
            cudaEventDestroy(done);
            if (c->broken) return ms_errorf("barrier on %s: %s", c->name, c->broken_msg);
            char msg[400];
            snprintf(msg, sizeof msg, "barrier on %s did not complete within %g s: the communicator was aborted",
                     c->name, c->timeout_s);
            std::lock_guard<std::mutex> cl(nc->mu);
            abort_locked(nc, msg);
            return -1;
        }
        if (spins++ < 100) {
            sched_yield();
        } else {
            struct timespec ts = {0, 200 * 1000};
            nanosleep(&ts, nullptr);
        }
    }
    cudaEventDestroy(done);
    return 0;
}

static void nccl_comm_free(ms_comm *c) {
    NcclComm *nc = (NcclComm *)c->impl;
    if (!nc) return;
    {
        std::lock_guard<std::mutex> cl(nc->mu);
        nc->owner = nullptr;
    }
    destroy_nccl(nc, c->timeout_s < 30 ? c->timeout_s : 30);
    c->impl = nullptr;
}

static void nccl_finalize(void) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_stop = true;
    }
    g_cv.notify_all();
    if (g_watchdog.joinable()) g_watchdog.join();
}

// ms_comm_watch: an event recorded on the compute stream after a CUDA
// graph's replay (whose captured collectives the watchdog cannot see: their
// events belong to the graph) goes in flight like a collective's `end`, so
// a replay that hangs on a peer past the group's time-out aborts the
// communicator as an eager collective would, and the host waiting on the
// compute stream wakes up
static int nccl_watch(ms_comm *c, const char *desc) {
    NcclComm *nc = (NcclComm *)c->impl;
    if (ms_cuda_activate(nc->device)) return -1;
    cudaStream_t compute = ms_cuda_stream_of(nc->device);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(compute, &cs));
    if (cs != cudaStreamCaptureStatusNone)
        return ms_errorf("watch (%s) during CUDA graph capture: watch a replay, after it is launched", desc);
    OpRec *op = new OpRec;
    snprintf(op->desc, sizeof op->desc, "%s", desc);
    op->device = nc->device;
    std::lock_guard<std::mutex> cl(nc->mu);
    nc->owner = c;
    if (nc->aborted || !nc->comm) {
        delete op;
        return ms_errorf("watch (%s): the group is broken: %s", desc, c->broken_msg);
    }
    cudaError_t ce = event_get(nc->device, &op->end);
    if (ce == cudaSuccess) ce = cudaEventRecord(op->end, compute);
    if (ce != cudaSuccess) {
        op_release(op);
        return ms_errorf("watch (%s): cudaEventRecord failed: %s", desc, cudaGetErrorString(ce));
    }
    op->t_enq = ms_dist_now();
    nc->inflight.push_back(op);   // (the watchdog's only reference)
    return 0;
}

static void nccl_abort(ms_comm *c, const char *why) {
    NcclComm *nc = (NcclComm *)c->impl;
    if (!nc) return;
    std::lock_guard<std::mutex> cl(nc->mu);
    nc->owner = c;
    abort_locked(nc, why);
}

static const ms_dist_backend g_nccl = {
    "nccl", nccl_init_world, nccl_split, nccl_start, nccl_wait, nccl_test, nccl_work_free,
    nccl_barrier, nccl_comm_free, nccl_finalize, nccl_abort,
    nccl_timing_set, nccl_timing_count, nccl_timing_entry, nccl_copy_register, nccl_copy_free, nccl_watch,
};

}  // extern "C"

namespace {
struct NcclRegistrar {
    NcclRegistrar() { ms_dist_nccl_backend = &g_nccl; }
} g_nccl_registrar;
}  // namespace

#else
namespace {
int ms_dist_nccl_unused;  // keeps the translation unit non-empty
}
#endif
