/*
 * copies.c -- the preload shim's descriptors of cached copies, as a program sees them: their
 * identity (the stat family) and the calls that copy from them (copy_file_range).
 *
 * A read-only open of a dataset file returns a descriptor of its cached copy (shim_open). Its
 * bytes, size, modification time and permission bits are the source's by construction, but
 * the kernel's fstat names the copy: another device and inode. Programs that compare the
 * descriptor with the path they opened then refuse the file: coreutils' cp and install check
 * that fstat of the descriptor and stat of the path name the same inode ("skipping file ...,
 * as it was replaced while being copied"). So fstat, fstat64, fstatat/fstatat64 and statx of
 * the descriptor itself (AT_EMPTY_PATH with an empty path), and the __fxstat* forms of older
 * binaries, report the source's device and inode numbers and change time, as the copy's
 * record and the tier's index hold them (the source version the copy holds, checked when it was cached, not the
 * source now: a source replaced since differs, as the program should be told). So do stat,
 * stat64, fstatat, statx and __xstat* of a path that leads to the copy through the kernel's
 * links to a process's descriptors (/dev/stdin, /dev/fd/N, /proc/self/fd/N: `cp /dev/stdin`),
 * the paths of a program's that name a copy. Everything else is the copy's: size,
 * modification time and permission bits (equal to the source's), owner (this user), link
 * count, access time, blocks and block size.
 *
 * Which descriptors, and what each costs. A descriptor the shim opens as the cached copy of a
 * dataset file, a hit it found in a tier's index (shim_open, fc_lookup) or the copy the server
 * answered a miss with (fc_lookup_fd: one fstat at that open, beside a round trip), is noted
 * at the open in a table by descriptor number (known, below KNOWN_FDS; a descriptor past it
 * is found out at each stat call, as below): the copy's identity as
 * the kernel reports it (device, inode, size, change time, owner) and the source's (its inode
 * and change time, which the tier's index repeats from the copy's record, and the device of
 * its dataset root, stat'ed once per process). fstat of it then costs the kernel's fstat and
 * a comparison: no system call more, which matters because Python's open() fstats every file
 * it opens. Any other descriptor is found out at its first stat call: a regular file on the
 * device of a tier is a cached copy when /proc/self/fd names it below that tier's directory
 * and the record beside it (tiers/record.go) describes that very data file (its inode and
 * size): one readlink, and an open, read and close of the record, once per descriptor (the
 * answer is noted in the same table); other descriptors cost a comparison of device numbers,
 * and files of this user on a tier's device outside the tier one readlink (once). That covers
 * dup, dup2, dup3, F_DUPFD, descriptors inherited across exec or passed over a socket, and
 * copies the index does not list yet, with no wrapper of theirs (a forked child keeps the
 * table, as it keeps the descriptors). An entry serves only a
 * descriptor with the identity it was noted for, so a number reused by another file (closed
 * and opened again, dup2'd over, from another thread) never reports a copy's source (see
 * known). The source's device is that of its dataset root (one stat of the root per process,
 * on first need): a file on another file system mounted beneath the root is given the root's
 * device, not its own. A copy without a record of its source's inode (one sent by another
 * node's server, a memory file) keeps its own identity.
 *
 * copy_file_range from a copy to a file on another file system fails with EXDEV where the
 * source (on the destination's file system) would have been copied: the wrapper then copies
 * through a buffer, with the offsets and the return value copy_file_range has. cp --reflink
 * (the FICLONE ioctl) is not wrapped: a clone is not a copy, and a tier's file system can
 * share no extents with the source's. sendfile and
 * splice read any regular file, copies included: they need no wrapper.
 *
 * Like the rest of the shim: no allocation, no lock, errno as the program expects it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "shim.h"

#define EXPORT __attribute__((visibility("default")))

static int (*libc_fstat)(int, struct stat *);
static int (*libc_fstat64)(int, struct stat64 *);
static int (*libc_stat)(const char *, struct stat *);
static int (*libc_stat64)(const char *, struct stat64 *);
static int (*libc___xstat)(int, const char *, struct stat *);
static int (*libc___xstat64)(int, const char *, struct stat64 *);
static int (*libc_fstatat)(int, const char *, struct stat *, int);
static int (*libc_fstatat64)(int, const char *, struct stat64 *, int);
static int (*libc_statx)(int, const char *, int, unsigned int, struct statx *);
static int (*libc___fxstat)(int, int, struct stat *);
static int (*libc___fxstat64)(int, int, struct stat64 *);
static int (*libc___fxstatat)(int, int, const char *, struct stat *, int);
static int (*libc___fxstatat64)(int, int, const char *, struct stat64 *, int);
static ssize_t (*libc_copy_file_range)(int, off64_t *, int, off64_t *, size_t, unsigned int);

// The tiers' directories as /proc/self/fd names files below them, and their devices; set at
// load (copies_tier), read only afterwards.
static char tier_names[16384];
static size_t tier_used;
static const char *tier_path[FC_MAX_TIERS];
static size_t tier_len[FC_MAX_TIERS];
static dev_t tier_dev[FC_MAX_TIERS];

void copies_init(void) {
	NEXT(fstat);
	NEXT(fstat64);
	NEXT(stat);
	NEXT(stat64);
	NEXT(__xstat);
	NEXT(__xstat64);
	NEXT(fstatat);
	NEXT(fstatat64);
	NEXT(statx);
	NEXT(__fxstat);
	NEXT(__fxstat64);
	NEXT(__fxstatat);
	NEXT(__fxstatat64);
	NEXT(copy_file_range);
}

void copies_tier(int i) {
	if (i < 0 || i >= FC_MAX_TIERS)
		return;
	char link[32], *out = tier_names + tier_used;
	snprintf(link, sizeof link, "/proc/self/fd/%d", shim_tiers[i].dirfd);
	long n = syscall(SYS_readlinkat, AT_FDCWD, link, out, sizeof tier_names - tier_used - 1);
	struct stat st;
	if (n <= 1 || out[0] != '/' || (size_t)n >= sizeof tier_names - tier_used - 1 ||
	    fc_sys_fstat(shim_tiers[i].dirfd, &st) != 0)
		return;
	out[n] = 0;
	tier_path[i] = out;
	tier_len[i] = (size_t)n;
	tier_dev[i] = st.st_dev;
	tier_used += (size_t)n + 1;
}

// The record of a cached file (tiers/record.go), beside it: magic, version, the source
// path's length and the path, the group's length and the group, then the data's size, the
// source's modification and change times, the source's inode, the data file's inode...
#define RECORD_PREFIX ".rec-"
#define RECORD_MAGIC "FCRECORD"
#define RECORD_VERSION 4

// What a copy's record says of its source.
struct source_id {
	dev_t dev;
	uint64_t ino;
	int64_t ctime_ns; // 0: unknown
};

static uint32_t le32(const uint8_t *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) {
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

// source_dev gives the device of dataset root r, stat'ed once per process (0 when it cannot
// be). A race between threads stats it twice, harmlessly. The roots are the shim's own
// writable storage (fitcache_preload.c), dev_plus1 the one field written after load.
static dev_t source_dev(const struct root *r) {
	uint64_t *slot = (uint64_t *)&r->dev_plus1, d = __atomic_load_n(slot, __ATOMIC_RELAXED);
	if (d == 0) {
		struct stat st;
		if (CALL_NEXT(stat, r->real, &st) != 0)
			return 0;
		d = (uint64_t)st.st_dev + 1;
		__atomic_store_n(slot, d, __ATOMIC_RELAXED);
	}
	return (dev_t)(d - 1);
}

// What the kernel says of a descriptor: a cached copy is recognised by it.
struct kernel_id {
	dev_t dev;
	uint64_t ino;
	int64_t size;
	struct timespec ctime; // tv_nsec -1: not known (statx not asked for it)
	uid_t uid;             // (uid_t)-1: not known
};

// look_up finds out whether fd, a regular file on a tier's device whose kernel identity is
// k, is a cached copy, and if so what its record says of its source: 1 and *id, or 0.
static int look_up(int fd, const struct kernel_id *k, struct source_id *id) {
	dev_t dev = k->dev;
	uint64_t ino = k->ino;
	int64_t size = k->size;
	int t;
	char link[32], path[FC_PATH_MAX];
	snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
	long n = syscall(SYS_readlinkat, AT_FDCWD, link, path, sizeof path - 1);
	if (n <= 0)
		return 0;
	path[n] = 0;
	// The tier below which /proc names it (tiers may share a device).
	for (t = 0; t < shim_ntiers; t++)
		if (tier_path[t] && tier_dev[t] == dev && (size_t)n > tier_len[t] + 1 &&
		    memcmp(path, tier_path[t], tier_len[t]) == 0 && path[tier_len[t]] == '/')
			break;
	if (t == shim_ntiers)
		return 0;
	// The record: RECORD_PREFIX + the data file's name, in the data file's directory.
	const char *rel = path + tier_len[t] + 1, *base = strrchr(rel, '/');
	base = base ? base + 1 : rel;
	char rec[FC_PATH_MAX];
	size_t dirlen = (size_t)(base - rel), baselen = strlen(base);
	if (dirlen + sizeof RECORD_PREFIX + baselen > sizeof rec)
		return 0;
	memcpy(rec, rel, dirlen);
	memcpy(rec + dirlen, RECORD_PREFIX, sizeof RECORD_PREFIX - 1);
	memcpy(rec + dirlen + sizeof RECORD_PREFIX - 1, base, baselen + 1);
	int rfd = (int)syscall(SYS_openat, shim_tiers[t].dirfd, rec, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (rfd < 0)
		return 0;
	// One read: a record longer than the buffer (a source path and root of 4 KiB together)
	// leaves the copy its own identity. The record's name is not needed any more: its buffer
	// takes the record.
	uint8_t *b = (uint8_t *)rec;
	ssize_t got = pread(rfd, b, sizeof rec, 0);
	syscall(SYS_close, rfd);
	uint32_t plen = 0, glen = 0;
	int ok = got >= 20 && memcmp(b, RECORD_MAGIC, 8) == 0 && le32(b + 8) == RECORD_VERSION &&
	         (plen = le32(b + 12)) < (uint32_t)got - 20 && (glen = le32(b + 16 + plen)) < (uint32_t)got &&
	         20 + (size_t)plen + glen + 40 <= (size_t)got;
	if (!ok)
		return 0;
	// After the path and group: size, mtime, ctime, the source's inode, the data file's inode.
	const uint8_t *tail = b + 20 + plen + glen;
	if ((int64_t)le64(tail) != size || le64(tail + 32) != ino || le64(tail + 24) == 0)
		return 0;
	const char *src = (const char *)b + 16;
	struct root *r = shim_root_of(src, plen);
	dev_t sdev = r ? source_dev(r) : 0;
	if (sdev == 0)
		return 0;
	id->dev = sdev;
	id->ino = le64(tail + 24);
	id->ctime_ns = (int64_t)le64(tail + 16);
	return 1;
}

// What a descriptor (below KNOWN_FDS) is, kept by its number: noted when the shim opens a
// cached copy (copies_opened, from the tier's index: no system call), or the first time a
// stat call looks up a descriptor the shim did not open (a dup, a copy the index did not
// list yet: the answer of look_up). So fstat of a descriptor opened as a hit costs the
// kernel's fstat alone (Python's open() fstats every file it opens, and its read of a whole
// file once more), and a program that looks up another one more than once pays its readlink
// and record read once. An entry serves only a descriptor whose kernel identity (device,
// inode, size, change time, owner) is the one it was noted for: a number reused by another
// file (closed, then opened, dup2'd over or received by any means), or a copy changed since
// (evicted: its link count, so its change time, changed), is looked up anew; a file cannot
// take on all five of a copy's while the copy is open, and ours is open while its entry
// matters. No wrapper of close, dup2 or fork is needed. Each entry is written under its
// sequence count (odd while written, taken by compare-and-swap: a second writer does
// without, which leaves the entry to a later lookup); a reader that finds it changing or
// changed across its reads (a torn entry) looks up for itself, and one that read a whole
// entry still serves it only to the identity it describes.
#define KNOWN_FDS 4096

struct known {
	uint32_t seq; // atomic
	struct kernel_id k;
	int found;
	struct source_id id;
};

static struct known known[KNOWN_FDS];

static int recall(int fd, const struct kernel_id *k, struct source_id *id) {
	struct known *e = &known[fd];
	uint32_t seq = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
	if (seq == 0 || (seq & 1))
		return -1;
	int same = e->k.dev == k->dev && e->k.ino == k->ino && e->k.size == k->size &&
	           e->k.ctime.tv_sec == k->ctime.tv_sec && e->k.ctime.tv_nsec == k->ctime.tv_nsec && e->k.uid == k->uid;
	int found = e->found;
	*id = e->id;
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	if (__atomic_load_n(&e->seq, __ATOMIC_RELAXED) != seq || !same)
		return -1;
	return found;
}

static void note(int fd, const struct kernel_id *k, int found, const struct source_id *id) {
	struct known *e = &known[fd];
	uint32_t seq = __atomic_load_n(&e->seq, __ATOMIC_RELAXED);
	if ((seq & 1) || !__atomic_compare_exchange_n(&e->seq, &seq, seq + 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
		return;
	__atomic_thread_fence(__ATOMIC_RELEASE);
	e->k = *k;
	e->found = found;
	e->id = *id;
	__atomic_store_n(&e->seq, seq + 2, __ATOMIC_RELEASE);
}

void copies_opened(int fd, const struct root *r, const struct fc_hit *hit) {
#ifndef FC_SYS_FSTAT
	return; // the kernel's fstat is libc's, and so this shim's: copies keep their identity
#endif
	if (fd < 0 || fd >= KNOWN_FDS || hit->tier < 0 || hit->tier >= shim_ntiers)
		return;
	struct kernel_id k = {(dev_t)hit->dev, hit->ino, hit->size, hit->ctime, shim_tiers[hit->tier].uid};
	struct source_id id = {0};
	// The source's device is its root's (see look_up); without the source's inode (a replica's
	// copy) or a root to stat, the copy keeps its own identity, as look_up would find.
	dev_t sdev = hit->src_ino ? source_dev(r) : 0;
	if (sdev)
		id = (struct source_id){sdev, hit->src_ino, hit->src_ctime_ns};
	note(fd, &k, sdev != 0, &id);
}

// copy_source finds out whether fd, whose kernel identity is k, is a cached copy, and if so
// what its record says of its source: 1 and *id, or 0. errno is unchanged.
static int copy_source(int fd, const struct kernel_id *k, struct source_id *id) {
#ifndef FC_SYS_FSTAT
	return 0; // the shim's own checks would see the source too (see fc_sys_fstat)
#endif
	// A tier serves only files of its owner (see fc_lookup): the files of other users on its
	// device (the system's, on a disk tier's root file system) need no readlink.
	int t = 0;
	while (t < shim_ntiers &&
	       !(tier_path[t] && tier_dev[t] == k->dev && (k->uid == (uid_t)-1 || k->uid == shim_tiers[t].uid)))
		t++;
	if (t == shim_ntiers || fd < 0)
		return 0;
	int keep = fd < KNOWN_FDS && k->ctime.tv_nsec >= 0, found = keep ? recall(fd, k, id) : -1;
	if (found >= 0)
		return found;
	int saved = errno;
	*id = (struct source_id){0};
	found = look_up(fd, k, id);
	if (keep)
		note(fd, k, found, id);
	errno = saved;
	return found;
}

// is_copy reports whether fd is a descriptor of a cached copy.
static int is_copy(int fd) {
	struct stat st;
	struct source_id id;
	return fc_sys_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
	       copy_source(fd, &(struct kernel_id){st.st_dev, st.st_ino, st.st_size, st.st_ctim, st.st_uid}, &id);
}

// IDENTIFY(st) gives the struct stat (or stat64) st of descriptor fd, filled by the kernel,
// its source's identity when fd is a cached copy.
#define IDENTIFY(fd, st)                                                                                               \
	do {                                                                                                           \
		struct source_id id_;                                                                                  \
		if (S_ISREG((st)->st_mode) &&                                                                          \
		    copy_source(fd, &(struct kernel_id){(st)->st_dev, (st)->st_ino, (st)->st_size, (st)->st_ctim,      \
		                                        (st)->st_uid},                                                 \
		                &id_)) {                                                                               \
			(st)->st_dev = id_.dev;                                                                        \
			(st)->st_ino = id_.ino;                                                                        \
			if (id_.ctime_ns) {                                                                            \
				(st)->st_ctim.tv_sec = id_.ctime_ns / 1000000000;                                      \
				(st)->st_ctim.tv_nsec = id_.ctime_ns % 1000000000;                                     \
			}                                                                                              \
		}                                                                                                      \
	} while (0)

// fd_named returns the descriptor a path names through the kernel's links to a process's
// own descriptors (/dev/stdin, /dev/fd/N, /proc/self/fd/N...), or -1. Such a path to a
// cached copy leads to the copy itself: stat of it must tell the same as fstat of the
// descriptor (cp /dev/stdin compares the two).
static int fd_named(const char *path) {
	static const char *const dirs[] = {"/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/"};
	if (!path || path[0] != '/')
		return -1;
	if (strcmp(path, "/dev/stdin") == 0)
		return 0;
	if (strcmp(path, "/dev/stdout") == 0)
		return 1;
	if (strcmp(path, "/dev/stderr") == 0)
		return 2;
	for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
		size_t n = strlen(dirs[i]);
		if (strncmp(path, dirs[i], n) != 0)
			continue;
		long fd = 0;
		const char *p = path + n;
		for (; *p >= '0' && *p <= '9' && fd < (1L << 30); p++)
			fd = fd * 10 + (*p - '0');
		return p > path + n && !*p && fd < (1L << 30) ? (int)fd : -1;
	}
	return -1;
}

// described returns the descriptor an fstatat or statx call with dirfd, path and flags
// describes: dirfd itself (AT_EMPTY_PATH with an empty path), one named by a path through
// the kernel's links to descriptors (followed), or -1 for any other file.
static int described(int dirfd, const char *path, int flags) {
	if ((flags & AT_EMPTY_PATH) && (!path || !*path))
		return dirfd >= 0 ? dirfd : -1;
	return flags & AT_SYMLINK_NOFOLLOW ? -1 : fd_named(path);
}

EXPORT int fstat(int fd, struct stat *st) {
	int rc = CALL_NEXT(fstat, fd, st);
	if (rc == 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int fstat64(int fd, struct stat64 *st) {
	int rc = CALL_NEXT(fstat64, fd, st);
	if (rc == 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int fstatat(int dirfd, const char *path, struct stat *st, int flags) {
	int rc = CALL_NEXT(fstatat, dirfd, path, st, flags), fd = described(dirfd, path, flags);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) {
	int rc = CALL_NEXT(fstatat64, dirfd, path, st, flags), fd = described(dirfd, path, flags);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int stat(const char *path, struct stat *st) {
	int rc = CALL_NEXT(stat, path, st), fd = fd_named(path);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int stat64(const char *path, struct stat64 *st) {
	int rc = CALL_NEXT(stat64, path, st), fd = fd_named(path);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

// The forms binaries built against glibc before 2.33 call.
EXPORT int __xstat(int ver, const char *path, struct stat *st) {
	int rc = CALL_NEXT(__xstat, ver, path, st), fd = fd_named(path);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int __xstat64(int ver, const char *path, struct stat64 *st) {
	int rc = CALL_NEXT(__xstat64, ver, path, st), fd = fd_named(path);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int __fxstat(int ver, int fd, struct stat *st) {
	int rc = CALL_NEXT(__fxstat, ver, fd, st);
	if (rc == 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int __fxstat64(int ver, int fd, struct stat64 *st) {
	int rc = CALL_NEXT(__fxstat64, ver, fd, st);
	if (rc == 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int __fxstatat(int ver, int dirfd, const char *path, struct stat *st, int flags) {
	int rc = CALL_NEXT(__fxstatat, ver, dirfd, path, st, flags), fd = described(dirfd, path, flags);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

EXPORT int __fxstatat64(int ver, int dirfd, const char *path, struct stat64 *st, int flags) {
	int rc = CALL_NEXT(__fxstatat64, ver, dirfd, path, st, flags), fd = described(dirfd, path, flags);
	if (rc == 0 && fd >= 0)
		IDENTIFY(fd, st);
	return rc;
}

// statx fills only the fields it was asked for (mask): the device always, the inode and
// change time when asked.
EXPORT int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *stx) {
	int rc = CALL_NEXT(statx, dirfd, path, flags, mask, stx), fd = described(dirfd, path, flags);
	unsigned int need = STATX_TYPE | STATX_INO | STATX_SIZE;
	if (rc != 0 || fd < 0 || (stx->stx_mask & need) != need || !S_ISREG(stx->stx_mode))
		return rc;
	struct kernel_id k = {makedev(stx->stx_dev_major, stx->stx_dev_minor), stx->stx_ino, (int64_t)stx->stx_size,
	                      {stx->stx_ctime.tv_sec, (stx->stx_mask & STATX_CTIME) ? (long)stx->stx_ctime.tv_nsec : -1L},
	                      (stx->stx_mask & STATX_UID) ? stx->stx_uid : (uid_t)-1};
	struct source_id id;
	if (!copy_source(fd, &k, &id))
		return rc;
	stx->stx_dev_major = major(id.dev);
	stx->stx_dev_minor = minor(id.dev);
	stx->stx_ino = id.ino;
	if (id.ctime_ns && (stx->stx_mask & STATX_CTIME)) {
		stx->stx_ctime.tv_sec = id.ctime_ns / 1000000000;
		stx->stx_ctime.tv_nsec = (uint32_t)(id.ctime_ns % 1000000000);
	}
	return rc;
}

// The largest count the kernel copies in one call (MAX_RW_COUNT).
#define MAX_COPY 0x7ffff000L

// copy_through copies up to len bytes as copy_file_range would, through a buffer: from
// *off_in of fd_in (or its file offset, moved on), to *off_out of fd_out (or its offset).
// Returns the bytes copied (0 at the end of fd_in), or -1 with errno when none could be.
static ssize_t copy_through(int fd_in, off64_t *off_in, int fd_out, off64_t *off_out, size_t len) {
	off64_t in = off_in ? *off_in : lseek(fd_in, 0, SEEK_CUR);
	off64_t out = off_out ? *off_out : lseek(fd_out, 0, SEEK_CUR);
	if (in < 0 || out < 0)
		return -1;
	if (len > MAX_COPY)
		len = MAX_COPY;
	char buf[16384]; // on the program's stack, which may be a small thread's
	ssize_t done = 0;
	int err = 0;
	while ((size_t)done < len) {
		size_t want = len - (size_t)done < sizeof buf ? len - (size_t)done : sizeof buf;
		ssize_t got = pread(fd_in, buf, want, in);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0) {
			err = got < 0 ? errno : 0;
			break;
		}
		ssize_t put = 0;
		while (put < got) {
			ssize_t k = pwrite(fd_out, buf + put, (size_t)(got - put), out + put);
			if (k < 0 && errno == EINTR)
				continue;
			if (k <= 0) {
				err = k < 0 ? errno : EIO;
				break;
			}
			put += k;
		}
		in += put, out += put, done += put;
		if (put < got)
			break;
	}
	if (done == 0 && err) {
		errno = err;
		return -1;
	}
	if (off_in)
		*off_in = in;
	else
		lseek(fd_in, in, SEEK_SET);
	if (off_out)
		*off_out = out;
	else
		lseek(fd_out, out, SEEK_SET);
	return done;
}

// copy_file_range from a cached copy to another file system fails with EXDEV where the
// source might have been copied (it is on the destination's file system, or the kernel
// copies across the two): such a copy goes through a buffer instead, also where the source
// would have failed too (a program falls back on EXDEV to the same copy). Any other result
// is the kernel's.
EXPORT ssize_t copy_file_range(int fd_in, off64_t *off_in, int fd_out, off64_t *off_out, size_t len,
                               unsigned int flags) {
	ssize_t n = CALL_NEXT(copy_file_range, fd_in, off_in, fd_out, off_out, len, flags);
	if (n >= 0 || errno != EXDEV || flags != 0 || !is_copy(fd_in))
		return n;
	return copy_through(fd_in, off_in, fd_out, off_out, len);
}
