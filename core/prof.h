/* core/prof.h — the op counter (the Lua face: moonshard.profile,
 * docs/tensors.md "Counting the ops").
 *
 * While on, every op of the core that writes a tensor counts itself: one
 * row per (op name, device) with the calls and the elements and bytes it
 * wrote. A call counts once however many outputs it writes (attention: out
 * and lse), and every output's elements and bytes count. The hooks sit in
 * ms_prepare_out (every op that makes or checks an output) and in the few
 * ops that write in place without one (copies, fills, the index adds);
 * views write nothing and are not counted. Off, a hook costs one test of an
 * int.
 *
 *   ms_prof_enable(1);  ...ops...
 *   for (int i = 0; i < ms_prof_count(); i++) ms_prof_entry(i, name, 64, &dev, &calls, &elems, &bytes);
 *   ms_prof_reset();
 *
 * Rows are kept in first-seen order; at most 1024 of them (later names are
 * folded into one row "(other)").
 */
#ifndef MS_PROF_H
#define MS_PROF_H

#include <stdint.h>

/* FFI-BEGIN */
void ms_prof_enable(int on);
int ms_prof_enabled(void);
void ms_prof_reset(void);
int ms_prof_count(void);
/* row i (0-based): its name (copied into name, at most name_len bytes with
 * the NUL), device (-1 the CPU), calls, elements and bytes written */
int ms_prof_entry(int i, char *name, int name_len, int *device, int64_t *calls, int64_t *elems, int64_t *bytes);
/* FFI-END */

/* for the core's .c files: the hook (calls 0 for a call's further outputs) */
extern volatile int ms_prof_on;
void ms_prof_note(const char *op, int device, int calls, int64_t elems, int64_t bytes);
struct ms_tensor;
/* t's elements and bytes (nothing for a NULL t) */
void ms_prof_tensor(const char *op, const struct ms_tensor *t, int calls);
#define MS_PROF_NOTE(op, t) \
    do { if (ms_prof_on) ms_prof_tensor((op), (t), 1); } while (0)

#endif
