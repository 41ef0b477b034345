// What a tier index's size costs the processes that look files up in it: the page faults and
// CPU of fresh DataLoader workers whose lookups land at random in a mapped index.
//
// The parent writes the keys of ENTRIES files into an index-like file of BUCKETS buckets on
// tmpfs (buckets of 8 slots of 80 bytes after a 20 KiB header, as tiers/index.go lays them
// out, each key in the bucket Fibonacci hashing gives it), then forks WORKERS children one
// after the other, as a DataLoader forks fresh workers; each maps the file read-only, as a
// reader's hit path does, and reads the keys of the buckets of LOOKUPS files drawn at random,
// then exits. Printed: CPU (user + system of the children) and minor page faults per lookup.
//
//   cc -O2 -o /tmp/index_faults bench/index_faults.c
//   for b in 16384 32768 262144; do /tmp/index_faults /dev/shm/fc-index-faults $b 16 1250 20000; done
//
// 20,000 files looked up by 16 workers of 1,250 each: 16,384 buckets (10 MiB) is the most a
// tier of 20,000 files grows its index to (4,096 to 16,384), 32,768 (20 MiB) what a budget of
// 1.1 times a 2.25 GB dataset gave it before it grew with its files, 262,144 (160 MiB) what a
// budget of half a 128 GiB node's /dev/shm gave (BENCHMARKS section 28).
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define HEADER 20480
#define SLOT 80
#define WAYS 8
#define BUCKET (SLOT * WAYS)

static size_t bucket_of(uint64_t key, unsigned log2_buckets) {
	return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - log2_buckets));
}

int main(int argc, char **argv) {
	if (argc != 6) {
		fprintf(stderr, "usage: %s FILE BUCKETS WORKERS LOOKUPS ENTRIES\n", argv[0]);
		return 2;
	}
	const char *path = argv[1];
	long buckets = atol(argv[2]);
	int workers = atoi(argv[3]), lookups = atoi(argv[4]), entries = atoi(argv[5]);
	if (buckets < 2 || buckets > (1L << 24) || (buckets & (buckets - 1)) != 0 || workers < 1 || workers > 4096 ||
	    lookups < 1 || entries < 1) {
		fprintf(stderr, "%s: bad arguments (BUCKETS a power of two up to 2^24)\n", argv[0]);
		return 2;
	}
	unsigned log2_buckets = (unsigned)__builtin_ctzl((unsigned long)buckets);
	size_t len = HEADER + ((size_t)1 << log2_buckets) * BUCKET;

	int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0 || ftruncate(fd, (off_t)len) != 0) {
		perror(path);
		return 1;
	}
	unlink(path); // gone with the last mapping and descriptor
	uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	uint64_t *keys = malloc((size_t)entries * sizeof *keys);
	if (m == MAP_FAILED || !keys) {
		perror("map");
		return 1;
	}
	uint64_t x = 88172645463325252ULL; // xorshift64: the keys, as FNV-1a's are, look random
	for (int i = 0; i < entries; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		keys[i] = x;
		uint8_t *b = m + HEADER + bucket_of(x, log2_buckets) * BUCKET;
		for (int w = 0; w < WAYS; w++) // the first free slot; a full bucket drops the key
			if (*(uint64_t *)(b + w * SLOT + 8) == 0) {
				*(uint64_t *)(b + w * SLOT + 8) = x;
				break;
			}
	}
	munmap(m, len);

	for (int w = 0; w < workers; w++) {
		pid_t pid = fork();
		if (pid < 0) {
			perror("fork");
			return 1;
		}
		if (pid == 0) {
			const uint8_t *r = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
			if (r == MAP_FAILED)
				_exit(1);
			uint64_t seed = 0x9E3779B97F4A7C15ULL * (uint64_t)(w + 1), found = 0;
			for (int i = 0; i < lookups; i++) {
				seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
				uint64_t key = keys[seed % (uint64_t)entries];
				const uint8_t *b = r + HEADER + bucket_of(key, log2_buckets) * BUCKET;
				for (int s = 0; s < WAYS; s++)
					found += *(const volatile uint64_t *)(b + s * SLOT + 8) == key;
			}
			_exit(found == 0);
		}
		int status;
		if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			fprintf(stderr, "worker %d failed\n", w);
			return 1;
		}
	}
	struct rusage ru;
	getrusage(RUSAGE_CHILDREN, &ru);
	double n = (double)workers * lookups;
	double user = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6, sys = ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
	printf("index %6.1f MiB, %d entries, %d workers of %d lookups: %.2f us of CPU per lookup (system %.2f), "
	       "%.2f minor faults per lookup\n",
	       len / 1048576.0, entries, workers, lookups, (user + sys) * 1e6 / n, sys * 1e6 / n, ru.ru_minflt / n);
	return 0;
}
