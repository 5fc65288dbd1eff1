/* core/io/writer.h — files written by a background thread (asynchronous
 * checkpoints).
 *
 *   ms_writer *w = NULL;
 *   ms_writer_new(&w);
 *   const void *ptrs[2] = {a, b};
 *   int64_t bytes[2] = {na, nb};
 *   int64_t job = ms_writer_submit(w, "ckpt-10.tmp/model.safetensors", head, nhead, 2, ptrs, bytes);
 *   ...                                  // training goes on; a and b stay unchanged
 *   if (ms_writer_wait(w) != 0) fprintf(stderr, "%s\n", ms_last_error());
 *   int64_t n; uint32_t crc;
 *   ms_writer_result(w, job, &n, &crc);  // the file's size and CRC-32
 *   ms_writer_free(w);
 *
 * One thread per writer takes the files in the order they were queued. A
 * file is the copied head followed by the borrowed pieces, written back to
 * back (created or truncated), its CRC-32 (zlib's: the polynomial of
 * checkpoint manifests) computed from the same bytes as they go out, then
 * fsync'd and closed. The pieces must stay valid and unchanged until the
 * file is done (ms_writer_idle, ms_writer_wait). A failure (open, write,
 * fsync, close) is kept with the file's path and the system's reason and
 * returned by the next ms_writer_wait; the files queued after it are
 * still written. A piece can also be queued empty and provided later
 * (ms_writer_provide), and ms_writer_wait_written tells when the pieces
 * written so far may be freed: a file streamed through a few host copies
 * at a time. Errors are values (0 / -1 and ms_last_error()).
 */
#ifndef MS_WRITER_H
#define MS_WRITER_H

#include <stdint.h>

/* FFI-BEGIN */
typedef struct ms_writer ms_writer;   /* opaque */

int ms_writer_new(ms_writer **out);
/* waits for the queued files, then stops the thread; NULL is fine */
void ms_writer_free(ms_writer *w);
/* queues a file; returns its job number (>= 0), or -1. A piece with bytes
 * but a NULL pointer comes later (ms_writer_provide): the thread waits for
 * it when it gets there, so the caller can copy the next piece while the
 * thread writes the previous one. Every such piece must be provided, or the
 * job cancelled, before the caller waits for the writer. */
int64_t ms_writer_submit(ms_writer *w, const char *path, const void *head, int64_t head_bytes, int n,
                         const void *const *ptrs, const int64_t *bytes);
/* piece i (0-based) of job, queued without its pointer: its bytes are at ptr */
int ms_writer_provide(ms_writer *w, int64_t job, int i, const void *ptr);
/* waits until the job has written at least k pieces (or is done); returns
 * the pieces written, or -1 when the job failed (its pieces may be freed) */
int ms_writer_wait_written(ms_writer *w, int64_t job, int k);
/* fails a job whose pieces are not all provided (the caller could not make
 * one): the thread stops waiting for them; the next ms_writer_wait reports
 * it with `why` */
int ms_writer_cancel(ms_writer *w, int64_t job, const char *why);
/* 1: every queued file is done (written or failed) */
int ms_writer_idle(ms_writer *w);
/* waits for every queued file: 0, or -1 naming the first failure since the previous wait */
int ms_writer_wait(ms_writer *w);
/* a written file's bytes and CRC-32; -1 when the job failed (the error is
 * the file's failure), is not done or does not exist */
int ms_writer_result(ms_writer *w, int64_t job, int64_t *bytes, uint32_t *crc32);
/* FFI-END */

#endif
