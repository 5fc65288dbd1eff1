/* core/dist/mpi.c — the MPI backend: collectives on CPU tensors.
 *
 * Every collective is a nonblocking MPI call (MPI_Iallgather,
 * MPI_Ireduce_scatter_block, MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier)
 * completed by a loop of MPI_Test with a deadline, so a rank that never
 * joins makes the others fail with a message instead of hanging (MPI's
 * blocking calls have no time-out). The loop yields, then sleeps up to
 * 200 us between tests: ranks oversubscribed on few cores (CI) leave the
 * cores to the rank that has work.
 *
 * bf16 has no MPI type: it travels as a committed 2-byte contiguous type
 * with user ops that widen to f32, reduce, and round to nearest even —
 * NCCL's rule, so CPU and GPU runs agree. avg is sum, then a division by
 * the group size when the collective completes (integers truncate).
 *
 * Built only when the build finds mpicc (MS_WITH_MPI); the backend table
 * registers itself when the library loads.
 */
#ifdef MS_WITH_MPI
#include "dist_internal.h"

#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct mpi_comm {
    MPI_Comm comm;
} mpi_comm;

typedef struct mpi_work {
    MPI_Request req;
    MPI_Request *reqs;   /* nreq requests: &req, or a p2p batch's */
    int nreq;
    ms_storage **hold;   /* a p2p batch's storages, kept alive until completion */
    int nhold;
    int active;          /* reqs not yet completed */
    int leaked;          /* timed out: MPI may still write into the buffers, keep them */
    void *data;          /* the result buffer (for avg) */
    int64_t count;       /* elements in the result */
    int dtype;
    void *staging;       /* reduce_scatter in place: a copy of the input */
} mpi_work;

static int g_we_initialized;
static void mpi_on_exit(int status, void *arg);
static int g_types_ready;
static MPI_Datatype g_bf16;
static MPI_Op g_bf16_op[3];   /* sum, max, min */

/* ------------------------------------------------------------- bf16 ops */

static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) b[i] = ms_f32_to_bf16(ms_bf16_to_f32(a[i]) + ms_bf16_to_f32(b[i]));
}
static void bf16_max(void *in, void *inout, int *len, MPI_Datatype *dt) {
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) if (ms_bf16_to_f32(a[i]) > ms_bf16_to_f32(b[i])) b[i] = a[i];
}
static void bf16_min(void *in, void *inout, int *len, MPI_Datatype *dt) {
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) if (ms_bf16_to_f32(a[i]) < ms_bf16_to_f32(b[i])) b[i] = a[i];
}

static int mpi_error(int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return ms_errorf("%s failed: %s", what, s);
}
#define MPI_CHECK(call)                                                                            \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != MPI_SUCCESS) return mpi_error(rc_, #call);                                      \
    } while (0)

static int types_init(void) {
    if (g_types_ready) return 0;
    MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_bf16));
    MPI_CHECK(MPI_Type_commit(&g_bf16));
    MPI_CHECK(MPI_Op_create(bf16_sum, 1, &g_bf16_op[0]));
    MPI_CHECK(MPI_Op_create(bf16_max, 1, &g_bf16_op[1]));
    MPI_CHECK(MPI_Op_create(bf16_min, 1, &g_bf16_op[2]));
    g_types_ready = 1;
    return 0;
}

static MPI_Datatype mpi_type(int dtype) {
    switch (dtype) {
    case MS_F32: return MPI_FLOAT;
    case MS_F64: return MPI_DOUBLE;
    case MS_I64: return MPI_INT64_T;
    case MS_F8E4M3:
    case MS_F8E5M2: return MPI_BYTE;
    default: return g_bf16;
    }
}

static MPI_Op mpi_op(int op, int dtype) {
    int k = op == MS_REDUCE_MAX ? 1 : op == MS_REDUCE_MIN ? 2 : 0;   /* avg: sum, then divide */
    if (dtype == MS_BF16) return g_bf16_op[k];
    return k == 1 ? MPI_MAX : k == 2 ? MPI_MIN : MPI_SUM;
}

/* ---------------------------------------------------------------- groups */

static int mpi_init_world(ms_comm *c, const ms_dist_env *e, const ms_dist_options *o, ms_store_client *store) {
    int flag = 0, fin = 0;
    MPI_CHECK(MPI_Initialized(&flag));
    if (!flag) {
        MPI_CHECK(MPI_Finalized(&fin));
        if (fin) return ms_errorf("dist.init: MPI was finalised in this process and cannot start again (MPI allows "
                                  "one init per process)");
        int provided = 0;
        MPI_CHECK(MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided));
        g_we_initialized = 1;
        on_exit(mpi_on_exit, NULL);
    }
    int size = 0, rank = 0;
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    if (strcmp(e->source, "none") == 0 && size != c->size) {
        /* started by a launcher whose variables we do not read: MPI knows */
        int *w = realloc(c->world_ranks, sizeof(int) * (size_t)size);
        if (!w) return ms_errorf("dist.init: out of memory");
        c->world_ranks = w;
        for (int i = 0; i < size; i++) w[i] = i;
        c->size = size;
        c->rank = rank;
    } else if (size != e->world_size || rank != e->rank) {
        return ms_errorf("dist.init: MPI's world has %d rank%s (this is rank %d) but the environment (%s) says %d "
                         "(rank %d): CPU ranks must be started by mpirun or srun (bin/train --device cpu does it)",
                         size, size == 1 ? "" : "s", rank, e->source, e->world_size, e->rank);
    }
    if (types_init()) return -1;
    mpi_comm *m = calloc(1, sizeof *m);
    if (!m) return ms_errorf("dist.init: out of memory");
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
    if (rc != MPI_SUCCESS) { free(m); return mpi_error(rc, "MPI_Comm_dup"); }
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    c->impl = m;
    c->device = -1;
    return 0;
}

static int mpi_split(ms_comm *parent, int color, int key, int n, void **impl) {
    (void)n;
    mpi_comm *p = parent->impl;
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(p->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Comm_split");
    *impl = NULL;
    if (color < 0) return 0;
    mpi_comm *m = calloc(1, sizeof *m);
    if (!m) { MPI_Comm_free(&nc); return ms_errorf("new_group: out of memory"); }
    MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN);
    m->comm = nc;
    *impl = m;
    return 0;
}

static void mpi_comm_free(ms_comm *c) {
    mpi_comm *m = c->impl;
    if (!m) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Comm_free(&m->comm);
    free(m);
    c->impl = NULL;
}

/* dist.destroy: the groups are gone (comm_free); MPI itself stays up, so
 * dist.init can run again in this process (MPI starts once per process) */
static void mpi_finalize(void) {}

/* MPI_Finalize at exit, only on success: Open MPI's finalize waits for
 * every rank (a fence), and a rank that fails must exit at once so that
 * mpirun (or bin/train) stops the others */
static void mpi_on_exit(int status, void *arg) {
    int fin = 0, init = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!g_we_initialized || !init || fin || status != 0) return;
    if (g_types_ready) {
        for (int i = 0; i < 3; i++) MPI_Op_free(&g_bf16_op[i]);
        MPI_Type_free(&g_bf16);
        g_types_ready = 0;
    }
    MPI_Finalize();
}

/* ----------------------------------------------------------- collectives */

static void backoff(int *spins) {
    if (*spins < 64) {
        sched_yield();
    } else {
        long us = *spins < 256 ? 20 : 200;
        struct timespec ts = {0, us * 1000};
        nanosleep(&ts, NULL);
    }
    (*spins)++;
}

static void release_hold(mpi_work *m) {
    for (int i = 0; i < m->nhold; i++) ms_storage_release(m->hold[i]);
    free(m->hold);
    m->hold = NULL;
    m->nhold = 0;
}

static void mpi_work_dealloc(mpi_work *m) {
    if (m->reqs != &m->req) free(m->reqs);
    free(m->staging);
    free(m);
}

static void finish(ms_work *w) {
    mpi_work *m = w->impl;
    if (w->op == MS_REDUCE_AVG && (w->kind == MS_COLL_ALL_REDUCE || w->kind == MS_COLL_REDUCE_SCATTER)) {
        int64_t n = m->count, k = w->comm->size;
        switch (m->dtype) {
        case MS_F32: { float *p = m->data; for (int64_t i = 0; i < n; i++) p[i] = p[i] / (float)k; break; }
        case MS_F64: { double *p = m->data; for (int64_t i = 0; i < n; i++) p[i] = p[i] / (double)k; break; }
        case MS_I64: { int64_t *p = m->data; for (int64_t i = 0; i < n; i++) p[i] = p[i] / k; break; }
        default: {
            uint16_t *p = m->data;
            for (int64_t i = 0; i < n; i++) p[i] = ms_f32_to_bf16(ms_bf16_to_f32(p[i]) / (float)k);
        }
        }
    }
    free(m->staging);
    m->staging = NULL;
    release_hold(m);
    for (int i = 0; i < 2; i++) {
        if (w->keep[i]) ms_storage_release(w->keep[i]);
        w->keep[i] = NULL;
    }
    w->done = 1;
}

/* a p2p batch: every operation posted, completed together (MPI_Testall) */
static int mpi_p2p_start(ms_work *w) {
    mpi_comm *mc = w->comm->impl;
    const ms_p2p_spec *sp = w->aux;
    mpi_work *m = calloc(1, sizeof *m);
    if (m) m->reqs = calloc((size_t)sp->n, sizeof(MPI_Request));
    if (m) m->hold = calloc((size_t)sp->n, sizeof(ms_storage *));
    if (!m || !m->reqs || !m->hold) {
        if (m) { free(m->reqs); free(m->hold); free(m); }
        return ms_errorf("%s: out of memory", w->desc);
    }
    /* every size first: nothing is posted when one cannot be */
    for (int i = 0; i < sp->n; i++) {
        if (ms_tensor_numel(sp->t[i]) > 0x7fffffff) {
            free(m->hold);
            free(m->reqs);
            free(m);
            return ms_errorf("%s: more than 2^31-1 elements in one MPI message", w->desc);
        }
    }
    for (int i = 0; i < sp->n; i++) {
        ms_tensor *t = sp->t[i];
        int64_t n = ms_tensor_numel(t);
        int rc = sp->is_recv[i]
                     ? MPI_Irecv(ms_tensor_data(t), (int)n, mpi_type(t->dtype_id), sp->peer[i], 0, mc->comm, &m->reqs[i])
                     : MPI_Isend(ms_tensor_data(t), (int)n, mpi_type(t->dtype_id), sp->peer[i], 0, mc->comm, &m->reqs[i]);
        if (rc != MPI_SUCCESS) {
            /* what was posted may still run: its buffers stay referenced (never released) */
            free(m->hold);
            free(m->reqs);
            free(m);
            return ms_comm_fail(w->comm, "%s: MPI refused operation %d (%d)", w->desc, i + 1, rc);
        }
        m->hold[m->nhold++] = t->storage;
        ms_storage_retain(t->storage);
        m->nreq = i + 1;
    }
    m->active = 1;
    w->impl = m;
    return 0;
}

static int mpi_start(ms_work *w, ms_tensor *out, const ms_tensor *in, int root) {
    if (w->kind == MS_COLL_P2P) return mpi_p2p_start(w);
    mpi_comm *mc = w->comm->impl;
    int64_t n_in = ms_tensor_numel(in), n_out = ms_tensor_numel(out);
    if (n_in > 0x7fffffff || n_out > 0x7fffffff)
        return ms_errorf("%s: more than 2^31-1 elements in one MPI collective", w->desc);
    mpi_work *m = calloc(1, sizeof *m);
    if (!m) return ms_errorf("%s: out of memory", w->desc);
    m->reqs = &m->req;
    m->nreq = 1;
    MPI_Datatype t = mpi_type(out->dtype_id);
    void *po = ms_tensor_data(out);
    const void *pi = ms_tensor_data(in);
    m->data = po;
    m->count = n_out;
    m->dtype = out->dtype_id;
    int rc = MPI_SUCCESS;
    switch (w->kind) {
    case MS_COLL_ALL_GATHER:
        rc = MPI_Iallgather(w->in_place ? MPI_IN_PLACE : pi, (int)n_in, t, po, (int)n_in, t, mc->comm, &m->req);
        break;
    case MS_COLL_REDUCE_SCATTER:
        if (w->in_place) {
            /* out is a chunk of in: reduce from a copy of in */
            size_t bytes = (size_t)n_in * (size_t)ms_dtype_size(in->dtype_id);
            m->staging = malloc(bytes ? bytes : 1);
            if (!m->staging) { free(m); return ms_errorf("%s: out of memory for staging", w->desc); }
            memcpy(m->staging, pi, bytes);
            pi = m->staging;
        }
        rc = MPI_Ireduce_scatter_block(pi, po, (int)n_out, t, mpi_op(w->op, out->dtype_id), mc->comm, &m->req);
        break;
    case MS_COLL_ALL_REDUCE:
        rc = MPI_Iallreduce(MPI_IN_PLACE, po, (int)n_out, t, mpi_op(w->op, out->dtype_id), mc->comm, &m->req);
        break;
    default:
        rc = MPI_Ibcast(po, (int)n_out, t, root, mc->comm, &m->req);
        break;
    }
    if (rc != MPI_SUCCESS) {
        free(m->staging);
        free(m);
        return ms_comm_fail(w->comm, "%s: MPI refused it (%d)", w->desc, rc);
    }
    m->active = 1;
    w->impl = m;
    /* the buffers must outlive the collective, whatever the caller frees */
    w->keep[0] = out->storage;
    ms_storage_retain(out->storage);
    if (in->storage != out->storage) {
        w->keep[1] = in->storage;
        ms_storage_retain(in->storage);
    }
    return 0;
}

static int timed_out(ms_work *w) {
    mpi_work *m = w->impl;
    m->leaked = 1;   /* MPI cannot cancel a collective: its buffers stay alive */
    char msg[300];
    snprintf(msg, sizeof msg, "%s did not complete within %g s: a rank of the group died, hangs, or called another "
             "collective; the group is unusable from now on", w->desc, w->comm->timeout_s);
    fprintf(stderr, "moonshard dist (world rank %d): %s\n", w->comm->world_ranks[w->comm->rank], msg);
    return ms_comm_fail(w->comm, "%s", msg);
}

/* an MPI error in a test: named (a truncated message is a receive smaller
 * than its send); the group is unusable from now on */
static int mpi_fail(ms_work *w, int rc) {
    mpi_work *m = w->impl;
    m->leaked = 1;
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    int cls = 0;
    MPI_Error_class(rc, &cls);
    if ((cls == MPI_ERR_IN_STATUS || cls == MPI_ERR_TRUNCATE) && w->kind == MS_COLL_P2P)
        snprintf(s, sizeof s, "a message did not fit its receive (a receive's tensor must have the numel and dtype of "
                 "the send it matches)");
    return ms_comm_fail(w->comm, "%s failed in MPI: %s", w->desc, s);
}

static int mpi_wait(ms_work *w, int stream_only) {
    mpi_work *m = w->impl;
    if (w->done) return 0;
    if (m->leaked) return ms_errorf("%s timed out earlier", w->desc);
    double deadline = w->t_start + w->comm->timeout_s;
    int spins = 0;
    while (m->active) {
        int flag = 0;
        int rc = MPI_Testall(m->nreq, m->reqs, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(w, rc);
        if (flag) { m->active = 0; break; }
        if (ms_dist_now() > deadline) return timed_out(w);
        backoff(&spins);
    }
    finish(w);
    return 0;
}

static int mpi_test(ms_work *w) {
    mpi_work *m = w->impl;
    if (w->done) return 1;
    if (m->leaked) return ms_errorf("%s timed out earlier", w->desc);
    int flag = 0;
    int rc = MPI_Testall(m->nreq, m->reqs, &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(w, rc);
    if (!flag) {
        if (ms_dist_now() > w->t_start + w->comm->timeout_s) return timed_out(w);
        return 0;
    }
    m->active = 0;
    finish(w);
    return 1;
}

static void mpi_work_free(ms_work *w) {
    mpi_work *m = w->impl;
    if (!m) return;
    if (m->active && !m->leaked && !w->comm->broken) {
        /* freed before completion: wait, since MPI still uses the buffers */
        if (mpi_wait(w, 0) != 0) m->leaked = 1;
    }
    if (m->leaked) {
        /* keep w->keep's storages (and a batch's) referenced forever: MPI may write into them */
        w->keep[0] = w->keep[1] = NULL;
        w->impl = NULL;
        free(m->hold);
        m->hold = NULL;
        mpi_work_dealloc(m);
        return;
    }
    release_hold(m);
    mpi_work_dealloc(m);
    w->impl = NULL;
}

static int mpi_barrier(ms_comm *c) {
    mpi_comm *mc = c->impl;
    MPI_Request req;
    int rc = MPI_Ibarrier(mc->comm, &req);
    if (rc != MPI_SUCCESS) return ms_comm_fail(c, "barrier on %s: MPI refused it (%d)", c->name, rc);
    double deadline = ms_dist_now() + c->timeout_s;
    int spins = 0;
    for (;;) {
        int flag = 0;
        rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return ms_comm_fail(c, "barrier on %s failed in MPI (%d)", c->name, rc);
        if (flag) return 0;
        if (ms_dist_now() > deadline)
            return ms_comm_fail(c, "barrier on %s did not complete within %g s: a rank of the group died, hangs, or "
                                "called another collective; the group is unusable from now on", c->name, c->timeout_s);
        backoff(&spins);
    }
}

static const ms_dist_backend g_mpi = {
    "mpi", mpi_init_world, mpi_split, mpi_start, mpi_wait, mpi_test, mpi_work_free,
    mpi_barrier, mpi_comm_free, mpi_finalize, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
};

__attribute__((constructor)) static void mpi_register(void) { ms_dist_mpi_backend = &g_mpi; }

#else
typedef int ms_dist_mpi_unused; /* keeps the translation unit non-empty */
#endif
