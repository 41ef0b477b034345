/* Fork before load: the child loads libfitcache with dlopen after fork() and must work
 * normally. Run as `fork_before_load LIBRARY DATASET_ROOT`; reads a.bin in the child. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*open_fn)(const char *, const char *, int64_t *);
typedef int (*read_fn)(int64_t, const char *, const void **, int64_t *, int64_t *);
typedef int (*release_fn)(int64_t);

int main(int argc, char **argv) {
	if (argc != 3) { fprintf(stderr, "usage: fork_before_load LIBRARY DATASET_ROOT\n"); return 2; }
	pid_t pid = fork();
	if (pid == 0) {
		alarm(30);
		void *lib = dlopen(argv[1], RTLD_NOW);
		if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); _exit(3); }
		open_fn fc_open = (open_fn)dlsym(lib, "fc_open");
		read_fn fc_read = (read_fn)dlsym(lib, "fc_read");
		release_fn fc_release = (release_fn)dlsym(lib, "fc_release");
		int64_t h, size, buf;
		const void *data;
		if (fc_open(argv[2], NULL, &h) != 0) _exit(4);
		if (fc_read(h, "a.bin", &data, &size, &buf) != 0 || size <= 0) _exit(5);
		fc_release(buf);
		_exit(0);
	}
	int status = 0;
	waitpid(pid, &status, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "fork_before_load: child failed, status %d\n", status);
		return 1;
	}
	printf("fork_before_load: child read through the library\n");
	return 0;
}
