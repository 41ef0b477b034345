// The stable fc_* entry points. Each one checks the fork guard before entering Go, because a
// Go runtime inherited through fork() has no threads and would hang; then it calls the Go
// export that does the work (see main.go).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fitcache.h"
#include "_cgo_export.h"

#define FITCACHE_VERSION "0.1.0"

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

int fc_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	if (forked()) return -ECHILD;
	if (!path || !data || !size || !buffer) { snprintf(errmsg, sizeof errmsg, "fc_read: NULL argument"); return -EINVAL; }
	return goRead(handle, (char *)path, (void **)data, size, buffer);
}

int fc_read_many(int64_t handle, int count, const char *const *paths, const void **data, int64_t *sizes,
                 int64_t *buffers, int *results) {
	if (forked()) return -ECHILD;
	if (count < 0 || (count > 0 && (!paths || !data || !sizes || !buffers || !results))) {
		snprintf(errmsg, sizeof errmsg, "fc_read_many: bad argument");
		return -EINVAL;
	}
	for (int i = 0; i < count; i++) {
		if (!paths[i]) { snprintf(errmsg, sizeof errmsg, "fc_read_many: NULL path %d", i); return -EINVAL; }
	}
	if (count == 0) return 0;
	return goReadMany(handle, count, (char **)paths, (void **)data, sizes, buffers, results);
}

int fc_prefetch(int64_t handle, int count, const char *const *paths) {
	if (forked()) return -ECHILD;
	if (count < 0 || (count > 0 && !paths)) { snprintf(errmsg, sizeof errmsg, "fc_prefetch: bad argument"); return -EINVAL; }
	for (int i = 0; i < count; i++) {
		if (!paths[i]) { snprintf(errmsg, sizeof errmsg, "fc_prefetch: NULL path %d", i); return -EINVAL; }
	}
	if (count == 0) return 0;
	return goPrefetch(handle, count, (char **)paths);
}

int fc_release(int64_t buffer) {
	if (forked()) return -ECHILD;
	return goRelease(buffer);
}

int64_t fc_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off) {
	if (forked()) return -ECHILD;
	if (!path || (!buf && len > 0) || len < 0 || off < 0) { snprintf(errmsg, sizeof errmsg, "fc_pread: bad argument"); return -EINVAL; }
	return goPread(handle, (char *)path, buf, len, off);
}

int fc_size(int64_t handle, const char *path, int64_t *size) {
	if (forked()) return -ECHILD;
	if (!path || !size) { snprintf(errmsg, sizeof errmsg, "fc_size: NULL argument"); return -EINVAL; }
	return goSize(handle, (char *)path, size);
}

int fc_stats(int64_t handle, char *buf, size_t len, size_t *needed) {
	if (forked()) return -ECHILD;
	if (!buf && len > 0) { snprintf(errmsg, sizeof errmsg, "fc_stats: NULL buffer"); return -EINVAL; }
	return goStats(handle, buf, len, needed);
}

int fc_debug_open_handles(int64_t *clients, int64_t *buffers) {
	if (forked()) return -ECHILD;
	return goDebugOpenHandles(clients, buffers);
}

int fc_errmsg(char *buf, size_t len) {
	if (!buf || len == 0) return -EINVAL;
	size_t n = strlen(errmsg);
	snprintf(buf, len, "%s", errmsg);
	return n >= len ? -ERANGE : 0;
}

const char *fc_version(void) { return FITCACHE_VERSION; }
