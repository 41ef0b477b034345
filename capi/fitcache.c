// The stable fc_* entry points. Reads try the hit path first (hitpath.c: cached files served
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

// fetch_and_read serves a miss without Go: the server brings the file into its tiers
// (through its node socket) and the hit path reads it. It returns FC_MISS or FC_UNAVAILABLE
// when that cannot be done, or fc_read's result.
static int fetch_and_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	char msg[FC_FETCH_MESSAGE];
	int rc = hit_fetch(handle, path, msg);
	if (rc == 0) return hit_read_fetched(handle, path, data, size, buffer);
	if (rc < 0) snprintf(errmsg, sizeof errmsg, "%s", msg[0] ? msg : strerror(-rc));
	return rc;
}

// forked_read serves a miss in a process forked after load, where Go cannot run. Without the
// node's server (none listening, or no answer), a copy its tiers hold still serves once the
// source shows the copy's version (hit_read_checked), as Go's reader does.
static int forked_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int rc = hit_fill(handle, path, data, size, buffer);
	if (rc != FC_MISS) return rc;
	rc = fetch_and_read(handle, path, data, size, buffer);
	if (rc == FC_DIRECT) rc = hit_read_direct(handle, path, data, size, buffer);
	if (rc == FC_MISS || rc == FC_UNAVAILABLE) {
		int checked = hit_read_checked(handle, path, data, size, buffer);
		if (checked != FC_MISS) return checked;
	}
	if (rc == FC_UNAVAILABLE) rc = hit_read_source(handle, path, data, size, buffer);
	return rc == FC_MISS || rc == FC_DIRECT || rc == FC_UNAVAILABLE ? forked_miss() : rc;
}

// read_direct is hit_read_direct for fc_read: a client whose node's server opens its misses
// (cluster mode) asks for the file as a batch of one (hit_read_open_many), so that the bytes of
// a file another node sent come inline, not through a memory file; a server that does not know
// batches opens it alone.
static int read_direct(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int idx = 0, rc = FC_DIRECT;
	if (hit_node_opens(handle))
		hit_read_open_many(handle, &path, &idx, 1, data, size, buffer, &rc);
	return rc == FC_DIRECT ? hit_read_direct(handle, path, data, size, buffer) : rc;
}

// A miss of a small file is the reader's own fill where its server records fills
// (hit_fill); other misses go to the server's node socket first; Go serves what that cannot
// (no server yet, a file no tier takes, cluster mode, a server that does not answer).
int fc_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	if (!path || !data || !size || !buffer) { snprintf(errmsg, sizeof errmsg, "fc_read: NULL argument"); return -EINVAL; }
	int rc = hit_read(handle, path, data, size, buffer);
	if (rc != FC_MISS) return rc;
	if (forked_after_load) return forked_read(handle, path, data, size, buffer);
	rc = hit_fill(handle, path, data, size, buffer);
	if (rc != FC_MISS) return rc;
	rc = fetch_and_read(handle, path, data, size, buffer);
	if (rc == FC_DIRECT) rc = read_direct(handle, path, data, size, buffer);
	if (rc != FC_MISS && rc != FC_UNAVAILABLE) return rc;
	if (rc == FC_UNAVAILABLE) goServerUnavailable(handle);
	rc = goRead(handle, (char *)path, (void **)data, size, buffer);
	if (rc == 0 && fcHitTiers(handle) == 0) goRefreshTiers(handle);
	return rc;
}

// read_misses_through_node serves the misses of fc_read_many (the indices miss[0..nmiss)) as
// fc_read does in cluster mode through the node's server: one round trip to it each, in C.
// It returns how many are left to Go (what C cannot serve), moved to the front of miss. In
// Go, each would cost a connection to the server, a Go buffer and a second copy, and the
// reader's garbage collection (a third of a DataLoader worker's CPU time when most of a
// node's reads are of other nodes' files: perf of bench/bench_cluster.py's share case). They
// are asked one at a time, where Go asked 8 at once: the node's server reads a reader's list
// ahead of it (prefetch), and a node's DataLoader workers ask at once.
static int read_misses_through_node(int64_t handle, const char *const *paths, const void **data, int64_t *sizes,
                                    int64_t *buffers, int *results, int *miss, int nmiss) {
	int left = 0;
	for (int j = 0; j < nmiss; j++) {
		int i = miss[j];
		int rc = fetch_and_read(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		if (rc == FC_DIRECT) rc = hit_read_direct(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		if (rc == FC_UNAVAILABLE) goServerUnavailable(handle);
		if (rc == FC_MISS || rc == FC_DIRECT || rc == FC_UNAVAILABLE) {
			data[i] = NULL; sizes[i] = 0; buffers[i] = 0;
			miss[left++] = i;
			continue;
		}
		results[i] = rc;
	}
	return left;
}

// read_misses_in_batches serves the misses of fc_read_many (the indices miss[0..nmiss)) in
// cluster mode through the node's server as read_misses_through_node does, with one request
// for all of them (hit_read_open_many): the server asks each owner on another node for its
// files in one call, so a batch costs a round trip per owner, not one per file. A server that
// does not know batches is asked for each file alone. It returns how many are left to Go,
// moved to the front of miss.
static int read_misses_in_batches(int64_t handle, const char *const *paths, const void **data, int64_t *sizes,
                                  int64_t *buffers, int *results, int *miss, int nmiss) {
	int alone = hit_read_open_many(handle, paths, miss, nmiss, data, sizes, buffers, results);
	int *asked_alone = alone > 0 ? malloc((size_t)alone * sizeof *asked_alone) : NULL;
	int left = 0, nalone = 0, told = 0;
	for (int j = 0; j < nmiss; j++) {
		int i = miss[j], rc = results[i];
		if (rc == FC_DIRECT && asked_alone) {
			results[i] = -EIO;
			asked_alone[nalone++] = i;
			continue;
		}
		if (rc == FC_UNAVAILABLE && !told) {
			goServerUnavailable(handle);
			told = 1;
		}
		if (rc == FC_MISS || rc == FC_DIRECT || rc == FC_UNAVAILABLE) {
			data[i] = NULL; sizes[i] = 0; buffers[i] = 0; results[i] = -EIO;
			miss[left++] = i;
		}
	}
	if (nalone > 0) {
		memcpy(miss + left, asked_alone, (size_t)nalone * sizeof *miss);
		left += read_misses_through_node(handle, paths, data, sizes, buffers, results, miss + left, nalone);
	}
	free(asked_alone);
	return left;
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
	// Hits first, in C; the misses then go to Go in one call, fetched concurrently there.
	int *miss = malloc((size_t)count * sizeof *miss);
	if (!miss) { snprintf(errmsg, sizeof errmsg, "fc_read_many: out of memory"); return -ENOMEM; }
	int nmiss = 0;
	for (int i = 0; i < count; i++) {
		data[i] = NULL; sizes[i] = 0; buffers[i] = 0;
		int rc = hit_read(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		if (rc == FC_MISS && !forked_after_load) rc = hit_fill(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		results[i] = rc == FC_MISS ? -EIO : rc;
		if (rc == FC_MISS) miss[nmiss++] = i;
	}
	if (nmiss > 0 && !forked_after_load && hit_node_opens(handle))
		nmiss = read_misses_in_batches(handle, paths, data, sizes, buffers, results, miss, nmiss);
	int rc = 0;
	if (nmiss > 0 && forked_after_load) {
		for (int j = 0; j < nmiss; j++) {
			int i = miss[j];
			results[i] = forked_read(handle, paths[i], &data[i], &sizes[i], &buffers[i]);
		}
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
