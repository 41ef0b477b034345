// The miss decision: what hit_read did not find is served here without Go where it can be,
// decided once for each miss (see hit_miss): the reader's own fill, the node's server
// (an open, or a fetch into its tiers), or the source.
#define _GNU_SOURCE
#include "hitclient.h"

#include "fcnode.h"
#include "fill.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

// same_file reports whether two fstat results of a source show one version of one file.
static int same_file(const struct stat *a, const struct stat *b) {
	return a->st_size == b->st_size && a->st_ino == b->st_ino && a->st_dev == b->st_dev &&
	       a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
	       a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

// record reports c's fill f of the file at the clean path path (len bytes), read as st, to
// the server (FC_NODE_OP_RECORD), with the CRC-32C of the bytes written: 0 when sent.
static int record(struct hit_client *c, const char *path, size_t len, const struct stat *st, const struct fc_fill *f) {
	char field[FC_PATH_MAX + 1 + FC_NODE_RECORD_BYTES];
	if (len + 1 + FC_NODE_RECORD_BYTES > sizeof field)
		return -1;
	memcpy(field, path, len);
	uint8_t *r = (uint8_t *)field + len + 1;
	field[len] = 0;
	uint64_t v[5] = {(uint64_t)st->st_size, (uint64_t)ts_ns(st->st_mtim), (uint64_t)ts_ns(st->st_ctim),
	                 (uint64_t)st->st_ino, f->ino};
	for (int i = 0; i < 5; i++) {
		fc_put32(r + 8 * i, (uint32_t)v[i]);
		fc_put32(r + 8 * i + 4, (uint32_t)(v[i] >> 32));
	}
	fc_put32(r + 40, ((uint32_t)st->st_mode & FC_NODE_RECORD_MODE_BITS) | FC_NODE_RECORD_HAS_CRC);
	fc_put32(r + FC_NODE_RECORD_CRC_OFFSET, f->crc);
	return node_tell(c, FC_NODE_OP_RECORD, field, len + 1 + FC_NODE_RECORD_BYTES);
}

// marked_full reports whether c's server marked its tiers full for c's dataset in the last
// FULL_RECHECK_NS (tiers.MarkFull: the mark ".full-<key of the root>" in the first tier, its
// modification time when the server last found no room); then c stops filling for as long,
// as a server's ENOSPC answer makes it skip the server (node_fetch).
static int marked_full(struct hit_client *c) {
	static const char hex[] = "0123456789abcdef";
	uint64_t key, check;
	fc_hashes(c->root, c->rootlen, &key, &check);
	char name[6 + 16 + 1] = ".full-";
	for (int i = 0; i < 16; i++)
		name[6 + i] = hex[(key >> (60 - 4 * i)) & 15];
	name[22] = 0;
	struct stat st;
	struct timespec now;
	if (syscall(SYS_newfstatat, c->tiers[0].dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	    clock_gettime(CLOCK_REALTIME, &now) != 0 || ts_ns(now) - ts_ns(st.st_mtim) >= FULL_RECHECK_NS)
		return 0;
	__atomic_store_n(&c->full_until, fc_monotonic_ns() + FULL_RECHECK_NS, __ATOMIC_RELAXED);
	return 1;
}

// A source that makes its readers wait (a parallel file system, where each lookup, open and
// read is a round trip to its servers) is read by several threads of a batch at once
// (hit_miss_many); a source read from memory (the page cache, a local disk's cache) is not,
// since a thread costs more CPU than it saves there. A fill waited on the source when its
// source system calls (the look, the open, its fstat and reads; nothing of the tiers) made its
// thread give up the CPU (a voluntary context switch; a preemption on a busy node is not one)
// and spent SOURCE_WAIT_NS or more off it in all. SOURCE_WAITS_TO_SPREAD such fills in a row
// (of any of the process's threads) take the source as slow for SOURCE_WAIT_KEEP_NS, so that
// the next batches spread at once; a fill that did not wait ends the row. A single wait (a
// cold directory lookup, a page fault) spreads nothing.
#define SOURCE_WAIT_NS 200000LL
#define SOURCE_WAITS_TO_SPREAD 2
#define SOURCE_WAIT_KEEP_NS 1000000000LL

// A thread's clocks at a moment (wait_clock_read).
struct wait_clock {
	int64_t wall_ns, cpu_ns;
	long voluntary; // context switches the thread made
};

// What a fill's source system calls cost it off the CPU (source_wait_begin, source_wait_end).
struct source_wait {
	struct wait_clock start;
	int64_t off_cpu_ns;
	bool slept;   // a voluntary context switch
	bool unknown; // a clock could not be read: not judged
};

static int wait_clock_read(struct wait_clock *w) {
	struct rusage ru;
	if (getrusage(RUSAGE_THREAD, &ru) != 0)
		return -1;
	w->wall_ns = fc_monotonic_ns();
	w->cpu_ns = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000000LL +
	            (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1000LL;
	w->voluntary = ru.ru_nvcsw;
	return 0;
}

static void source_wait_begin(struct source_wait *w) {
	if (wait_clock_read(&w->start) != 0)
		w->unknown = true;
}

static void source_wait_end(struct source_wait *w) {
	struct wait_clock end;
	if (w->unknown || wait_clock_read(&end) != 0) {
		w->unknown = true;
		return;
	}
	w->off_cpu_ns += (end.wall_ns - w->start.wall_ns) - (end.cpu_ns - w->start.cpu_ns);
	w->slept |= end.voluntary > w->start.voluntary;
}

// judge_source counts a fill of c's process that read the source, and whether it waited.
static void judge_source(struct hit_client *c, const struct source_wait *w) {
	if (w->unknown)
		return;
	if (!w->slept || w->off_cpu_ns < SOURCE_WAIT_NS) {
		if (__atomic_load_n(&c->source_wait_row, __ATOMIC_RELAXED) != 0)
			__atomic_store_n(&c->source_wait_row, 0, __ATOMIC_RELAXED);
		return;
	}
	if (__atomic_add_fetch(&c->source_wait_row, 1, __ATOMIC_RELAXED) >= SOURCE_WAITS_TO_SPREAD)
		__atomic_store_n(&c->source_waits_until, fc_monotonic_ns() + SOURCE_WAIT_KEEP_NS, __ATOMIC_RELAXED);
}

// source_waits reports whether fills of c's process lately waited on the source.
static bool source_waits(struct hit_client *c) {
	return fc_monotonic_ns() < __atomic_load_n(&c->source_waits_until, __ATOMIC_RELAXED);
}

// fill_read serves a miss of a small file (up to read_max) as the reader's own fill, when
// c's server records fills (fcHitSetFills): the file is claimed in the server's first tier
// (capi/fill.h), read from the source here, its copy written into that tier and reported to
// the server, which records it without being waited for. Returns as hit_read: FC_MISS
// whenever the server should serve it instead (another process holds the claim, the source
// cannot be opened here or changes while read, no server).
static int fill_read(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                     int64_t *buffer) {
	int saved = errno;
	int nt, rc = FC_MISS, fd = -1, claimed = 0;
	struct fc_fill fill;
	if (!__atomic_load_n(&c->fills, __ATOMIC_RELAXED) || c->node_opens || (nt = tier_count(c)) == 0 ||
	    fc_monotonic_ns() < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED) ||
	    fc_monotonic_ns() < __atomic_load_n(&c->full_until, __ATOMIC_RELAXED) || marked_full(c))
		goto out;
	// Whatever fails here leaves the file to the server (FC_MISS), which reads it and says why.
	// A look, the tiers and the claim first: a file that is too large, cached already, or read
	// by another process is not opened here as well as there.
	struct stat look, before, after;
	const char *rel = clean + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	struct fc_hit h;
	struct source_wait wait = {0};
	if ((size_t)n <= c->rootlen || c->real_root_fd < 0)
		goto out;
	source_wait_begin(&wait);
	int looked = (int)syscall(SYS_newfstatat, c->real_root_fd, rel, &look, 0);
	source_wait_end(&wait);
	if (looked != 0 || !S_ISREG(look.st_mode) || look.st_size > read_max)
		goto out;
	// A copy the tiers list but this job has not had checked yet (hit_read's miss): the
	// server checks it (one stat), no fill.
	if (fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, 0, &h) == 0) {
		close(h.fd);
		goto out;
	}
	if (fc_fill_claim(&c->tiers[0], clean, (size_t)n, (uint32_t)look.st_mode, &fill) != 0)
		goto out; // another process reads it: the server waits for it
	claimed = 1;
	// A copy published between the look above and the claim (a fill whose claim was given up
	// once its copy was listed) is listed by the index now, but a lookup may not see it yet: it
	// trusts an index checked a moment ago, and goes on with one its server just replaced (a
	// growth) while another thread maps the new one. So the file is read here only when the
	// indexes are their servers' now, else the server serves it: never a second source read.
	for (int i = 0; i < nt; i++)
		if (!fc_index_current(&c->tiers[i]))
			goto out;
	if (fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, 0, &h) == 0) {
		close(h.fd); // recorded between the look above and the claim: the server serves it
		goto out;
	}
	source_wait_begin(&wait);
	fd = open_beneath_root(c, clean, (size_t)n);
	if (fd < 0 || fc_sys_fstat(fd, &before) != 0 || !S_ISREG(before.st_mode) || before.st_size > read_max)
		goto out;
	h = (struct fc_hit){.fd = fd, .size = before.st_size};
	void *ptr;
	uint8_t kind;
	if (take(&h, &ptr, &kind) != 0)
		goto out;
	source_wait_end(&wait);
	judge_source(c, &wait);
	if (fc_sys_fstat(fd, &after) != 0 || !same_file(&before, &after)) {
		free_mem(ptr, (size_t)h.size, kind); // changed while read: the server reads it, or says so
		goto out;
	}
	// The reader has the bytes: a copy that cannot be written or reported is only not cached.
	// The copy is made what the server would make it (its checksum, its times and mode, see
	// capi/fill.h) so that the server only records it.
	if (fc_fill_write(&fill, ptr, (size_t)h.size) == 0) {
		fc_fill_finish(&fill, before.st_mtim);
		if (record(c, clean, (size_t)n, &before, &fill) == 0) {
			fc_fill_keep(&fill);
			claimed = 0;
		}
	}
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->filled, 1, __ATOMIC_RELAXED);
out:
	if (claimed)
		fc_fill_drop(&fill);
	if (fd >= 0)
		close(fd);
	errno = saved;
	return rc;
}

// ask_node serves a miss of the clean path clean (n bytes) through c's node's server, or
// returns FC_MISS when c has none up. A server that opens files for its clients (cluster
// mode: c->node_opens) answers with a descriptor (OpOpen) in one round trip, its tier's copy
// or the bytes another node sent: asking it to fetch first (OpFetch) and then finding the
// file would cost a second round trip, and a second transfer of a file it has no room to
// keep. Unless alone, that file is asked for as a batch of one (node_open_many), so that the
// bytes of a file another node sent come inline, not through a memory file; a server that
// does not know batches opens it alone. Any other server is asked to fetch the file into its
// tiers, which are then read; a file no tier takes is read from the source.
static int ask_node(struct hit_client *c, const char *clean, size_t n, bool alone, const void **data,
                    int64_t *size, int64_t *buffer, char *msg) {
	if (!node_up(c))
		return FC_MISS;
	if (c->node_opens) {
		int rc = FC_ASK_ALONE, idx = 0;
		if (!alone)
			node_open_many(c, &clean, &idx, 1, data, size, buffer, &rc);
		return rc == FC_ASK_ALONE ? node_open_read(c, clean, n, data, size, buffer) : rc;
	}
	char said[FC_FETCH_MESSAGE] = "";
	int rc = node_fetch(c, FC_NODE_OP_FETCH, clean, n, said);
	if (rc == 0)
		return read_cached(c, clean, n, data, size, buffer, 0); // the server counted the miss
	if (rc == FC_NO_TIER)
		return read_source(c, clean, n, data, size, buffer);
	if (rc < 0) // msg is written for errors only: with several in a batch, one of theirs stays
		snprintf(msg, FC_FETCH_MESSAGE, "%s", said[0] ? said : strerror(-rc));
	return rc;
}

// around_node serves, in a process forked after load (which cannot enter Go), a miss of the
// clean path clean (n bytes) of c that the node's server did not serve (rc: FC_MISS, or
// FC_UNAVAILABLE when none listened or it did not answer): from a copy the tiers hold once
// the source shows the copy's version (read_checked), as Go's reader does, else, when the
// server did not answer, from the source. Returns as hit_miss.
static int around_node(struct hit_client *c, const char *clean, size_t n, int rc, const void **data,
                       int64_t *size, int64_t *buffer) {
	int checked = read_checked(c, clean, n, data, size, buffer);
	if (checked != FC_MISS)
		return checked;
	return rc == FC_UNAVAILABLE ? read_source(c, clean, n, data, size, buffer) : rc;
}

// decide serves a miss of the clean path clean (n bytes) of c: the reader's own fill, else
// the node's server, else, in a process forked after load, around it (around_node).
// Returns as hit_miss.
static int decide(struct hit_client *c, const char *clean, size_t n, bool forked, const void **data,
                  int64_t *size, int64_t *buffer, char *msg) {
	int rc = fill_read(c, clean, n, data, size, buffer);
	if (rc == FC_MISS)
		rc = ask_node(c, clean, n, false, data, size, buffer, msg);
	if (forked && (rc == FC_MISS || rc == FC_UNAVAILABLE))
		rc = around_node(c, clean, n, rc, data, size, buffer);
	return rc;
}

int hit_miss(int64_t handle, const char *path, bool forked, const void **data, int64_t *size, int64_t *buffer,
             char *msg) {
	msg[0] = 0;
	// A reference is held through the miss, so that the client cannot go meanwhile
	// (fcHitClose waits for it); no lock is held while the server is waited for.
	int saved = errno; // a miss served answers without touching the caller's errno
	struct hit_client *c = acquire(handle);
	char clean[FC_PATH_MAX];
	int n, rc = FC_MISS;
	if (c && (n = source_path(c, path, clean, sizeof clean)) >= 0)
		rc = decide(c, clean, (size_t)n, forked, data, size, buffer, msg);
	put(c);
	errno = saved;
	return rc;
}

// open_in_batches serves the misses miss[0..nmiss) of hit_miss_many through c's node's
// server, which opens them (c->node_opens), with one request for all of them
// (node_open_many): the server asks each owner on another node for its files in one call, so
// a batch costs a round trip per owner, not one per file. A server that does not know
// batches is asked for each file alone. Returns how many are left to Go, moved to the front
// of miss. In Go, each would cost a connection to the server, a Go buffer and a second copy,
// and the reader's garbage collection (a third of a DataLoader worker's CPU time when most of
// a node's reads are of other nodes' files: perf of bench/bench_cluster.py's share case).
static int open_in_batches(struct hit_client *c, const char *const *paths, int *miss, int nmiss, const void **data,
                           int64_t *sizes, int64_t *buffers, int *results, bool *unavailable, char *msg) {
	node_open_many(c, paths, miss, nmiss, data, sizes, buffers, results);
	int left = 0;
	for (int j = 0; j < nmiss; j++) {
		int i = miss[j], rc = results[i], k;
		char clean[FC_PATH_MAX];
		if (rc == FC_ASK_ALONE)
			rc = (k = source_path(c, paths[i], clean, sizeof clean)) < 0
			         ? FC_MISS
			         : ask_node(c, clean, (size_t)k, true, &data[i], &sizes[i], &buffers[i], msg);
		if (rc == FC_UNAVAILABLE)
			*unavailable = true;
		if (rc == FC_MISS || rc == FC_UNAVAILABLE) {
			data[i] = NULL; sizes[i] = 0; buffers[i] = 0; results[i] = -EIO;
			miss[left++] = i;
			continue;
		}
		results[i] = rc;
	}
	return left;
}

// A batch's misses (hit_miss_many), served in turn by the calling thread and, once the
// source makes fills wait (source_waits), by up to MISS_THREADS - 1 helper threads beside it.
// Each miss j gets its answer in results[miss[j]] (as hit_miss returns).
#define MISS_THREADS 8
#define MISS_THREAD_STACK (256 << 10)

struct miss_batch {
	struct hit_client *c;
	const char *const *paths;
	const int *miss;
	int nmiss;
	bool forked, batches;
	const void **data;
	int64_t *sizes, *buffers;
	int *results;
	int next; // the next miss to serve (atomic): each thread takes the next in turn
};

struct miss_helper {
	pthread_t thread;
	struct miss_batch *batch;
	char msg[FC_FETCH_MESSAGE]; // its last error, as hit_miss's msg
};

// serve_miss serves miss j of b as hit_miss would, except that in cluster mode (b->batches)
// only the reader's own fill is tried: the rest go to the node's server in one request.
static void serve_miss(struct miss_batch *b, int j, char *msg) {
	int i = b->miss[j], rc = FC_MISS, n;
	char clean[FC_PATH_MAX];
	if ((n = source_path(b->c, b->paths[i], clean, sizeof clean)) >= 0)
		rc = b->forked && !b->batches
		         ? decide(b->c, clean, (size_t)n, true, &b->data[i], &b->sizes[i], &b->buffers[i], msg)
		         : fill_read(b->c, clean, (size_t)n, &b->data[i], &b->sizes[i], &b->buffers[i]);
	b->results[i] = rc;
}

static void *help_serve(void *arg) {
	struct miss_helper *h = arg;
	for (int j; (j = __atomic_fetch_add(&h->batch->next, 1, __ATOMIC_RELAXED)) < h->batch->nmiss;)
		serve_miss(h->batch, j, h->msg);
	return NULL;
}

// start_helpers starts up to want threads that serve b's misses beside the caller: how many
// started. They block every signal, which stay the program's threads' to handle.
static int start_helpers(struct miss_batch *b, struct miss_helper *helpers, int want) {
	pthread_attr_t attr;
	sigset_t all, old;
	int started = 0;
	if (pthread_attr_init(&attr) != 0)
		return 0;
	pthread_attr_setstacksize(&attr, MISS_THREAD_STACK);
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	for (; started < want; started++) {
		helpers[started].batch = b;
		helpers[started].msg[0] = 0;
		if (pthread_create(&helpers[started].thread, &attr, help_serve, &helpers[started]) != 0)
			break; // out of threads: fewer helpers, or none
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	return started;
}

// serve_misses serves every miss of b, in turn until the source is seen to make fills wait,
// then with helpers. A reader's fills of a slow source wait on round trips, not on the CPU:
// a batch of 4 misses served side by side waits about as long as one.
static void serve_misses(struct miss_batch *b, char *msg) {
	struct miss_helper helpers[MISS_THREADS - 1];
	int started = 0, spread_at = -1;
	for (int j; (j = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED)) < b->nmiss;) {
		if (spread_at < 0 && !b->batches && b->nmiss - j >= 2 && source_waits(b->c)) {
			spread_at = j;
			int want = b->nmiss - j - 1;
			started = start_helpers(b, helpers, want < MISS_THREADS - 1 ? want : MISS_THREADS - 1);
		}
		serve_miss(b, j, msg);
	}
	for (int k = 0; k < started; k++) {
		pthread_join(helpers[k].thread, NULL);
		if (helpers[k].msg[0])
			memcpy(msg, helpers[k].msg, FC_FETCH_MESSAGE);
	}
	if (started > 0)
		__atomic_fetch_add(&b->c->parallel_misses, b->nmiss - spread_at, __ATOMIC_RELAXED);
}

int hit_miss_many(int64_t handle, const char *const *paths, int *miss, int nmiss, bool forked, const void **data,
                  int64_t *sizes, int64_t *buffers, int *results, bool *unavailable, char *msg) {
	msg[0] = 0;
	*unavailable = false;
	int saved = errno; // as hit_miss
	struct hit_client *c = acquire(handle);
	// A server that opens files for its clients (cluster mode) is asked for a batch's misses
	// at once, also by a process forked after load (DataLoader workers forked from the process
	// that opened the client), which then serves what it did not around it.
	bool batches = c && c->node_opens;
	int left = 0;
	if (c) {
		struct miss_batch b = {.c = c, .paths = paths, .miss = miss, .nmiss = nmiss, .forked = forked,
		                       .batches = batches, .data = data, .sizes = sizes, .buffers = buffers,
		                       .results = results};
		serve_misses(&b, msg);
	}
	for (int j = 0; j < nmiss; j++) {
		int i = miss[j], rc = c ? results[i] : FC_MISS;
		if (rc == FC_MISS || rc == FC_UNAVAILABLE) {
			data[i] = NULL; sizes[i] = 0; buffers[i] = 0; results[i] = -EIO;
			miss[left++] = i;
		}
	}
	if (batches && left > 0 && node_path(c)[0])
		left = open_in_batches(c, paths, miss, left, data, sizes, buffers, results, unavailable, msg);
	if (batches && forked && left > 0) {
		int around = 0;
		for (int j = 0; j < left; j++) {
			int i = miss[j], rc = FC_MISS, n;
			char clean[FC_PATH_MAX];
			if ((n = source_path(c, paths[i], clean, sizeof clean)) >= 0)
				rc = around_node(c, clean, (size_t)n, *unavailable ? FC_UNAVAILABLE : FC_MISS, &data[i], &sizes[i],
				                 &buffers[i]);
			if (rc == FC_MISS || rc == FC_UNAVAILABLE) {
				data[i] = NULL; sizes[i] = 0; buffers[i] = 0; results[i] = -EIO;
				miss[around++] = i;
				continue;
			}
			results[i] = rc;
		}
		left = around;
	}
	put(c);
	errno = saved;
	return left;
}
