// Hits: files served whole from the cached copies of a client's tiers (see hitpath.h:
// hit_read, hit_read_fetched), and read_checked, the copy a process forked after load
// serves once the source shows the copy's version.
#define _GNU_SOURCE
#include "hitclient.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

// hit_read and hit_read_fetched: the client held for the read, the path made clean.
static int read_path(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer,
                     int count) {
	struct hit_client *c = acquire(handle);
	char clean[FC_PATH_MAX];
	int n, rc = FC_MISS;
	if (c && (n = source_path(c, path, clean, sizeof clean)) >= 0)
		rc = read_cached(c, clean, (size_t)n, data, size, buffer, count);
	put(c);
	return rc;
}

int hit_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	return read_path(handle, path, data, size, buffer, 1);
}

int hit_read_fetched(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	return read_path(handle, path, data, size, buffer, 0);
}

// read_cached serves the clean path clean (n bytes) of c from its tiers; it counts the read as
// a hit only with count. Without count (a file the server has just fetched, and checked
// against its source), a copy checked in an earlier session than the client's is served too:
// a restarted server numbers sessions anew.
int read_cached(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                int64_t *buffer, int count) {
	int saved = errno;
	struct fc_hit h;
	int nt, rc = FC_MISS;
	if ((nt = tier_count(c)) == 0 || fc_lookup(c->tiers, nt, clean, n, O_CLOEXEC, count, &h) != 0)
		goto out;
	void *ptr;
	uint8_t kind;
	rc = take(&h, &ptr, &kind);
	close(h.fd);
	if (rc != 0)
		goto out;
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0 || !count)
		goto out;
	fc_count_hit(&c->tiers[h.tier], h.size);
	count_hit(c);
out:
	errno = saved;
	return rc;
}

// read_checked serves the clean path clean (n bytes) of c, a client whose node's server does
// not answer (a process forked after load cannot ask Go): a copy is served whatever validation
// session its server last checked it in, once one stat of the source shows the version the
// copy's index slot names (size, modification and change times, inode; the last two where
// the slot knows them). No server checks copies while it is dead, so the reader does, at each
// such read. Returns as hit_read.
int read_checked(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                 int64_t *buffer) {
	int saved = errno;
	struct fc_hit h = {.fd = -1};
	int nt, rc = FC_MISS;
	if ((nt = tier_count(c)) == 0 || c->real_root_fd < 0 || n <= c->rootlen ||
	    fc_lookup(c->tiers, nt, clean, n, O_CLOEXEC, 0, &h) != 0) {
		h.fd = -1;
		goto out;
	}
	// The source as Go's reader looks at it (client/deadtiers.go): one stat beneath the
	// resolved root, following links (a link to anything else is another version). A system
	// call, not libc's fstatat: the preload shim may interpose it.
	struct stat st;
	const char *rel = clean + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	if (syscall(SYS_newfstatat, c->real_root_fd, rel, &st, 0) != 0 || !S_ISREG(st.st_mode) ||
	    (int64_t)st.st_size != h.size || ts_ns(st.st_mtim) != h.mtime_ns ||
	    (h.src_ctime_ns != 0 && ts_ns(st.st_ctim) != h.src_ctime_ns) ||
	    (h.src_ino != 0 && (uint64_t)st.st_ino != h.src_ino))
		goto out; // another version: the copy is no hit
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0 || (rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	fc_count_hit(&c->tiers[h.tier], h.size);
	count_hit(c);
out:
	if (h.fd >= 0)
		close(h.fd);
	errno = saved;
	return rc;
}
