// The stable fc_* entry points. Reads try the hit path first (hitpath.h: cached files served
// in C); everything else checks the fork guard before entering Go, because a Go runtime
// inherited through fork() has no threads and would hang, then calls the Go export that does
// the work (see main.go).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitcache.h"
#include "hitpath.h"
#include "_cgo_export.h"

static pid_t loaded_pid;
static volatile int forked_after_load;
static __thread char errmsg[1024];

static void mark_forked(void) { forked_after_load = 1; }

__attribute__((constructor)) static void fc_init(void) {
	loaded_pid = getpid();
	pthread_atfork(NULL, NULL, mark_forked);
}

// fcSetErrmsg records the calling thread's last error message (called from Go).
void fcSetErrmsg(const char *msg) {
	snprintf(errmsg, sizeof errmsg, "%s", msg);
}

static int forked(void) {
	if (!forked_after_load)
		return 0;
	snprintf(errmsg, sizeof errmsg,
		"libfitcache was loaded in process %d before it forked; this process (%d) cannot "
		"use it: load the library after fork, or use the spawn or forkserver start method",
		(int)loaded_pid, (int)getpid());
	return 1;
}

// fcLibraryPath returns the path of this library, so that Go can find the fitcache
// executable installed beside it.
const char *fcLibraryPath(void) {
	Dl_info info;
	if (dladdr((void *)fcLibraryPath, &info) && info.dli_fname)
		return info.dli_fname;
	return "";
}

int fc_open(const char *root, const char *options_json, int64_t *handle) {
	if (forked()) return -ECHILD;
	if (!root || !handle) { snprintf(errmsg, sizeof errmsg, "fc_open: NULL argument"); return -EINVAL; }
	return goOpen((char *)root, (char *)options_json, handle);
}

int fc_close(int64_t handle) {
	if (forked()) return -ECHILD;
	return goClose(handle);
}

static int forked_miss(void) {
	snprintf(errmsg, sizeof errmsg,
		"libfitcache was loaded in process %d before it forked; in this process (%d) it serves "
		"only cached files and what its server can cache (the embedded server): read this one "
		"from the source, or load the library after fork",
		(int)loaded_pid, (int)getpid());
	return -ECHILD;
}

// miss_msg records the server's message for a miss that failed with the file's own error.
static int miss_msg(int rc, const char *msg) {
	if (rc < 0 && msg[0])
		snprintf(errmsg, sizeof errmsg, "%s", msg);
	return rc;
}

// A hit is served by hit_read; a miss by hit_miss where it can be without Go (the reader's own
// fill, the node's server, the source), which decides once how; Go serves what that leaves
// (no server yet, a server that does not answer, an error to explain). In a process forked
// after load, what hit_miss leaves cannot be served.
int fc_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	if (!path || !data || !size || !buffer) { snprintf(errmsg, sizeof errmsg, "fc_read: NULL argument"); return -EINVAL; }
	int rc = hit_read(handle, path, data, size, buffer);
	if (rc != FC_MISS) return rc;
	char msg[FC_FETCH_MESSAGE];
	rc = miss_msg(hit_miss(handle, path, forked_after_load, data, size, buffer, msg), msg);
	if (rc != FC_MISS && rc != FC_UNAVAILABLE) return rc;
	if (forked_after_load) return forked_miss();
	if (rc == FC_UNAVAILABLE) goServerUnavailable(handle);
	rc = goRead(handle, (char *)path, (void **)data, size, buffer);
	if (rc == 0 && fcHitTiers(handle) == 0) goRefreshTiers(handle);
	return rc;
}

int fc_read_many(int64_t handle, int count, const char *const *paths, const void **data, int64_t *sizes,
                 int64_t *buffers, int *results) {
	if (count < 0 || (count > 0 && (!paths || !data || !sizes || !buffers || !results))) {
		snprintf(errmsg, sizeof errmsg, "fc_read_many: bad argument");
		return -EINVAL;
	}
	for (int i = 0; i < count; i++) {
		if (!paths[i]) { snprintf(errmsg, sizeof errmsg, "fc_read_many: NULL path %d", i); return -EINVAL; }
	}
	if (count == 0) return 0;
	// Hits first, then the misses in C where they can be served without Go (hit_miss_many); the
	// rest go to Go in one call, fetched concurrently there.
	int *miss = malloc((size_t)count * sizeof *miss);
	if (!miss) { snprintf(errmsg, sizeof errmsg, "fc_read_many: out of memory"); return -ENOMEM; }
	int nmiss = 0;
	for (int i = 0; i < count; i++) {
		data[i] = NULL; sizes[i] = 0; buffers[i] = 0;
		int rc = hit_read(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		results[i] = rc == FC_MISS ? -EIO : rc;
		if (rc == FC_MISS) miss[nmiss++] = i;
	}
	if (nmiss > 0) {
		char msg[FC_FETCH_MESSAGE];
		bool unavailable;
		nmiss = hit_miss_many(handle, paths, miss, nmiss, forked_after_load, data, sizes, buffers, results,
		                      &unavailable, msg);
		miss_msg(-1, msg);
		if (unavailable && !forked_after_load) goServerUnavailable(handle);
	}
	int rc = 0;
	if (nmiss > 0 && forked_after_load) {
		for (int j = 0; j < nmiss; j++)
			results[miss[j]] = forked_miss();
	} else if (nmiss > 0) {
		const char **mp = malloc((size_t)nmiss * sizeof *mp);
		const void **md = malloc((size_t)nmiss * sizeof *md);
		int64_t *ms = malloc((size_t)nmiss * sizeof *ms), *mb = malloc((size_t)nmiss * sizeof *mb);
		int *mr = malloc((size_t)nmiss * sizeof *mr);
		if (!mp || !md || !ms || !mb || !mr) {
			snprintf(errmsg, sizeof errmsg, "fc_read_many: out of memory");
			rc = -ENOMEM;
		} else {
			for (int j = 0; j < nmiss; j++) mp[j] = paths[miss[j]];
			rc = goReadMany(handle, nmiss, (char **)mp, (void **)md, ms, mb, mr);
			for (int j = 0; rc == 0 && j < nmiss; j++) {
				int i = miss[j];
				data[i] = md[j]; sizes[i] = ms[j]; buffers[i] = mb[j]; results[i] = mr[j];
			}
		}
		free(mp); free(md); free(ms); free(mb); free(mr);
		if (rc == 0 && fcHitTiers(handle) == 0) goRefreshTiers(handle);
	}
	if (rc != 0) { // hand nothing out: release the hits
		for (int i = 0; i < count; i++) {
			if (results[i] == 0 && buffers[i] >= FC_CBUF_BASE) hit_release(buffers[i]);
			data[i] = NULL; sizes[i] = 0; buffers[i] = 0;
		}
	}
	free(miss);
	return rc;
}

int fc_prefetch(int64_t handle, int count, const char *const *paths) {
	return fc_prefetch_epochs(handle, count, paths, 0);
}

int fc_prefetch_epochs(int64_t handle, int count, const char *const *paths, int this_epoch) {
	if (forked()) return -ECHILD;
	if (count < 0 || (count > 0 && !paths) || this_epoch < 0) {
		snprintf(errmsg, sizeof errmsg, "fc_prefetch: bad argument");
		return -EINVAL;
	}
	for (int i = 0; i < count; i++) {
		if (!paths[i]) { snprintf(errmsg, sizeof errmsg, "fc_prefetch: NULL path %d", i); return -EINVAL; }
	}
	if (count == 0) return 0;
	return goPrefetch(handle, count, (char **)paths, this_epoch);
}

int fc_release(int64_t buffer) {
	if (buffer >= FC_CBUF_BASE) {
		int rc = hit_release(buffer);
		if (rc != 0) snprintf(errmsg, sizeof errmsg, "unknown or released fitcache buffer %lld", (long long)buffer);
		return rc;
	}
	if (forked()) return -ECHILD;
	return goRelease(buffer);
}

int64_t fc_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off) {
	if (!path || (!buf && len > 0) || len < 0 || off < 0) { snprintf(errmsg, sizeof errmsg, "fc_pread: bad argument"); return -EINVAL; }
	int64_t got;
	// In a process forked after load, a block not cached is asked of the server in C (Go
	// cannot run there); elsewhere Go reads it from the source at once while it is cached.
	int rc = len > 0 ? hit_pread(handle, path, buf, len, off, forked(), &got) : FC_MISS;
	if (rc == 0) return got;
	if (rc == -EAGAIN) {
		snprintf(errmsg, sizeof errmsg, "fc_pread %s: source file changed while being read", path);
		return rc;
	}
	if (forked()) return -ECHILD;
	return goPread(handle, (char *)path, buf, len, off);
}

int fc_size(int64_t handle, const char *path, int64_t *size) {
	if (forked()) return -ECHILD;
	if (!path || !size) { snprintf(errmsg, sizeof errmsg, "fc_size: NULL argument"); return -EINVAL; }
	return goSize(handle, (char *)path, size);
}

int fc_check_server(int64_t handle) {
	if (forked()) return -ECHILD;
	return goCheckServer(handle);
}

int fc_stats(int64_t handle, char *buf, size_t len, size_t *needed) {
	if (forked()) return -ECHILD;
	if (!buf && len > 0) { snprintf(errmsg, sizeof errmsg, "fc_stats: NULL buffer"); return -EINVAL; }
	return goStats(handle, buf, len, needed);
}

int fc_cluster(int64_t handle) { return hit_cluster(handle); }

int fc_debug_open_handles(int64_t *clients, int64_t *buffers) {
	if (forked()) return -ECHILD;
	int rc = goDebugOpenHandles(clients, buffers);
	if (rc == 0 && buffers) *buffers += hit_buffers();
	return rc;
}

int fc_errmsg(char *buf, size_t len) {
	if (!buf || len == 0) return -EINVAL;
	size_t n = strlen(errmsg);
	snprintf(buf, len, "%s", errmsg);
	return n >= len ? -ERANGE : 0;
}

const char *fc_version(void) { return FITCACHE_VERSION; }
