/* core/fsdp/flat.c — the flat-parameter layout (flat.h tells the rules). */
#include "flat.h"
#include "../internal.h"
#include <stdlib.h>

struct ms_flat_layout {
    int nparams;
    int group_size;
    int64_t elem_size;
    int64_t align;          /* elements */
    int64_t used, total, shard;
    int64_t *offsets;       /* nparams */
    int64_t *numels;        /* nparams */
};

int ms_flat_layout_new(ms_flat_layout **out, int nparams, const int64_t *numels,
                       int64_t elem_size, int group_size, int64_t align_bytes) {
    if (!out) return ms_errorf("flat layout: out is NULL");
    *out = NULL;
    if (nparams < 0) return ms_errorf("flat layout: %d parameters (must be >= 0)", nparams);
    if (nparams > 0 && !numels) return ms_errorf("flat layout: %d parameters but numels is NULL", nparams);
    if (elem_size < 1) return ms_errorf("flat layout: element size %lld bytes (must be >= 1)", (long long)elem_size);
    if (group_size < 1) return ms_errorf("flat layout: group size %d (must be >= 1)", group_size);
    if (align_bytes < 1 || align_bytes % elem_size != 0)
        return ms_errorf("flat layout: alignment %lld bytes is not a positive multiple of the element size %lld bytes",
                         (long long)align_bytes, (long long)elem_size);
    int64_t align = align_bytes / elem_size;
    const int64_t limit = INT64_MAX / 2 / elem_size;   /* byte sizes stay representable */
    int64_t end = 0;
    for (int i = 0; i < nparams; i++) {
        if (numels[i] < 0)
            return ms_errorf("flat layout: parameter %d has numel %lld (must be >= 0)", i, (long long)numels[i]);
        int64_t off = (end + align - 1) / align * align;
        if (numels[i] > limit - off)
            return ms_errorf("flat layout: parameter %d (numel %lld at offset %lld) overflows the flat buffer (limit %lld elements of %lld bytes)",
                             i, (long long)numels[i], (long long)off, (long long)limit, (long long)elem_size);
        end = off + numels[i];
    }
    ms_flat_layout *l = calloc(1, sizeof *l);
    if (!l) return ms_errorf("flat layout: out of host memory");
    size_t n = nparams > 0 ? (size_t)nparams : 1;
    l->offsets = malloc(n * sizeof(int64_t));
    l->numels = malloc(n * sizeof(int64_t));
    if (!l->offsets || !l->numels) { ms_flat_layout_free(l); return ms_errorf("flat layout: out of host memory"); }
    l->nparams = nparams; l->group_size = group_size; l->elem_size = elem_size; l->align = align;
    end = 0;
    for (int i = 0; i < nparams; i++) {
        int64_t off = (end + align - 1) / align * align;
        l->offsets[i] = off; l->numels[i] = numels[i];
        end = off + numels[i];
    }
    l->used = end;
    l->shard = (end + group_size - 1) / group_size;
    l->total = l->shard * group_size;
    *out = l;
    return 0;
}

void ms_flat_layout_free(ms_flat_layout *l) {
    if (!l) return;
    free(l->offsets); free(l->numels); free(l);
}

int ms_flat_layout_nparams(const ms_flat_layout *l) { return l->nparams; }
int ms_flat_layout_group_size(const ms_flat_layout *l) { return l->group_size; }
int64_t ms_flat_layout_elem_size(const ms_flat_layout *l) { return l->elem_size; }
int64_t ms_flat_layout_align(const ms_flat_layout *l) { return l->align; }
int64_t ms_flat_layout_used(const ms_flat_layout *l) { return l->used; }
int64_t ms_flat_layout_total(const ms_flat_layout *l) { return l->total; }
int64_t ms_flat_layout_shard_numel(const ms_flat_layout *l) { return l->shard; }

int64_t ms_flat_layout_offset(const ms_flat_layout *l, int i) {
    return (i < 0 || i >= l->nparams) ? -1 : l->offsets[i];
}
int64_t ms_flat_layout_numel(const ms_flat_layout *l, int i) {
    return (i < 0 || i >= l->nparams) ? -1 : l->numels[i];
}

int ms_flat_layout_slice(const ms_flat_layout *l, int rank, int i, ms_flat_slice *out) {
    if (!l || !out) return ms_errorf("flat layout slice: NULL layout or out");
    out->param_start = out->numel = out->shard_offset = 0;
    if (rank < 0 || rank >= l->group_size)
        return ms_errorf("flat layout slice: rank %d out of range for a group of %d", rank, l->group_size);
    if (i < 0 || i >= l->nparams)
        return ms_errorf("flat layout slice: parameter %d out of range (%d parameters)", i, l->nparams);
    int64_t lo = (int64_t)rank * l->shard, hi = lo + l->shard;
    int64_t plo = l->offsets[i], phi = plo + l->numels[i];
    int64_t a = plo > lo ? plo : lo, b = phi < hi ? phi : hi;
    if (a >= b) return 0;
    out->param_start = a - plo;
    out->numel = b - a;
    out->shard_offset = a - lo;
    return 0;
}
