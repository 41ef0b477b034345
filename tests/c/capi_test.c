/* Tests the C interface of libfitcache: run as `capi_test DATASET_ROOT`, where the dataset
 * holds a.bin (any bytes), empty.bin (0 bytes) and a directory sub/. Exits 0 when every check
 * passes; prints each failure. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fitcache.h"

static int failures;

#define CHECK(cond, ...)                                             \
	do {                                                             \
		if (!(cond)) {                                               \
			failures++;                                              \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                            \
			fputc('\n', stderr);                                     \
		}                                                            \
	} while (0)

static char *slurp(const char *path, long *len) {
	FILE *f = fopen(path, "rb");
	if (!f) return NULL;
	fseek(f, 0, SEEK_END);
	*len = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *buf = malloc(*len + 1);
	if (fread(buf, 1, *len, f) != (size_t)*len) { free(buf); buf = NULL; }
	fclose(f);
	return buf;
}

static const char *errmsg(void) {
	static char buf[512];
	fc_errmsg(buf, sizeof buf);
	return buf;
}

int main(int argc, char **argv) {
	if (argc != 2) { fprintf(stderr, "usage: capi_test DATASET_ROOT\n"); return 2; }
	const char *root = argv[1];
	char path[4096];
	snprintf(path, sizeof path, "%s/a.bin", root);
	long want_len;
	char *want = slurp(path, &want_len);
	if (!want) { perror(path); return 2; }

	int64_t h = 0;
	int rc = fc_open(root, NULL, &h);
	CHECK(rc == 0 && h > 0, "fc_open: %d %s", rc, errmsg());

	/* Whole-file zero-copy reads, twice (a miss, then a hit), by relative and absolute path. */
	const char *names[] = {"a.bin", path};
	for (int i = 0; i < 2; i++) {
		const void *data = NULL; int64_t size = -1, buf = 0;
		rc = fc_read(h, names[i], &data, &size, &buf);
		CHECK(rc == 0, "fc_read %s: %d %s", names[i], rc, errmsg());
		CHECK(size == want_len && data && memcmp(data, want, want_len) == 0, "fc_read %s: wrong bytes", names[i]);
		CHECK(fc_release(buf) == 0, "fc_release: %s", errmsg());
		CHECK(fc_release(buf) == -EBADF, "second fc_release must be -EBADF");
	}
	{
		const void *data = (void *)1; int64_t size = -1, buf = 0;
		rc = fc_read(h, "empty.bin", &data, &size, &buf);
		CHECK(rc == 0 && size == 0 && data == NULL, "empty file: rc %d size %lld", rc, (long long)size);
		CHECK(fc_release(buf) == 0, "release of empty buffer");
	}

	/* Batched reads: each file's result on its own, buffers released one by one. */
	{
		const char *batch[] = {"a.bin", "missing.bin", "empty.bin", "sub", path};
		enum { N = 5 };
		const void *datas[N]; int64_t sizes[N], bufs[N]; int results[N];
		rc = fc_read_many(h, N, batch, datas, sizes, bufs, results);
		CHECK(rc == 0, "fc_read_many: %d %s", rc, errmsg());
		CHECK(results[0] == 0 && sizes[0] == want_len && memcmp(datas[0], want, want_len) == 0, "batch a.bin");
		CHECK(results[1] == -ENOENT && datas[1] == NULL, "batch missing: %d", results[1]);
		CHECK(results[2] == 0 && sizes[2] == 0, "batch empty: %d", results[2]);
		CHECK(results[3] == -EISDIR, "batch directory: %d", results[3]);
		CHECK(results[4] == 0 && sizes[4] == want_len && memcmp(datas[4], want, want_len) == 0, "batch absolute");
		for (int i = 0; i < N; i++)
			if (results[i] == 0) CHECK(fc_release(bufs[i]) == 0, "release batch buffer %d", i);
		CHECK(fc_read_many(h, 0, NULL, NULL, NULL, NULL, NULL) == 0, "empty batch");
		CHECK(fc_read_many(h, -1, batch, datas, sizes, bufs, results) == -EINVAL, "negative count");
		const char *nullpath[] = {"a.bin", NULL};
		CHECK(fc_read_many(h, 2, nullpath, datas, sizes, bufs, results) == -EINVAL, "NULL path in a batch");
		CHECK(fc_read_many(h + 1000, 1, batch, datas, sizes, bufs, results) == -EBADF, "batch on an unknown handle");
	}

	/* Prefetch: the server takes the list; bad arguments and paths are refused, nothing sent. */
	{
		const char *list[] = {"a.bin", "empty.bin", path};
		CHECK(fc_prefetch(h, 3, list) == 0, "fc_prefetch: %s", errmsg());
		CHECK(fc_prefetch(h, 0, NULL) == 0, "empty prefetch list");
		CHECK(fc_prefetch(h, -1, list) == -EINVAL, "negative prefetch count");
		const char *nullpath[] = {"a.bin", NULL};
		CHECK(fc_prefetch(h, 2, nullpath) == -EINVAL, "NULL path in a prefetch list");
		const char *outside[] = {"a.bin", "/etc/passwd"};
		CHECK(fc_prefetch(h, 2, outside) == -EACCES, "prefetch outside the root: %s", errmsg());
		CHECK(fc_prefetch(h + 1000, 3, list) == -EBADF, "prefetch on an unknown handle");
	}

	/* pread into a caller buffer, size. */
	char part[100];
	int64_t n = fc_pread(h, "a.bin", part, sizeof part, 10);
	CHECK(n == 100 && memcmp(part, want + 10, 100) == 0, "fc_pread: %lld %s", (long long)n, errmsg());
	CHECK(fc_pread(h, "a.bin", part, sizeof part, want_len) == 0, "fc_pread at EOF must return 0");
	CHECK(fc_pread(h, "a.bin", part, sizeof part, -1) == -EINVAL, "negative offset");
	int64_t size = 0;
	CHECK(fc_size(h, "a.bin", &size) == 0 && size == want_len, "fc_size: %lld", (long long)size);
	/* The embedded server: not cluster mode; an unknown handle is -EBADF. */
	CHECK(fc_cluster(h) == 0, "fc_cluster of an embedded client: %d", fc_cluster(h));
	CHECK(fc_cluster(h + 1000) == -EBADF, "fc_cluster of an unknown handle");

	/* Errors map to errno values with a message. */
	const void *data; int64_t sz, buf;
	rc = fc_read(h, "missing.bin", &data, &sz, &buf);
	CHECK(rc == -ENOENT, "missing file: %d", rc);
	CHECK(strstr(errmsg(), "missing.bin") != NULL, "message names the file: %s", errmsg());
	CHECK(fc_read(h, "/etc/passwd", &data, &sz, &buf) == -EACCES, "outside root");
	CHECK(fc_read(h, "../outside", &data, &sz, &buf) == -EACCES, "dot-dot escape");
	CHECK(fc_read(h, "sub", &data, &sz, &buf) == -EISDIR, "directory");
	CHECK(fc_read(h, NULL, &data, &sz, &buf) == -EINVAL, "NULL path");
	CHECK(fc_read(h + 1000, "a.bin", &data, &sz, &buf) == -EBADF, "unknown handle");
	int64_t bad;
	CHECK(fc_open("/nonexistent/dataset", NULL, &bad) == -ENOENT, "missing root");
	CHECK(fc_open(root, "{\"no_such_option\": \"1\"}", &bad) == -EINVAL, "unknown option");
	CHECK(fc_open(root, "not json", &bad) == -EINVAL, "bad options JSON");

	/* fc_errmsg truncates with -ERANGE and always terminates. */
	fc_read(h, "missing.bin", &data, &sz, &buf);
	char small[8];
	CHECK(fc_errmsg(small, sizeof small) == -ERANGE && strlen(small) == 7, "errmsg truncation");

	/* Stats as JSON, with -ERANGE and the needed size when the buffer is small. */
	size_t needed = 0;
	char tiny[4];
	CHECK(fc_stats(h, tiny, sizeof tiny, &needed) == -ERANGE && needed > sizeof tiny, "stats ERANGE");
	char *js = malloc(needed + 1024);
	CHECK(fc_stats(h, js, needed + 1024, NULL) == 0 && strstr(js, "\"source_reads\"") != NULL, "stats: %s", js);
	CHECK(strstr(js, "\"prefetch\"") != NULL, "stats without prefetch counters: %s", js);
	free(js);

	/* Fork after load: the child serves cached files (the hit path needs no Go runtime), has
	 * the embedded server cache a miss through its node socket, and gets -ECHILD at once for
	 * everything that needs Go, never a hang. */
	char late[4096];
	snprintf(late, sizeof late, "%s/late.bin", root);
	FILE *lf = fopen(late, "wb");
	CHECK(lf && fwrite("written late", 1, 12, lf) == 12 && fclose(lf) == 0, "write %s", late);
	pid_t pid = fork();
	if (pid == 0) {
		alarm(10); /* a hang would be killed by SIGALRM and fail the check below */
		int64_t ch;
		const void *d = NULL; int64_t s = 0, b = 0;
		int hit = fc_read(h, "a.bin", &d, &s, &b);
		int same = hit == 0 && s == want_len && memcmp(d, want, want_len) == 0;
		int released = hit == 0 && fc_release(b) == 0;
		int miss = fc_read(h, "late.bin", &d, &s, &b);
		int fetched = miss == 0 && s == 12 && memcmp(d, "written late", 12) == 0 && fc_release(b) == 0;
		int r1 = fc_read(h, "missing.bin", &data, &sz, &buf);
		int r2 = fc_open(root, NULL, &ch);
		char msg[512];
		fc_errmsg(msg, sizeof msg);
		int r3 = fc_debug_open_handles(NULL, NULL);
		const char *one[] = {"a.bin"};
		int r4 = fc_prefetch(h, 1, one);
		if (!same || !released) fprintf(stderr, "child: cached a.bin: rc %d, %lld bytes\n", hit, (long long)s);
		if (!fetched) fprintf(stderr, "child: late.bin through the node socket: rc %d, %lld bytes\n", miss, (long long)s);
		if (r1 != -ENOENT || r2 != -ECHILD || r3 != -ECHILD || r4 != -ECHILD || !strstr(msg, "fork"))
			fprintf(stderr, "child: missing %d open %d handles %d prefetch %d: %s\n", r1, r2, r3, r4, msg);
		_exit(same && released && fetched && r1 == -ENOENT && r2 == -ECHILD && r3 == -ECHILD && r4 == -ECHILD &&
		      strstr(msg, "fork") ? 0 : 1);
	}
	int status = 0;
	waitpid(pid, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child: status %d", status);

	/* A handle of one kind is never valid as the other: fc_close of a buffer and fc_release of
	 * a client are -EBADF and change nothing. */
	{
		int64_t h2 = 0, nc = -1, nb = -1;
		CHECK(fc_open(root, NULL, &h2) == 0, "second fc_open: %s", errmsg());
		const void *d1 = NULL; int64_t s1 = 0, b1 = 0;
		CHECK(fc_read(h2, "a.bin", &d1, &s1, &b1) == 0 && s1 == want_len, "fc_read: %s", errmsg());
		CHECK(fc_debug_open_handles(&nc, &nb) == 0 && nc == 2 && nb == 1,
		      "open handles with a buffer out: %lld clients, %lld buffers", (long long)nc, (long long)nb);
		CHECK(b1 != h && b1 != h2, "buffer %lld has a client's number", (long long)b1);
		CHECK(fc_close(b1) == -EBADF, "fc_close of a buffer must be -EBADF");
		CHECK(fc_release(h) == -EBADF && fc_release(h2) == -EBADF, "fc_release of a client must be -EBADF");
		CHECK(fc_size(b1, "a.bin", &size) == -EBADF, "a buffer is not a client");
		CHECK(fc_size(h, "a.bin", &size) == 0 && fc_size(h2, "a.bin", &size) == 0, "clients still open: %s", errmsg());
		CHECK(memcmp(d1, want, want_len) == 0, "buffer still valid");
		CHECK(fc_close(h2) == 0, "fc_close of the second client");
		CHECK(memcmp(d1, want, want_len) == 0, "buffer outlives its client");
		CHECK(fc_release(b1) == 0, "fc_release: %s", errmsg());
		CHECK(fc_debug_open_handles(NULL, NULL) == 0, "NULL counts");
	}

	CHECK(fc_close(h) == 0, "fc_close");
	CHECK(fc_close(h) == -EBADF, "second fc_close");
	{
		int64_t nc = -1, nb = -1;
		CHECK(fc_debug_open_handles(&nc, &nb) == 0 && nc == 0 && nb == 0,
		      "everything closed and released: %lld clients, %lld buffers left", (long long)nc, (long long)nb);
	}
	CHECK(strlen(fc_version()) > 0, "version");
	free(want);
	if (failures) { fprintf(stderr, "%d failures\n", failures); return 1; }
	printf("capi_test: all checks passed\n");
	return 0;
}
