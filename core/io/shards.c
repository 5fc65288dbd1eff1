/* core/io/shards.c — mmap'd llm.c token shards (see shards.h). */
#include "shards.h"
#include "../internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct ms_shard {
    char *path;
    void *map;            /* the whole file */
    size_t map_bytes;
    const void *tokens;   /* map + 1024 */
    int64_t ntokens;
    int32_t version;
    int32_t token_bytes;
    int64_t refcount;
};

static int64_t live_shards = 0;

int64_t ms_shard_live(void) { return live_shards; }

static int32_t le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

int ms_shard_open(ms_shard **out, const char *path) {
    *out = NULL;
    if (!path) return ms_errorf("shard: no path");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ms_errorf("shard: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return ms_errorf("shard: cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return ms_errorf("shard: %s is not a regular file", path);
    }
    const int64_t header_bytes = MS_SHARD_HEADER_INTS * 4;
    int64_t size = (int64_t)st.st_size;
    if (size < header_bytes) {
        close(fd);
        return ms_errorf("shard: %s has %lld bytes, too small for the %lld-byte header (256 x int32)",
                         path, (long long)size, (long long)header_bytes);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return ms_errorf("shard: cannot mmap %s: %s", path, strerror(e));
    const unsigned char *h = (const unsigned char *)map;
    int32_t magic = le32(h), version = le32(h + 4), n = le32(h + 8);
    int rc = 0;
    int token_bytes = version == 1 ? 2 : version == 2 ? 4 : 0;
    if (magic != MS_SHARD_MAGIC)
        rc = ms_errorf("shard: %s: bad magic number %d (expected %d: an llm.c token shard)", path, magic, MS_SHARD_MAGIC);
    else if (token_bytes == 0)
        rc = ms_errorf("shard: %s: bad version %d (expected 1 for uint16 tokens or 2 for uint32)", path, version);
    else if (n < 0)
        rc = ms_errorf("shard: %s: bad token count %d in the header", path, n);
    else if (header_bytes + (int64_t)n * token_bytes > size)
        rc = ms_errorf("shard: %s is truncated: the header claims %d tokens (%lld bytes) but the file has %lld bytes",
                       path, n, (long long)(header_bytes + (int64_t)n * token_bytes), (long long)size);
    if (rc != 0) {
        munmap(map, (size_t)size);
        return rc;
    }
    ms_shard *s = calloc(1, sizeof *s);
    char *p = s ? strdup(path) : NULL;
    if (!s || !p) {
        free(s);
        munmap(map, (size_t)size);
        return ms_errorf("shard: out of memory opening %s", path);
    }
    madvise(map, (size_t)size, MADV_RANDOM);
    s->path = p;
    s->map = map;
    s->map_bytes = (size_t)size;
    s->tokens = (const unsigned char *)map + header_bytes;
    s->ntokens = n;
    s->version = version;
    s->token_bytes = token_bytes;
    s->refcount = 1;
    live_shards++;
    *out = s;
    return 0;
}

void ms_shard_retain(ms_shard *s) {
    if (s) s->refcount++;
}

void ms_shard_free(ms_shard *s) {
    if (!s || --s->refcount > 0) return;
    munmap(s->map, s->map_bytes);
    free(s->path);
    free(s);
    live_shards--;
}

int64_t ms_shard_ntokens(const ms_shard *s) { return s->ntokens; }
int ms_shard_version(const ms_shard *s) { return s->version; }
int ms_shard_token_bytes(const ms_shard *s) { return s->token_bytes; }
const void *ms_shard_tokens(const ms_shard *s) { return s->tokens; }
const char *ms_shard_path(const ms_shard *s) { return s->path; }

int ms_shard_read_i64(const ms_shard *s, int64_t start, int64_t n, int64_t *dst) {
    if (!s) return ms_errorf("shard: read from a closed shard");
    if (start < 0 || n < 0 || start + n > s->ntokens)
        return ms_errorf("shard: %s: tokens [%lld, %lld) are outside [0, %lld)", s->path,
                         (long long)start, (long long)(start + n), (long long)s->ntokens);
    /* tokens are little-endian on disk; so is every host moonshard runs on (x86-64, aarch64) */
    if (s->version == 1) {
        const uint16_t *src = (const uint16_t *)s->tokens + start;
        for (int64_t i = 0; i < n; i++) dst[i] = src[i];
    } else {
        const uint32_t *src = (const uint32_t *)s->tokens + start;
        for (int64_t i = 0; i < n; i++) dst[i] = src[i];
    }
    return 0;
}
