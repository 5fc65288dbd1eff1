/* core/fsdp/flat.h — the flat-parameter layout of FSDP: where each parameter
 * of a unit lives in one flat buffer, and which part of it each rank keeps.
 *
 *   int64_t numels[3] = { 10, 3, 7 };
 *   ms_flat_layout *l = NULL;
 *   if (ms_flat_layout_new(&l, 3, numels, 4, 4, 16) != 0)    // f32, 4 ranks, 16-byte starts
 *       fprintf(stderr, "%s\n", ms_last_error());
 *   // offsets 0, 12, 16; used 23; total 24 (a multiple of 4); shard 6
 *   ms_flat_slice s;
 *   ms_flat_layout_slice(l, 1, 0, &s);     // rank 1's part of parameter 0:
 *   // s.param_start = 6, s.numel = 4, s.shard_offset = 0 (elements 6..9)
 *   ms_flat_layout_free(l);
 *
 * Layout, in elements of `elem_size` bytes. Parameter i starts at the first
 * multiple of align_bytes / elem_size at or after the end of parameter i-1
 * (parameter 0 at 0), so every parameter starts 16-byte aligned when the
 * buffer does; the gaps are padding. `used` is the end of the last
 * parameter; `total` is `used` rounded up to a multiple of the group size,
 * so every rank's shard has the same length, shard = total / group_size.
 * Rank r keeps the elements [r * shard, (r + 1) * shard) of the flat buffer.
 * A parameter may straddle shard boundaries; trailing ranks may hold only
 * padding. A parameter of 0 elements takes no room (its offset is aligned
 * all the same) and no rank holds any of it.
 *
 * ms_flat_layout_slice(l, rank, i, &s): the part of parameter i inside
 * rank's shard, as
 *   s.param_start   first element of it, counted in the parameter (0-based)
 *   s.numel         how many elements (0: none, then the other two are 0)
 *   s.shard_offset  where it starts in the rank's shard
 * so shard[s.shard_offset + k] == param[s.param_start + k] for k < s.numel.
 *
 * Errors are values: 0 on success, -1 with ms_last_error() naming the sizes
 * (a negative numel, a group size < 1, an alignment that is not a multiple
 * of the element size, a rank or parameter out of range, an int64 overflow).
 * Offsets and sizes are int64_t; parameters are counted with int.
 */
#ifndef MS_FSDP_FLAT_H
#define MS_FSDP_FLAT_H

#include <stdint.h>

/* FFI-BEGIN */
typedef struct ms_flat_layout ms_flat_layout;   /* opaque */

typedef struct ms_flat_slice {
    int64_t param_start;    /* first element of the slice, in the parameter */
    int64_t numel;          /* 0 when the rank holds none of the parameter */
    int64_t shard_offset;   /* where the slice starts in the rank's shard */
} ms_flat_slice;

int ms_flat_layout_new(ms_flat_layout **out, int nparams, const int64_t *numels,
                       int64_t elem_size, int group_size, int64_t align_bytes);
void ms_flat_layout_free(ms_flat_layout *l);                  /* NULL is fine */
int ms_flat_layout_nparams(const ms_flat_layout *l);
int ms_flat_layout_group_size(const ms_flat_layout *l);
int64_t ms_flat_layout_elem_size(const ms_flat_layout *l);
int64_t ms_flat_layout_align(const ms_flat_layout *l);        /* in elements */
int64_t ms_flat_layout_used(const ms_flat_layout *l);         /* end of the last parameter */
int64_t ms_flat_layout_total(const ms_flat_layout *l);        /* padded: group_size * shard */
int64_t ms_flat_layout_shard_numel(const ms_flat_layout *l);
/* parameter i's offset and numel in the flat buffer (-1 when i is out of range) */
int64_t ms_flat_layout_offset(const ms_flat_layout *l, int i);
int64_t ms_flat_layout_numel(const ms_flat_layout *l, int i);
int ms_flat_layout_slice(const ms_flat_layout *l, int rank, int i, ms_flat_slice *out);
/* FFI-END */

#endif
