/*
 * fclookup.h -- finding a file's cached copy in FitCache tiers, in C, without Go.
 *
 * The layout of a tier is deterministic (see tiers/doc.go and tiers/index.go): the cached copy
 * of the source path P is TIER/ab/cd/<key>-<base name of P>, listed in the tier's index file
 * TIER/fitcache.index, where key is the FNV-1a 64 hash of P. This code looks P up in the
 * mapped index and opens the data file below the tier directory, following no link, and
 * serves it only if it is a regular file of this user with the inode number and size the
 * index records. So a hit costs the system calls of a plain read (open, fstat) plus a lookup
 * in memory.
 *
 * It is shared by libfitcache (the hit path of fc_read, capi/hitpath.c) and the LD_PRELOAD
 * shim (preload/), so it obeys the rules of code that runs inside other programs: no
 * allocation, no locks, no threads, errno left as it was on every path, and no call of
 * libc's open functions (the shim interposes them: opens here are system calls); it is
 * safe in a process forked after the tiers were opened (descriptors and mappings are
 * inherited).
 */
#ifndef FITCACHE_LOOKUP_H
#define FITCACHE_LOOKUP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

/* Nanoseconds of CLOCK_MONOTONIC, for rate limits and back-offs. */
static inline int64_t fc_monotonic_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#ifdef __cplusplus
extern "C" {
#endif

/* The longest path handled; longer ones are misses. */
#define FC_PATH_MAX 4096

/* Replaced indexes a tier keeps track of (one per server restart): they stay mapped, since a
 * lookup in another thread may still read them, and the first ones are unmapped by
 * fc_tier_close; past this many, replaced indexes stay mapped until the process exits. */
#define FC_TIER_OLD_INDEXES 4

/* A tier directory open for lookups. Fill it with fc_tier_open; all fields are private. */
struct fc_tier {
	int dirfd;                 /* the tier directory, checked private at open */
	int kind;                  /* the caller's tag for the tier (its kind), for statistics */
	uid_t uid;                 /* the owner of the tier directory: this user when it was opened */
	const uint8_t *_Atomic index; /* the mapped index (read-only), NULL while there is none */
	uint64_t *_Atomic counters;   /* the index's hit counters (a writable mapping of its header) */
	int64_t retry_ns;          /* CLOCK_MONOTONIC time before which a missing index is not sought */
	const uint8_t *old[FC_TIER_OLD_INDEXES];
	size_t old_len[FC_TIER_OLD_INDEXES];
	uint64_t *old_counters[FC_TIER_OLD_INDEXES];
	int nold;
};

/* Opens the tier directory dir for lookups: it must be a directory (not a link) owned by this
 * user with no permission for others (the server makes it so). kind is stored as given.
 * Returns 0, or a negated errno (-EPERM for a directory that is not private). */
int fc_tier_open(struct fc_tier *t, const char *dir, int kind);

/* Closes a tier opened by fc_tier_open. No lookup may run on it meanwhile. */
void fc_tier_close(struct fc_tier *t);

/* What fc_lookup found. */
struct fc_hit {
	int fd;           /* the cached file, open read-only with the flags asked for; the caller closes it */
	int tier;         /* index of the tier in the array passed to fc_lookup */
	int64_t size;     /* the file's size (the source's) */
	int64_t mtime_ns; /* the source's modification time, Unix nanoseconds */
};

/* Looks up the clean absolute source path (len bytes, as fc_clean_path makes it) in tiers[0..n),
 * fastest first. On a hit, returns 0 and fills *hit; on a miss, returns -ENOENT. Any other
 * problem (a tier without index, a file replaced behind the index's back) is a miss too.
 * The cached file is opened O_RDONLY | O_NOFOLLOW with the open flags oflags added
 * (O_CLOEXEC, O_NONBLOCK, O_NOATIME, O_DIRECT: a tier that refuses O_DIRECT is opened
 * without it). */
int fc_lookup(struct fc_tier *tiers, int n, const char *path, size_t len, int oflags, struct fc_hit *hit);

/* Adds a read of bytes served from tier t to the hit counters the tier's server reports. */
void fc_count_hit(struct fc_tier *t, int64_t bytes);

/* Writes the lexically cleaned form of the absolute path in (as Go's filepath.Clean: no
 * repeated slashes, no "." or ".." elements, no trailing slash) into out, of cap bytes.
 * Returns its length, or -1 if in is not absolute or out is too small. */
int fc_clean_path(const char *in, char *out, size_t cap);

/* The two hashes of a clean source path that name its cached copy (FNV-1a 64 of the path)
 * and guard against collisions (FNV-1a 64 of the path's bytes in reverse order). */
uint64_t fc_key(const char *path, size_t len);
uint64_t fc_check(const char *path, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* FITCACHE_LOOKUP_H */
