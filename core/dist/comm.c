/* core/dist/comm.c — the backend-independent half of the communicator:
 * the environment, the rendezvous, argument checks, groups and work
 * handles. The backends (mpi.c, nccl.cu) only move bytes. */
#include "dist_internal.h"
#include "../cuda.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const ms_dist_backend *ms_dist_mpi_backend = NULL;
const ms_dist_backend *ms_dist_nccl_backend = NULL;

/* process-wide state: one run per process */
static struct {
    int initialized;
    const ms_dist_backend *be;
    ms_comm *world;          /* the library's own reference */
    ms_comm *all;            /* every live group (linked by ->next) */
    ms_store_client *store;
    ms_store_server *server;
    int atexit_done;
    int epoch;   /* inits so far in this process: the rendezvous keys carry it */
} g_dist;

/* ------------------------------------------------------------ environment */

/* strict decimal parse of an environment variable; 0 absent, 1 ok, -1 bad */
static int env_int(const char *name, int *out) {
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || !end || *end || x < 0 || x > INT_MAX) {
        ms_errorf("dist: %s='%s' is not a non-negative integer", name, v);
        return -1;
    }
    *out = (int)x;
    return 1;
}

int ms_dist_read_env(ms_dist_env *e) {
    memset(e, 0, sizeof *e);
    e->rank = 0;
    e->world_size = 1;
    e->local_rank = 0;
    e->local_world_size = 1;
    snprintf(e->source, sizeof e->source, "none");
    /* first family found wins */
    static const char *fam[3][5] = {
        {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
        {"ompi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"},
        {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
    };
    for (int f = 0; f < 3; f++) {
        int r = 0, w = 0, lr = 0, lw = 0;
        int hr = env_int(fam[f][1], &r), hw = env_int(fam[f][2], &w);
        if (hr < 0 || hw < 0) return -1;
        if (!hr && !hw) continue;
        if (!hr || !hw)
            return ms_errorf("dist: %s is set but %s is not (both or neither)", hr ? fam[f][1] : fam[f][2],
                             hr ? fam[f][2] : fam[f][1]);
        if (w < 1) return ms_errorf("dist: %s=%d: a world has at least one rank", fam[f][2], w);
        if (r >= w) return ms_errorf("dist: %s=%d is outside a world of %s=%d", fam[f][1], r, fam[f][2], w);
        int hl = env_int(fam[f][3], &lr);
        if (hl < 0) return -1;
        /* SLURM_NTASKS_PER_NODE may read "4(x2)": the leading number is ours */
        int hlw = 0;
        const char *lwv = getenv(fam[f][4]);
        if (lwv && *lwv) {
            char *end = NULL;
            long x = strtol(lwv, &end, 10);
            if (x >= 1 && x <= INT_MAX && end != lwv) { lw = (int)x; hlw = 1; }
            else return ms_errorf("dist: %s='%s' is not a positive integer", fam[f][4], lwv);
        }
        e->rank = r;
        e->world_size = w;
        e->local_rank = hl ? lr : r;
        e->local_world_size = hlw ? lw : (hl ? w : w);
        if (e->local_rank >= e->local_world_size && hlw)
            return ms_errorf("dist: %s=%d is outside %s=%d", fam[f][3], e->local_rank, fam[f][4], e->local_world_size);
        snprintf(e->source, sizeof e->source, "%s", fam[f][0]);
        break;
    }
    const char *addr = getenv("MASTER_ADDR");
    int port = 0;
    int hp = env_int("MASTER_PORT", &port);
    if (hp < 0) return -1;
    if (hp && (port < 1 || port > 65535)) return ms_errorf("dist: MASTER_PORT=%d is not a TCP port (1-65535)", port);
    if (addr && *addr) {
        if (strlen(addr) >= sizeof e->master_addr) return ms_errorf("dist: MASTER_ADDR is longer than 255 bytes");
        snprintf(e->master_addr, sizeof e->master_addr, "%s", addr);
    }
    e->master_port = hp ? port : 0;
    e->has_master = (addr && *addr && hp) ? 1 : 0;
    return 0;
}

void ms_dist_options_default(ms_dist_options *o) {
    memset(o, 0, sizeof *o);
    o->backend = MS_DIST_MPI;
    o->device = -1;
    double t = 600;
    const char *v = getenv("MS_DIST_TIMEOUT");
    if (v && *v) {
        char *end = NULL;
        double x = strtod(v, &end);
        if (end && !*end && x > 0) t = x;
    }
    o->timeout_s = t;
    o->rendezvous_timeout_s = t < 300 ? t : 300;
}

int ms_dist_backend_available(int backend) {
    if (backend == MS_DIST_MPI) return ms_dist_mpi_backend != NULL;
    if (backend == MS_DIST_NCCL) return ms_dist_nccl_backend != NULL;
    return 0;
}

int ms_dist_is_initialized(void) { return g_dist.initialized; }

int ms_dist_timing(int on) {
    const ms_dist_backend *be = ms_dist_nccl_backend;
    if (!be || !be->timing_set) return ms_errorf("dist timing: the collective timeline needs the NCCL backend (not built)");
    return be->timing_set(on);
}

int ms_dist_timing_count(void) {
    const ms_dist_backend *be = ms_dist_nccl_backend;
    return be && be->timing_count ? be->timing_count() : 0;
}

int ms_dist_timing_entry(int i, struct ms_cuda_event *ref, char *desc, int desc_len, double *t) {
    const ms_dist_backend *be = ms_dist_nccl_backend;
    if (!be || !be->timing_entry) return ms_errorf("dist timing: the collective timeline needs the NCCL backend (not built)");
    if (!ref || !desc || desc_len <= 0 || !t) return ms_errorf("dist timing: entry %d: NULL argument", i);
    return be->timing_entry(i, ref, desc, desc_len, t);
}
ms_store_client *ms_dist_store(void) { return g_dist.store; }

/* ----------------------------------------------------------------- groups */

int ms_comm_fail(ms_comm *c, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!c->broken) {
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", msg);
        c->broken = 1;
    }
    ms_set_error(msg);
    return -1;
}

static ms_comm *comm_alloc(const ms_dist_backend *be, int size) {
    ms_comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->world_ranks = calloc((size_t)(size > 0 ? size : 1), sizeof(int));
    if (!c->world_ranks) { free(c); return NULL; }
    c->be = be;
    c->refs = 1;
    c->size = size;
    c->device = -1;
    c->next = g_dist.all;
    g_dist.all = c;
    return c;
}

/* MS_DIST_TRACE=prefix: every rank appends each operation it issues (its
 * group, its number on that group, what it moves) to prefix.<world rank>,
 * flushed at once. Ranks must issue a group's operations in the same
 * order with the same shapes; comparing two ranks' files line by line
 * (grep the group's name) finds the first one where they part. */
static FILE *trace_file(void) {
    static int tried;
    static FILE *f;
    if (tried || !g_dist.world) return f;
    tried = 1;
    const char *p = getenv("MS_DIST_TRACE");
    if (!p || !*p) return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", p, g_dist.world->world_ranks[g_dist.world->rank]);
    f = fopen(path, "a");
    if (!f) fprintf(stderr, "moonshard dist: MS_DIST_TRACE: cannot open %s for appending\n", path);
    return f;
}

static void trace(ms_comm *c, const char *what) {
    c->seq++;
    FILE *f = trace_file();
    if (!f) return;
    fprintf(f, "%s #%lld %s\n", c->name, (long long)c->seq, what);
    fflush(f);
}

static void comm_unlink(ms_comm *c) {
    for (ms_comm **p = &g_dist.all; *p; p = &(*p)->next)
        if (*p == c) { *p = c->next; return; }
}

void ms_comm_free(ms_comm *c) {
    if (!c || --c->refs > 0) return;
    if (!c->destroyed && c->impl && g_dist.initialized) {
        /* The backend state is freed at ms_dist_destroy, by every rank in
         * the same order: ranks drop their handles at different times
         * (Lua's GC), and freeing a communicator may wait for its peers
         * (ncclCommFinalize), which would deadlock two ranks freeing two
         * groups in opposite orders. */
        c->released = 1;
        return;
    }
    if (!c->destroyed && c->be && c->impl) c->be->comm_free(c);
    comm_unlink(c);
    free(c->world_ranks);
    free(c);
}

int ms_comm_rank(const ms_comm *c) { return c ? c->rank : -1; }
int ms_comm_size(const ms_comm *c) { return c ? c->size : 0; }
int ms_comm_world_rank(const ms_comm *c, int r) { return (c && r >= 0 && r < c->size) ? c->world_ranks[r] : -1; }
int ms_comm_backend(const ms_comm *c) { return c && c->be == ms_dist_nccl_backend ? MS_DIST_NCCL : MS_DIST_MPI; }
int ms_comm_device(const ms_comm *c) { return c ? c->device : -1; }
int ms_comm_is_broken(const ms_comm *c) { return c ? c->broken : 1; }

int ms_comm_set_timeout(ms_comm *c, double t) {
    if (!c) return ms_errorf("dist: no group");
    if (!(t > 0)) return ms_errorf("dist: a time-out must be > 0 seconds, got %g", t);
    c->timeout_s = t;
    return 0;
}

int ms_comm_abort(ms_comm *c) {
    if (!c) return ms_errorf("abort: no group");
    if (c->destroyed || c->broken) return 0;
    if (c->be->abort) c->be->abort(c, "aborted by this rank (ms_comm_abort)");
    if (!c->broken) ms_comm_fail(c, "aborted by this rank (ms_comm_abort)");
    return 0;
}

static int usable(ms_comm *c, const char *op) {
    if (!c) return ms_errorf("%s: no group (dist not initialised, or this rank is not a member)", op);
    if (c->destroyed) return ms_errorf("%s: the group %s was destroyed (dist.destroy)", op, c->name);
    if (c->broken) return ms_errorf("%s: the group %s is broken: %s", op, c->name, c->broken_msg);
    return 0;
}

/* CUDA graph capture (docs/cuda-graphs.md): an NCCL collective issued
 * while this thread captures is recorded into the graph (the communication
 * stream forked from the capturing stream and joined back by the wait), so
 * each replay runs it. What makes the host wait or poll, or runs once on the
 * host, is refused while capturing, naming the op: the MPI backend (host
 * calls), barrier (a host wait), is_done (a poll of an event only being
 * recorded), creating a group or a copy registration (host exchanges). */
static int refuse_captured(const char *op, const char *why) {
    int dev = ms_cuda_capturing();
    if (dev < 0) return 0;
    return ms_errorf("%s during CUDA graph capture on cuda:%d: %s (the capture is aborted; docs/cuda-graphs.md)", op,
                     dev, why);
}

/* a new group from parent: members (world ranks, ascending) and this rank's place */
static int make_group(ms_comm **out, ms_comm *parent, int color, int key, int n, const int *members,
                      const char *name) {
    *out = NULL;
    void *impl = NULL;
    char what[160];
    snprintf(what, sizeof what, "split into %s", name);
    if (refuse_captured("new_group", "creating a communicator exchanges with the peers on the host")) return -1;
    trace(parent, what);
    if (parent->be->split(parent, color, key, n, &impl)) return -1;
    if (color < 0) return 0;
    ms_comm *c = comm_alloc(parent->be, n);
    if (!c) {
        ms_comm tmp = *parent;
        tmp.impl = impl;
        parent->be->comm_free(&tmp);
        return ms_errorf("dist: out of memory");
    }
    memcpy(c->world_ranks, members, sizeof(int) * (size_t)n);
    c->rank = key;
    c->device = parent->device;
    c->timeout_s = parent->timeout_s;
    c->impl = impl;
    snprintf(c->name, sizeof c->name, "%s", name);
    *out = c;
    return 0;
}

static void list_str(char *out, size_t cap, int n, const int *v) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < n && k + 16 < cap; i++) k += (size_t)snprintf(out + k, cap - k, i ? ",%d" : "%d", v[i]);
    if (k + 16 >= cap) k += (size_t)snprintf(out + k, cap - k, ",...");
    snprintf(out + k, cap - k, "]");
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return x < y ? -1 : x > y;
}

int ms_comm_new_group(ms_comm **out, ms_comm *parent, int n, const int *ranks) {
    *out = NULL;
    if (usable(parent, "new_group")) return -1;
    if (n < 1) return ms_errorf("new_group: a group needs at least one rank");
    int *sorted = malloc(sizeof(int) * (size_t)n);
    if (!sorted) return ms_errorf("new_group: out of memory");
    memcpy(sorted, ranks, sizeof(int) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof(int), cmp_int);
    int me = parent->world_ranks[parent->rank], key = -1;
    for (int i = 0; i < n; i++) {
        int inparent = 0;
        for (int j = 0; j < parent->size; j++) if (parent->world_ranks[j] == sorted[i]) inparent = 1;
        if (!inparent) {
            free(sorted);
            return ms_errorf("new_group: rank %d is not in the parent group %s (ranks are 0-based world ranks)",
                             ranks[i], parent->name);
        }
        if (i > 0 && sorted[i] == sorted[i - 1]) {
            int dup = sorted[i];
            free(sorted);
            return ms_errorf("new_group: rank %d is listed twice", dup);
        }
        if (sorted[i] == me) key = i;
    }
    char name[80];
    list_str(name, sizeof name, n, sorted);
    char full[96];
    snprintf(full, sizeof full, "group %s", name);
    int rc = make_group(out, parent, key >= 0 ? 0 : -1, key >= 0 ? key : 0, n, sorted, full);
    free(sorted);
    return rc;
}

int ms_comm_mesh(ms_comm **rep, ms_comm **shard, ms_comm *world, int R, int S) {
    *rep = NULL;
    *shard = NULL;
    if (usable(world, "mesh")) return -1;
    if (R < 1 || S < 1 || (int64_t)R * S != world->size)
        return ms_errorf("mesh: replicate=%d x shard=%d must equal the group size %d", R, S, world->size);
    int me = world->rank, row = me / S, col = me % S;
    int *m = malloc(sizeof(int) * (size_t)(R > S ? R : S));
    if (!m) return ms_errorf("mesh: out of memory");
    char name[96];
    /* the shard group: my row, ranks row*S .. row*S+S-1 */
    for (int j = 0; j < S; j++) m[j] = world->world_ranks[row * S + j];
    snprintf(name, sizeof name, "mesh shard group %d of %dx%d", row, R, S);
    int rc = make_group(shard, world, row, col, S, m, name);
    if (rc == 0) {
        for (int i = 0; i < R; i++) m[i] = world->world_ranks[i * S + col];
        snprintf(name, sizeof name, "mesh replicate group %d of %dx%d", col, R, S);
        rc = make_group(rep, world, col, row, R, m, name);
    }
    free(m);
    if (rc) { ms_comm_free(*shard); *shard = NULL; }
    return rc;
}

/* ------------------------------------------------------------- rendezvous */

int ms_dist_exiting_with_error = 0;

static void dist_on_exit(int status, void *arg) {
    /* a process that exits without ms_dist_destroy: the NCCL watchdog must
     * stop before the CUDA runtime tears down. On a failure exit nothing may
     * wait for the peers (they may never come): communicators are aborted,
     * not finalised, and MPI is not finalised (mpi.c) */
    if (status != 0) ms_dist_exiting_with_error = 1;
    if (g_dist.initialized) ms_dist_destroy();
}

int ms_dist_init(ms_comm **world, const ms_dist_options *opt) {
    *world = NULL;
    if (g_dist.initialized) return ms_errorf("dist.init: already initialised (call dist.destroy first)");
    ms_dist_options o;
    ms_dist_options_default(&o);
    if (opt) o = *opt;
    if (!(o.timeout_s > 0) || !(o.rendezvous_timeout_s > 0))
        return ms_errorf("dist.init: time-outs must be > 0 seconds (got %g and %g)", o.timeout_s, o.rendezvous_timeout_s);
    const ms_dist_backend *be = o.backend == MS_DIST_NCCL ? ms_dist_nccl_backend
                                : o.backend == MS_DIST_MPI ? ms_dist_mpi_backend : NULL;
    if (o.backend != MS_DIST_NCCL && o.backend != MS_DIST_MPI)
        return ms_errorf("dist.init: unknown backend %d", o.backend);
    if (!be)
        return ms_errorf("dist.init: moonshard was built without %s (%s)", o.backend == MS_DIST_NCCL ? "NCCL" : "MPI",
                         o.backend == MS_DIST_NCCL ? "no nvcc or no nccl.h at build time"
                                                   : "no mpicc at build time: apt-get install libopenmpi-dev, then make");
    ms_dist_env e;
    if (ms_dist_read_env(&e)) return -1;
    ms_store_client *store = NULL;
    ms_store_server *server = NULL;
    int need_store = e.world_size > 1 && (o.backend == MS_DIST_NCCL || e.has_master);
    if (need_store) {
        if (!e.has_master)
            return ms_errorf("dist.init: %d ranks need MASTER_ADDR and MASTER_PORT for the rendezvous (bin/train "
                             "sets them; with srun or mpirun, export them: the address of rank 0's host and a free port)",
                             e.world_size);
        const char *token = getenv("MS_DIST_TOKEN");
        if (!token || !*token)
            return ms_errorf("dist.init: MS_DIST_TOKEN is not set: the rendezvous store admits only ranks that "
                             "present the run's secret (bin/train makes one; with srun/mpirun: export "
                             "MS_DIST_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'))");
        int restart = 0;
        if (env_int("MS_RESTART_COUNT", &restart) < 0) return -1;
        if (restart > 999999) return ms_errorf("dist: MS_RESTART_COUNT=%d is above 999999", restart);
        /* MS_AGENT_STORE=1: the launcher (bin/train) serves the store for
         * the whole run, as torchrun's agent does; rank 0 only connects */
        const char *agent = getenv("MS_AGENT_STORE");
        const int hosted = agent && strcmp(agent, "1") == 0;
        if (e.rank == 0 && !hosted && ms_store_server_start(&server, e.master_addr, e.master_port, token)) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", ms_last_error());
            return ms_errorf("dist.init (rank 0): %s", msg);
        }
        /* after a dist.destroy() in the same processes, another rank may
         * reach its next init while rank 0 still serves the old store on the
         * same port: the barrier key carries the init's number ("init", then
         * "init/2", ...: every rank inits as often), so a rank that reached
         * the old store waits there for a key that never comes, loses the
         * connection when rank 0 stops it, and connects again, to the new one */
        char key[32];
        if (++g_dist.epoch == 1) snprintf(key, sizeof key, "init");
        else snprintf(key, sizeof key, "init/%d", g_dist.epoch);
        /* a restarted run's keys (bin/train --max-restarts: its ranks are
         * new processes, at their first init again) and every later init's
         * (NCCL's ids too) in a namespace of their own: a store that
         * outlived them (the launcher's) holds their values under the same
         * names. At most "r999999/e2147483647/", within the 23 bytes of a
         * prefix */
        char prefix[48] = "";
        int np = 0;
        if (restart > 0) np += snprintf(prefix + np, sizeof prefix - (size_t)np, "r%d/", restart);
        if (g_dist.epoch > 1) snprintf(prefix + np, sizeof prefix - (size_t)np, "e%d/", g_dist.epoch);
        const double deadline = ms_dist_now() + o.rendezvous_timeout_s;
        int failed;
        for (;;) {
            const double left = deadline - ms_dist_now();
            failed = ms_store_connect(&store, e.master_addr, e.master_port, token, e.rank, left > 1 ? left : 1) ||
                     ms_store_set_prefix(store, prefix) ||
                     ms_store_barrier_within(store, key, e.rank, e.world_size, left > 1 ? left : 1,
                                             o.rendezvous_timeout_s);
            if (!failed || e.rank == 0 || ms_dist_now() > deadline) break;
            const char *m = ms_last_error();
            if (!strstr(m, "closed the connection") && !strstr(m, "lost the connection")) break;
            ms_store_free(store);
            store = NULL;
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (failed) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", ms_last_error());
            ms_store_free(store);
            if (server) {
                /* rank 0 keeps the store up until the other ranks' own waits
                 * have ended (their deadlines are a little later than ours),
                 * so every rank reports which ranks never arrived */
                double until = ms_dist_now() + 5;
                struct timespec ts = {0, 20 * 1000 * 1000};
                do nanosleep(&ts, NULL);
                while (ms_store_server_waiting(server) > 0 && ms_dist_now() < until);
            }
            ms_store_server_stop(server);
            return ms_errorf("dist.init (rank %d of %d): %s", e.rank, e.world_size, msg);
        }
    }
    ms_comm *c = comm_alloc(be, e.world_size);
    if (!c) {
        ms_store_free(store);
        ms_store_server_stop(server);
        return ms_errorf("dist.init: out of memory");
    }
    for (int i = 0; i < e.world_size; i++) c->world_ranks[i] = i;
    c->rank = e.rank;
    c->timeout_s = o.timeout_s;
    snprintf(c->name, sizeof c->name, "world");
    if (be->init_world(c, &e, &o, store)) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ms_last_error());
        c->impl = NULL;
        ms_comm_free(c);
        ms_store_free(store);
        ms_store_server_stop(server);
        return ms_errorf("%s", msg);
    }
    g_dist.initialized = 1;
    g_dist.be = be;
    g_dist.world = c;
    g_dist.store = store;
    g_dist.server = server;
    if (!g_dist.atexit_done) {
        on_exit(dist_on_exit, NULL);
        g_dist.atexit_done = 1;
    }
    c->refs++;   /* one for the caller, one for the library */
    *world = c;
    return 0;
}

int ms_dist_destroy(void) {
    if (!g_dist.initialized) return 0;
    /* free the backend state of every group; handles the caller still holds
     * stay valid as "destroyed" until they are freed */
    for (ms_comm *c = g_dist.all; c; c = c->next) {
        if (!c->destroyed && c->impl) c->be->comm_free(c);
        c->impl = NULL;
        c->destroyed = 1;
    }
    /* the groups no handle refers to any more go now */
    for (ms_comm **p = &g_dist.all; *p;) {
        ms_comm *c = *p;
        if (c->released) {
            *p = c->next;
            free(c->world_ranks);
            free(c);
        } else {
            p = &c->next;
        }
    }
    const ms_dist_backend *be = g_dist.be;
    ms_comm *w = g_dist.world;
    g_dist.world = NULL;
    g_dist.initialized = 0;
    if (be && be->finalize) be->finalize();
    ms_store_free(g_dist.store);
    g_dist.store = NULL;
    ms_store_server_stop(g_dist.server);
    g_dist.server = NULL;
    ms_comm_free(w);
    return 0;
}

/* ------------------------------------------------------------ collectives */

static const char *op_names[4] = {"sum", "avg", "max", "min"};
static const char *kind_names[6] = {"all_gather_into", "reduce_scatter", "all_reduce", "broadcast", "copy_gather", "p2p"};

/* moves8: a collective that only moves bytes (all_gather_into, broadcast,
 * copy_gather), which also takes the 8-bit floats (FSDP's float8 gathers) */
static int check_tensor(ms_comm *c, const char *op, const char *what, const ms_tensor *t, int moves8) {
    char d[200];
    if (!t) return ms_errorf("%s: %s is missing", op, what);
    if (ms_tensor_check_live(t, op)) return -1;
    if (moves8 && ms_is_float8(t->dtype_id)) {
        /* (bytes: every backend moves them as such) */
    } else if (t->dtype_id != MS_F32 && t->dtype_id != MS_BF16 && t->dtype_id != MS_F64 && t->dtype_id != MS_I64)
        return ms_errorf("%s: %s is %s; collectives take f32, bf16, f64 or i64 (all_gather_into and broadcast "
                         "also f8e4m3, f8e5m2)", op, what, ms_desc(t, d, sizeof d));
    if (!ms_tensor_is_contiguous(t))
        return ms_errorf("%s: %s (%s) is not contiguous (call :contiguous() first)", op, what, ms_desc(t, d, sizeof d));
    if (c->be == ms_dist_nccl_backend && t->device_id != c->device)
        return ms_errorf("%s: %s is %s but the NCCL group %s works on cuda:%d", op, what, ms_desc(t, d, sizeof d),
                         c->name, c->device);
    if (c->be == ms_dist_mpi_backend && t->device_id >= 0)
        return ms_errorf("%s: %s is %s but the MPI backend takes CPU tensors (init dist with backend='nccl' "
                         "for CUDA tensors)", op, what, ms_desc(t, d, sizeof d));
    return 0;
}

static int launch(ms_work **work, ms_work *w, ms_tensor *out, const ms_tensor *in, int root);

static int start(ms_work **work, ms_comm *c, int kind, int op, ms_tensor *out, const ms_tensor *in, int root,
                 void *aux) {
    const char *name = kind_names[kind];
    if (work) *work = NULL;
    if (usable(c, name)) return -1;
    if ((kind == MS_COLL_REDUCE_SCATTER || kind == MS_COLL_ALL_REDUCE) && (op < 0 || op > MS_REDUCE_MIN))
        return ms_errorf("%s: unknown reduction %d (sum, avg, max, min)", name, op);
    const int moves8 = kind == MS_COLL_ALL_GATHER || kind == MS_COLL_BROADCAST || kind == MS_COLL_COPY_GATHER;
    if (check_tensor(c, name, kind == MS_COLL_ALL_REDUCE || kind == MS_COLL_BROADCAST ? "the tensor" : "out", out,
                     moves8))
        return -1;
    if (in != out && check_tensor(c, name, "in", in, moves8)) return -1;
    char a[200], b[200];
    int64_t n_out = ms_tensor_numel(out), n_in = ms_tensor_numel(in);
    if (in->dtype_id != out->dtype_id)
        return ms_errorf("%s: out is %s but in is %s (the same dtype is needed)", name, ms_desc(out, a, sizeof a),
                         ms_desc(in, b, sizeof b));
    if ((kind == MS_COLL_ALL_GATHER || kind == MS_COLL_COPY_GATHER) && n_out != n_in * c->size)
        return ms_errorf("%s: out (%s) must hold %d x %lld = %lld elements for in (%s) on the group %s of %d ranks",
                         name, ms_desc(out, a, sizeof a), c->size, (long long)n_in, (long long)(n_in * c->size),
                         ms_desc(in, b, sizeof b), c->name, c->size);
    if (kind == MS_COLL_REDUCE_SCATTER && n_in != n_out * c->size)
        return ms_errorf("%s: in (%s) must hold %d x %lld = %lld elements for out (%s) on the group %s of %d ranks "
                         "(pad the input to a multiple of the group size)",
                         name, ms_desc(in, b, sizeof b), c->size, (long long)n_out, (long long)(n_out * c->size),
                         ms_desc(out, a, sizeof a), c->name, c->size);
    int in_place = 0;
    if (kind == MS_COLL_COPY_GATHER && in->storage == out->storage)
        return ms_errorf("%s: out shares the registered tensor's storage", name);
    if (kind != MS_COLL_ALL_REDUCE && kind != MS_COLL_BROADCAST && in->storage == out->storage) {
        /* in place as NCCL defines it: in is this rank's chunk of out
         * (all_gather) or out is this rank's chunk of in (reduce_scatter);
         * any other overlap is refused */
        char *lo_o = (char *)ms_tensor_data(out), *lo_i = (char *)ms_tensor_data(in);
        int64_t es = ms_dtype_size(out->dtype_id), bo = n_out * es, bi = n_in * es;
        if (kind == MS_COLL_ALL_GATHER && lo_i == lo_o + (int64_t)c->rank * bi) in_place = 1;
        else if (kind == MS_COLL_REDUCE_SCATTER && lo_o == lo_i + (int64_t)c->rank * bo) in_place = 1;
        else if (lo_o < lo_i + bi && lo_i < lo_o + bo)
            return ms_errorf("%s: in and out overlap in memory (in place means in is this rank's chunk of out "
                             "for all_gather_into, out this rank's chunk of in for reduce_scatter)", name);
    }
    int root_g = -1;
    if (kind == MS_COLL_BROADCAST) {
        for (int i = 0; i < c->size; i++) if (c->world_ranks[i] == root) root_g = i;
        if (root_g < 0)
            return ms_errorf("broadcast: root %d is not a rank of the group %s (roots are world ranks)", root, c->name);
    }
    ms_work *w = calloc(1, sizeof *w);
    if (!w) return ms_errorf("%s: out of memory", name);
    w->comm = c;
    c->refs++;
    w->kind = kind;
    w->op = op;
    w->in_place = in_place;
    w->t_start = ms_dist_now();
    w->aux = aux;
    if (kind == MS_COLL_REDUCE_SCATTER || kind == MS_COLL_ALL_REDUCE)
        snprintf(w->desc, sizeof w->desc, "%s %s of %s on %s", name, op_names[op], ms_desc(in, a, sizeof a), c->name);
    else
        snprintf(w->desc, sizeof w->desc, "%s of %s on %s", name, ms_desc(in, a, sizeof a), c->name);
    return launch(work, w, out, in, root_g);
}

/* runs the backend's start for w, then hands w to the caller (work) or
 * waits for it (work NULL) and frees it; on a failed start w is freed */
static int launch(ms_work **work, ms_work *w, ms_tensor *out, const ms_tensor *in, int root) {
    ms_comm *c = w->comm;
    char msg[1024];
    if (c->be != ms_dist_nccl_backend &&
        refuse_captured(w->desc, "the MPI backend runs on the host, once, not at each replay")) {
        snprintf(msg, sizeof msg, "%s", ms_last_error());
        ms_comm_free(c);
        free(w);
        return ms_errorf("%s", msg);
    }
    w->captured = ms_cuda_capturing() >= 0;
    trace(c, w->desc);
    int rc = c->be->start(w, out, in, root);
    if (w->kind == MS_COLL_P2P) w->aux = NULL;   /* (the batch lived on the caller's stack) */
    if (rc) {
        snprintf(msg, sizeof msg, "%s", ms_last_error());
        ms_comm_free(c);
        free(w);
        return ms_errorf("%s", msg);
    }
    if (work) {
        *work = w;
        return 0;
    }
    rc = c->be->wait(w, 1);
    if (rc) snprintf(msg, sizeof msg, "%s", ms_last_error());
    ms_work_free(w);
    if (rc) return ms_errorf("%s", msg);
    return 0;
}

#define MS_P2P_MAX 32

int ms_comm_p2p(ms_work **work, ms_comm *c, int n, const int *is_recv, ms_tensor *const *t, const int *peers) {
    const char *name = "p2p";
    if (work) *work = NULL;
    if (usable(c, name)) return -1;
    if (n < 1 || n > MS_P2P_MAX) return ms_errorf("%s: %d operations in one batch (1 to %d)", name, n, MS_P2P_MAX);
    if (!is_recv || !t || !peers) return ms_errorf("%s: missing arrays", name);
    int gpeer[MS_P2P_MAX];
    char what[64], d[200], desc[160];
    int len = 0;
    len += snprintf(desc, sizeof desc, "p2p");
    for (int i = 0; i < n; i++) {
        const char *verb = is_recv[i] ? "receive" : "send";
        snprintf(what, sizeof what, "the tensor of operation %d (%s)", i + 1, verb);
        if (check_tensor(c, name, what, t[i], 1)) return -1;
        gpeer[i] = -1;
        for (int j = 0; j < c->size; j++) if (c->world_ranks[j] == peers[i]) gpeer[i] = j;
        if (gpeer[i] < 0)
            return ms_errorf("%s: operation %d (%s) names rank %d, not a rank of the group %s (peers are world ranks)",
                             name, i + 1, verb, peers[i], c->name);
        if (gpeer[i] == c->rank)
            return ms_errorf("%s: operation %d (%s) names this rank (%d) as its peer", name, i + 1, verb, peers[i]);
        for (int j = 0; j < i; j++)
            if (t[j]->storage == t[i]->storage && (is_recv[i] || is_recv[j]))
                return ms_errorf("%s: operations %d and %d share a storage and one of them receives into it", name,
                                 j + 1, i + 1);
        if (len < (int)sizeof desc)
            len += snprintf(desc + len, sizeof desc - (size_t)len, "%s %s %s %d", i ? "," : "",
                            is_recv[i] ? "recv" : "send", ms_desc(t[i], d, sizeof d), peers[i]);
    }
    ms_work *w = calloc(1, sizeof *w);
    if (!w) return ms_errorf("%s: out of memory", name);
    w->comm = c;
    c->refs++;
    w->kind = MS_COLL_P2P;
    w->t_start = ms_dist_now();
    snprintf(w->desc, sizeof w->desc, "%.100s on %.50s", desc, c->name);
    ms_p2p_spec spec = {n, is_recv, t, gpeer};
    w->aux = &spec;
    return launch(work, w, NULL, NULL, -1);
}

int ms_comm_all_gather_into(ms_work **work, ms_comm *c, ms_tensor *out, const ms_tensor *in) {
    return start(work, c, MS_COLL_ALL_GATHER, 0, out, in, 0, NULL);
}
int ms_comm_reduce_scatter(ms_work **work, ms_comm *c, ms_tensor *out, const ms_tensor *in, int op) {
    return start(work, c, MS_COLL_REDUCE_SCATTER, op, out, in, 0, NULL);
}
int ms_comm_all_reduce(ms_work **work, ms_comm *c, ms_tensor *t, int op) {
    return start(work, c, MS_COLL_ALL_REDUCE, op, t, t, 0, NULL);
}
int ms_comm_broadcast(ms_work **work, ms_comm *c, ms_tensor *t, int root) {
    return start(work, c, MS_COLL_BROADCAST, 0, t, t, root, NULL);
}

struct ms_copy_buf {
    ms_comm *c;          /* one reference */
    const ms_tensor *t;  /* the registered tensor (the caller keeps it alive) */
    void *impl;          /* the backend's */
};

int ms_comm_copy_register(ms_copy_buf **out, ms_comm *c, ms_tensor *t) {
    const char *name = "copy_register";
    char d[200];
    if (!out) return ms_errorf("%s: no output handle", name);
    *out = NULL;
    if (usable(c, name)) return -1;
    if (refuse_captured(name, "registering exchanges the peers' handles on the host")) return -1;
    if (!c->be->copy_register)
        return ms_errorf("%s: copy-engine gathers need the NCCL backend (the group %s is %s)", name, c->name,
                         c->be->name);
    if (check_tensor(c, name, "the tensor", t, 1)) return -1;
    if (t->storage->external)
        return ms_errorf("%s: %s is not memory of the caching allocator", name, ms_desc(t, d, sizeof d));
    ms_copy_buf *b = calloc(1, sizeof *b);
    if (!b) return ms_errorf("%s: out of memory", name);
    int rc = c->be->copy_register(c, t, &b->impl);
    if (rc != 0) {
        free(b);
        return rc;
    }
    b->c = c;
    c->refs++;
    b->t = t;
    *out = b;
    return 0;
}

int ms_comm_copy_gather(ms_work **work, ms_copy_buf *b, ms_tensor *out) {
    if (!b || !b->impl) return ms_errorf("copy_gather: no registration");
    if (ms_tensor_check_live(b->t, "copy_gather (the registered tensor)")) return -1;
    return start(work, b->c, MS_COLL_COPY_GATHER, 0, out, b->t, 0, b->impl);
}

void ms_copy_buf_free(ms_copy_buf *b) {
    if (!b) return;
    if (b->impl && b->c && b->c->be->copy_free) b->c->be->copy_free(b->impl);   /* closes its mappings */
    if (b->c) ms_comm_free(b->c);
    free(b);
}

int ms_comm_barrier(ms_comm *c) {
    if (usable(c, "barrier")) return -1;
    if (refuse_captured("barrier", "the host waits for every member")) return -1;
    trace(c, "barrier");
    return c->be->barrier(c);
}

int ms_comm_watch(ms_comm *c, const char *desc) {
    if (usable(c, "watch")) return -1;
    if (!desc) desc = "work on the compute stream";
    if (!c->be->watch) return 0;   /* (MPI: its waits are the host's, with their own deadline) */
    return c->be->watch(c, desc);
}

int ms_work_wait(ms_work *w) {
    if (!w) return ms_errorf("wait: no work");
    if (w->failed) return ms_errorf("wait: %s failed earlier", w->desc);
    if (w->done) return 0;
    if (w->comm->destroyed) return ms_errorf("wait: %s: dist was destroyed before it completed", w->desc);
    if (w->comm->broken && !w->done) {
        w->failed = 1;
        return ms_errorf("wait: %s: the group is broken: %s", w->desc, w->comm->broken_msg);
    }
    /* a wait is a stream wait on NCCL: inside the capture that recorded the
     * collective it joins the communication stream back; across the
     * capture's border it has nothing to wait for */
    int capturing = ms_cuda_capturing() >= 0;
    if (w->captured && !capturing)
        return ms_errorf("wait: %s was recorded into a CUDA graph capture that has ended: it runs at each replay; "
                         "wait for it inside the capture (the communication stream must join back before the "
                         "capture ends)", w->desc);
    if (!w->captured && capturing)
        return ms_errorf("wait: %s was issued before the CUDA graph capture on cuda:%d began: wait for it before "
                         "the capture (a replay could not wait for it)", w->desc, ms_cuda_capturing());
    int rc = w->comm->be->wait(w, 0);
    if (rc) w->failed = 1;
    return rc;
}

int ms_work_is_done(ms_work *w) {
    if (!w) return ms_errorf("is_done: no work");
    if (w->failed) return ms_errorf("is_done: %s failed", w->desc);
    if (w->done) return 1;
    if (w->comm->destroyed) return ms_errorf("is_done: %s: dist was destroyed before it completed", w->desc);
    if (refuse_captured("is_done", "the host would poll work that is only being recorded; wait() for it (a stream "
                        "wait)"))
        return -1;
    if (w->captured)
        return ms_errorf("is_done: %s was recorded into a CUDA graph: it runs at each replay, not once; there is "
                         "nothing to poll", w->desc);
    int rc = w->comm->be->test(w);
    if (rc < 0) w->failed = 1;
    return rc;
}

void ms_work_free(ms_work *w) {
    if (!w) return;
    if (!w->comm->destroyed) w->comm->be->work_free(w);
    for (int i = 0; i < 2; i++) if (w->keep[i]) ms_storage_release(w->keep[i]);
    ms_comm_free(w->comm);
    free(w);
}
