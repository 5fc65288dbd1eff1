/* core/dist/comm.h — collectives: one API, two backends (NCCL for CUDA
 * tensors, MPI for CPU tensors), process groups, rendezvous and the TCP store.
 *
 *   ms_dist_options o;
 *   ms_dist_options_default(&o);          // backend MPI, timeouts from MS_DIST_TIMEOUT or 600 s
 *   o.backend = MS_DIST_NCCL;             // CUDA tensors on cuda:LOCAL_RANK
 *   ms_comm *world = NULL;
 *   if (ms_dist_init(&world, &o) != 0) fprintf(stderr, "%s\n", ms_last_error());
 *   ms_comm_all_reduce(NULL, world, grad, MS_REDUCE_AVG);     // stream-ordered, no host sync
 *   ms_work *w = NULL;
 *   ms_comm_all_gather_into(&w, world, full, shard);          // async: w is the handle
 *   ...                                                       // other work meanwhile
 *   ms_work_wait(w); ms_work_free(w);                         // full is ready (in stream order)
 *   ms_comm_free(world); ms_dist_destroy();
 *
 * Ranks. ms_dist_init reads the run's shape from the environment, first
 * found wins: RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE (bin/train,
 * torchrun), OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (mpirun),
 * SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun); none of them: one rank.
 * Ranks are 0-based everywhere, as in the environment.
 *
 * Rendezvous. With more than one rank and MASTER_ADDR/MASTER_PORT set, rank 0
 * serves a small TCP store on MASTER_ADDR:MASTER_PORT (on that address only;
 * with MS_AGENT_STORE=1 the launcher serves it, as bin/train does, for the
 * whole run: no port left free between choosing it and rank 0's bind)
 * and every rank connects to it with the run's secret, MS_DIST_TOKEN
 * (bin/train makes one per run). All ranks then meet at a store barrier:
 * a rank that does not arrive within the rendezvous timeout makes the others
 * fail with a message naming it. NCCL's unique id goes through the store.
 * The MPI backend needs no store when mpirun/srun started the ranks (MPI
 * wires itself up), but uses it when MASTER_ADDR is set, for the same
 * named-rank time-outs.
 *
 * Store protocol (store.c): every message is a 4-byte little-endian length
 * then that many bytes (1 to MS_STORE_MAX_MSG); the first message of a
 * connection must be HELLO with the token. A wrong token, a malformed or
 * oversized message, or a connection that says nothing for
 * MS_STORE_AUTH_TIMEOUT_MS is answered with an error (where possible) and
 * closed; the store's contents are changed only by complete, valid requests
 * from authenticated peers.
 *
 * Collectives. Tensors are contiguous, of dtype f32, bf16, f64 or i64, on
 * the backend's device (CPU for MPI, the communicator's GPU for NCCL).
 * all_gather_into: out has group_size x in.numel elements, rank i's input
 * at offset i*in.numel (the concatenation along the first dim).
 * reduce_scatter: in has group_size x out.numel elements; rank i gets the
 * reduction of chunk i. all_reduce and broadcast work in place. broadcast's
 * root is a world rank (as in PyTorch). MS_REDUCE_AVG divides the sum by the
 * group size (integers: truncated, as NCCL does). bf16 is reduced in f32 and
 * rounded after each step (NCCL's rule; MPI uses an MPI datatype and user
 * ops that do the same).
 *
 * Async. Every collective takes `ms_work **work`: NULL runs it "now"; else
 * *work receives a handle. On NCCL the collective runs on the
 * communicator's own high-priority stream: it waits (cudaStreamWaitEvent)
 * for an event recorded on the current stream, and every tensor it touches
 * is marked used on the communication stream (ms_cuda_record_stream), so
 * the caching allocator never reuses its memory too early. ms_work_wait (and
 * a call without a handle) makes the *current stream* wait for the
 * collective's end event; neither blocks the host. On MPI the collective is
 * a nonblocking MPI call; ms_work_wait blocks the host until it completes
 * (or the timeout). ms_work_is_done never blocks. ms_work_free on an MPI
 * work that has not completed waits for it (its buffers must outlive it).
 *
 * CUDA graphs. An NCCL collective issued while this thread captures a graph
 * (ms_cuda_graph_begin) is recorded into it (NCCL >= 2.9): the `ready`
 * event forks the communication stream into the capture, and the wait (a
 * handle's, or the one of a call without a handle) joins it back, which
 * must happen before the capture ends. Each replay then runs it. Refused
 * during a capture, naming the op: the MPI backend, barrier, is_done, new
 * groups and copy registrations (host waits and exchanges); a wait across
 * the capture's border (a handle issued before it waited inside, or one
 * recorded in it waited after). The watchdog does not see a recorded
 * collective: ms_comm_watch after a replay watches the replay instead.
 *
 * Failures. Every MPI wait and every NCCL collective has a deadline
 * (ms_dist_options.timeout_s, or per group with ms_comm_set_timeout). On
 * NCCL a watchdog thread polls ncclCommGetAsyncError and the end event of
 * every collective in flight; on an error or a missed deadline it aborts
 * the communicator (ncclCommAbort), prints the reason on stderr and marks
 * the group broken: every later call on it returns that error. On MPI a
 * missed deadline returns an error naming the collective and marks the
 * group broken (MPI cannot cancel a collective). Nothing here exits the
 * process.
 */
#ifndef MS_DIST_COMM_H
#define MS_DIST_COMM_H

#include <stdint.h>
#include "../tensor.h"

#define MS_STORE_MAX_MSG (1 << 20)        /* bytes in one store message body */
#define MS_STORE_MAX_KEY 512              /* bytes in one key */
#define MS_STORE_MAX_KEYS 16384
#define MS_STORE_MAX_BYTES (64 << 20)     /* keys + values held by one store */
#define MS_STORE_MAX_CONNS 1024
#define MS_STORE_AUTH_TIMEOUT_MS 10000    /* a new connection must say HELLO within */

/* FFI-BEGIN */
enum { MS_DIST_MPI = 0, MS_DIST_NCCL = 1 };
enum { MS_REDUCE_SUM = 0, MS_REDUCE_AVG = 1, MS_REDUCE_MAX = 2, MS_REDUCE_MIN = 3 };

typedef struct ms_comm ms_comm;        /* a process group (opaque, refcounted) */
typedef struct ms_work ms_work;        /* an asynchronous collective (opaque) */
struct ms_cuda_event;                  /* core/cuda.h */
typedef struct ms_copy_buf ms_copy_buf;  /* a tensor every member of a group can copy from (opaque) */
typedef struct ms_store_client ms_store_client;      /* a client of the TCP store (opaque) */
typedef struct ms_store_server ms_store_server;  /* the store itself (opaque) */

/* the run's shape, as the environment gives it */
typedef struct ms_dist_env {
    int32_t rank;
    int32_t world_size;
    int32_t local_rank;
    int32_t local_world_size;
    int32_t master_port;      /* 0 when MASTER_PORT is not set */
    int32_t has_master;       /* 1 when MASTER_ADDR and MASTER_PORT are set */
    char master_addr[256];
    char source[16];          /* "env", "ompi", "slurm" or "none" */
} ms_dist_env;

typedef struct ms_dist_options {
    int32_t backend;          /* MS_DIST_MPI or MS_DIST_NCCL */
    int32_t device;           /* NCCL: the GPU (-1: local_rank); MPI: ignored */
    double timeout_s;         /* collectives (> 0) */
    double rendezvous_timeout_s;  /* the store barrier at start (> 0) */
} ms_dist_options;

typedef struct ms_store_stats {
    int64_t connections;      /* accepted */
    int64_t authenticated;
    int64_t requests;         /* valid requests served */
    int64_t rejected_auth;    /* wrong token or no HELLO first */
    int64_t rejected_oversize;
    int64_t rejected_malformed;
    int64_t truncated;        /* closed in the middle of a message */
    int64_t timed_out;        /* dropped: silent before HELLO */
    int64_t keys;
    int64_t bytes;
    int64_t open;             /* authenticated connections open now */
} ms_store_stats;

/* environment and process-wide state */
int ms_dist_read_env(ms_dist_env *out);
void ms_dist_options_default(ms_dist_options *o);
int ms_dist_init(ms_comm **world, const ms_dist_options *o);
int ms_dist_is_initialized(void);
int ms_dist_destroy(void);     /* frees every group's backend state, stops the store; MPI stays up until exit */
int ms_dist_backend_available(int backend);   /* 1 when built in */
ms_store_client *ms_dist_store(void); /* the rendezvous store of this run (NULL without one) */

/* groups */
int ms_comm_rank(const ms_comm *c);        /* in the group */
int ms_comm_size(const ms_comm *c);
int ms_comm_world_rank(const ms_comm *c, int group_rank);   /* -1 when out of range */
int ms_comm_backend(const ms_comm *c);
int ms_comm_device(const ms_comm *c);      /* -1 for MPI */
int ms_comm_is_broken(const ms_comm *c);
int ms_comm_set_timeout(ms_comm *c, double timeout_s);
/* gives the group up at once: NCCL aborts the communicator (what is in
 * flight is cancelled); every later call on it fails. Local, not collective. */
int ms_comm_abort(ms_comm *c);
/* collective over `parent` (every rank of it calls): ranks (world ranks of
 * parent's members, any order, no duplicates) form a group ordered by
 * world rank. A rank outside `ranks` gets *out = NULL. */
int ms_comm_new_group(ms_comm **out, ms_comm *parent, int n, const int *ranks);
/* collective over world: a replicate x shard mesh; world rank r sits at
 * (r / shard, r % shard). *shard_group holds the ranks of r's row (the same
 * replica: r - r % shard ...), *replicate_group those of r's column. */
int ms_comm_mesh(ms_comm **replicate_group, ms_comm **shard_group, ms_comm *world,
                 int replicate, int shard);
void ms_comm_free(ms_comm *c);             /* drops a reference */

/* collectives (see the header comment) */
int ms_comm_all_gather_into(ms_work **work, ms_comm *c, ms_tensor *out, const ms_tensor *in);
int ms_comm_reduce_scatter(ms_work **work, ms_comm *c, ms_tensor *out, const ms_tensor *in, int op);
int ms_comm_all_reduce(ms_work **work, ms_comm *c, ms_tensor *t, int op);
int ms_comm_broadcast(ms_work **work, ms_comm *c, ms_tensor *t, int root);
int ms_comm_barrier(ms_comm *c);           /* host-blocking on both backends */
/* NCCL: the work queued so far on the current stream of c's device (a CUDA
 * graph's replay holding c's collectives, which the watchdog cannot see) is
 * watched like a collective of c: not done within c's time-out, the
 * communicator is aborted (the replay's kernels return) and c is broken;
 * MPI: nothing to do. Refused during a capture. */
int ms_comm_watch(ms_comm *c, const char *desc);

/* Point-to-point, for pipeline parallelism: n sends and receives run as one
 * batch (NCCL: inside one ncclGroupStart/End, so a send to a peer and a
 * receive from it cannot deadlock each other; MPI: MPI_Isend/MPI_Irecv
 * completed together). is_recv[i] = 0 sends t[i] to peers[i], 1 receives
 * into t[i] from peers[i]; peers are world ranks (as broadcast's root),
 * members of c other than this rank. Messages from one rank to another
 * match in the order they were posted; a receive's tensor must have the
 * numel and dtype of the send it matches (MPI reports a longer message as
 * an error; NCCL cannot check: the pipeline's shapes are known on both
 * sides). Tensors are contiguous, of a collective's dtype or f8, at most
 * 32 a batch. Asynchronous and stream-ordered as the collectives: work
 * NULL waits (the compute stream on NCCL), else *work is the handle. */
int ms_comm_p2p(ms_work **work, ms_comm *c, int n, const int *is_recv, ms_tensor *const *t, const int *peers);

/* Copy-engine all-gathers (NCCL groups whose members share one host; FSDP's
 * unshard): ms_comm_copy_register, collective over c, makes t (a contiguous
 * CUDA tensor of the caching allocator, the same numel and dtype on every
 * member, that stays allocated and in place while registered) readable by
 * every member through CUDA IPC. It returns 0 with *out set, or 1 with *out
 * NULL on every member when one of them cannot (another host, no peer
 * access, a tensor the allocator did not make): use ms_comm_all_gather_into
 * then. ms_comm_copy_gather: out (size x numel) = every member's registered
 * tensor, member r's at r x numel, as cudaMemcpyAsync copies on the group's
 * communication stream (the copy engines: no SM does it), ordered after this
 * rank's compute stream as any collective. It reads the peers' tensors as
 * they are when the copy runs: after a member changes its tensor, a
 * collective on c (a fence: any all_reduce) must complete between the change
 * and the copy, and before the next change every copy that read it. */
int ms_comm_copy_register(ms_copy_buf **out, ms_comm *c, ms_tensor *t);
int ms_comm_copy_gather(ms_work **work, ms_copy_buf *b, ms_tensor *out);
void ms_copy_buf_free(ms_copy_buf *b);

/* The collective timeline, for benchmarks (NCCL only): ms_dist_timing(1)
 * clears the log and makes every later collective record timed CUDA events:
 * when the compute stream issued it, when its communication stream started
 * it, when it ended, and, at its first wait, when the compute stream reached
 * the wait and when it went on. ms_dist_timing(0) stops logging (the log
 * stays). ms_dist_timing_entry(i, ref, ...) gives entry i (0-based) of
 * ms_dist_timing_count(): its description and t[0..4] = issued, started,
 * ended, wait reached, resumed, in ms after `ref` (an event recorded on the
 * same device before them; every event must have completed: synchronize
 * first); t[3] = t[4] = NaN when it was never waited for. */
int ms_dist_timing(int on);
int ms_dist_timing_count(void);
int ms_dist_timing_entry(int i, struct ms_cuda_event *ref, char *desc, int desc_len, double *t);

int ms_work_wait(ms_work *w);
int ms_work_is_done(ms_work *w);           /* 1 done, 0 pending, -1 error */
void ms_work_free(ms_work *w);

/* the TCP store. host: an address or a name of this machine; port 0 picks one */
int ms_store_server_start(ms_store_server **out, const char *host, int port, const char *token);
int ms_store_server_port(const ms_store_server *s);
int ms_store_server_stats(const ms_store_server *s, ms_store_stats *out);
void ms_store_server_stop(ms_store_server *s);

/* connects (retrying until timeout_s: the server may start later) and
 * authenticates; rank is for messages only */
int ms_store_connect(ms_store_client **out, const char *host, int port, const char *token, int rank,
                     double timeout_s);
int ms_store_set(ms_store_client *s, const char *key, const void *value, int64_t n);
/* waits up to timeout_s for the key; copies at most cap bytes, *n = its length */
int ms_store_get(ms_store_client *s, const char *key, void *buf, int64_t cap, int64_t *n, double timeout_s);
int ms_store_add(ms_store_client *s, const char *key, int64_t delta, int64_t *result);
/* waits for every key; a time-out names the missing ones */
int ms_store_wait(ms_store_client *s, int n, const char *const *keys, double timeout_s);
/* every rank of 0..world_size-1 calls it with the same name; a time-out
 * names the ranks that never arrived */
int ms_store_barrier(ms_store_client *s, const char *name, int rank, int world_size, double timeout_s);
int ms_store_ping(ms_store_client *s);
/* every key this client names gets this prefix first (at most 23 bytes; "" for none):
 * dist.init's later inits in one process use "e<n>/" so that a store that outlives an
 * init (bin/train's) never answers with an earlier init's values */
int ms_store_set_prefix(ms_store_client *s, const char *prefix);
void ms_store_free(ms_store_client *s);
/* FFI-END */

#endif
