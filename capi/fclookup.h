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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* Nanoseconds of CLOCK_MONOTONIC, for rate limits and back-offs. */
static inline int64_t fc_monotonic_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The kernel's fstat. The preload shim's fstat reports a cached copy's source instead (see
 * preload/copies.c), and the checks made here and in the shim need the copy itself. 64-bit
 * Linux, where the system call's struct stat is the C library's; elsewhere, the C library's
 * fstat (the shim then reports the copy, see copies.c). */
#if defined(SYS_fstat) && __SIZEOF_LONG__ == 8
#define FC_SYS_FSTAT 1
#endif
static inline int fc_sys_fstat(int fd, struct stat *st) {
#ifdef FC_SYS_FSTAT
	return (int)syscall(SYS_fstat, fd, st);
#else
	return fstat(fd, st);
#endif
}

/* The kernel's close and pread, called on purpose. This code is compiled into the preload
 * shim too (preload/Makefile builds capi/fclookup.c into it, and the shim includes
 * fcnode.h), where the names close and pread are the shim's own wrappers: a call by name
 * would go round through them (a circle: they look the descriptor up in the shim's tables
 * before they call the C library). The descriptors closed and read here are this code's own
 * (tier directories, index files, sockets, copies it opened with system calls), never one the
 * shim tracks, so nothing is lost by going to the kernel straight; in libfitcache.so the same
 * calls behave as the C library's. (pread64 is the system call's name on 64-bit Linux, where
 * the offset is one register; elsewhere, the C library's pread.) */
static inline int fc_sys_close(int fd) { return (int)syscall(SYS_close, fd); }
static inline ssize_t fc_sys_pread(int fd, void *buf, size_t n, off_t off) {
#if defined(SYS_pread64) && __SIZEOF_LONG__ == 8
	return (ssize_t)syscall(SYS_pread64, fd, buf, n, off);
#else
	return pread(fd, buf, n, off);
#endif
}

#ifdef __cplusplus
extern "C" {
#endif

/* The longest path handled; longer ones are misses. */
#define FC_PATH_MAX 4096

/* Mappings of its index a tier keeps in place (the first, then one per server restart and
 * one each time the index doubles: tiers/index.go): a replaced one stays mapped, since a
 * lookup in another thread may still read it, until fc_tier_close (the server gives back its
 * slots' pages once it replaced it). Past this many (an index grown from 1,024 buckets to
 * 262,144 in the life of one process, or many restarts), the record of each new mapping is
 * kept in a page of its own (mmap, no malloc), also freed by fc_tier_close. */
#define FC_TIER_MAPS 8

/* The tier directories a reader looks files up in, at most: those of every server on its node
 * (the FITCACHE paper runs up to 16 servers per node), each with up to four tiers (memory,
 * persistent memory, NVMe, disk). A reader with more reads the rest through its server. */
#define FC_MAX_TIERS 64

/* Lines of hit counters in a tier's index (tiers/index.go counterLines): each reader process
 * adds its counts to a line of its own while there are enough, so that a hit writes nothing
 * another process writes; the server sums them. */
#define FC_COUNTER_LINES 256

/* One mapping of a tier's index, with what a lookup needs read once when it was mapped: a
 * stray write to the index file cannot make a lookup read outside the mapping. */
struct fc_index {
	const uint8_t *base; /* the whole index, read-only; NULL for an unused entry */
	size_t len;
	uint32_t buckets;   /* from the header, checked against len */
	uint8_t *counters;  /* the counter lines (FC_COUNTER_LINES of 64 bytes), mapped writable */
	uint64_t *line;     /* this process's line among them, NULL until its first count (atomic;
	                       see claim_line in fclookup.c) */
	pid_t line_pid;     /* the process that claimed line, 0 for none (atomic): a forked child
	                       claims its own */
	uint64_t ino;       /* the index file's inode number: see index_state in fclookup.c */
	int64_t intact_ns;  /* CLOCK_MONOTONIC time it was last found intact (atomic) */
	struct fc_index *next; /* the previous record kept in a page of its own (see FC_TIER_MAPS) */
};

/* A tier directory open for lookups. Fill it with fc_tier_open; all fields are private. */
struct fc_tier {
	int dirfd;                     /* the tier directory, checked private at open */
	int kind;                      /* the caller's tag for the tier (its kind), for statistics */
	uid_t uid;                     /* the owner of the tier directory: this user when it was opened */
	dev_t dev;                     /* the device of the tier directory, and so of its files */
	uint32_t session;              /* the reader's validation session (see fc_tier_open) */
	struct fc_index *_Atomic index; /* the current mapping, in maps; NULL while there is none */
	int64_t retry_ns;              /* CLOCK_MONOTONIC time before which a missing index is not
	                                  sought again, and a replaced one is not used */
	uint64_t remapping;            /* the thread mapping the index: its process id and when it
	                                  began (see current_index in fclookup.c), or 0 (atomic) */
	struct fc_index maps[FC_TIER_MAPS];
	int nmaps;                     /* entries of maps taken (atomic) */
	struct fc_index *extra;        /* records past maps, each in a page of its own, newest first */
};

/* Opens the tier directory dir for lookups: it must be a directory (not a link) owned by this
 * user with no permission for others (the server makes it so). kind is stored as given.
 * session is the reader's validation session at the tier's server (core.Engine.BeginSession):
 * a copy the server has not found to match its source in that session or a later one is a
 * miss for fc_lookup with require_session, so that the server checks it first; 0 serves
 * every copy, UINT32_MAX none without asking. Returns 0, or a negated errno (-EPERM for a
 * directory that is not private). */
int fc_tier_open(struct fc_tier *t, const char *dir, int kind, uint32_t session);

/* Opens rel below dirfd read-only with the extra flags oflags in one openat2 system call,
 * following no link at any level. Returns the descriptor, or -1 with errno set: ENOSYS where
 * the kernel has no openat2 (or a seccomp filter refuses it), for a caller that then opens
 * one level at a time. */
int fc_openat2_beneath(int dirfd, const char *rel, int oflags);

/* Closes a tier opened by fc_tier_open. No lookup may run on it meanwhile. */
void fc_tier_close(struct fc_tier *t);

/* What fc_lookup found. */
struct fc_hit {
	int fd;           /* the cached file, open read-only with the flags asked for; the caller closes it */
	int tier;         /* index of the tier in the array passed to fc_lookup */
	int64_t size;     /* the file's size (the source's) */
	int64_t mtime_ns; /* the source's modification time, Unix nanoseconds */
	uint64_t ino;     /* the cached file's inode number (see fc_listed) */
	/* The cached file's device and change time as the kernel's fstat of fd gave them: with
	 * ino and size, the identity by which the preload shim knows the descriptor again. */
	uint64_t dev;
	struct timespec ctime;
	/* The identity of the source version the copy holds, as the index records it (0 where
	 * unknown: a replica's copy): what fstat of the descriptor reports under the preload
	 * shim (preload/copies.c). */
	uint64_t src_ino;
	int64_t src_ctime_ns;
};

/* Every touch of a tier's mapped index (fc_lookup, fc_listed, the counters) first checks with
 * one stat that the file is still as long as the mapping and under the index's name:
 * another process of the user can truncate it, and a page touched past the new end would
 * kill the program with SIGBUS (a signal code inside other programs cannot catch). An index
 * found truncated is let go and mapped anew, and meanwhile lookups miss; one replaced by a
 * server's new index (FitCache never shortens one) serves lookups while one thread of the
 * process maps the new one. A file found intact is trusted for FC_INTACT_TRUST_NS: a stat
 * costs about 1 us (against some 9 us for a whole hit of 64 KiB), and a reader that touches
 * the index every few microseconds pays one per FC_INTACT_TRUST_NS, not one per touch. So a
 * truncation within that time of a check still kills the reader, as does one of a replaced
 * index (under its temporary name) before the new one is mapped: microseconds, more on a
 * machine with more threads than cores, and the time of a check is stretched the same way
 * for a thread descheduled between its check and its touch. Windows kept short, against a
 * process of the same user, which could as well kill the reader with a signal. */
#define FC_INTACT_TRUST_NS 100000LL

/* Looks up the clean absolute source path (len bytes, as fc_clean_path makes it) in tiers[0..n),
 * fastest first. On a hit, returns 0 and fills *hit; on a miss, returns -ENOENT. Any other
 * problem (a tier without index, a file replaced behind the index's back) is a miss too,
 * and so, with require_session, is a copy not checked in the tier's session (see
 * fc_tier_open); without it (a file the server has just said it holds, having checked it)
 * any copy is served. The cached file is opened O_RDONLY | O_NOFOLLOW with the open flags
 * oflags added (O_CLOEXEC, O_NONBLOCK, O_NOATIME, O_DIRECT: a tier that refuses O_DIRECT is
 * opened without it). */
int fc_lookup(struct fc_tier *tiers, int n, const char *path, size_t len, int oflags, int require_session,
              struct fc_hit *hit);

/* Reports whether the index the tier's lookups use is its server's index now: one stat, made
 * whatever the trust window (FC_INTACT_TRUST_NS). A lookup may miss a copy published a moment
 * ago, since it trusts an index checked within the window and goes on with a replaced one while
 * another thread maps the new one (see current_index in fclookup.c); a lookup that misses
 * after this returned 1 has seen every copy the server listed before the call. */
int fc_index_current(struct fc_tier *t);

/* The version of a source file a cached copy holds, as its record gives it: what tells two
 * versions of the file apart (a rewrite in place that keeps the size and puts the
 * modification time back still moves the change time). ctime_ns 0 is unknown (a copy sent
 * by another server may lack it). */
struct fc_version {
	int64_t mtime_ns, ctime_ns;
	uint64_t ino; /* the source's inode number, 0 if unknown */
};

/* The version of the source that the copy fc_lookup found as hit holds, as the tier's index
 * records it (the slot's source inode and change time, beside the modification time): no
 * system call. Returns 0, or -1 when the index does not know it (a replica's copy): the
 * caller then takes the copy's version for unknown. */
int fc_copy_version(const struct fc_hit *hit, struct fc_version *v);

/* Finds out whether fd, a descriptor that the server answered an open of the clean source path
 * (len bytes) with, is the cached copy that the index of one of tiers[0..n) lists for it,
 * whatever its session: one fstat of fd (the kernel's) and index lookups. On success, returns
 * 0 and fills *hit as fc_lookup would (hit->fd is fd; the caller keeps it); otherwise (the
 * source, a memory file, a copy the index does not list yet) returns -ENOENT. */
int fc_lookup_fd(struct fc_tier *tiers, int n, const char *path, size_t len, int fd, struct fc_hit *hit);

/* Whether tier t's index still lists the copy with hashes (key, check) and data file inode
 * ino (as fc_lookup found it), whatever its session: a reader that keeps a cached copy open
 * or mapped lets go of one no longer listed (evicted, removed, found stale), whose pages the
 * reader would otherwise keep in use. An index lookup, after one stat of the index file (see
 * below). */
int fc_listed(struct fc_tier *t, uint64_t key, uint64_t check, uint64_t ino);

/* Whether the cached copy of the clean path (len bytes) in tier t is still the file with
 * data file inode ino that a reader mapped, at least size bytes long: one stat, unless
 * *intact_ns (the CLOCK_MONOTONIC time the caller's mapping was last found intact, updated
 * here atomically) is less than FC_INTACT_TRUST_NS old. A reader that keeps a copy mapped
 * checks it before each copy from the mapping: another process of the user can truncate a
 * cached file in place (FitCache never does), and a page touched past the new end would
 * kill the program with SIGBUS. As for the index, a truncation within FC_INTACT_TRUST_NS of
 * a check still does. An evicted copy (unlinked) is no longer intact either: the caller
 * looks it up anew. */
int fc_copy_intact(struct fc_tier *t, const char *path, size_t len, uint64_t ino, int64_t size, int64_t *intact_ns);

/* Adds a read of bytes served from tier t to the hit counters the tier's server reports: to
 * this process's line of them, which no other process writes while the index has a line per
 * reader process (see claim_line in fclookup.c). */
void fc_count_hit(struct fc_tier *t, int64_t bytes);

/* Adds a range of bytes read from the source of a large file (no block held it) to the
 * counters the tier's server reports. */
void fc_count_source(struct fc_tier *t, int64_t bytes);

/* Writes the lexically cleaned form of the absolute path in (as Go's filepath.Clean: no
 * repeated slashes, no "." or ".." elements, no trailing slash) into out, of cap bytes.
 * Returns its length, or -1 if in is not absolute or out is too small. */
int fc_clean_path(const char *in, char *out, size_t cap);

/* Writes the name of block number block (of bb bytes) of the file at the clean path held in
 * name's first n bytes, after it: tiers.BlockName's "path\0<bb>:<block>" (no terminator).
 * name has room for n + 42 bytes. Returns the name's length. */
size_t fc_block_name(char *name, size_t n, int64_t bb, int64_t block);

/* The two hashes of a clean source path: key names its cached copy (FNV-1a 64 of the path,
 * tiers.KeyOf), check guards against collisions (FNV-1a 64 of the path's bytes in reverse
 * order, tiers.CheckOf). */
void fc_hashes(const char *path, size_t len, uint64_t *key, uint64_t *check);

#ifdef __cplusplus
}
#endif

#endif /* FITCACHE_LOOKUP_H */
