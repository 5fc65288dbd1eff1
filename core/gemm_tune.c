/* core/gemm_tune.c — GEMM tuning's choice and its records on disk.
 *
 * kernels/gemm.cu times cuBLASLt's candidates for each new GEMM plan and
 * keeps one (ms_gemm_tune_pick). With a tuning file (MS_GEMM_TUNE_FILE, or
 * ms_cuda_gemm_set_tune_file) each choice is appended as a line, and a later
 * process (or another rank) that reads the file takes the recorded choice
 * instead of timing again: the same algorithms, so the same bits, run after
 * run. A line:
 *
 *   ms-gemm-tune 1 <library version> <device> <22 plan key integers> <pick> <found>
 *
 * device: the GPU's name, spaces as '_'; pick: the index among the
 * heuristic's `found` candidates. Only the lines of this library version
 * and device apply (the heuristic's list is theirs). Kept in plain C so the
 * CPU specs cover the format. */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

int ms_gemm_tune_pick(const double *ms, int n, double margin) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (ms[i] >= 0 && (best < 0 || ms[i] < ms[best])) best = i;
    if (best <= 0) return 0;
    if (ms[0] < 0) return best;
    return ms[best] < ms[0] * (1.0 - margin) ? best : 0;
}

static const char kTag[] = "ms-gemm-tune";

static void device_word(char *out, size_t n, const char *device) {
    size_t i = 0;
    for (; device && device[i] && i + 1 < n; i++) out[i] = device[i] == ' ' || device[i] == '\t' ? '_' : device[i];
    out[i] = 0;
    if (i == 0 && n > 1) snprintf(out, n, "-");
}

int ms_gemm_tune_format(char *buf, size_t n, uint64_t version, const char *device, const int64_t *key, int pick,
                        int found) {
    char dev[128];
    device_word(dev, sizeof dev, device);
    int off = snprintf(buf, n, "%s 1 %llu %s", kTag, (unsigned long long)version, dev);
    for (int i = 0; i < MS_GEMM_TUNE_KEY && off > 0 && (size_t)off < n; i++)
        off += snprintf(buf + off, n - (size_t)off, " %lld", (long long)key[i]);
    if (off > 0 && (size_t)off < n) off += snprintf(buf + off, n - (size_t)off, " %d %d\n", pick, found);
    if (off < 0 || (size_t)off >= n) return ms_errorf("gemm tuning: a record needs more than %zu bytes", n);
    return 0;
}

int ms_gemm_tune_read(const char *path, uint64_t version, const char *device, ms_gemm_tune_rec **recs, int *count) {
    *recs = NULL;
    *count = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return 0;   // not written yet: no records
        return ms_errorf("gemm tuning file %s: cannot read it: %s", path, strerror(errno));
    }
    char dev[128];
    device_word(dev, sizeof dev, device);
    char line[1024];
    int lineno = 0, cap = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            rc = ms_errorf("gemm tuning file %s line %d: longer than %zu bytes", path, lineno, sizeof line - 2);
            break;
        }
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == '#' || *p == '\n' || *p == '\r' || *p == 0) continue;
        char tag[32], ldev[128];
        int fmt = 0, used = 0;
        unsigned long long ver = 0;
        if (sscanf(p, "%31s %d %llu %127s%n", tag, &fmt, &ver, ldev, &used) != 4 || strcmp(tag, kTag) != 0 || fmt != 1) {
            rc = ms_errorf("gemm tuning file %s line %d: not a record (expected \"%s 1 <version> <device> <%d key "
                           "integers> <pick> <found>\")",
                           path, lineno, kTag, MS_GEMM_TUNE_KEY);
            break;
        }
        ms_gemm_tune_rec r;
        char *q = p + used;
        int ok = 1;
        for (int i = 0; i < MS_GEMM_TUNE_KEY + 2 && ok; i++) {
            char *end = NULL;
            errno = 0;
            long long v = strtoll(q, &end, 10);
            if (end == q || errno) ok = 0;
            else if (i < MS_GEMM_TUNE_KEY) r.key[i] = v;
            else if (i == MS_GEMM_TUNE_KEY) r.pick = (int)v;
            else r.found = (int)v;
            q = end;
        }
        while (ok && (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n')) q++;
        if (!ok || *q != 0 || r.found < 1 || r.pick < 0 || r.pick >= r.found) {
            rc = ms_errorf("gemm tuning file %s line %d: a record needs %d key integers, then 0 <= pick < found",
                           path, lineno, MS_GEMM_TUNE_KEY);
            break;
        }
        if (ver != version || strcmp(ldev, dev) != 0) continue;   // another library or GPU's choice
        if (*count == cap) {
            int nc = cap ? 2 * cap : 64;
            ms_gemm_tune_rec *g = (ms_gemm_tune_rec *)realloc(*recs, (size_t)nc * sizeof *g);
            if (!g) {
                rc = ms_errorf("gemm tuning file %s: out of memory for %d records", path, nc);
                break;
            }
            *recs = g;
            cap = nc;
        }
        (*recs)[(*count)++] = r;
    }
    if (!rc && ferror(f)) rc = ms_errorf("gemm tuning file %s: read error: %s", path, strerror(errno));
    fclose(f);
    if (rc) {
        free(*recs);
        *recs = NULL;
        *count = 0;
    }
    return rc;
}

int ms_gemm_tune_append(const char *path, const char *line) {
    /* one write of a whole line in append mode: ranks appending to one file
     * do not interleave within a line */
    FILE *f = fopen(path, "a");
    if (!f) return ms_errorf("gemm tuning file %s: cannot append to it: %s", path, strerror(errno));
    size_t n = strlen(line);
    int rc = fwrite(line, 1, n, f) == n ? 0 : -1;
    if (fclose(f) != 0) rc = -1;
    if (rc) return ms_errorf("gemm tuning file %s: write failed: %s", path, strerror(errno));
    return 0;
}

void ms_gemm_tune_free(ms_gemm_tune_rec *recs) { free(recs); }
