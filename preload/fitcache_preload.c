/*
 * libfitcache_preload.so -- the transparent mode of FitCache: an LD_PRELOAD library that makes
 * unmodified programs read their dataset from the cache.
 *
 * It interposes the open functions (open, open64, openat, openat64, their fortified __*_2
 * forms, creat, fopen, fopen64), close and fclose of dataset files it saw opened for
 * writing, and the calls that change which file a path names (renames, unlinks, truncates).
 * A read-only open of a file under a dataset root returns a descriptor of the file's cached
 * copy instead of the source; everything after the open (read, pread, mmap, stdio) then
 * runs natively on a real file, so every way of reading works. The exceptions: a large
 * file no tier holds whole, whose source the program gets and whose reads ranges.c serves
 * from cached blocks; and what tells the copy from the source, the stat family on the
 * descriptor (made to report the source's identity) and copy_file_range across file
 * systems (made to copy), in copies.c. Specifically:
 *
 *   - A hit is found here, without a round trip: the path is looked up in the tiers' mapped
 *     indexes and the cached file opened (capi/fclookup.c, shared with libfitcache).
 *   - A miss asks the local server over its node socket (package nodesock, OpOpen), which
 *     reads the source once, publishes the copy and answers with its descriptor (or, when no
 *     tier takes the file, with the source opened beneath the dataset root; the reads of a
 *     large file's source are then served from its cached blocks, see ranges.c). In cluster mode
 *     the tiers are those of the job's servers on this node, and the server asked answers
 *     for every file of the job from its owner: a file of another node comes as a sealed
 *     memory file holding the bytes the owner sent (see server/readers.go, rootReader.open).
 *   - A write-open of a dataset file (O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND) goes to
 *     the source, after the server dropped the cached copy (OpForget); the copy is dropped
 *     again when the descriptor is closed (or the process exits), in case a reader cached
 *     the file meanwhile.
 *   - A rename, unlink or truncate of a dataset file (rename, renameat, renameat2, unlink,
 *     unlinkat, remove, truncate, truncate64) drops the copies of the names it changed once
 *     it succeeded; a renamed directory, those of the files beneath it (see renamed).
 *   - Anything else, and every failure here (no server, a server that does not answer in
 *     time, an error), goes to libc's own function, untouched: the shim never makes a
 *     program fail that would have worked without it.
 *
 * It is small C with no threads, no locks and no allocation in the open path, so it is safe
 * in forked children (DataLoader workers) and between vfork and exec. It never loads Go: a
 * Go runtime does not survive fork and would enter every process of the job, shells included.
 *
 * Configuration (set by `fitcache run`, see cmd/fitcache/run.go); without the first three
 * the library does nothing but call libc:
 *   FITCACHE_PRELOAD_ROOTS    dataset roots, ':'-separated; an entry NAME=REAL gives a root
 *                             named through symbolic links (NAME) and its resolved path (REAL)
 *   FITCACHE_PRELOAD_TIERS    tier directories of the local server (in cluster mode, of the
 *                             job's servers on this node), fastest first
 *   FITCACHE_PRELOAD_SOCKET   the local server's node socket (in cluster mode, one of them)
 *   FITCACHE_PRELOAD_TIMEOUT_MS  how long a miss waits for the answer of a server that
 *                             keeps acknowledging it (default 30000); each acknowledgement
 *                             is waited for a second at most (FC_NODE_PROBE_MS)
 *   FITCACHE_PRELOAD_SESSIONS the run's validation session at the server of each tier, in
 *                             the order of FITCACHE_PRELOAD_TIERS (core.Engine.BeginSession):
 *                             a copy not checked against its source in that session is
 *                             asked of the server, which checks it; a tier without one
 *                             serves nothing without asking
 *   FITCACHE_PRELOAD_BLOCK_BYTES  the size of the server's blocks (see ranges.c); without it
 *                             large files are read from their source
 *   FITCACHE_PRELOAD_HEAT     the file the shim shares what it read of blocks in (ranges.c)
 *   FITCACHE_PRELOAD_DEBUG    set (not "0"): a line on standard error for each open of a
 *                             dataset file, saying what the shim did with it and why
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../capi/fclookup.h"
#include "../capi/fcnode.h"
#include "shim.h"

#define EXPORT __attribute__((visibility("default")))

#define MAX_ROOTS 16

// NOT_OURS: the open is left to libc.
#define NOT_OURS (-2)

// The dataset roots (see struct root).
static struct root roots[MAX_ROOTS];
static int nroots;
struct fc_tier shim_tiers[FC_MAX_TIERS];
int shim_ntiers;
static struct sockaddr_un node_addr;
static int64_t timeout_ms = 30000;
static int enabled;

// CLOCK_MONOTONIC ns before which misses skip the server: it did not answer in time. Written
// atomically; a vfork child that writes it only makes its parent skip the server a while too.
static int64_t node_down_until;

// After the server did not answer in time, misses go to libc for this long.
#define NODE_BACKOFF_NS (5 * 1000000000LL)

// libc's functions (or the next interposer's), found at load.
static int (*libc_open)(const char *, int, ...);
static int (*libc_open64)(const char *, int, ...);
static int (*libc_openat)(int, const char *, int, ...);
static int (*libc_openat64)(int, const char *, int, ...);
static int (*libc___open_2)(const char *, int);
static int (*libc___open64_2)(const char *, int);
static int (*libc___openat_2)(int, const char *, int);
static int (*libc___openat64_2)(int, const char *, int);
static int (*libc_creat)(const char *, mode_t);
static int (*libc_creat64)(const char *, mode_t);
static int (*libc_close)(int);
static int (*libc_fclose)(FILE *);
static FILE *(*libc_fopen)(const char *, const char *);
static FILE *(*libc_fopen64)(const char *, const char *);
static FILE *(*libc_fdopen)(int, const char *);
static int (*libc_rename)(const char *, const char *);
static int (*libc_renameat)(int, const char *, int, const char *);
static int (*libc_renameat2)(int, const char *, int, const char *, unsigned int);
static int (*libc_unlink)(const char *);
static int (*libc_unlinkat)(int, const char *, int);
static int (*libc_remove)(const char *);
static int (*libc_truncate)(const char *, off_t);
static int (*libc_truncate64)(const char *, off64_t);

// FITCACHE_PRELOAD_DEBUG set (and not "0"): shim_debug writes what the shim decides to
// standard error, a line each.
static int debug;

void shim_debug(const char *fmt, ...) {
	if (!debug)
		return;
	int saved = errno;
	char line[FC_PATH_MAX + 256];
	int n = snprintf(line, sizeof line, "fitcache preload[%d]: ", (int)getpid());
	va_list ap;
	va_start(ap, fmt);
	int k = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
	va_end(ap);
	n += k < 0 ? 0 : (k < (int)(sizeof line - (size_t)n - 1) ? k : (int)(sizeof line - (size_t)n - 2));
	line[n++] = '\n';
	ssize_t w = syscall(SYS_write, 2, line, (size_t)n); // not stdio: no lock, no buffer
	(void)w;
	errno = saved;
}

// none_found marks a slot whose function dlsym did not find, so that it is looked for once.
static char none_found;

void *shim_resolve(void **slot, const char *name) {
	void *p = __atomic_load_n(slot, __ATOMIC_RELAXED);
	if (!p) {
		p = dlsym(RTLD_NEXT, name);
		if (!p) { // an older C library: calls of name fail (CALL_NEXT); renameat2 is a system call
			shim_debug("dlsym found no %s after this library", name);
			p = &none_found;
		}
		__atomic_store_n(slot, p, __ATOMIC_RELAXED);
	}
	return p == &none_found ? NULL : p;
}

int shim_missing(const char *name) {
	shim_debug("%s: the C library has no such function: ENOSYS", name);
	errno = ENOSYS;
	return -1;
}

// The environment is parsed into this storage once, at load.
static char config_roots[8192];

// parse_roots reads FITCACHE_PRELOAD_ROOTS into roots.
static void parse_roots(const char *v) {
	size_t n = strlen(v);
	if (n >= sizeof config_roots)
		return;
	memcpy(config_roots, v, n + 1);
	for (char *p = config_roots; *p && nroots < MAX_ROOTS;) {
		char *end = strchr(p, ':');
		if (end)
			*end = 0;
		char *eq = strchr(p, '=');
		struct root *r = &roots[nroots];
		r->name = p;
		r->real = eq ? eq + 1 : p;
		if (eq)
			*eq = 0;
		r->namelen = strlen(r->name);
		r->reallen = strlen(r->real);
		// Clean absolute directories other than "/" only (fitcache run makes them so).
		if (r->name[0] == '/' && r->real[0] == '/' && r->namelen > 1 && r->reallen > 1 &&
		    r->name[r->namelen - 1] != '/' && r->real[r->reallen - 1] != '/')
			nroots++;
		if (!end)
			break;
		p = end + 1;
	}
}

// next_session reads the next number of FITCACHE_PRELOAD_SESSIONS at *s and moves past it;
// a missing or malformed one is UINT32_MAX: no copy of that tier is served without asking.
static uint32_t next_session(const char **s) {
	if (!*s)
		return UINT32_MAX;
	char *end;
	unsigned long long v = strtoull(*s, &end, 10);
	int ok = end != *s && (*end == ':' || *end == 0) && v <= UINT32_MAX;
	*s = *end == ':' ? end + 1 : NULL;
	return ok ? (uint32_t)v : UINT32_MAX;
}

// parse_tiers opens the tier directories of FITCACHE_PRELOAD_TIERS, each for its session in
// sessions (FITCACHE_PRELOAD_SESSIONS, may be NULL).
static void parse_tiers(const char *v, const char *sessions) {
	char dir[FC_PATH_MAX];
	while (*v && shim_ntiers < FC_MAX_TIERS) {
		const char *end = strchr(v, ':');
		size_t n = end ? (size_t)(end - v) : strlen(v);
		uint32_t session = next_session(&sessions);
		if (n > 0 && n < sizeof dir) {
			memcpy(dir, v, n);
			dir[n] = 0;
			if (fc_tier_open(&shim_tiers[shim_ntiers], dir, shim_ntiers, session) == 0) {
				copies_tier(shim_ntiers);
				shim_ntiers++;
			}
		}
		if (!end)
			break;
		v = end + 1;
	}
}

__attribute__((constructor)) static void preload_init(void) {
	int saved = errno;
	const char *dbg = getenv("FITCACHE_PRELOAD_DEBUG");
	debug = dbg && *dbg && strcmp(dbg, "0") != 0;
	NEXT(open);
	NEXT(open64);
	NEXT(openat);
	NEXT(openat64);
	NEXT(__open_2);
	NEXT(__open64_2);
	NEXT(__openat_2);
	NEXT(__openat64_2);
	NEXT(creat);
	NEXT(creat64);
	NEXT(fopen);
	NEXT(fopen64);
	NEXT(fdopen);
	NEXT(close);
	NEXT(fclose);
	NEXT(rename);
	NEXT(renameat);
	NEXT(renameat2);
	NEXT(unlink);
	NEXT(unlinkat);
	NEXT(remove);
	NEXT(truncate);
	NEXT(truncate64);
	copies_init();

	const char *r = getenv("FITCACHE_PRELOAD_ROOTS"), *t = getenv("FITCACHE_PRELOAD_TIERS"),
	           *s = getenv("FITCACHE_PRELOAD_SOCKET"), *ms = getenv("FITCACHE_PRELOAD_TIMEOUT_MS");
	if (!r || !t || !s) {
		errno = saved;
		return;
	}
	parse_roots(r);
	ranged_configure(getenv("FITCACHE_PRELOAD_BLOCK_BYTES"), getenv("FITCACHE_PRELOAD_HEAT"));
	parse_tiers(t, getenv("FITCACHE_PRELOAD_SESSIONS"));
	// A path only: an empty name would be an abstract socket, which any user can bind.
	if (s[0] == '/' && strlen(s) < sizeof node_addr.sun_path) {
		node_addr.sun_family = AF_UNIX;
		strcpy(node_addr.sun_path, s);
	}
	if (ms && *ms) {
		char *end;
		long long v = strtoll(ms, &end, 10);
		if (*end == 0 && v > 0)
			timeout_ms = v;
	}
	// Without a node socket hits still work; without roots nothing is ours.
	enabled = nroots > 0 && (shim_ntiers > 0 || node_addr.sun_family == AF_UNIX);
	errno = saved;
}

// has_dotdot reports whether path has a ".." element. Such a path is left to libc: the kernel
// resolves ".." after following links ("a/link/../b" need not be "a/b"), the lexical
// cleaning done here does not, and the two could name different files.
static int has_dotdot(const char *p) {
	for (const char *s = p; (s = strstr(s, "..")) != NULL; s += 2)
		if ((s == p || s[-1] == '/') && (s[2] == 0 || s[2] == '/'))
			return 1;
	return 0;
}

// absolute writes the absolute form of path (relative to dirfd) into out; the directory part
// comes from the kernel (the working directory, or /proc/self/fd for a directory
// descriptor), resolved and without touching the file system of the dataset. Returns 0, or
// -1 when it cannot tell.
static int absolute(int dirfd, const char *path, char *out, size_t cap) {
	size_t plen = strlen(path);
	if (path[0] == '/') {
		if (plen >= cap)
			return -1;
		memcpy(out, path, plen + 1);
		return 0;
	}
	long n;
	if (dirfd == AT_FDCWD) {
		n = syscall(SYS_getcwd, out, cap);
		if (n <= 0 || out[0] != '/')
			return -1; // unreachable working directory: "(unreachable)/..."
		n = (long)strlen(out);
	} else {
		char link[32];
		snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
		n = syscall(SYS_readlinkat, AT_FDCWD, link, out, cap - 1);
		if (n <= 0 || out[0] != '/')
			return -1; // not a directory of a file system, or no /proc
		out[n] = 0;
		if (n > 10 && strcmp(out + n - 10, " (deleted)") == 0)
			return -1;
	}
	if ((size_t)n + 1 + plen >= cap)
		return -1;
	out[n] = '/';
	memcpy(out + n + 1, path, plen + 1);
	return 0;
}

// beneath returns what follows prefix (plen bytes) in the clean path p (n bytes): "/..." for
// a path below it, "" for prefix itself when whole is set, or NULL.
static const char *beneath(const char *p, size_t n, const char *prefix, size_t plen, int whole) {
	if (n < plen || memcmp(p, prefix, plen) != 0)
		return NULL;
	if (n == plen)
		return whole ? p + n : NULL;
	return p[plen] == '/' ? p + plen : NULL;
}

static int dataset_key(int dirfd, const char *path, char *key, const struct root **root, int whole);

// dataset_path turns the path a program opens into the key of its cached copy: the clean
// absolute path with the root in its resolved form, written into key (FC_PATH_MAX bytes).
// It returns the key's length and the root it is under in *root, or -1 for a path that is not
// a dataset file (or that it leaves to libc).
static int dataset_path(int dirfd, const char *path, char *key, const struct root **root) {
	return dataset_key(dirfd, path, key, root, 0);
}

// dataset_key is dataset_path; with whole, a dataset root itself is a dataset path too (its
// key is the root's resolved form), for a directory renamed with everything beneath it.
static int dataset_key(int dirfd, const char *path, char *key, const struct root **root, int whole) {
	if (!path || !*path || has_dotdot(path))
		return -1;
	char abs[FC_PATH_MAX], clean[FC_PATH_MAX];
	if (absolute(dirfd, path, abs, sizeof abs) != 0)
		return -1;
	int n = fc_clean_path(abs, clean, sizeof clean);
	if (n < 0)
		return -1;
	for (int i = 0; i < nroots; i++) {
		const struct root *r = &roots[i];
		const char *rest = beneath(clean, (size_t)n, r->real, r->reallen, whole);
		if (!rest)
			rest = beneath(clean, (size_t)n, r->name, r->namelen, whole);
		if (!rest)
			continue;
		size_t restlen = (size_t)n - (size_t)(rest - clean);
		if (r->reallen + restlen >= FC_PATH_MAX)
			return -1;
		memcpy(key, r->real, r->reallen);
		memcpy(key + r->reallen, rest, restlen + 1);
		*root = r;
		return (int)(r->reallen + restlen);
	}
	return -1;
}

struct root *shim_root_of(const char *key, size_t len) {
	for (int i = 0; i < nroots; i++)
		if (beneath(key, len, roots[i].real, roots[i].reallen, 0))
			return &roots[i];
	return NULL;
}

// timed_out notes a server that did not answer in time (errno from the failed call), so
// that misses skip it a while instead of each waiting the whole timeout.
static void timed_out(void) {
	if (errno == EAGAIN || errno == EWOULDBLOCK)
		__atomic_store_n(&node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
}

void shim_node_timed_out(void) { timed_out(); }

int64_t shim_node_timeout_ms(void) { return timeout_ms; }

// shim_node_request connects to the node socket, sends one request and waits for its reply to
// begin: a server that does not acknowledge within the probe time (about a second), or stops
// repeating its ack while it works on the request, is hung, and skipped for a while; one that
// keeps acknowledging is waited for up to the read timeout. Each
// request has its own connection: a kept one could not be shared safely with a vfork child
// or across fork, and a miss costs far more than a connect. Returns the connection, or -1.
int shim_node_request(uint32_t op, const struct root *r, const char *key, size_t len, int64_t reply_ms) {
	if (node_addr.sun_family != AF_UNIX || fc_monotonic_ns() < __atomic_load_n(&node_down_until, __ATOMIC_RELAXED))
		return -1;
	int fd = fc_node_connect(&node_addr, timeout_ms);
	if (fd < 0) {
		timed_out();
		return -1;
	}
	if (fc_node_request(fd, op, r->real, r->reallen, key, len, reply_ms, -1) != 0) {
		timed_out();
		CALL_NEXT(close, fd);
		return -1;
	}
	return fd;
}

void shim_node_tell(uint32_t op, const struct root *r, const char *key, size_t len) {
	if (node_addr.sun_family != AF_UNIX || fc_monotonic_ns() < __atomic_load_n(&node_down_until, __ATOMIC_RELAXED))
		return;
	int fd = fc_node_connect(&node_addr, timeout_ms);
	if (fd < 0 || fc_node_send_request(fd, op, r->real, r->reallen, key, len) != 0)
		timed_out();
	if (fd >= 0)
		CALL_NEXT(close, fd);
}

// lowest_fd moves fd to the lowest free descriptor, as open() would have returned (POSIX:
// programs rely on it, `close(0); open(f)` makes f their standard input). A descriptor
// received over the node socket is not there: the socket held a lower one when it came.
// The copy keeps close-on-exec (the caller sets what the program asked for). Returns the
// descriptor to use; on failure, fd itself.
static int lowest_fd(int fd) {
	if (fd <= 0)
		return fd;
	int low = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (low < 0)
		return fd;
	if (low > fd) { // fd was the lowest already
		CALL_NEXT(close, low);
		return fd;
	}
	CALL_NEXT(close, fd);
	return low;
}

// ask_open asks the server for a descriptor of the dataset file key; returns it (close-on-
// exec) with what it holds in *origin (an FC_ORIGIN_ value), or -1.
static int ask_open(const struct root *r, const char *key, size_t len, uint32_t *origin) {
	int sock = shim_node_request(FC_NODE_OP_OPEN, r, key, len, timeout_ms);
	if (sock < 0)
		return -1;
	int fd;
	int32_t err;
	if (fc_node_recv_open(sock, &fd, &err, origin) != 0)
		timed_out();
	CALL_NEXT(close, sock); // an error message, if any, is not needed: libc opens the file and says why
	return lowest_fd(fd);
}

// forget asks the server to drop the cached copy of a dataset file about to be written.
static void forget(const struct root *r, const char *key, size_t len) {
	int sock = shim_node_request(FC_NODE_OP_FORGET, r, key, len, timeout_ms);
	if (sock < 0)
		return;
	uint8_t reply[12];
	if (fc_recv_all(sock, reply, sizeof reply) != 0)
		timed_out();
	CALL_NEXT(close, sock);
}

// Flags of a read-only open the shim serves; others (O_DIRECTORY, O_PATH, O_TMPFILE,
// O_SYNC...) go to libc. O_NOFOLLOW (GNU tar and rsync open every file with it) is served
// when the path does not end in a symbolic link (see follows_no_link).
#define SERVED_FLAGS                                                                                                   \
	(O_ACCMODE | O_CLOEXEC | O_LARGEFILE | O_NONBLOCK | O_NOATIME | O_DIRECT | O_NOCTTY | O_NOFOLLOW)
#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND)

// follows_no_link reports whether an O_NOFOLLOW open of path (relative to dirfd) would follow
// no symbolic link at its end, which is all that O_NOFOLLOW refuses: a path that ends in a
// link is left to libc, which fails it with ELOOP as the program expects. A link put in its
// place after this check and before the open is served as the file it replaced was (the
// cache holds the file that path named); the program could not tell the two orders apart.
static int follows_no_link(int dirfd, const char *path) {
	struct stat st;
	return fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISLNK(st.st_mode);
}

// set_flags gives a descriptor from the server the flags the program asked for (it comes
// plain read-only and close-on-exec), except O_DIRECT: the descriptor may share its open
// file with the server's copy of a large file in progress (see core.Engine.OpenForReader),
// whose last, partial read would fail with it. The bytes read are the same without it.
static void set_flags(int fd, int flags) {
	if (!(flags & O_CLOEXEC))
		fcntl(fd, F_SETFD, 0);
	int fl = flags & (O_NONBLOCK | O_NOATIME);
	if (fl)
		fcntl(fd, F_SETFL, fl);
}

// Descriptors of dataset files open for writing, as a bitmap (atomic words): their cached
// copies are dropped once more when they are closed, in case a reader cached the file
// between the write-open and the last write. Descriptors past the map are not tracked.
#define TRACKED_FDS 65536
static uint64_t writing[TRACKED_FDS / 64];

static void track_write(int fd) {
	if (fd >= 0 && fd < TRACKED_FDS)
		__atomic_fetch_or(&writing[fd / 64], 1ULL << (fd % 64), __ATOMIC_RELAXED);
}

// untrack_write reports whether fd was a tracked write descriptor, and stops tracking it. It
// is also called for every descriptor an open returns, so that a bit left by a tracked
// descriptor closed some other way (dup2, close_range) does not outlive it.
static int untrack_write(int fd) {
	if (fd < 0 || fd >= TRACKED_FDS)
		return 0;
	uint64_t bit = 1ULL << (fd % 64);
	if (!(__atomic_load_n(&writing[fd / 64], __ATOMIC_RELAXED) & bit))
		return 0;
	return (__atomic_fetch_and(&writing[fd / 64], ~bit, __ATOMIC_RELAXED) & bit) != 0;
}

// fd_key writes the key of the dataset file open at fd (named by the kernel) into key
// (FC_PATH_MAX bytes): its length and root, or -1.
static int fd_key(int fd, char *key, const struct root **r) {
	char link[32], target[FC_PATH_MAX];
	snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
	long n = syscall(SYS_readlinkat, AT_FDCWD, link, target, sizeof target - 1);
	if (n <= 0)
		return -1;
	target[n] = 0;
	return dataset_path(AT_FDCWD, target, key, r);
}

// shim_open serves an open of path (relative to dirfd) from the cache when it is a read-only
// open of a dataset file: it returns the descriptor, or NOT_OURS to leave the open to libc.
// For a dataset file opened for writing it drops the cached copy first and sets *writes, so
// that the caller tracks the descriptor libc gives (see track_write). errno is unchanged on
// every path.
static int shim_open(int dirfd, const char *path, int flags, int *writes) {
	*writes = 0;
	if (!enabled)
		return NOT_OURS;
	int saved = errno;
	char key[FC_PATH_MAX];
	const struct root *r;
	int fd = NOT_OURS;
	int n = dataset_path(dirfd, path, key, &r);
	if (n < 0)
		goto out;
	if (flags & WRITE_FLAGS) {
		shim_debug("%s: open for writing: the cached copy is dropped, libc opens the source", key);
		forget(r, key, (size_t)n);
		*writes = 1;
		goto out;
	}
	if ((flags & ~SERVED_FLAGS) || ((flags & O_NOFOLLOW) && !follows_no_link(dirfd, path))) {
		shim_debug("%s: flags %#o (or a link with O_NOFOLLOW): left to libc", key, flags);
		goto out;
	}
	ranged_sweep(); // kept copies of blocks evicted since, at most once a second
	struct fc_hit hit;
	if (fc_lookup(shim_tiers, shim_ntiers, key, (size_t)n, flags & (O_CLOEXEC | O_NONBLOCK | O_NOATIME | O_DIRECT), 1, &hit) == 0) {
		// A hit with no bytes: the program reads what it wants of the descriptor, which the
		// server cannot see ("served" counts bytes delivered, not the sizes of files opened).
		fc_count_hit(&shim_tiers[hit.tier], 0);
		fd = hit.fd;
		untrack_write(fd);
		ranged_forget(fd);
		copies_opened(fd, r, &hit);
		shim_debug("%s: cached in tier %d: fd %d", key, hit.tier, fd);
		goto out;
	}
	uint32_t origin;
	int got = ask_open(r, key, (size_t)n, &origin);
	if (got >= 0) {
		set_flags(got, flags);
		fd = got;
		untrack_write(fd);
		ranged_forget(fd);
		// The source of a large file no tier holds whole yet: its reads go through the
		// blocks the tiers hold (ranges.c).
		struct stat st;
		if ((origin == FC_ORIGIN_SOURCE || origin == FC_ORIGIN_SOURCE_WHILE_CACHED) && fc_sys_fstat(fd, &st) == 0)
			ranged_open(fd, origin == FC_ORIGIN_SOURCE, r, key, (size_t)n, &st);
		// A copy in a tier: known now, for fstat, at the cost of one fstat here (next to the
		// round trip to the server, nothing). A copy the index does not list yet (a large
		// file still being written) is left for fstat to find out (copies.c).
		if (origin >= FC_ORIGIN_TIER_FIRST && fc_lookup_fd(shim_tiers, shim_ntiers, key, (size_t)n, fd, &hit) == 0)
			copies_opened(fd, r, &hit);
		shim_debug("%s: the server answered: fd %d, origin %s", key, fd, fc_origin_name(origin));
	} else {
		shim_debug("%s: no answer from the server: left to libc", key);
	}
out:
	errno = saved;
	return fd;
}

// libc_result tracks the descriptor libc returned for a dataset file opened for writing (and
// untracks any other).
static int libc_result(int fd, int writes) {
	ranged_forget(fd);
	if (writes && fd >= 0)
		track_write(fd);
	else
		untrack_write(fd);
	return fd;
}

// mode_arg reads open's third argument when the flags say there is one.
#define MODE_ARG(flags, mode)                                                                                          \
	do {                                                                                                           \
		if ((flags) & (O_CREAT | __O_TMPFILE)) {                                                              \
			va_list ap;                                                                                    \
			va_start(ap, flags);                                                                           \
			mode = va_arg(ap, mode_t);                                                                     \
			va_end(ap);                                                                                    \
		}                                                                                                      \
	} while (0)

EXPORT int open(const char *path, int flags, ...) {
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	int w, fd = shim_open(AT_FDCWD, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(open, path, flags, mode), w);
}

EXPORT int open64(const char *path, int flags, ...) {
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	int w, fd = shim_open(AT_FDCWD, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(open64, path, flags, mode), w);
}

EXPORT int openat(int dirfd, const char *path, int flags, ...) {
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	int w, fd = shim_open(dirfd, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(openat, dirfd, path, flags, mode), w);
}

EXPORT int openat64(int dirfd, const char *path, int flags, ...) {
	mode_t mode = 0;
	MODE_ARG(flags, mode);
	int w, fd = shim_open(dirfd, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(openat64, dirfd, path, flags, mode), w);
}

// The fortified forms (-D_FORTIFY_SOURCE) take no mode: they are called only without O_CREAT.
EXPORT int __open_2(const char *path, int flags) {
	int w, fd = shim_open(AT_FDCWD, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(__open_2, path, flags), w);
}

EXPORT int __open64_2(const char *path, int flags) {
	int w, fd = shim_open(AT_FDCWD, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(__open64_2, path, flags), w);
}

EXPORT int __openat_2(int dirfd, const char *path, int flags) {
	int w, fd = shim_open(dirfd, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(__openat_2, dirfd, path, flags), w);
}

EXPORT int __openat64_2(int dirfd, const char *path, int flags) {
	int w, fd = shim_open(dirfd, path, flags, &w);
	return fd != NOT_OURS ? fd : libc_result(CALL_NEXT(__openat64_2, dirfd, path, flags), w);
}

// creat always writes: the cached copy is dropped, the call goes to libc.
EXPORT int creat(const char *path, mode_t mode) {
	int w;
	shim_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, &w);
	return libc_result(CALL_NEXT(creat, path, mode), w);
}

EXPORT int creat64(const char *path, mode_t mode) {
	int w;
	shim_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, &w);
	return libc_result(CALL_NEXT(creat64, path, mode), w);
}

// close of a dataset file written through this process drops its cached copy once more,
// after the close (the last write is in), by the name read before the descriptor goes.
EXPORT int close(int fd) {
	ranged_forget(fd);
	if (!untrack_write(fd))
		return CALL_NEXT(close, fd);
	char key[FC_PATH_MAX];
	const struct root *r;
	int len = fd_key(fd, key, &r);
	int rc = CALL_NEXT(close, fd), saved = errno;
	if (len >= 0)
		forget(r, key, (size_t)len);
	errno = saved;
	return rc;
}

// stdio_flags turns an fopen mode into open flags and, for a read-only mode, the mode
// fdopen takes (without 'e', which fdopen does not know, and 'x'). Returns -1 for a mode
// left to libc (",ccs=" encodings).
static int stdio_flags(const char *mode, int *flags, char *fdmode, size_t cap) {
	if (!mode || strchr(mode, ','))
		return -1;
	int f;
	switch (mode[0]) {
	case 'r':
		f = O_RDONLY;
		break;
	case 'w':
		f = O_WRONLY | O_CREAT | O_TRUNC;
		break;
	case 'a':
		f = O_WRONLY | O_CREAT | O_APPEND;
		break;
	default:
		return -1;
	}
	size_t w = 0;
	for (const char *m = mode; *m; m++) {
		if (*m == '+')
			f = (f & ~O_ACCMODE) | O_RDWR;
		else if (*m == 'e')
			f |= O_CLOEXEC;
		if (*m != 'e' && *m != 'x' && w + 1 < cap)
			fdmode[w++] = *m;
	}
	fdmode[w] = 0;
	*flags = f;
	return 0;
}

// shim_fopen serves a read-only fopen from the cache (a stream over the cached copy's
// descriptor), or returns NULL to leave it to libc, with *writes set for a dataset file
// opened for writing (as shim_open).
static FILE *shim_fopen(const char *path, const char *mode, int *writes) {
	int flags;
	char fdmode[16];
	*writes = 0;
	if (!enabled || stdio_flags(mode, &flags, fdmode, sizeof fdmode) != 0)
		return NULL;
	int fd = shim_open(AT_FDCWD, path, flags, writes);
	if (fd < 0)
		return NULL;
	int saved = errno;
	FILE *f = CALL_NEXT_PTR(fdopen, fd, fdmode);
	if (!f)
		CALL_NEXT(close, fd);
	errno = saved;
	return f;
}

// libc_stream tracks the stream libc opened on a dataset file for writing (and untracks any
// other descriptor).
static FILE *libc_stream(FILE *f, int writes) {
	if (f && writes)
		track_write(fileno(f));
	else if (f)
		untrack_write(fileno(f));
	return f;
}

EXPORT FILE *fopen(const char *path, const char *mode) {
	int w;
	FILE *f = shim_fopen(path, mode, &w);
	return f ? f : libc_stream(CALL_NEXT_PTR(fopen, path, mode), w);
}

EXPORT FILE *fopen64(const char *path, const char *mode) {
	int w;
	FILE *f = shim_fopen(path, mode, &w);
	return f ? f : libc_stream(CALL_NEXT_PTR(fopen64, path, mode), w);
}

// fclose closes its descriptor inside libc, not through close: a stream written to a dataset
// file drops the cached copy here, after fclose has flushed its buffer and closed it.
EXPORT int fclose(FILE *f) {
	int fd = f ? fileno(f) : -1;
	ranged_forget(fd);
	if (!untrack_write(fd))
		return CALL_NEXT(fclose, f);
	char key[FC_PATH_MAX];
	const struct root *r;
	int len = fd_key(fd, key, &r);
	int rc = CALL_NEXT(fclose, f), saved = errno;
	if (len >= 0)
		forget(r, key, (size_t)len);
	errno = saved;
	return rc;
}

// --- Calls that change which file a dataset path names ------------------------------------
//
// A rename over a dataset file (mv, os.replace, sed -i), an unlink (rm, os.remove, remove) or a
// truncate(2) leaves the file's cached copy holding bytes its path no longer names, or a file
// that is gone. Once such a call succeeded, the shim has the server drop the copies of the
// names it changed (OpForget, as for a write-open); the call's result and errno are returned
// untouched.
//
// Only after the call, not also before: until the call returns, the copy holds what the path
// names. A reader that caches the file again around the call (a miss between the call and the
// forget) has its copy dropped by the forget after it; a forget before would only narrow the
// instant between the call and that forget, in which a reader racing the call may read either
// version anyway, at the price of a second round trip per call (`rm -r` of a large tree). A
// fill that opened the old file before the call and publishes after the forget is not stopped
// by a forget before either (it may have started before that too): only the server checking
// the source's identity when it publishes closes that.

// Key lengths of a name that is not a dataset path.
#define NO_KEY (-1)

// forget_key drops the copies of the dataset file key (len bytes, NO_KEY for none) under
// root r; a dataset root itself names no file.
static void forget_key(const struct root *r, const char *key, int len) {
	if (len > 0 && (size_t)len > r->reallen)
		forget(r, key, (size_t)len);
}

// resolved_key writes the key of path (relative to dirfd) with its directory resolved by
// the kernel (opened, and named by /proc/self/fd), as dataset_key does with whole: the name
// of a file reached through a link or a ".." element, which dataset_path leaves to libc.
static int resolved_key(int dirfd, const char *path, char *key, const struct root **r) {
	if (!path || !*path)
		return NO_KEY;
	const char *slash = strrchr(path, '/'), *last = slash ? slash + 1 : path;
	if (!*last || strcmp(last, ".") == 0 || strcmp(last, "..") == 0)
		return NO_KEY;
	char dir[FC_PATH_MAX];
	size_t n = slash ? (size_t)(slash - path) : 1;
	if (n >= sizeof dir)
		return NO_KEY;
	if (!slash)
		dir[0] = '.';
	else if (n == 0)
		dir[n++] = '/';
	else
		memcpy(dir, path, n);
	dir[n] = 0;
	int dfd = (int)syscall(SYS_openat, dirfd, dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return NO_KEY;
	int len = dataset_key(dfd, last, key, r, 1);
	CALL_NEXT(close, dfd);
	return len;
}

// node_usable reports whether the server may be asked now.
static int node_usable(void) {
	return node_addr.sun_family == AF_UNIX && fc_monotonic_ns() >= __atomic_load_n(&node_down_until, __ATOMIC_RELAXED);
}

// forget_path drops the copies of path (relative to dirfd) under its name as given (the key
// opens use) and with its directory resolved, when they differ.
static void forget_path(int dirfd, const char *path) {
	char key[FC_PATH_MAX], real[FC_PATH_MAX];
	const struct root *r, *rr;
	int len = dataset_path(dirfd, path, key, &r), rlen = resolved_key(dirfd, path, real, &rr);
	if (len >= 0)
		forget_key(r, key, len);
	if (rlen >= 0 && (len != rlen || memcmp(key, real, (size_t)len) != 0))
		forget_key(rr, real, rlen);
}

// changed drops the copies of path (relative to dirfd) after a call changed what it names.
// errno is unchanged.
static void changed(int dirfd, const char *path) {
	if (!enabled || !node_usable())
		return;
	int saved = errno;
	forget_path(dirfd, path);
	errno = saved;
}

// A directory renamed in a dataset takes the names of the files beneath it along: after such
// a rename, the files beneath it are walked (at their new names) and the copies of each under
// its old name and its new name are dropped. The walk goes WALK_DEPTH levels deep (deeper
// files keep their copies) and reads every directory through one buffer: a directory's read
// position stays in its descriptor (set to the entry after the subdirectory walked first).
#define WALK_DEPTH 32

struct linux_dirent64 {
	uint64_t d_ino;
	int64_t d_off;
	unsigned short d_reclen;
	unsigned char d_type;
	char d_name[];
};

// append writes "/name" (n bytes) after the len bytes of key: the new length, or NO_KEY.
static int append(char *key, int len, const char *name, size_t n) {
	if (len < 0 || (size_t)len + 1 + n >= FC_PATH_MAX)
		return NO_KEY;
	key[len] = '/';
	memcpy(key + len + 1, name, n + 1);
	return len + 1 + (int)n;
}

// walk_renamed drops the copies of the regular files beneath the directory open at fd
// (closed here) under both keys: okey and nkey (olen and nlen bytes, NO_KEY for a name
// outside the datasets, under roots ro and rn) followed by the path below the directory.
static void walk_renamed(int fd, const struct root *ro, char *okey, int olen, const struct root *rn, char *nkey,
                         int nlen) {
	int fds[WALK_DEPTH], olens[WALK_DEPTH], nlens[WALK_DEPTH], depth = 0;
	fds[0] = fd, olens[0] = olen, nlens[0] = nlen;
	_Alignas(struct linux_dirent64) char buf[2048];
	while (depth >= 0) {
		long got = node_usable() ? syscall(SYS_getdents64, fds[depth], buf, sizeof buf) : 0;
		if (got <= 0) {
			int listed = fds[depth--]; // not in CALL_NEXT's arguments: see shim.h
			CALL_NEXT(close, listed);
			continue;
		}
		for (long at = 0; at < got;) {
			struct linux_dirent64 *d = (struct linux_dirent64 *)(buf + at);
			at += d->d_reclen;
			const char *name = d->d_name;
			if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0)))
				continue;
			unsigned type = d->d_type;
			struct stat st;
			if (type == DT_UNKNOWN && fstatat(fds[depth], name, &st, AT_SYMLINK_NOFOLLOW) == 0)
				type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
			size_t n = strlen(name);
			int ol = append(okey, olens[depth], name, n), nl = append(nkey, nlens[depth], name, n);
			if (type == DT_REG) {
				forget_key(ro, okey, ol);
				forget_key(rn, nkey, nl);
				continue;
			}
			int sub;
			if (type != DT_DIR || depth + 1 == WALK_DEPTH || (ol < 0 && nl < 0) ||
			    (sub = (int)syscall(SYS_openat, fds[depth], name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
				continue;
			if (lseek(fds[depth], d->d_off, SEEK_SET) < 0) { // cannot come back to the rest
				CALL_NEXT(close, sub);
				continue;
			}
			depth++;
			fds[depth] = sub, olens[depth] = ol, nlens[depth] = nl;
			break; // the subdirectory first; the rest of the parent is read again from its offset
		}
	}
}

// renamed drops the copies of the names a rename changed, after it succeeded: both names,
// and for each that is now a directory (the new one, or both after RENAME_EXCHANGE), the
// names of the files beneath it under both. errno is unchanged.
static void renamed(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
	if (!enabled || !node_usable())
		return;
	int saved = errno;
	forget_path(olddirfd, oldpath);
	forget_path(newdirfd, newpath);
	char okey[FC_PATH_MAX], nkey[FC_PATH_MAX];
	const struct root *ro = NULL, *rn = NULL;
	int olen = resolved_key(olddirfd, oldpath, okey, &ro), nlen = resolved_key(newdirfd, newpath, nkey, &rn);
	for (int side = 0; side < 2 && (olen >= 0 || nlen >= 0); side++) {
		int dirfd = side ? olddirfd : newdirfd;
		const char *path = side ? oldpath : newpath;
		int fd = (int)syscall(SYS_openat, dirfd, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (fd >= 0)
			walk_renamed(fd, ro, okey, olen, rn, nkey, nlen);
	}
	errno = saved;
}

EXPORT int rename(const char *oldpath, const char *newpath) {
	int rc = CALL_NEXT(rename, oldpath, newpath);
	if (rc == 0)
		renamed(AT_FDCWD, oldpath, AT_FDCWD, newpath);
	return rc;
}

EXPORT int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
	int rc = CALL_NEXT(renameat, olddirfd, oldpath, newdirfd, newpath);
	if (rc == 0)
		renamed(olddirfd, oldpath, newdirfd, newpath);
	return rc;
}

EXPORT int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags) {
	int rc = NEXT(renameat2) ? NEXT(renameat2)(olddirfd, oldpath, newdirfd, newpath, flags)
	                         : (int)syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags);
	if (rc == 0)
		renamed(olddirfd, oldpath, newdirfd, newpath);
	return rc;
}

EXPORT int unlink(const char *path) {
	int rc = CALL_NEXT(unlink, path);
	if (rc == 0)
		changed(AT_FDCWD, path);
	return rc;
}

// unlinkat with AT_REMOVEDIR removes an empty directory: nothing beneath it to drop.
EXPORT int unlinkat(int dirfd, const char *path, int flags) {
	int rc = CALL_NEXT(unlinkat, dirfd, path, flags);
	if (rc == 0)
		changed(dirfd, path);
	return rc;
}

// glibc's remove calls its own unlink and rmdir, not the exported ones this library
// interposes: it needs its own wrapper.
EXPORT int remove(const char *path) {
	int rc = CALL_NEXT(remove, path);
	if (rc == 0)
		changed(AT_FDCWD, path);
	return rc;
}

EXPORT int truncate(const char *path, off_t length) {
	int rc = CALL_NEXT(truncate, path, length);
	if (rc == 0)
		changed(AT_FDCWD, path);
	return rc;
}

EXPORT int truncate64(const char *path, off64_t length) {
	int rc = CALL_NEXT(truncate64, path, length);
	if (rc == 0)
		changed(AT_FDCWD, path);
	return rc;
}

// A process that exits with dataset files open for writing drops their cached copies. exit
// flushes stdio buffers only after destructors run, so they are flushed here first: the
// copies are dropped after the last write.
__attribute__((destructor)) static void preload_fini(void) {
	int saved = errno;
	int any = 0;
	for (int w = 0; w < TRACKED_FDS / 64 && !any; w++)
		any = __atomic_load_n(&writing[w], __ATOMIC_RELAXED) != 0;
	if (any)
		fflush(NULL);
	char key[FC_PATH_MAX];
	const struct root *r;
	for (int w = 0; w < TRACKED_FDS / 64; w++)
		for (uint64_t bits = __atomic_load_n(&writing[w], __ATOMIC_RELAXED); bits; bits &= bits - 1) {
			int len = fd_key(w * 64 + __builtin_ctzll(bits), key, &r);
			if (len >= 0)
				forget(r, key, (size_t)len);
		}
	errno = saved;
}
