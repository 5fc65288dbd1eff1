/* core/io/shards.h — token shards in llm.c's format, memory-mapped.
 *
 * A shard is a header of 256 little-endian int32 then the tokens:
 *   header[0] = 20240520 (MS_SHARD_MAGIC)
 *   header[1] = 1: uint16 tokens, 2: uint32 tokens (vocabularies over 65,535)
 *   header[2] = number of tokens
 * so a shard of n tokens is 1024 + n * (2 or 4) bytes (bytes past the
 * tokens are allowed and ignored, as llm.c does).
 *
 *   ms_shard *s = NULL;
 *   if (ms_shard_open(&s, "data/train_000000.bin") != 0)
 *       fprintf(stderr, "%s\n", ms_last_error());   // names the file and the numbers
 *   int64_t x[1025];
 *   ms_shard_read_i64(s, 0, 1025, x);               // tokens [0, 1025) widened to int64
 *   ms_shard_free(s);                               // drops one reference
 *
 * The file is mapped read-only (MAP_PRIVATE) and validated at open: too
 * small for a header, a bad magic number, a bad version or fewer bytes than
 * the header claims is an error, never a crash. A shard is refcounted:
 * ms_shard_retain adds a reference, ms_shard_free drops one and unmaps the
 * file with the last. Errors are values (0 / -1 and ms_last_error()).
 */
#ifndef MS_SHARDS_H
#define MS_SHARDS_H

#include <stdint.h>

#define MS_SHARD_MAGIC 20240520
#define MS_SHARD_HEADER_INTS 256

/* FFI-BEGIN */
typedef struct ms_shard ms_shard;   /* opaque */

int ms_shard_open(ms_shard **out, const char *path);
void ms_shard_retain(ms_shard *s);
void ms_shard_free(ms_shard *s);                  /* NULL is fine */
int64_t ms_shard_ntokens(const ms_shard *s);
int ms_shard_version(const ms_shard *s);          /* 1: uint16, 2: uint32 */
int ms_shard_token_bytes(const ms_shard *s);      /* 2 or 4 */
const void *ms_shard_tokens(const ms_shard *s);   /* the mapped tokens */
const char *ms_shard_path(const ms_shard *s);
/* dst[i] = token[start + i] for i in [0, n); an error past the end */
int ms_shard_read_i64(const ms_shard *s, int64_t start, int64_t n, int64_t *dst);
int64_t ms_shard_live(void);                      /* shards open now (all refs) */
/* FFI-END */

#endif
