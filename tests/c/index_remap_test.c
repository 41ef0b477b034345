// Readers follow their server's index across many restarts, with threads racing to map it.
//
// A restarted server writes a new index and marks the old one retired; readers (the hit path
// of libfitcache, the preload shim) then map the new one. Each mapping takes one of a few
// entries of the tier (capi/fclookup.h, FC_TIER_MAPS). When every thread that saw the old index
// retired mapped the new one, the losers of the race used entries up after two or three
// restarts, and the tier stayed on a retired index for the life of the process: files
// published since were never hits again. Here 4 threads look up files while the "server"
// replaces the index 40 times; after that, a file only the last index lists must be a hit.
// Meanwhile a file every index lists must never miss: while one thread maps the new index,
// the others go on with the one they have (a tier that let go of it first sent every reader
// to its server at each restart). fc_index_current tells when a lookup may be behind.
//
// Built by tests/test_capi.py from this file and capi/fclookup.c; writes the index format of
// tiers/index.go itself. Prints "all checks passed".
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fclookup.h"

#define BUCKETS 1024
#define SLOTS 20480 // tiers/index.go indexSlots
#define SLOT 80 // tiers/index.go indexSlotSize
#define INDEX_LEN (SLOTS + BUCKETS * 8 * SLOT)
#define RESTARTS 40

static char tier[256];
static struct fc_tier t;
static int stop; // accessed atomically

static void fail(const char *what) {
	fprintf(stderr, "FAIL: %s (errno %d)\n", what, errno);
	exit(1);
}

// source_path returns the source path of file i; data_file creates its cached copy.
static void source_path(int i, char *out, size_t cap) { snprintf(out, cap, "/data/set/file%03d.bin", i); }

static uint64_t data_file(int i) {
	char src[64], rel[640], dir[512];
	source_path(i, src, sizeof src);
	uint64_t key, check;
	fc_hashes(src, strlen(src), &key, &check);
	snprintf(dir, sizeof dir, "%s/%02x", tier, (unsigned)(key & 0xff));
	mkdir(dir, 0700);
	snprintf(dir, sizeof dir, "%s/%02x/%02x", tier, (unsigned)(key & 0xff), (unsigned)((key >> 8) & 0xff));
	mkdir(dir, 0700);
	snprintf(rel, sizeof rel, "%s/%016llx-file%03d.bin", dir, (unsigned long long)key, i);
	int fd = open(rel, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || write(fd, "abc", 3) != 3)
		fail("write a data file");
	struct stat st;
	fstat(fd, &st);
	close(fd);
	return st.st_ino;
}

// put lists file i (inode ino, 3 bytes, checked in session 1) in the index m.
static void put(uint8_t *m, int i, uint64_t ino) {
	char src[64];
	source_path(i, src, sizeof src);
	uint64_t key, check, size = 3;
	fc_hashes(src, strlen(src), &key, &check);
	size_t bucket = (size_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - 10));
	for (size_t s = bucket * 8; s < bucket * 8 + 8; s++) {
		uint8_t *slot = m + SLOTS + s * SLOT;
		uint32_t used;
		memcpy(&used, slot + 4, 4);
		if (used)
			continue;
		uint32_t one = 1, checked = 1;
		memcpy(slot + 4, &one, 4);
		memcpy(slot + 8, &key, 8);
		memcpy(slot + 16, &check, 8);
		memcpy(slot + 24, &size, 8);
		memcpy(slot + 40, &ino, 8);
		memcpy(slot + 52, &checked, 4);
		return;
	}
	fail("bucket full");
}

// publish_index writes an index listing files 0..n-1 in place of the current one (temporary
// file, rename), then marks the replaced one retired, as a restarting server does.
static void publish_index(const uint64_t *inos, int n) {
	static uint8_t m[INDEX_LEN];
	memset(m, 0, sizeof m);
	memcpy(m, "FCINDEX\x01", 8);
	uint32_t version = 5, ways = 8, buckets = BUCKETS, slot = SLOT;
	memcpy(m + 8, &version, 4);
	memcpy(m + 12, &ways, 4);
	memcpy(m + 16, &buckets, 4);
	memcpy(m + 20, &slot, 4);
	for (int i = 0; i < n; i++)
		put(m, i, inos[i]);
	char tmp[512], path[512];
	snprintf(tmp, sizeof tmp, "%s/.tmp-index", tier);
	snprintf(path, sizeof path, "%s/fitcache.index", tier);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || write(fd, m, sizeof m) != (ssize_t)sizeof m)
		fail("write the index");
	close(fd);
	int old = open(path, O_WRONLY);
	if (rename(tmp, path) != 0)
		fail("rename the index");
	if (old >= 0) {
		uint32_t retired = 1;
		if (pwrite(old, &retired, 4, 24) != 4)
			fail("retire the old index");
		close(old);
	}
}

static int lookup(int i) {
	char src[64];
	source_path(i, src, sizeof src);
	struct fc_hit hit;
	if (fc_lookup(&t, 1, src, strlen(src), O_CLOEXEC, 1, &hit) != 0)
		return 0;
	close(hit.fd);
	return 1;
}

// Lookups of file 0, which every index lists, that missed: a thread must go on with the index
// it has while another maps the new one, never find none.
static long missed;

static void *reader(void *arg) {
	(void)arg;
	while (!__atomic_load_n(&stop, __ATOMIC_RELAXED))
		if (!lookup(0))
			__atomic_fetch_add(&missed, 1, __ATOMIC_RELAXED);
	return NULL;
}

int main(void) {
	snprintf(tier, sizeof tier, "/tmp/fc-remap-XXXXXX");
	if (!mkdtemp(tier))
		fail("mkdtemp");
	uint64_t inos[RESTARTS + 3];
	inos[0] = data_file(0);
	publish_index(inos, 1);
	if (fc_tier_open(&t, tier, 0, 1) != 0)
		fail("fc_tier_open");
	if (!lookup(0))
		fail("file 0 is not a hit in the first index");
	pthread_t threads[4];
	for (int i = 0; i < 4; i++)
		pthread_create(&threads[i], NULL, reader, NULL);
	for (int r = 1; r <= RESTARTS; r++) {
		inos[r] = data_file(r);
		publish_index(inos, r + 1);
		struct timespec pause = {.tv_nsec = 5 * 1000000};
		nanosleep(&pause, NULL); // the readers meet the retired index and map the new one
	}
	__atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
	for (int i = 0; i < 4; i++)
		pthread_join(threads[i], NULL);
	if (missed > 0) {
		fprintf(stderr, "FAIL: %ld lookups of a file every index lists missed while the index was replaced\n",
		        missed);
		return 1;
	}
	// The last index lists file RESTARTS; the tier must have moved to it (allow a second for a
	// retry after a mapping that lost a race with a newer index).
	int hit = 0;
	for (int tries = 0; tries < 200 && !hit; tries++) {
		hit = lookup(RESTARTS);
		struct timespec pause = {.tv_nsec = 10 * 1000000};
		if (!hit)
			nanosleep(&pause, NULL);
	}
	if (!hit) {
		fprintf(stderr, "FAIL: after %d restarts the tier still reads a retired index\n", RESTARTS);
		return 1;
	}
	// A mapping begun by a thread of another process (a parent's, caught mid-way by fork) is
	// taken over at once: the tier goes on with a replaced index only while a thread of its
	// own process maps the new one. The index replaced now lists a file the old one did not.
	inos[RESTARTS + 1] = data_file(RESTARTS + 1);
	uint64_t parent = (uint64_t)(uint32_t)(getpid() + 1) << 32 | (uint32_t)(fc_monotonic_ns() / 1000000);
	__atomic_store_n(&t.remapping, parent, __ATOMIC_RELAXED);
	publish_index(inos, RESTARTS + 2);
	if (!lookup(RESTARTS + 1)) {
		fprintf(stderr, "FAIL: a mapping begun by another process held this one's tier on a replaced index\n");
		return 1;
	}
	// While a thread of this process maps a new index, lookups go on with the replaced one and
	// miss what only the new one lists; fc_index_current says so, so that a reader's fill does
	// not read such a file from the source a second time (capi/miss.c, fill_read).
	if (!fc_index_current(&t)) {
		fprintf(stderr, "FAIL: fc_index_current denies the index just mapped\n");
		return 1;
	}
	inos[RESTARTS + 2] = data_file(RESTARTS + 2);
	uint64_t self = (uint64_t)(uint32_t)getpid() << 32 | (uint32_t)(fc_monotonic_ns() / 1000000);
	__atomic_store_n(&t.remapping, self, __ATOMIC_RELAXED);
	publish_index(inos, RESTARTS + 3);
	if (lookup(RESTARTS + 2) || fc_index_current(&t)) {
		fprintf(stderr, "FAIL: with the new index not yet mapped, a lookup found file %d (%d) or fc_index_current "
		        "said the replaced index is current\n", RESTARTS + 2, lookup(RESTARTS + 2));
		return 1;
	}
	__atomic_store_n(&t.remapping, 0, __ATOMIC_RELAXED);
	if (!fc_index_current(&t) || !lookup(RESTARTS + 2)) {
		fprintf(stderr, "FAIL: once mapped, the new index is not current or misses file %d\n", RESTARTS + 2);
		return 1;
	}
	fc_tier_close(&t);
	char cmd[300];
	snprintf(cmd, sizeof cmd, "rm -rf %s", tier);
	if (system(cmd) != 0)
		fail("clean up");
	printf("all checks passed\n");
	return 0;
}
