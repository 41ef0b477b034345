// The dataset's source files, opened and read without Go where that keeps the guarantees of
// core.OpenSource: beneath the client's real root, regular files only, not changed while
// read. Whole files (read_source), and the sources of large files kept open for ranges
// (keep_range_source, fcHitSetSource).
#define _GNU_SOURCE
#include "hitclient.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

// open_beneath_root opens the source file at the clean path path (len bytes, under c's root) for
// reading, beneath the real root held open since the client opened (openat2 RESOLVE_BENEATH:
// no link leads out of it; O_NONBLOCK: a FIFO never blocks), as core.OpenSource does: the
// descriptor, or -1 (Go then reads the file, and says why).
int open_beneath_root(struct hit_client *c, const char *path, size_t len) {
	if (c->real_root_fd < 0 || len <= c->rootlen)
		return -1;
	const char *rel = path + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	struct open_how how = {.flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC, .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
	return (int)syscall(SYS_openat2, c->real_root_fd, rel, &how, sizeof how);
}

// keep_range_source makes sure c has a source descriptor of the file at the clean path path (len
// bytes, under c's root) for read_source_range: one Go left, or one opened here, beneath the
// root as read_source opens (no link out of it, a regular file). It returns 1 when there
// is one (of a file of FC_READ_NOW_BYTES or more), 0 for a smaller file (not kept), -1 when the
// file cannot be opened here (Go's rules apply, or the server's). A source is kept for
// FC_SOURCE_KEEP_MS, as the Go client keeps one (capi/fclimits.h).
int keep_range_source(struct hit_client *c, const char *path, size_t len) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	int64_t now = fc_monotonic_ns();
	int have = -1; // 1: a source kept, 0: a file noted small
	pthread_mutex_lock(&c->ranges_mu);
	for (int i = 0; i < RANGE_SOURCES && have < 0; i++)
		if (c->sources[i].key == key && c->sources[i].check == check && now < c->sources[i].until_ns)
			have = c->sources[i].fd >= 0;
	pthread_mutex_unlock(&c->ranges_mu);
	if (have >= 0)
		return have;
	int fd = open_beneath_root(c, path, len);
	struct stat st;
	if (fd < 0)
		return -1;
	if (fc_sys_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return -1;
	}
	if (st.st_size < FC_READ_NOW_BYTES) { // noted, so that its next ranges do not open it again
		close(fd);
		keep_source(c, path, len, -1, FC_SOURCE_KEEP_MS);
		return 0;
	}
	keep_source(c, path, len, fd, FC_SOURCE_KEEP_MS);
	return 1;
}

// keep_source keeps fd, the source of the large file at the clean absolute path path (len
// bytes), in c's sources for ms milliseconds (see fcHitSetSource); c owns fd from then on. An
// fd of -1 notes a file too small to be read by blocks (see keep_range_source).
void keep_source(struct hit_client *c, const char *path, size_t len, int fd, int64_t ms) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	int old = -1, kept = 0;
	int64_t now = fc_monotonic_ns();
	pthread_mutex_lock(&c->ranges_mu);
	// Its entry if it has one, else a free one, else an expired one, else the unused one that
	// expires first: the sources of files read in turn are all kept.
	int at = -1;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].key == key && c->sources[i].check == check)
			at = i;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].key == 0 && c->sources[i].check == 0)
			at = i;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].refs == 0 && c->sources[i].until_ns <= now)
			at = i;
	if (at < 0)
		for (int i = 0; i < RANGE_SOURCES; i++)
			if (c->sources[i].refs == 0 && (at < 0 || c->sources[i].until_ns < c->sources[at].until_ns))
				at = i;
	if (at >= 0 && c->sources[at].refs == 0) {
		struct range_source *s = &c->sources[at];
		old = s->key || s->check ? s->fd : -1;
		*s = (struct range_source){.key = key, .check = check, .fd = fd,
		                           .until_ns = fc_monotonic_ns() + ms * 1000000LL};
		kept = 1;
	} else if (at >= 0) { // in use: only its deadline moves
		c->sources[at].until_ns = fc_monotonic_ns() + ms * 1000000LL;
	}
	pthread_mutex_unlock(&c->ranges_mu);
	if (old >= 0)
		close(old);
	if (!kept && fd >= 0)
		close(fd);
}

void fcHitSetSource(int64_t handle, const char *path, int fd, int64_t ms) {
	struct hit_client *c = acquire(handle);
	if (!c) {
		close(fd);
		return;
	}
	keep_source(c, path, strlen(path), fd, ms);
	put(c);
}

// Source reads without Go: for files no tier takes (the server said so), and in a process
// forked after load. They keep the guarantees of core.OpenSource, or leave the file to Go:
// the file is opened beneath the real root, held open since the client opened (openat2
// RESOLVE_BENEATH, so no link leads out),
// it must be a regular file (opened O_NONBLOCK: a FIFO never blocks), and it must not change
// while read. Anything unusual (an absolute link, a kernel without openat2, an error to
// report with its message) returns FC_MISS, and Go reads the file and says why.
int read_source(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                int64_t *buffer) {
	int saved = errno;
	int rc = FC_MISS;
	int fd = open_beneath_root(c, clean, n);
	struct stat before, after;
	if (fd < 0 || fc_sys_fstat(fd, &before) != 0 || !S_ISREG(before.st_mode))
		goto out;
	struct fc_hit h = {.fd = fd, .size = before.st_size};
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0)
		goto out;
	if (fc_sys_fstat(fd, &after) != 0 || after.st_size != before.st_size || after.st_ino != before.st_ino ||
	    after.st_mtim.tv_sec != before.st_mtim.tv_sec || after.st_mtim.tv_nsec != before.st_mtim.tv_nsec ||
	    after.st_ctim.tv_sec != before.st_ctim.tv_sec || after.st_ctim.tv_nsec != before.st_ctim.tv_nsec) {
		free_mem(ptr, (size_t)h.size, kind); // changed while read: Go reads it again, or says so
		rc = FC_MISS;
		goto out;
	}
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->source_files, 1, __ATOMIC_RELAXED);
out:
	if (fd >= 0)
		close(fd);
	errno = saved;
	return rc;
}
