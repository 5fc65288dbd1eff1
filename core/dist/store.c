/* core/dist/store.c — the TCP store of the rendezvous: a key/value server
 * that rank 0 runs on a thread of its own, and the client every rank uses.
 *
 * It carries a few hundred bytes per rank at start-up (NCCL's unique id,
 * barrier arrivals), so it is built for robustness, not speed: one thread,
 * poll(), non-blocking sockets, a hash table of keys, and hard limits on
 * everything a peer can make it hold (comm.h: MS_STORE_*).
 *
 * Wire format, all integers little-endian:
 *   frame    u32 len, then len bytes (1 <= len <= MS_STORE_MAX_MSG)
 *   string   u32 n, then n bytes
 *   request  u8 op, then per op:
 *     HELLO  u32 version, i32 rank, string token     (first, and only first)
 *     SET    string key, string value
 *     GET    string key, u32 timeout_ms               (waits for the key)
 *     ADD    string key, i64 delta                    (value is a decimal integer)
 *     WAIT   u32 timeout_ms, u32 n, n strings         (waits for every key)
 *     PING
 *   reply    u8 status, then: OK -, VALUE string, INT i64,
 *            TIMEOUT u32 n + n u32 indices of the missing keys, ERROR string
 * A request is parsed completely (every length checked against what is
 * left of the frame, nothing left over) before it touches the table, so a
 * malformed one changes nothing. Time-outs of GET/WAIT are kept by the
 * server, so a reply always comes and the client's deadline only guards
 * against a dead server.
 */
#include "dist_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_ADD = 4, OP_WAIT = 5, OP_PING = 6 };
enum { ST_OK = 0, ST_VALUE = 1, ST_INT = 2, ST_TIMEOUT = 3, ST_ERROR = 4 };
#define PROTOCOL_VERSION 1

double ms_dist_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ byte helpers */

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16); p[3] = (unsigned char)(v >> 24);
}
static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* a growable byte buffer for building messages */
typedef struct buf {
    unsigned char *p;
    size_t n, cap;
    int oom;
} buf;

static void buf_need(buf *b, size_t more) {
    if (b->oom || b->n + more <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more) cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p) { b->oom = 1; return; }
    b->p = p;
    b->cap = cap;
}
static void buf_bytes(buf *b, const void *src, size_t n) {
    buf_need(b, n);
    if (b->oom) return;
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void buf_u8(buf *b, unsigned v) { unsigned char c = (unsigned char)v; buf_bytes(b, &c, 1); }
static void buf_u32(buf *b, uint32_t v) { unsigned char t[4]; put_u32(t, v); buf_bytes(b, t, 4); }
static void buf_u64(buf *b, uint64_t v) { unsigned char t[8]; put_u64(t, v); buf_bytes(b, t, 8); }
static void buf_str(buf *b, const void *s, size_t n) { buf_u32(b, (uint32_t)n); buf_bytes(b, s, n); }
/* start a frame: 4 bytes of length filled in by buf_end_frame */
static size_t buf_begin_frame(buf *b) { size_t at = b->n; buf_u32(b, 0); return at; }
static void buf_end_frame(buf *b, size_t at) {
    if (!b->oom) put_u32(b->p + at, (uint32_t)(b->n - at - 4));
}

/* a cursor over a received frame; any overrun sets bad */
typedef struct rd {
    const unsigned char *p;
    size_t n, at;
    int bad;
} rd;

static uint32_t rd_u32(rd *r) {
    if (r->bad || r->n - r->at < 4) { r->bad = 1; return 0; }
    uint32_t v = get_u32(r->p + r->at);
    r->at += 4;
    return v;
}
static uint64_t rd_u64(rd *r) {
    if (r->bad || r->n - r->at < 8) { r->bad = 1; return 0; }
    uint64_t v = get_u64(r->p + r->at);
    r->at += 8;
    return v;
}
static unsigned rd_u8(rd *r) {
    if (r->bad || r->n - r->at < 1) { r->bad = 1; return 0; }
    return r->p[r->at++];
}
static const unsigned char *rd_str(rd *r, size_t *len, size_t max) {
    uint32_t n = rd_u32(r);
    if (r->bad || n > max || r->n - r->at < n) { r->bad = 1; *len = 0; return NULL; }
    const unsigned char *s = r->p + r->at;
    r->at += n;
    *len = n;
    return s;
}

/* -------------------------------------------------------------- the table */

typedef struct entry {
    char *key;
    size_t klen;
    unsigned char *val;
    size_t vlen;
    struct entry *next;
} entry;

#define NBUCKETS 4096

static uint32_t hash_key(const unsigned char *k, size_t n) {
    uint32_t h = 2166136261u;   /* FNV-1a */
    for (size_t i = 0; i < n; i++) { h ^= k[i]; h *= 16777619u; }
    return h;
}

/* ------------------------------------------------------------- the server */

typedef struct conn {
    int fd;
    int authed;
    int rank;
    double t_open;
    unsigned char *in;       /* bytes of the frame being received (header included) */
    size_t in_len, in_cap;
    unsigned char *out;      /* reply bytes not yet written */
    size_t out_len, out_at;
    int closing;             /* close once `out` is written */
    /* a GET or WAIT waiting for keys */
    int waiting;             /* 0, OP_GET or OP_WAIT */
    double deadline;
    int nwait;
    char **wkeys;
    size_t *wklen;
} conn;

struct ms_store_server {
    int listen_fd;
    int wake[2];             /* a byte here stops the thread */
    int port;
    char token[256];
    size_t token_len;
    pthread_t thread;
    pthread_mutex_t mu;      /* guards stats for readers on other threads */
    ms_store_stats stats;
    int waiting;             /* connections with a GET/WAIT pending (under mu) */
    entry *buckets[NBUCKETS];
    int64_t nkeys, nbytes;
    conn *conns[MS_STORE_MAX_CONNS];
    int nconns;
};

static entry *table_find(ms_store_server *s, const unsigned char *k, size_t n) {
    for (entry *e = s->buckets[hash_key(k, n) % NBUCKETS]; e; e = e->next)
        if (e->klen == n && memcmp(e->key, k, n) == 0) return e;
    return NULL;
}

/* set key = val; returns NULL or an error text */
static const char *table_set(ms_store_server *s, const unsigned char *k, size_t kn,
                             const unsigned char *v, size_t vn) {
    entry *e = table_find(s, k, kn);
    if (e) {
        if (s->nbytes - (int64_t)e->vlen + (int64_t)vn > MS_STORE_MAX_BYTES) return "store is full (bytes)";
        unsigned char *nv = malloc(vn ? vn : 1);
        if (!nv) return "store: out of memory";
        memcpy(nv, v, vn);
        free(e->val);
        s->nbytes += (int64_t)vn - (int64_t)e->vlen;
        e->val = nv;
        e->vlen = vn;
        return NULL;
    }
    if (s->nkeys >= MS_STORE_MAX_KEYS) return "store is full (keys)";
    if (s->nbytes + (int64_t)(kn + vn) > MS_STORE_MAX_BYTES) return "store is full (bytes)";
    e = calloc(1, sizeof *e);
    if (!e) return "store: out of memory";
    e->key = malloc(kn + 1);
    e->val = malloc(vn ? vn : 1);
    if (!e->key || !e->val) { free(e->key); free(e->val); free(e); return "store: out of memory"; }
    memcpy(e->key, k, kn);
    e->key[kn] = 0;
    e->klen = kn;
    memcpy(e->val, v, vn);
    e->vlen = vn;
    uint32_t b = hash_key(k, kn) % NBUCKETS;
    e->next = s->buckets[b];
    s->buckets[b] = e;
    s->nkeys++;
    s->nbytes += (int64_t)(kn + vn);
    return NULL;
}

static void conn_clear_wait(conn *c) {
    for (int i = 0; i < c->nwait; i++) free(c->wkeys[i]);
    free(c->wkeys);
    free(c->wklen);
    c->wkeys = NULL;
    c->wklen = NULL;
    c->nwait = 0;
    c->waiting = 0;
}

static void conn_close(ms_store_server *s, int i) {
    conn *c = s->conns[i];
    if (c->authed) {
        pthread_mutex_lock(&s->mu);
        s->stats.open--;
        pthread_mutex_unlock(&s->mu);
    }
    close(c->fd);
    conn_clear_wait(c);
    free(c->in);
    free(c->out);
    free(c);
    s->conns[i] = s->conns[--s->nconns];
}

/* queue a reply frame (status + payload already in b as a complete frame) */
static void conn_send(conn *c, buf *b) {
    if (b->oom) { c->closing = 1; free(b->p); return; }
    if (c->out_at == c->out_len) {
        free(c->out);
        c->out = b->p;
        c->out_len = b->n;
        c->out_at = 0;
        return;
    }
    /* a reply is still being written: append */
    unsigned char *p = realloc(c->out, c->out_len + b->n);
    if (!p) { c->closing = 1; free(b->p); return; }
    memcpy(p + c->out_len, b->p, b->n);
    c->out = p;
    c->out_len += b->n;
    free(b->p);
}

static void reply_status(conn *c, int st) {
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, (unsigned)st);
    buf_end_frame(&b, at);
    conn_send(c, &b);
}

static void reply_error(conn *c, const char *msg, int close_after) {
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, ST_ERROR);
    buf_str(&b, msg, strlen(msg));
    buf_end_frame(&b, at);
    conn_send(c, &b);
    if (close_after) c->closing = 1;
}

static void reply_value(conn *c, const entry *e) {
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, ST_VALUE);
    buf_str(&b, e->val, e->vlen);
    buf_end_frame(&b, at);
    conn_send(c, &b);
}

static void reply_int(conn *c, int64_t v) {
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, ST_INT);
    buf_u64(&b, (uint64_t)v);
    buf_end_frame(&b, at);
    conn_send(c, &b);
}

/* answer a waiting connection if its keys are all there, or if its time is up */
static void conn_check_wait(ms_store_server *s, conn *c, double now) {
    if (!c->waiting) return;
    int missing = 0;
    for (int i = 0; i < c->nwait; i++)
        if (!table_find(s, (const unsigned char *)c->wkeys[i], c->wklen[i])) missing++;
    if (missing == 0) {
        if (c->waiting == OP_GET) reply_value(c, table_find(s, (const unsigned char *)c->wkeys[0], c->wklen[0]));
        else reply_status(c, ST_OK);
        conn_clear_wait(c);
        return;
    }
    if (now < c->deadline) return;
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, ST_TIMEOUT);
    buf_u32(&b, (uint32_t)missing);
    for (int i = 0; i < c->nwait; i++)
        if (!table_find(s, (const unsigned char *)c->wkeys[i], c->wklen[i])) buf_u32(&b, (uint32_t)i);
    buf_end_frame(&b, at);
    conn_send(c, &b);
    conn_clear_wait(c);
}

static void count(ms_store_server *s, int64_t *field) {
    pthread_mutex_lock(&s->mu);
    (*field)++;
    pthread_mutex_unlock(&s->mu);
}

static void reject_malformed(ms_store_server *s, conn *c, const char *what) {
    count(s, &s->stats.rejected_malformed);
    char msg[160];
    snprintf(msg, sizeof msg, "store: malformed request (%s)", what);
    reply_error(c, msg, 1);
}

/* constant-time comparison, so the reply time tells nothing about the token */
static int token_equal(const unsigned char *a, size_t an, const char *b, size_t bn) {
    unsigned diff = (unsigned)(an ^ bn);
    for (size_t i = 0; i < an; i++) diff |= (unsigned)(a[i] ^ (unsigned char)b[i % (bn ? bn : 1)]);
    return diff == 0;
}

/* one complete frame body from an authenticated (or authenticating) peer */
static void handle_frame(ms_store_server *s, conn *c, const unsigned char *body, size_t n) {
    rd r = {body, n, 0, 0};
    unsigned op = rd_u8(&r);
    if (!c->authed) {
        if (op != OP_HELLO) {
            count(s, &s->stats.rejected_auth);
            reply_error(c, "store: authentication required (the first message must be HELLO with the run's token)", 1);
            return;
        }
        uint32_t version = rd_u32(&r);
        int32_t rank = (int32_t)rd_u32(&r);
        size_t tn;
        const unsigned char *tok = rd_str(&r, &tn, 4096);
        if (r.bad || r.at != r.n) { reject_malformed(s, c, "HELLO"); return; }
        if (version != PROTOCOL_VERSION) {
            count(s, &s->stats.rejected_malformed);
            reply_error(c, "store: protocol version mismatch", 1);
            return;
        }
        if (!token_equal(tok, tn, s->token, s->token_len)) {
            count(s, &s->stats.rejected_auth);
            reply_error(c, "store: authentication failed (wrong MS_DIST_TOKEN)", 1);
            return;
        }
        c->authed = 1;
        c->rank = rank;
        count(s, &s->stats.authenticated);
        count(s, &s->stats.open);
        reply_status(c, ST_OK);
        return;
    }
    switch (op) {
    case OP_SET: {
        size_t kn, vn;
        const unsigned char *k = rd_str(&r, &kn, MS_STORE_MAX_KEY);
        const unsigned char *v = rd_str(&r, &vn, MS_STORE_MAX_MSG);
        if (r.bad || r.at != r.n || kn == 0) { reject_malformed(s, c, "SET"); return; }
        const char *err = table_set(s, k, kn, v, vn);
        if (err) { reply_error(c, err, 0); return; }
        count(s, &s->stats.requests);
        reply_status(c, ST_OK);
        double now = ms_dist_now();
        for (int i = 0; i < s->nconns; i++) conn_check_wait(s, s->conns[i], now);
        return;
    }
    case OP_ADD: {
        size_t kn;
        const unsigned char *k = rd_str(&r, &kn, MS_STORE_MAX_KEY);
        int64_t delta = (int64_t)rd_u64(&r);
        if (r.bad || r.at != r.n || kn == 0) { reject_malformed(s, c, "ADD"); return; }
        entry *e = table_find(s, k, kn);
        long long cur = 0;
        if (e) {
            char tmp[32];
            size_t m = e->vlen < sizeof tmp - 1 ? e->vlen : sizeof tmp - 1;
            memcpy(tmp, e->val, m);
            tmp[m] = 0;
            char *end = NULL;
            cur = strtoll(tmp, &end, 10);
            if (e->vlen == 0 || e->vlen >= sizeof tmp || !end || *end) {
                reply_error(c, "store: ADD on a key whose value is not an integer", 0);
                return;
            }
        }
        char num[32];
        long long next = (long long)((uint64_t)cur + (uint64_t)delta);
        int m = snprintf(num, sizeof num, "%lld", next);
        const char *err = table_set(s, k, kn, (const unsigned char *)num, (size_t)m);
        if (err) { reply_error(c, err, 0); return; }
        count(s, &s->stats.requests);
        reply_int(c, next);
        double now = ms_dist_now();
        for (int i = 0; i < s->nconns; i++) conn_check_wait(s, s->conns[i], now);
        return;
    }
    case OP_GET:
    case OP_WAIT: {
        uint32_t nk = 1, timeout_ms = 0;
        if (op == OP_WAIT) {
            timeout_ms = rd_u32(&r);
            nk = rd_u32(&r);
            if (r.bad || nk == 0 || nk > 65536) { reject_malformed(s, c, "WAIT"); return; }
        }
        /* parse everything first */
        size_t at0 = r.at;
        for (uint32_t i = 0; i < nk; i++) {
            size_t kn;
            rd_str(&r, &kn, MS_STORE_MAX_KEY);
            if (kn == 0) r.bad = 1;
        }
        if (op == OP_GET) timeout_ms = rd_u32(&r);
        if (r.bad || r.at != r.n) { reject_malformed(s, c, op == OP_GET ? "GET" : "WAIT"); return; }
        c->wkeys = calloc(nk, sizeof *c->wkeys);
        c->wklen = calloc(nk, sizeof *c->wklen);
        if (!c->wkeys || !c->wklen) { conn_clear_wait(c); reply_error(c, "store: out of memory", 1); return; }
        r.at = at0;
        for (uint32_t i = 0; i < nk; i++) {
            size_t kn;
            const unsigned char *k = rd_str(&r, &kn, MS_STORE_MAX_KEY);
            c->wkeys[i] = malloc(kn + 1);
            if (!c->wkeys[i]) { conn_clear_wait(c); reply_error(c, "store: out of memory", 1); return; }
            memcpy(c->wkeys[i], k, kn);
            c->wkeys[i][kn] = 0;
            c->wklen[i] = kn;
            c->nwait = (int)i + 1;
        }
        count(s, &s->stats.requests);
        c->waiting = (int)op;
        c->deadline = ms_dist_now() + timeout_ms / 1000.0;
        conn_check_wait(s, c, ms_dist_now());
        return;
    }
    case OP_PING:
        if (r.at != r.n) { reject_malformed(s, c, "PING"); return; }
        count(s, &s->stats.requests);
        reply_status(c, ST_OK);
        return;
    case OP_HELLO:
        reject_malformed(s, c, "HELLO twice");
        return;
    default: {
        char what[48];
        snprintf(what, sizeof what, "unknown op %u", op);
        reject_malformed(s, c, what);
        return;
    }
    }
}

/* read what the socket has; returns -1 when the connection must close now */
static int conn_read(ms_store_server *s, conn *c) {
    for (;;) {
        size_t want;
        if (c->in_len < 4) want = 4 - c->in_len;
        else want = 4 + (size_t)get_u32(c->in) - c->in_len;
        if (c->in_cap < c->in_len + want) {
            size_t cap = c->in_len + want;
            if (cap < 64) cap = 64;
            unsigned char *p = realloc(c->in, cap);
            if (!p) return -1;
            c->in = p;
            c->in_cap = cap;
        }
        ssize_t got = recv(c->fd, c->in + c->in_len, want, 0);
        if (got == 0) {
            if (c->in_len > 0) count(s, &s->stats.truncated);
            return -1;
        }
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (c->in_len > 0) count(s, &s->stats.truncated);
            return -1;
        }
        c->in_len += (size_t)got;
        if (c->in_len == 4) {
            uint32_t len = get_u32(c->in);
            if (len == 0 || len > MS_STORE_MAX_MSG) {
                count(s, &s->stats.rejected_oversize);
                char msg[128];
                snprintf(msg, sizeof msg, "store: message of %u bytes refused (1 to %d allowed)", len,
                         MS_STORE_MAX_MSG);
                reply_error(c, msg, 1);
                c->in_len = 0;
                return 0;
            }
            continue;
        }
        if (c->in_len >= 4 && c->in_len == 4 + (size_t)get_u32(c->in)) {
            if (c->waiting) {
                /* one request at a time: a client that sends while it waits is broken */
                reject_malformed(s, c, "a request while another is pending");
                c->in_len = 0;
                return 0;
            }
            handle_frame(s, c, c->in + 4, c->in_len - 4);
            c->in_len = 0;
            if (c->closing) return 0;
            /* a big buffer is not kept for the next small message */
            if (c->in_cap > 65536) { free(c->in); c->in = NULL; c->in_cap = 0; }
        }
    }
}

/* write what can be written; -1 on a dead socket */
static int conn_write(conn *c) {
    while (c->out_at < c->out_len) {
        ssize_t n = send(c->fd, c->out + c->out_at, c->out_len - c->out_at, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return -1;
        }
        c->out_at += (size_t)n;
    }
    return 0;
}

static void server_accept(ms_store_server *s) {
    for (;;) {
        /* close-on-exec: a launcher that serves the store while it starts
         * ranks must not hand them its end of a connection */
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return;
        if (s->nconns >= MS_STORE_MAX_CONNS) { close(fd); continue; }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conn *c = calloc(1, sizeof *c);
        if (!c) { close(fd); continue; }
        c->fd = fd;
        c->rank = -1;
        c->t_open = ms_dist_now();
        s->conns[s->nconns++] = c;
        count(s, &s->stats.connections);
    }
}

static void *server_main(void *arg) {
    ms_store_server *s = arg;
    struct pollfd *pfd = malloc(sizeof *pfd * (MS_STORE_MAX_CONNS + 2));
    if (!pfd) return NULL;
    for (;;) {
        double now = ms_dist_now();
        int timeout_ms = 1000;
        for (int i = 0; i < s->nconns; i++) {
            conn *c = s->conns[i];
            double d = c->waiting ? c->deadline : (!c->authed ? c->t_open + MS_STORE_AUTH_TIMEOUT_MS / 1000.0 : 1e300);
            if (d < 1e300) {
                int ms = (int)((d - now) * 1000.0) + 1;
                if (ms < timeout_ms) timeout_ms = ms < 0 ? 0 : ms;
            }
        }
        pfd[0].fd = s->wake[0];
        pfd[0].events = POLLIN;
        pfd[1].fd = s->listen_fd;
        pfd[1].events = POLLIN;
        int n = s->nconns;
        for (int i = 0; i < n; i++) {
            conn *c = s->conns[i];
            pfd[i + 2].fd = c->fd;
            pfd[i + 2].events = (short)((c->closing ? 0 : POLLIN) | (c->out_at < c->out_len ? POLLOUT : 0));
        }
        int rc = poll(pfd, (nfds_t)(n + 2), timeout_ms);
        if (rc < 0 && errno != EINTR) break;
        if (pfd[0].revents) break;
        now = ms_dist_now();
        /* walk backwards: conn_close moves the last connection into slot i */
        for (int i = n - 1; i >= 0; i--) {
            conn *c = s->conns[i];
            short ev = rc > 0 ? pfd[i + 2].revents : 0;
            int dead = 0;
            if (ev & (POLLIN | POLLHUP | POLLERR)) {
                if (!c->closing && conn_read(s, c) < 0) dead = 1;
                else if (c->closing && (ev & (POLLHUP | POLLERR))) dead = 1;
            }
            if (!dead && !c->authed && !c->closing && now > c->t_open + MS_STORE_AUTH_TIMEOUT_MS / 1000.0) {
                count(s, &s->stats.timed_out);
                dead = 1;
            }
            if (!dead) conn_check_wait(s, c, now);
            if (!dead && conn_write(c) < 0) dead = 1;
            if (!dead && c->closing && c->out_at == c->out_len) dead = 1;
            if (dead) conn_close(s, i);
        }
        if (rc > 0 && (pfd[1].revents & POLLIN)) server_accept(s);
        int waiting = 0;
        for (int i = 0; i < s->nconns; i++) waiting += s->conns[i]->waiting != 0;
        pthread_mutex_lock(&s->mu);
        s->stats.keys = s->nkeys;
        s->stats.bytes = s->nbytes;
        s->waiting = waiting;
        pthread_mutex_unlock(&s->mu);
    }
    free(pfd);
    return NULL;
}

static int resolve(const char *host, int port, int passive, struct addrinfo **res) {
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, res);
    if (rc != 0)
        return ms_errorf("store: cannot resolve MASTER_ADDR '%s': %s", host, gai_strerror(rc));
    return 0;
}

int ms_store_server_start(ms_store_server **out, const char *host, int port, const char *token) {
    *out = NULL;
    if (!host || !*host) return ms_errorf("store: no address to listen on (MASTER_ADDR)");
    if (port < 0 || port > 65535) return ms_errorf("store: port %d out of range", port);
    if (!token || !*token) return ms_errorf("store: no token (set MS_DIST_TOKEN to a secret shared by the ranks)");
    if (strlen(token) >= 256) return ms_errorf("store: token longer than 255 bytes");
    struct addrinfo *res = NULL;
    if (resolve(host, port, 0, &res)) return -1;
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) { err = errno; continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 512) == 0) break;
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return ms_errorf("store: cannot listen on %s:%d: %s%s", host, port, strerror(err),
                         err == EADDRINUSE ? " (another run on this port? choose another MASTER_PORT)" : "");
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    ms_store_server *s = calloc(1, sizeof *s);
    if (!s) { close(fd); return ms_errorf("store: out of memory"); }
    s->listen_fd = fd;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    s->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    snprintf(s->token, sizeof s->token, "%s", token);
    s->token_len = strlen(s->token);
    pthread_mutex_init(&s->mu, NULL);
    if (pipe2(s->wake, O_CLOEXEC) != 0) {
        close(fd);
        free(s);
        return ms_errorf("store: pipe failed: %s", strerror(errno));
    }
    /* the thread must not take the signals meant for the main thread */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, server_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        close(fd);
        close(s->wake[0]);
        close(s->wake[1]);
        free(s);
        return ms_errorf("store: cannot start the server thread: %s", strerror(rc));
    }
    *out = s;
    return 0;
}

int ms_store_server_port(const ms_store_server *s) { return s ? s->port : -1; }

int ms_store_server_stats(const ms_store_server *s, ms_store_stats *out) {
    if (!s) return ms_errorf("store: no server");
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    *out = s->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
    return 0;
}

int ms_store_server_waiting(const ms_store_server *s) {
    if (!s) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    int n = s->waiting;
    pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
    return n;
}

void ms_store_server_stop(ms_store_server *s) {
    if (!s) return;
    ssize_t w = write(s->wake[1], "x", 1);
    (void)w;
    pthread_join(s->thread, NULL);
    while (s->nconns > 0) conn_close(s, s->nconns - 1);
    for (int b = 0; b < NBUCKETS; b++) {
        entry *e = s->buckets[b];
        while (e) {
            entry *next = e->next;
            free(e->key);
            free(e->val);
            free(e);
            e = next;
        }
    }
    close(s->listen_fd);
    close(s->wake[0]);
    close(s->wake[1]);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ------------------------------------------------------------- the client */

struct ms_store_client {
    int fd;
    int rank;
    char where[300];          /* "127.0.0.1:29500" for messages */
    double timeout_s;         /* default for requests that do not wait */
    int broken;
    char prefix[24];          /* put before every key ("" or "e2/": ms_store_set_prefix) */
};

/* a key as it goes on the wire: the client's prefix, then the key */
static void buf_key(buf *b, const ms_store_client *s, const char *key) {
    size_t p = strlen(s->prefix), n = strlen(key);
    buf_u32(b, (uint32_t)(p + n));
    buf_bytes(b, s->prefix, p);
    buf_bytes(b, key, n);
}

int ms_store_set_prefix(ms_store_client *s, const char *prefix) {
    size_t n = prefix ? strlen(prefix) : 0;
    if (n >= sizeof s->prefix) return ms_errorf("store: a key prefix is at most %d bytes, got %zu", (int)sizeof s->prefix - 1, n);
    memcpy(s->prefix, prefix ? prefix : "", n);
    s->prefix[n] = 0;
    return 0;
}

static int io_full(ms_store_client *s, void *p, size_t n, int writing, double deadline) {
    size_t done = 0;
    while (done < n) {
        double left = deadline - ms_dist_now();
        if (left <= 0)
            return ms_errorf("store: no answer from the store at %s within the time-out (is rank 0 alive?)", s->where);
        struct pollfd pfd = {s->fd, (short)(writing ? POLLOUT : POLLIN), 0};
        int ms = (int)(left * 1000.0) + 1;
        int rc = poll(&pfd, 1, ms > 1000 ? 1000 : ms);
        if (rc < 0 && errno != EINTR) return ms_errorf("store: poll failed: %s", strerror(errno));
        if (rc <= 0) continue;
        ssize_t k = writing ? send(s->fd, (char *)p + done, n - done, MSG_NOSIGNAL)
                            : recv(s->fd, (char *)p + done, n - done, 0);
        if (k == 0 && !writing)
            return ms_errorf("store: the store at %s closed the connection (its host, rank 0 or the launcher, exited?)", s->where);
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            return ms_errorf("store: lost the connection to the store at %s: %s", s->where, strerror(errno));
        }
        done += (size_t)k;
    }
    return 0;
}

/* send one request frame and read the reply frame into *reply (malloc'ed) */
static int roundtrip(ms_store_client *s, buf *req, unsigned char **reply, size_t *rlen, double wait_s) {
    *reply = NULL;
    if (s->broken) return ms_errorf("store: the connection to %s is broken by an earlier failure", s->where);
    if (req->oom) { free(req->p); return ms_errorf("store: out of memory"); }
    double deadline = ms_dist_now() + s->timeout_s + wait_s;
    int rc = io_full(s, req->p, req->n, 1, deadline);
    free(req->p);
    if (rc) { s->broken = 1; return -1; }
    unsigned char hdr[4];
    if (io_full(s, hdr, 4, 0, deadline)) { s->broken = 1; return -1; }
    uint32_t len = get_u32(hdr);
    if (len == 0 || len > MS_STORE_MAX_MSG + 64) {
        s->broken = 1;
        return ms_errorf("store: bad reply length %u from %s", len, s->where);
    }
    unsigned char *p = malloc(len);
    if (!p) { s->broken = 1; return ms_errorf("store: out of memory"); }
    if (io_full(s, p, len, 0, deadline)) { free(p); s->broken = 1; return -1; }
    *reply = p;
    *rlen = len;
    if (p[0] == ST_ERROR) {
        rd r = {p, len, 1, 0};
        size_t n;
        const unsigned char *m = rd_str(&r, &n, len);
        ms_errorf("%.*s", (int)(m ? n : 0), m ? (const char *)m : "");
        free(p);
        *reply = NULL;
        return -1;
    }
    return 0;
}

int ms_store_connect(ms_store_client **out, const char *host, int port, const char *token, int rank,
                     double timeout_s) {
    *out = NULL;
    if (!token || !*token) return ms_errorf("store: no token (set MS_DIST_TOKEN to a secret shared by the ranks)");
    if (timeout_s <= 0) timeout_s = 300;
    double deadline = ms_dist_now() + timeout_s;
    int fd = -1, err = 0;
    for (;;) {
        struct addrinfo *res = NULL;
        if (resolve(host, port, 0, &res)) return -1;
        for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
            fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) { err = errno; continue; }
            if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
                err = errno;
                close(fd);
                fd = -1;
            }
        }
        freeaddrinfo(res);
        if (fd >= 0) break;
        if (ms_dist_now() > deadline)
            return ms_errorf("store: cannot reach the store at %s:%d within %g s (%s): what serves it (rank 0, or "
                             "bin/train's launcher) is not there",
                             host, port, timeout_s, strerror(err));
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ms_store_client *s = calloc(1, sizeof *s);
    if (!s) { close(fd); return ms_errorf("store: out of memory"); }
    s->fd = fd;
    s->rank = rank;
    s->timeout_s = timeout_s;
    snprintf(s->where, sizeof s->where, "%s:%d", host, port);
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_HELLO);
    buf_u32(&b, PROTOCOL_VERSION);
    buf_u32(&b, (uint32_t)rank);
    buf_str(&b, token, strlen(token));
    buf_end_frame(&b, at);
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, 0)) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", ms_last_error());
        ms_store_free(s);
        return ms_errorf("%s (store at %s:%d)", msg, host, port);
    }
    free(rep);
    *out = s;
    return 0;
}

static int check_key(const ms_store_client *s, const char *key) {
    size_t n = key ? strlen(key) : 0, p = strlen(s->prefix);
    if (n == 0 || n + p > MS_STORE_MAX_KEY)
        return ms_errorf("store: keys are 1 to %zu bytes, got %zu", MS_STORE_MAX_KEY - p, n);
    return 0;
}

int ms_store_set(ms_store_client *s, const char *key, const void *value, int64_t n) {
    if (check_key(s, key)) return -1;
    if (n < 0 || n > MS_STORE_MAX_MSG - MS_STORE_MAX_KEY - 16)
        return ms_errorf("store: a value of %lld bytes is too large (at most %d)", (long long)n,
                         MS_STORE_MAX_MSG - MS_STORE_MAX_KEY - 16);
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_SET);
    buf_key(&b, s, key);
    buf_str(&b, value, (size_t)n);
    buf_end_frame(&b, at);
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, 0)) return -1;
    free(rep);
    return 0;
}

static uint32_t ms_of(double t) {
    if (t <= 0) return 0;
    if (t > 4e6) return 4000000000u;
    return (uint32_t)(t * 1000.0);
}

int ms_store_get(ms_store_client *s, const char *key, void *out, int64_t cap, int64_t *n, double timeout_s) {
    if (check_key(s, key)) return -1;
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_GET);
    buf_key(&b, s, key);
    buf_u32(&b, ms_of(timeout_s));
    buf_end_frame(&b, at);
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, timeout_s)) return -1;
    if (rep[0] == ST_TIMEOUT) {
        free(rep);
        return ms_errorf("store: key '%s' did not appear within %g s (store at %s)", key, timeout_s, s->where);
    }
    rd r = {rep, rlen, 1, 0};
    size_t vn;
    const unsigned char *v = rd_str(&r, &vn, rlen);
    if (rep[0] != ST_VALUE || r.bad) { free(rep); s->broken = 1; return ms_errorf("store: bad reply to GET"); }
    if (n) *n = (int64_t)vn;
    if (out && cap > 0) memcpy(out, v, vn < (size_t)cap ? vn : (size_t)cap);
    free(rep);
    return 0;
}

int ms_store_add(ms_store_client *s, const char *key, int64_t delta, int64_t *result) {
    if (check_key(s, key)) return -1;
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_ADD);
    buf_key(&b, s, key);
    buf_u64(&b, (uint64_t)delta);
    buf_end_frame(&b, at);
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, 0)) return -1;
    if (rep[0] != ST_INT || rlen != 9) { free(rep); s->broken = 1; return ms_errorf("store: bad reply to ADD"); }
    if (result) *result = (int64_t)get_u64(rep + 1);
    free(rep);
    return 0;
}

/* waits for keys; on a time-out *missing (malloc'ed) lists the indices */
static int wait_keys(ms_store_client *s, int n, const char *const *keys, double timeout_s, uint32_t **missing,
                     uint32_t *nmissing) {
    *missing = NULL;
    *nmissing = 0;
    if (n <= 0) return 0;
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_WAIT);
    buf_u32(&b, ms_of(timeout_s));
    buf_u32(&b, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        if (check_key(s, keys[i])) { free(b.p); return -1; }
        buf_key(&b, s, keys[i]);
    }
    buf_end_frame(&b, at);
    if (b.n > MS_STORE_MAX_MSG + 4) { free(b.p); return ms_errorf("store: too many keys in one wait (%d)", n); }
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, timeout_s)) return -1;
    if (rep[0] == ST_OK) { free(rep); return 0; }
    rd r = {rep, rlen, 1, 0};
    uint32_t m = rd_u32(&r);
    if (rep[0] != ST_TIMEOUT || r.bad || m > (uint32_t)n) { free(rep); s->broken = 1; return ms_errorf("store: bad reply to WAIT"); }
    uint32_t *idx = malloc(sizeof *idx * (m ? m : 1));
    if (!idx) { free(rep); return ms_errorf("store: out of memory"); }
    for (uint32_t i = 0; i < m; i++) idx[i] = rd_u32(&r);
    free(rep);
    if (r.bad) { free(idx); s->broken = 1; return ms_errorf("store: bad reply to WAIT"); }
    *missing = idx;
    *nmissing = m;
    return 1;
}

/* "2, 5-7, 9" from sorted integers */
static void ranges_str(char *out, size_t cap, const int *v, int n) {
    size_t k = 0;
    out[0] = 0;
    for (int i = 0; i < n && k + 32 < cap; ) {
        int j = i;
        while (j + 1 < n && v[j + 1] == v[j] + 1) j++;
        if (j > i) k += (size_t)snprintf(out + k, cap - k, "%s%d-%d", k ? ", " : "", v[i], v[j]);
        else k += (size_t)snprintf(out + k, cap - k, "%s%d", k ? ", " : "", v[i]);
        i = j + 1;
        if (i < n && k + 32 >= cap) snprintf(out + k, cap - k, ", ...");
    }
}

int ms_store_wait(ms_store_client *s, int n, const char *const *keys, double timeout_s) {
    uint32_t *missing, m;
    int rc = wait_keys(s, n, keys, timeout_s, &missing, &m);
    if (rc <= 0) return rc;
    char names[600];
    size_t k = 0;
    names[0] = 0;
    for (uint32_t i = 0; i < m && k + 80 < sizeof names; i++)
        k += (size_t)snprintf(names + k, sizeof names - k, "%s'%s'", i ? ", " : "", keys[missing[i]]);
    free(missing);
    return ms_errorf("store: timed out after %g s waiting for %u key%s: %s (store at %s)", timeout_s, m,
                     m == 1 ? "" : "s", names, s->where);
}

int ms_store_barrier(ms_store_client *s, const char *name, int rank, int world_size, double timeout_s) {
    return ms_store_barrier_within(s, name, rank, world_size, timeout_s, timeout_s);
}

int ms_store_barrier_within(ms_store_client *s, const char *name, int rank, int world_size, double wait_s,
                            double timeout_s) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
        return ms_errorf("store barrier '%s': rank %d outside a world of %d", name, rank, world_size);
    if (strlen(name) > 200) return ms_errorf("store barrier: name longer than 200 bytes");
    /* the generation counts this process's barriers of this name, so the
     * same name can be used again: every rank calls them in the same order */
    char gkey[300];
    snprintf(gkey, sizeof gkey, "ms/bgen/%s/%d", name, rank);
    int64_t gen = 0;
    if (ms_store_add(s, gkey, 1, &gen)) return -1;
    char mine[300];
    snprintf(mine, sizeof mine, "ms/barrier/%s/%lld/%d", name, (long long)gen, rank);
    if (ms_store_set(s, mine, "1", 1)) return -1;
    char **keys = calloc((size_t)world_size, sizeof *keys);
    if (!keys) return ms_errorf("store: out of memory");
    int rc = 0;
    for (int r = 0; r < world_size && rc == 0; r++) {
        keys[r] = malloc(300);
        if (!keys[r]) rc = ms_errorf("store: out of memory");
        else snprintf(keys[r], 300, "ms/barrier/%s/%lld/%d", name, (long long)gen, r);
    }
    uint32_t *missing = NULL, m = 0;
    if (rc == 0) rc = wait_keys(s, world_size, (const char *const *)keys, wait_s, &missing, &m);
    for (int r = 0; r < world_size; r++) free(keys[r]);
    free(keys);
    if (rc <= 0) return rc;
    int *ranks = malloc(sizeof *ranks * (m ? m : 1));
    if (!ranks) { free(missing); return ms_errorf("store: out of memory"); }
    for (uint32_t i = 0; i < m; i++) ranks[i] = (int)missing[i];
    free(missing);
    char list[400];
    ranges_str(list, sizeof list, ranks, (int)m);
    free(ranks);
    return ms_errorf("rendezvous '%s' timed out after %g s: rank%s %s of %d never arrived (rank %d waited; "
                     "store at %s)",
                     name, timeout_s, m == 1 ? "" : "s", list, world_size, rank, s->where);
}

int ms_store_ping(ms_store_client *s) {
    buf b = {0};
    size_t at = buf_begin_frame(&b);
    buf_u8(&b, OP_PING);
    buf_end_frame(&b, at);
    unsigned char *rep;
    size_t rlen;
    if (roundtrip(s, &b, &rep, &rlen, 0)) return -1;
    free(rep);
    return 0;
}

void ms_store_free(ms_store_client *s) {
    if (!s) return;
    close(s->fd);
    free(s);
}
