/* ranged_reads PATH SMALL: reads the large file PATH through every read function the preload
 * shim serves from cached blocks (test_ranges.py runs it with and without the shim), and prints,
 * for each, the FNV-1a hash of what it read and how many bytes; then what a descriptor number
 * reads once dup2 put another file (SMALL) in its place, how many bytes two threads read with
 * read() from one descriptor (the file's size: each byte once), and what a forked child
 * reads. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t fnv(uint64_t h, const unsigned char *p, size_t n) {
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

#define CHUNK 300007 /* not a divisor of any block size: reads span blocks */
static unsigned char fixed[CHUNK]; /* of a size the compiler knows: the fortified forms */

/* hidden: the compiler cannot see the buffer's size, so the plain forms are called */
static unsigned char *__attribute__((noinline)) opaque(unsigned char *p) {
	__asm__ volatile("" : "+r"(p));
	return p;
}

static size_t __attribute__((noinline)) opaque_n(size_t n) {
	__asm__ volatile("" : "+r"(n));
	return n;
}

/* Two threads reading one descriptor with read() (no offset) until its end. */
static int shared_fd;
static long long shared_bytes[2];

static void *read_shared(void *arg) {
	long long *total = arg;
	unsigned char *buf = malloc(1 << 20);
	ssize_t got;
	while ((got = read(shared_fd, buf, 1 << 20)) > 0)
		*total += got;
	free(buf);
	return NULL;
}

static void report(const char *how, uint64_t h, long long n) { printf("%s\t%016llx\t%lld\n", how, (unsigned long long)h, n); }

int main(int argc, char **argv) {
	const char *path = argv[1], *small = argv[2];
	unsigned char *buf = opaque(malloc(2 * CHUNK));
	const char *hows[] = {"read", "pread", "pread64", "readv", "preadv", "preadv64", "preadv2", "preadv2 -1",
	                      "__read_chk", "__pread_chk", "__pread64_chk"};
	for (size_t m = 0; m < sizeof hows / sizeof *hows; m++) {
		int fd = open(path, O_RDONLY);
		if (fd < 0) {
			perror(path);
			return 1;
		}
		uint64_t h = 14695981039346656037ULL;
		long long off = 0;
		for (;;) {
			ssize_t got;
			struct iovec v[2] = {{buf, 1000}, {buf + 1000, CHUNK - 1000}};
			switch (m) {
			case 0: got = read(fd, buf, CHUNK); break;
			case 1: got = pread(fd, buf, CHUNK, off); break;
			case 2: got = pread64(fd, buf, CHUNK, off); break;
			case 3: got = readv(fd, v, 2); break;
			case 4: got = preadv(fd, v, 2, off); break;
			case 5: got = preadv64(fd, v, 2, off); break;
			case 6: got = preadv2(fd, v, 2, off, 0); break;
			case 7: got = preadv2(fd, v, 2, -1, 0); break;
			case 8: got = read(fd, fixed, opaque_n(sizeof fixed)); break;
			case 9: got = pread(fd, fixed, opaque_n(sizeof fixed), off); break;
			default: got = pread64(fd, fixed, opaque_n(sizeof fixed), off); break;
			}
			if (got < 0) {
				perror(hows[m]);
				return 1;
			}
			if (got == 0)
				break;
			h = fnv(h, m >= 8 ? fixed : buf, (size_t)got);
			off += got;
			if ((m == 0 || m == 3 || m == 7 || m == 8) && lseek(fd, 0, SEEK_CUR) != off) {
				fprintf(stderr, "%s: the offset is %lld after reading %lld bytes\n", hows[m], (long long)lseek(fd, 0, SEEK_CUR), off);
				return 1;
			}
		}
		close(fd);
		report(hows[m], h, off);
	}
	/* A descriptor number that comes to name another file (dup2) reads that file. */
	int fd = open(path, O_RDONLY), other = open(small, O_RDONLY);
	ssize_t got = pread(fd, buf, 100, 0);
	dup2(other, fd);
	got = pread(fd, buf, CHUNK, 0);
	report("dup2", fnv(14695981039346656037ULL, buf, got > 0 ? (size_t)got : 0), got);
	close(fd);
	/* Two threads sharing a descriptor's offset read each byte once between them. */
	shared_fd = open(path, O_RDONLY);
	pthread_t threads[2];
	for (int i = 0; i < 2; i++)
		pthread_create(&threads[i], NULL, read_shared, &shared_bytes[i]);
	for (int i = 0; i < 2; i++)
		pthread_join(threads[i], NULL);
	close(shared_fd);
	report("threads", 0, shared_bytes[0] + shared_bytes[1]);
	/* A child forked with the descriptor open reads it too. */
	fd = open(path, O_RDONLY);
	got = pread(fd, buf, 10, 0);
	fflush(stdout);
	pid_t pid = fork();
	if (pid == 0) {
		uint64_t h = 14695981039346656037ULL;
		long long off = 0;
		while ((got = pread(fd, buf, CHUNK, off)) > 0) {
			h = fnv(h, buf, (size_t)got);
			off += got;
		}
		report("fork", h, off);
		fflush(stdout);
		_exit(got < 0);
	}
	int status;
	waitpid(pid, &status, 0);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
