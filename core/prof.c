/* core/prof.c — the op counter (core/prof.h): a small table of rows, kept
 * under a lock (the checkpoint writer's thread may copy while the main
 * thread computes), found by name and device with a linear search: it only
 * runs while counting, and a step has a few dozen op names. */
#include "internal.h"
#include "prof.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define PROF_ROWS 1024

typedef struct prof_row {
    char name[48];
    int device;
    int64_t calls, elems, bytes;
} prof_row;

volatile int ms_prof_on = 0;
static prof_row g_rows[PROF_ROWS];
static int g_nrows = 0;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

void ms_prof_enable(int on) { ms_prof_on = on != 0; }
int ms_prof_enabled(void) { return ms_prof_on; }

void ms_prof_reset(void) {
    pthread_mutex_lock(&g_mu);
    g_nrows = 0;
    pthread_mutex_unlock(&g_mu);
}

int ms_prof_count(void) {
    pthread_mutex_lock(&g_mu);
    int n = g_nrows;
    pthread_mutex_unlock(&g_mu);
    return n;
}

void ms_prof_note(const char *op, int device, int calls, int64_t elems, int64_t bytes) {
    if (!op) op = "?";
    pthread_mutex_lock(&g_mu);
    prof_row *r = NULL;
    for (int i = 0; i < g_nrows && !r; i++)
        if (g_rows[i].device == device && strncmp(g_rows[i].name, op, sizeof g_rows[i].name - 1) == 0) r = &g_rows[i];
    if (!r && g_nrows < PROF_ROWS) {
        r = &g_rows[g_nrows++];
        snprintf(r->name, sizeof r->name, "%s", g_nrows == PROF_ROWS ? "(other)" : op);
        r->device = device;
        r->calls = r->elems = r->bytes = 0;
    }
    if (!r) r = &g_rows[PROF_ROWS - 1];   /* the "(other)" row */
    r->calls += calls;
    r->elems += elems;
    r->bytes += bytes;
    pthread_mutex_unlock(&g_mu);
}

int ms_prof_entry(int i, char *name, int name_len, int *device, int64_t *calls, int64_t *elems, int64_t *bytes) {
    if (!name || name_len <= 0 || !device || !calls || !elems || !bytes)
        return ms_errorf("prof entry %d: NULL argument", i);
    pthread_mutex_lock(&g_mu);
    if (i < 0 || i >= g_nrows) {
        int n = g_nrows;
        pthread_mutex_unlock(&g_mu);
        return ms_errorf("prof entry: %d out of range (%d rows)", i, n);
    }
    snprintf(name, (size_t)name_len, "%s", g_rows[i].name);
    *device = g_rows[i].device;
    *calls = g_rows[i].calls;
    *elems = g_rows[i].elems;
    *bytes = g_rows[i].bytes;
    pthread_mutex_unlock(&g_mu);
    return 0;
}

void ms_prof_tensor(const char *op, const ms_tensor *t, int calls) {
    if (!t) {
        if (calls) ms_prof_note(op, MS_CPU, calls, 0, 0);
        return;
    }
    int64_t n = ms_tensor_numel(t);
    ms_prof_note(op, t->device_id, calls, n, n * ms_dtype_size(t->dtype_id));
}
