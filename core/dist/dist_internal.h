/* core/dist/dist_internal.h — what comm.c shares with the backends (mpi.c,
 * nccl.cu); not public, not seen by the FFI.
 *
 * comm.c owns everything backend-independent: the environment, the
 * rendezvous, argument checks, group bookkeeping (member lists, refcounts,
 * the broken flag) and the work handles. A backend fills an ms_dist_backend
 * table and registers it when the library loads (a constructor), so a build
 * without MPI or NCCL simply has no table and ms_dist_init says so. */
#ifndef MS_DIST_INTERNAL_H
#define MS_DIST_INTERNAL_H

#ifdef __cplusplus
extern "C" {
#endif

#include "comm.h"   /* C linkage for the .cu backend too (nccl.cu calls the store) */
#include "../internal.h"

enum { MS_COLL_ALL_GATHER = 0, MS_COLL_REDUCE_SCATTER, MS_COLL_ALL_REDUCE, MS_COLL_BROADCAST, MS_COLL_COPY_GATHER,
       MS_COLL_P2P };

/* MS_COLL_P2P's batch (w->aux while the backend's start runs; the backend
 * keeps what it needs of it): peers are group ranks */
typedef struct ms_p2p_spec {
    int n;
    const int *is_recv;
    ms_tensor *const *t;
    const int *peer;
} ms_p2p_spec;

struct ms_comm {
    const struct ms_dist_backend *be;
    int64_t refs;
    int rank, size;            /* in this group */
    int *world_ranks;          /* size entries: the world rank of each member */
    int device;                /* NCCL: the GPU; MPI: -1 */
    double timeout_s;
    int destroyed;             /* ms_dist_destroy ran: the backend state is gone */
    int released;              /* no handle left; the backend state waits for ms_dist_destroy */
    volatile int broken;       /* a failure made the group unusable */
    char broken_msg[768];
    char name[96];             /* "world", "group [0,2]", "mesh shard row 1" */
    int64_t seq;               /* operations issued on this group (MS_DIST_TRACE numbers them) */
    void *impl;                /* the backend's */
    struct ms_comm *next;      /* every live group, for ms_dist_destroy */
};

struct ms_work {
    ms_comm *comm;             /* one reference */
    int kind;                  /* MS_COLL_* */
    int op;                    /* MS_REDUCE_* */
    int done;                  /* completed and finished (avg divided, storages released) */
    int failed;
    int in_place;              /* in is out's chunk (all_gather) or out in's (reduce_scatter) */
    int captured;              /* issued while this thread captured a CUDA graph (recorded, run by each replay) */
    double t_start;            /* monotonic seconds */
    char desc[160];            /* "all_reduce sum of bf16 (1000) on world" */
    ms_storage *keep[2];       /* MPI: buffers kept alive until completion */
    void *aux;                 /* MS_COLL_COPY_GATHER: the registration's backend state; MS_COLL_P2P: its ms_p2p_spec */
    void *impl;                /* the backend's */
};

typedef struct ms_dist_backend {
    const char *name;
    /* sets c->rank/size/device/impl for the world; info is the environment,
     * store the rendezvous store (NULL for MPI without one) */
    int (*init_world)(ms_comm *c, const ms_dist_env *info, const ms_dist_options *o, ms_store_client *store);
    /* collective over parent: color < 0 means "not a member" (*impl stays NULL) */
    int (*split)(ms_comm *parent, int color, int key, int n, void **impl);  /* n: members of this rank's new group */
    /* start a collective: fill w->impl; in-place ops pass in == out */
    int (*start)(ms_work *w, ms_tensor *out, const ms_tensor *in, int root_group_rank);
    int (*wait)(ms_work *w, int stream_only);   /* stream_only: NCCL's "now" calls */
    int (*test)(ms_work *w);                    /* 1 done, 0 pending, -1 error */
    void (*work_free)(ms_work *w);
    int (*barrier)(ms_comm *c);
    void (*comm_free)(ms_comm *c);              /* frees c->impl */
    void (*finalize)(void);                     /* ms_dist_destroy, after every comm_free */
    void (*abort)(ms_comm *c, const char *why); /* NULL: nothing to abort */
    /* the collective timeline (ms_dist_timing); NULL: not kept by this backend */
    int (*timing_set)(int on);
    int (*timing_count)(void);
    int (*timing_entry)(int i, const void *ref_event, char *desc, int desc_len, double t[5]);
    /* copy-engine gathers: 0 (*impl set), 1 not possible on some member, -1 error */
    int (*copy_register)(ms_comm *c, const ms_tensor *t, void **impl);
    void (*copy_free)(void *impl);
    /* ms_comm_watch: the work queued so far on the current stream watched
     * as a collective of c (its time-out); NULL: not for this backend */
    int (*watch)(ms_comm *c, const char *desc);
} ms_dist_backend;

extern const ms_dist_backend *ms_dist_mpi_backend;   /* NULL: built without MPI */
extern const ms_dist_backend *ms_dist_nccl_backend;  /* NULL: built without NCCL */

double ms_dist_now(void);   /* monotonic seconds */
/* set while the process exits with a non-zero status: tear down without
 * waiting for peers */
extern int ms_dist_exiting_with_error;
/* connections of the server that wait in a GET/WAIT (as of its last loop) */
int ms_store_server_waiting(const ms_store_server *s);
/* ms_store_barrier that waits wait_s but names timeout_s in its error: the
 * rendezvous waits what is left of its deadline and reports the whole of it */
int ms_store_barrier_within(ms_store_client *s, const char *name, int rank, int world_size, double wait_s,
                            double timeout_s);
/* mark c broken with a message (kept, and set as the error); returns -1 */
int ms_comm_fail(ms_comm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#ifdef __cplusplus
}
#endif

#endif
