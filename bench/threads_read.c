/* The read loop of bench/bench_threads.py --strace: T threads of one process read the files
 * of a list through libfitcache (fc_read, then fc_release), with no Python between the reads,
 * so that `strace -f -c` counts the system calls of the library alone (futex ones: threads
 * waiting on each other).
 *
 *   threads_read LIBRARY ROOT OPTIONS_JSON THREADS PASSES LIST
 *
 * LIST holds one path a line. Every file is read once untimed (the client's validation
 * session), then each thread reads its share (every THREADS-th path) PASSES times. Prints the reads done, the wall seconds and the CPU seconds of the process (user +
 * system, Go's threads included) over the reads as JSON. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static int (*fc_open)(const char *, const char *, int64_t *);
static int (*fc_read)(int64_t, const char *, const void **, int64_t *, int64_t *);
static int (*fc_release)(int64_t);
static int (*fc_close)(int64_t);

static int64_t handle;
static char **paths;
static int npaths, nthreads, passes;
static long failed;

static void *reader(void *arg) {
	int id = (int)(intptr_t)arg;
	for (int p = 0; p < passes; p++)
		for (int i = id; i < npaths; i += nthreads) {
			const void *data;
			int64_t size, buf;
			if (fc_read(handle, paths[i], &data, &size, &buf) != 0) {
				__atomic_fetch_add(&failed, 1, __ATOMIC_RELAXED);
				continue;
			}
			fc_release(buf);
		}
	return NULL;
}

int main(int argc, char **argv) {
	if (argc != 7) {
		fprintf(stderr, "usage: threads_read LIBRARY ROOT OPTIONS_JSON THREADS PASSES LIST\n");
		return 2;
	}
	void *lib = dlopen(argv[1], RTLD_NOW);
	if (!lib) {
		fprintf(stderr, "%s\n", dlerror());
		return 2;
	}
	fc_open = dlsym(lib, "fc_open");
	fc_read = dlsym(lib, "fc_read");
	fc_release = dlsym(lib, "fc_release");
	fc_close = dlsym(lib, "fc_close");
	nthreads = atoi(argv[4]);
	passes = atoi(argv[5]);
	FILE *f = fopen(argv[6], "r");
	if (!f || nthreads < 1 || nthreads > 1024) {
		perror(argv[6]);
		return 2;
	}
	char line[4096];
	int cap = 0;
	while (fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = 0;
		if (npaths == cap)
			paths = realloc(paths, (cap = cap ? 2 * cap : 1024) * sizeof *paths);
		paths[npaths++] = strdup(line);
	}
	fclose(f);
	if (fc_open(argv[2], argv[3], &handle) != 0) {
		fprintf(stderr, "fc_open failed\n");
		return 1;
	}
	for (int i = 0; i < npaths; i++) {
		const void *data;
		int64_t size, buf;
		if (fc_read(handle, paths[i], &data, &size, &buf) == 0)
			fc_release(buf);
	}
	pthread_t t[1024];
	struct timespec a, b;
	struct rusage ra, rb;
	getrusage(RUSAGE_SELF, &ra);
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (int i = 0; i < nthreads; i++)
		pthread_create(&t[i], NULL, reader, (void *)(intptr_t)i);
	for (int i = 0; i < nthreads; i++)
		pthread_join(t[i], NULL);
	clock_gettime(CLOCK_MONOTONIC, &b);
	getrusage(RUSAGE_SELF, &rb);
	fc_close(handle);
	double cpu = (double)(rb.ru_utime.tv_sec - ra.ru_utime.tv_sec + rb.ru_stime.tv_sec - ra.ru_stime.tv_sec) +
	             (double)(rb.ru_utime.tv_usec - ra.ru_utime.tv_usec + rb.ru_stime.tv_usec - ra.ru_stime.tv_usec) / 1e6;
	printf("{\"reads\": %ld, \"failed\": %ld, \"seconds\": %.6f, \"cpu_seconds\": %.6f}\n",
	       (long)npaths * passes - failed, failed, (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9,
	       cpu);
	return failed != 0;
}
