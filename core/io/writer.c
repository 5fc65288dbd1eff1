/* core/io/writer.c — a background thread that writes queued files
 * (writer.h). The thread never touches the library's error state: a job's
 * failure is a message kept in the job, raised by ms_writer_wait on the
 * caller's thread. */
#include "writer.h"
#include "../internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

typedef struct job {
    char *path;
    char *head;            /* copied */
    int64_t head_bytes;
    int n;
    const void **ptrs;     /* borrowed until done */
    int64_t *bytes;
    int written;           /* pieces written so far */
    int cancelled;         /* a piece will never come */
    int state;             /* 0 queued, 1 written, -1 failed */
    int64_t total;
    uint32_t crc;
    char err[512];
} job;

struct ms_writer {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work;   /* a job was queued, or stop */
    pthread_cond_t done;   /* a job finished, or a piece was written */
    pthread_cond_t given;  /* a piece was provided, or a job cancelled */
    job **jobs;
    int64_t njobs, cap;
    int64_t next;          /* the first job the thread has not finished */
    int64_t reported;      /* jobs before this one were reported by a wait */
    int stop;
};

static uint32_t crc_update(uint32_t crc, const unsigned char *p, int64_t n) {
    while (n > 0) {
        uInt k = n > (1 << 30) ? (1u << 30) : (uInt)n;
        crc = (uint32_t)crc32(crc, p, k);
        p += k;
        n -= k;
    }
    return crc;
}

static int write_all(int fd, const char *p, int64_t n) {
    while (n > 0) {
        ssize_t k = write(fd, p, n > (1 << 30) ? (1 << 30) : (size_t)n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= k;
    }
    return 0;
}

/* the pointer of piece i, waited for when it comes later (NULL: cancelled) */
static const void *piece(ms_writer *w, job *j, int i) {
    pthread_mutex_lock(&w->mu);
    while (!j->ptrs[i] && !j->cancelled) pthread_cond_wait(&w->given, &w->mu);
    const void *p = j->cancelled ? NULL : j->ptrs[i];
    pthread_mutex_unlock(&w->mu);
    return p;
}

static void piece_written(ms_writer *w, job *j, int i) {
    pthread_mutex_lock(&w->mu);
    j->written = i + 1;
    pthread_cond_broadcast(&w->done);
    pthread_mutex_unlock(&w->mu);
}

/* writes one file, the thread's only work: 1 written (*total, *crc), -1
 * failed (err says why; empty when a piece never came: the job was
 * cancelled, and the cancel's message stands) */
static int run_job(ms_writer *w, job *j, char *err, size_t cap, int64_t *total_out, uint32_t *crc_out) {
    err[0] = 0;
    int fd = open(j->path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, cap, "cannot create %s: %s", j->path, strerror(errno));
        return -1;
    }
    uint32_t crc = (uint32_t)crc32(0L, Z_NULL, 0);
    int64_t total = 0;
    const char *what = "write";
    int ok = 1, cancelled = 0, e = 0;
    if (j->head_bytes > 0) {
        if (write_all(fd, j->head, j->head_bytes)) {
            ok = 0;
            e = errno;
        } else {
            crc = crc_update(crc, (const unsigned char *)j->head, j->head_bytes);
            total += j->head_bytes;
        }
    }
    for (int i = 0; ok && i < j->n; i++) {
        if (j->bytes[i] > 0) {
            const void *p = piece(w, j, i);
            if (!p) { ok = 0; cancelled = 1; break; }
            if (write_all(fd, p, j->bytes[i])) { ok = 0; e = errno; break; }
            crc = crc_update(crc, p, j->bytes[i]);
            total += j->bytes[i];
        }
        piece_written(w, j, i);
    }
    if (ok && fsync(fd) != 0 && errno != EINVAL && errno != EROFS) { ok = 0; what = "fsync"; e = errno; }
    if (close(fd) != 0 && ok) { ok = 0; what = "close"; e = errno; }
    if (!ok) {
        if (!cancelled)
            snprintf(err, cap, "cannot %s %s (%lld bytes in): %s", what, j->path, (long long)total, strerror(e));
        return -1;
    }
    *total_out = total;
    *crc_out = crc;
    return 1;
}

static void release(job *j) {
    free(j->path);
    free(j->head);
    free(j->ptrs);
    free(j->bytes);
    j->path = j->head = NULL;
    j->ptrs = NULL;
    j->bytes = NULL;
}

static void *thread_main(void *arg) {
    ms_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->next >= w->njobs && !w->stop) pthread_cond_wait(&w->work, &w->mu);
        if (w->next >= w->njobs) break;   /* stop, and nothing left */
        job *j = w->jobs[w->next];
        pthread_mutex_unlock(&w->mu);
        char err[sizeof j->err];
        int64_t total = 0;
        uint32_t crc = 0;
        int st = run_job(w, j, err, sizeof err, &total, &crc);
        pthread_mutex_lock(&w->mu);
        if (j->cancelled) {
            st = -1;   /* (its message was set by the cancel) */
        } else if (st < 0) {
            snprintf(j->err, sizeof j->err, "%s", err);
        } else {
            j->total = total;
            j->crc = crc;
        }
        j->state = st;
        release(j);
        w->next++;
        pthread_cond_broadcast(&w->done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int ms_writer_new(ms_writer **out) {
    *out = NULL;
    ms_writer *w = calloc(1, sizeof *w);
    if (!w) return ms_errorf("writer: out of memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->done, NULL);
    pthread_cond_init(&w->given, NULL);
    int rc = pthread_create(&w->thread, NULL, thread_main, w);
    if (rc != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->work);
        pthread_cond_destroy(&w->done);
        pthread_cond_destroy(&w->given);
        free(w);
        return ms_errorf("writer: cannot start its thread: %s", strerror(rc));
    }
    *out = w;
    return 0;
}

void ms_writer_free(ms_writer *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    /* a file still waiting for a piece gets none now: it fails, so that the
     * thread (joined below) finishes the queue */
    for (int64_t i = w->next; i < w->njobs; i++) {
        job *j = w->jobs[i];
        for (int k = 0; k < j->n && !j->cancelled; k++)
            if (!j->ptrs[k] && j->bytes[k] > 0) {
                snprintf(j->err, sizeof j->err, "%s: the writer was freed before all its pieces were given", j->path);
                j->cancelled = 1;
            }
    }
    pthread_cond_broadcast(&w->given);
    w->stop = 1;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);   /* (the thread finishes the queue first) */
    for (int64_t i = 0; i < w->njobs; i++) {
        release(w->jobs[i]);
        free(w->jobs[i]);
    }
    free(w->jobs);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->done);
    pthread_cond_destroy(&w->given);
    free(w);
}

int64_t ms_writer_submit(ms_writer *w, const char *path, const void *head, int64_t head_bytes, int n,
                         const void *const *ptrs, const int64_t *bytes) {
    if (!w) return ms_errorf("writer: no writer");
    if (!path || !*path) return ms_errorf("writer: no path");
    if (n < 0 || head_bytes < 0 || (head_bytes > 0 && !head) || (n > 0 && (!ptrs || !bytes)))
        return ms_errorf("writer: %s: bad arguments (%d pieces, a head of %lld bytes)", path, n,
                         (long long)head_bytes);
    for (int i = 0; i < n; i++)
        if (bytes[i] < 0) return ms_errorf("writer: %s: piece %d has %lld bytes", path, i + 1, (long long)bytes[i]);
    job *j = calloc(1, sizeof *j);
    if (!j) return ms_errorf("writer: out of memory");
    j->path = strdup(path);
    j->head = head_bytes > 0 ? malloc((size_t)head_bytes) : NULL;
    j->ptrs = n > 0 ? malloc(sizeof(void *) * (size_t)n) : NULL;
    j->bytes = n > 0 ? malloc(sizeof(int64_t) * (size_t)n) : NULL;
    if (!j->path || (head_bytes > 0 && !j->head) || (n > 0 && (!j->ptrs || !j->bytes))) {
        release(j);
        free(j);
        return ms_errorf("writer: out of memory");
    }
    if (head_bytes > 0) memcpy(j->head, head, (size_t)head_bytes);
    for (int i = 0; i < n; i++) { j->ptrs[i] = ptrs[i]; j->bytes[i] = bytes[i]; }
    j->head_bytes = head_bytes;
    j->n = n;
    pthread_mutex_lock(&w->mu);
    if (w->njobs == w->cap) {
        int64_t cap = w->cap ? 2 * w->cap : 16;
        job **nj = realloc(w->jobs, sizeof(job *) * (size_t)cap);
        if (!nj) {
            pthread_mutex_unlock(&w->mu);
            release(j);
            free(j);
            return ms_errorf("writer: out of memory");
        }
        w->jobs = nj;
        w->cap = cap;
    }
    int64_t id = w->njobs;
    w->jobs[w->njobs++] = j;
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->mu);
    return id;
}

/* the job, under the lock; NULL (an error set) when it does not exist */
static job *job_of(ms_writer *w, int64_t id, const char *op) {
    if (id < 0 || id >= w->njobs) {
        ms_errorf("writer: %s: no job %lld", op, (long long)id);
        return NULL;
    }
    return w->jobs[id];
}

int ms_writer_provide(ms_writer *w, int64_t id, int i, const void *ptr) {
    if (!w) return ms_errorf("writer: no writer");
    pthread_mutex_lock(&w->mu);
    job *j = job_of(w, id, "provide");
    int rc = 0;
    if (!j) rc = -1;
    else if (j->state != 0 || j->cancelled || !j->ptrs || i < 0 || i >= j->n || j->ptrs[i] || !ptr)
        rc = ms_errorf("writer: provide: job %lld piece %d is not one waiting for its bytes", (long long)id, i);
    else {
        j->ptrs[i] = ptr;
        pthread_cond_broadcast(&w->given);
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

int ms_writer_wait_written(ms_writer *w, int64_t id, int k) {
    if (!w) return ms_errorf("writer: no writer");
    pthread_mutex_lock(&w->mu);
    job *j = job_of(w, id, "wait_written");
    int r = -1;
    if (j) {
        while (j->state == 0 && j->written < k) pthread_cond_wait(&w->done, &w->mu);
        r = j->state < 0 ? -1 : j->written;
    }
    pthread_mutex_unlock(&w->mu);
    return r;
}

int ms_writer_cancel(ms_writer *w, int64_t id, const char *why) {
    if (!w) return ms_errorf("writer: no writer");
    pthread_mutex_lock(&w->mu);
    job *j = job_of(w, id, "cancel");
    int rc = j ? 0 : -1;
    if (j && j->state == 0 && !j->cancelled) {
        snprintf(j->err, sizeof j->err, "%s: %s", j->path, why && *why ? why : "cancelled");
        j->cancelled = 1;
        pthread_cond_broadcast(&w->given);
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

int ms_writer_idle(ms_writer *w) {
    if (!w) return 1;
    pthread_mutex_lock(&w->mu);
    int idle = w->next >= w->njobs;
    pthread_mutex_unlock(&w->mu);
    return idle;
}

int ms_writer_wait(ms_writer *w) {
    if (!w) return ms_errorf("writer: no writer");
    pthread_mutex_lock(&w->mu);
    while (w->next < w->njobs) pthread_cond_wait(&w->done, &w->mu);
    int64_t from = w->reported, to = w->njobs;
    w->reported = to;
    pthread_mutex_unlock(&w->mu);
    int failed = 0;
    const char *first = NULL;
    for (int64_t i = from; i < to; i++)
        if (w->jobs[i]->state < 0) {
            if (!first) first = w->jobs[i]->err;
            failed++;
        }
    if (first) {
        if (failed > 1) return ms_errorf("writer: %s (and %d more file%s failed)", first, failed - 1, failed > 2 ? "s" : "");
        return ms_errorf("writer: %s", first);
    }
    return 0;
}

int ms_writer_result(ms_writer *w, int64_t job_id, int64_t *bytes, uint32_t *crc) {
    if (!w) return ms_errorf("writer: no writer");
    pthread_mutex_lock(&w->mu);
    int ok = job_id >= 0 && job_id < w->next;
    job *j = ok ? w->jobs[job_id] : NULL;
    pthread_mutex_unlock(&w->mu);
    if (!j) return ms_errorf("writer: job %lld is not done (or does not exist)", (long long)job_id);
    if (j->state != 1) return ms_errorf("writer: %s", j->err);   /* (the failed file, named) */
    if (bytes) *bytes = j->total;
    if (crc) *crc = j->crc;
    return 0;
}
