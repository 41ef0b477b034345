// Package chitpath gives Go tests the hit path of libfitcache (capi/hitpath.c and the files
// hitclient.h lists), compiled here
// with capi/fclookup.c as the library compiles them, and driven from threads of C: many
// threads of one process read and release cached files at once, across fork and fc_close.
// The locks the hit path takes are recorded per thread, so that a test can tell whether
// threads share one.
//
// Nothing else imports it.
package chitpath

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Wno-unused-function
#cgo LDFLAGS: -pthread
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

// The locks the hit path takes, recorded per test thread (rec_thread, 1 and up; 0 records
// nothing): the distinct ones each thread took while recording is on.
#define REC_THREADS 64
#define REC_LOCKS 32
static int recording;
static __thread int rec_thread;
static const void *rec_locks[REC_THREADS + 1][REC_LOCKS];
static int rec_n[REC_THREADS + 1];

static void rec(const void *lock) {
	int t = rec_thread;
	if (!__atomic_load_n(&recording, __ATOMIC_RELAXED) || t <= 0 || t > REC_THREADS)
		return;
	for (int i = 0; i < rec_n[t]; i++)
		if (rec_locks[t][i] == lock)
			return;
	if (rec_n[t] < REC_LOCKS)
		rec_locks[t][rec_n[t]++] = lock;
}

static int rec_mutex_lock(pthread_mutex_t *m) {
	rec(m);
	return pthread_mutex_lock(m);
}
static int rec_rdlock(pthread_rwlock_t *l) {
	rec(l);
	return pthread_rwlock_rdlock(l);
}
static int rec_wrlock(pthread_rwlock_t *l) {
	rec(l);
	return pthread_rwlock_wrlock(l);
}

#define pthread_mutex_lock rec_mutex_lock
#define pthread_rwlock_rdlock rec_rdlock
#define pthread_rwlock_wrlock rec_wrlock
// The files of the hit path, each included through a link (hitpath_c.h is ../hitpath.c; see
// capi/clayout for why a link), so that the locks they take are recorded and their static
// functions are reached from here.
#include "clients_c.h"
#include "buffers_c.h"
#include "hitpath_c.h"
#include "hitranges_c.h"
#include "source_c.h"
#include "nodesock_c.h"
#include "openmany_c.h"
#include "miss_c.h"
#undef pthread_mutex_lock
#undef pthread_rwlock_rdlock
#undef pthread_rwlock_wrlock

// shared_lock returns a lock that two test threads of 1..n took while recording, or NULL.
static const void *shared_lock(int n) {
	for (int a = 1; a <= n; a++)
		for (int i = 0; i < rec_n[a]; i++)
			for (int b = a + 1; b <= n; b++)
				for (int j = 0; j < rec_n[b]; j++)
					if (rec_locks[a][i] == rec_locks[b][j])
						return rec_locks[a][i];
	return NULL;
}

// rec_start forgets what was recorded, and records from now on with on, else stops.
static void rec_start(int on) {
	if (on)
		memset(rec_n, 0, sizeof rec_n);
	__atomic_store_n(&recording, on, __ATOMIC_SEQ_CST);
}

// The files a test reads: paths[i] under the client's root, holding the size[i] bytes at
// want[i].
#define MAX_FILES 64
static char paths[MAX_FILES][64];
static int64_t sizes[MAX_FILES];
static char *want[MAX_FILES];
static int nfiles;

static void set_file(int i, const char *path, const void *data, int64_t size) {
	strncpy(paths[i], path, sizeof paths[i] - 1);
	free(want[i]);
	want[i] = malloc(size ? size : 1);
	memcpy(want[i], data, size);
	sizes[i] = size;
	if (i >= nfiles)
		nfiles = i + 1;
}

// check_file returns whether data/size hold file i.
static int check_file(int i, const void *data, int64_t size) {
	return size == sizes[i] && (size == 0 || memcmp(data, want[i], size) == 0);
}

// A run of hammer: threads threads of a client read files and release them.
struct hammer {
	int64_t handle;
	int threads, rounds, per_round;
	int cross; // release a neighbour's buffers (else its own)
	pthread_barrier_t barrier;
	struct held {
		int64_t buf;
		const void *data;
		int64_t size;
		int file;
	} *held; // threads * per_round: what each thread read this round
	int64_t *stale; // threads * per_round: the handles released the round before
	long reads, bad_bytes, bad_rc, dup_handles, stale_ok, release_fail, double_ok;
};

static int cmp_i64(const void *a, const void *b) {
	int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
	return x < y ? -1 : x > y;
}

struct hammer_arg {
	struct hammer *h;
	int t;
};

static void *hammer_thread(void *arg) {
	struct hammer *h = ((struct hammer_arg *)arg)->h;
	int t = ((struct hammer_arg *)arg)->t;
	rec_thread = t + 1;
	long reads = 0, bad_bytes = 0, bad_rc = 0, stale_ok = 0, release_fail = 0, double_ok = 0;
	for (int r = 0; r < h->rounds; r++) {
		struct held *mine = &h->held[t * h->per_round];
		for (int j = 0; j < h->per_round; j++) {
			int f = (t * 7 + r * 13 + j) % nfiles;
			struct held *x = &mine[j];
			x->file = f;
			int rc = hit_read(h->handle, paths[f], &x->data, &x->size, &x->buf);
			reads++;
			if (rc != 0) {
				bad_rc++;
				x->buf = 0;
			}
		}
		pthread_barrier_wait(&h->barrier);
		if (t == 0) { // every buffer is live now: no two have one handle
			int n = h->threads * h->per_round;
			int64_t *all = malloc(n * sizeof *all);
			for (int i = 0; i < n; i++)
				all[i] = h->held[i].buf;
			qsort(all, n, sizeof *all, cmp_i64);
			for (int i = 1; i < n; i++)
				if (all[i] != 0 && all[i] == all[i - 1])
					h->dup_handles++;
			free(all);
		}
		pthread_barrier_wait(&h->barrier);
		int from = h->cross ? (t + 1) % h->threads : t;
		struct held *theirs = &h->held[from * h->per_round];
		int64_t *stale = &h->stale[from * h->per_round];
		for (int j = 0; j < h->per_round; j++) {
			struct held *x = &theirs[j];
			if (!x->buf)
				continue;
			if (!check_file(x->file, x->data, x->size))
				bad_bytes++;
			// The handle released the round before, whose slot this round's reads took again.
			if (stale[j] && hit_release(stale[j]) != -EBADF)
				stale_ok++;
			if (hit_release(x->buf) != 0)
				release_fail++;
			if (j % 16 == 0 && hit_release(x->buf) != -EBADF)
				double_ok++;
			stale[j] = x->buf;
		}
		pthread_barrier_wait(&h->barrier);
	}
	__atomic_fetch_add(&h->reads, reads, __ATOMIC_RELAXED);
	__atomic_fetch_add(&h->bad_bytes, bad_bytes, __ATOMIC_RELAXED);
	__atomic_fetch_add(&h->bad_rc, bad_rc, __ATOMIC_RELAXED);
	__atomic_fetch_add(&h->stale_ok, stale_ok, __ATOMIC_RELAXED);
	__atomic_fetch_add(&h->release_fail, release_fail, __ATOMIC_RELAXED);
	__atomic_fetch_add(&h->double_ok, double_ok, __ATOMIC_RELAXED);
	rec_thread = 0;
	return NULL;
}

// hammer runs h (its handle, threads, rounds, per_round and cross set) and fills its counts.
static int hammer_run(struct hammer *h) {
	h->held = calloc(h->threads * h->per_round, sizeof *h->held);
	h->stale = calloc(h->threads * h->per_round, sizeof *h->stale);
	pthread_t *th = calloc(h->threads, sizeof *th);
	struct hammer_arg *args = calloc(h->threads, sizeof *args);
	if (!h->held || !h->stale || !th || !args)
		return -ENOMEM;
	pthread_barrier_init(&h->barrier, NULL, h->threads);
	for (int t = 0; t < h->threads; t++) {
		args[t] = (struct hammer_arg){h, t};
		pthread_create(&th[t], NULL, hammer_thread, &args[t]);
	}
	for (int t = 0; t < h->threads; t++)
		pthread_join(th[t], NULL);
	pthread_barrier_destroy(&h->barrier);
	free(h->held);
	free(h->stale);
	free(th);
	free(args);
	return 0;
}

// Readers that read and release until told to stop, counting what went wrong.
struct loop {
	int64_t handle;
	int threads;
	int stop;
	long reads, misses, bad_bytes, bad_rc;
	pthread_t th[64];
};

static void *loop_thread(void *arg) {
	struct loop *l = arg;
	long reads = 0, misses = 0, bad_bytes = 0, bad_rc = 0;
	for (int i = 0; !__atomic_load_n(&l->stop, __ATOMIC_RELAXED); i++) {
		int f = i % nfiles;
		const void *data;
		int64_t size, buf;
		int rc = hit_read(__atomic_load_n(&l->handle, __ATOMIC_RELAXED), paths[f], &data, &size, &buf);
		reads++;
		if (rc == FC_MISS) {
			misses++;
			continue;
		}
		if (rc != 0) {
			bad_rc++;
			continue;
		}
		if (!check_file(f, data, size))
			bad_bytes++;
		if (hit_release(buf) != 0)
			bad_rc++;
	}
	__atomic_fetch_add(&l->reads, reads, __ATOMIC_RELAXED);
	__atomic_fetch_add(&l->misses, misses, __ATOMIC_RELAXED);
	__atomic_fetch_add(&l->bad_bytes, bad_bytes, __ATOMIC_RELAXED);
	__atomic_fetch_add(&l->bad_rc, bad_rc, __ATOMIC_RELAXED);
	return NULL;
}

static void loop_start(struct loop *l) {
	for (int t = 0; t < l->threads; t++)
		pthread_create(&l->th[t], NULL, loop_thread, l);
}

static void loop_set_handle(struct loop *l, int64_t handle) {
	__atomic_store_n(&l->handle, handle, __ATOMIC_RELAXED);
}

static void loop_stop(struct loop *l) {
	__atomic_store_n(&l->stop, 1, __ATOMIC_RELAXED);
	for (int t = 0; t < l->threads; t++)
		pthread_join(l->th[t], NULL);
}

// fork_while_reading forks forks times while the threads of l read; each child reads and
// releases every file, checks the bytes, and that the buffers it took are all released again,
// within 10 seconds (alarm). Returns how many children did not exit 0, or a negated errno.
static int fork_while_reading(struct loop *l, int forks) {
	int failed = 0;
	for (int k = 0; k < forks; k++) {
		usleep(2000);
		pid_t pid = fork();
		if (pid < 0)
			return -errno;
		if (pid == 0) {
			alarm(10); // a lock a parent's thread held at fork would hang the child
			int64_t before = hit_buffers();
			int ok = 1;
			for (int i = 0; i < nfiles; i++) {
				const void *data;
				int64_t size, buf;
				if (hit_read(l->handle, paths[i], &data, &size, &buf) != 0 || !check_file(i, data, size) ||
				    hit_release(buf) != 0)
					ok = 0;
			}
			if (hit_buffers() != before)
				ok = 0;
			_exit(ok ? 0 : 1);
		}
		int status;
		if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
			failed++;
	}
	return failed;
}

// Threads that come and go, one after another (churn): each reads holds of the files from
// the fifth on at once, releases them, and exits. churn returns how many shards they used.
struct churner {
	int64_t handle;
	int holds, shard;
};

static void *churn_thread(void *arg) {
	struct churner *c = arg;
	const void *data;
	int64_t size, bufs[256];
	int n = 0;
	for (int j = 0; j < c->holds && j < 256 && nfiles > 4; j++)
		if (hit_read(c->handle, paths[4 + j % (nfiles - 4)], &data, &size, &bufs[n]) == 0)
			n++;
	for (int j = 0; j < n; j++)
		hit_release(bufs[j]);
	c->shard = shard_plus1 - 1;
	return NULL;
}

static int churn(int64_t handle, int threads, int holds) {
	uint64_t seen = 0;
	for (int t = 0; t < threads; t++) {
		struct churner c = {.handle = handle, .holds = holds, .shard = -1};
		pthread_t th;
		if (pthread_create(&th, NULL, churn_thread, &c) != 0)
			return -1;
		pthread_join(th, NULL);
		if (c.shard >= 0)
			seen |= (uint64_t)1 << c.shard;
	}
	return __builtin_popcountll(seen);
}

// pooled_bytes returns the bytes the shards' pools keep.
static int64_t pooled_bytes(void) {
	int64_t n = 0;
	for (int i = 0; i < SHARDS; i++) {
		pthread_mutex_lock(&shards[i].mu);
		n += (int64_t)shards[i].pool_bytes;
		pthread_mutex_unlock(&shards[i].mu);
	}
	return n;
}

// What a thread holding a reference to a client (as a read does) sees of fcHitClose.
struct holder {
	int64_t handle;
	int tried, got;        // it tried to take a reference, and took one
	int closed_while_held; // fcHitClose returned before it let the reference go
	int close_returned;    // set by the closer
	int hold_ms;
};

static void *holder_thread(void *arg) {
	struct holder *h = arg;
	struct hit_client *c = acquire(h->handle);
	h->got = c != NULL;
	__atomic_store_n(&h->tried, 1, __ATOMIC_SEQ_CST);
	if (!c)
		return NULL;
	usleep(h->hold_ms * 1000);
	h->closed_while_held = __atomic_load_n(&h->close_returned, __ATOMIC_SEQ_CST);
	put(c);
	return NULL;
}

// close_while_held takes a reference to the client of handle in a thread, closes the client
// while it holds it for hold_ms, and returns 1 if fcHitClose waited for it, 0 if it returned
// while the reference was held, -1 if no reference could be taken.
static int close_while_held(int64_t handle, int hold_ms) {
	struct holder h = {.handle = handle, .hold_ms = hold_ms};
	pthread_t th;
	pthread_create(&th, NULL, holder_thread, &h);
	while (!__atomic_load_n(&h.tried, __ATOMIC_SEQ_CST)) {
		struct timespec ts = {.tv_nsec = 100000};
		nanosleep(&ts, NULL);
	}
	if (!h.got) {
		pthread_join(th, NULL);
		return -1;
	}
	fcHitClose(handle);
	__atomic_store_n(&h.close_returned, 1, __ATOMIC_SEQ_CST);
	pthread_join(th, NULL);
	return h.closed_while_held ? 0 : 1;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"
)

// File is a file the tests read: its path (absolute, or relative to the client's root) and
// the bytes the hit path must serve for it.
type File struct {
	Path string
	Data []byte
}

// SetFiles tells the harness the files that readers read and check (MaxFiles at most).
func SetFiles(files []File) {
	if len(files) > MaxFiles {
		panic("too many files")
	}
	for i, f := range files {
		cp := C.CString(f.Path)
		data := C.CBytes(append(f.Data, 0))
		C.set_file(C.int(i), cp, data, C.int64_t(len(f.Data)))
		C.free(data)
		C.free(unsafe.Pointer(cp))
	}
}

// MaxFiles is the number of files SetFiles takes at most.
const MaxFiles = C.MAX_FILES

// Open registers client handle with root (its real root, no node socket) and its tier
// directories, each read for session, as capi/main.go does (fcHitOpen, fcHitAddTier).
func Open(handle int64, root string, session uint32, dirs ...string) error {
	croot, cnone := C.CString(root), C.CString("")
	defer C.free(unsafe.Pointer(croot))
	defer C.free(unsafe.Pointer(cnone))
	if C.fcHitOpen(C.int64_t(handle), croot, croot, cnone, 1000, false) != 0 {
		return errors.New("fcHitOpen failed")
	}
	for _, d := range dirs {
		cd := C.CString(d)
		rc := C.fcHitAddTier(C.int64_t(handle), cd, 0, C.uint32_t(session))
		C.free(unsafe.Pointer(cd))
		if rc != 0 {
			return fmt.Errorf("fcHitAddTier %s: %d", d, rc)
		}
	}
	return nil
}

// Close is fcHitClose.
func Close(handle int64) { C.fcHitClose(C.int64_t(handle)) }

// Hits is the hits fcHitCounts reports for handle.
func Hits(handle int64) int64 {
	var hits, fetches, direct, ranges C.int64_t
	C.fcHitCounts(C.int64_t(handle), &hits, &fetches, &direct, &ranges)
	return int64(hits)
}

// Buffers is hit_buffers: the buffers handed out and not released.
func Buffers() int64 { return int64(C.hit_buffers()) }

// Read is hit_read of path, the bytes copied out and the buffer released: the bytes, or an
// error for a miss or a failure.
func Read(handle int64, path string) ([]byte, error) {
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var data unsafe.Pointer
	var size, buf C.int64_t
	if rc := C.hit_read(C.int64_t(handle), cp, &data, &size, &buf); rc != 0 {
		return nil, fmt.Errorf("hit_read %s: %d", path, rc)
	}
	b := C.GoBytes(data, C.int(size))
	if rc := C.hit_release(buf); rc != 0 {
		return nil, fmt.Errorf("hit_release: %d", rc)
	}
	return b, nil
}

// Hammer is what a run of HammerRun saw.
type Hammer struct {
	Reads       int64 // hit_read calls
	BadRC       int64 // reads that did not return 0
	BadBytes    int64 // buffers whose bytes were not the file's
	DupHandles  int64 // handles seen twice among the buffers live at once
	StaleOK     int64 // releases of a stale handle (its slot handed out again) that did not fail with EBADF
	DoubleOK    int64 // second releases of a handle that did not fail with EBADF
	ReleaseFail int64 // releases of a live buffer that failed
	SharedLock  bool  // two threads took one lock
}

// HammerRun reads with threads threads of C, each rounds times: per_round files read (all
// live at once, their handles checked to be distinct), then checked and released by the
// thread itself or, with cross, by its neighbour; each release is followed by one of the
// handle released the round before, stale by then. With record, the locks each thread took
// are recorded, and SharedLock says whether two threads took one.
func HammerRun(handle int64, threads, rounds, perRound int, cross, record bool) (Hammer, error) {
	if threads > C.REC_THREADS {
		return Hammer{}, errors.New("too many threads")
	}
	h := (*C.struct_hammer)(C.calloc(1, C.sizeof_struct_hammer))
	defer C.free(unsafe.Pointer(h))
	h.handle, h.threads, h.rounds, h.per_round = C.int64_t(handle), C.int(threads), C.int(rounds), C.int(perRound)
	if cross {
		h.cross = 1
	}
	if record {
		C.rec_start(1)
	}
	rc := C.hammer_run(h)
	C.rec_start(0)
	if rc != 0 {
		return Hammer{}, fmt.Errorf("hammer: %d", rc)
	}
	return Hammer{Reads: int64(h.reads), BadRC: int64(h.bad_rc), BadBytes: int64(h.bad_bytes),
		DupHandles: int64(h.dup_handles), StaleOK: int64(h.stale_ok), DoubleOK: int64(h.double_ok),
		ReleaseFail: int64(h.release_fail), SharedLock: C.shared_lock(C.int(threads)) != nil}, nil
}

// Loop is a set of threads of C that read and release files of a client until stopped.
type Loop struct{ l *C.struct_loop }

// LoopStart starts threads readers of handle.
func LoopStart(handle int64, threads int) *Loop {
	l := (*C.struct_loop)(C.calloc(1, C.sizeof_struct_loop))
	l.handle, l.threads = C.int64_t(handle), C.int(threads)
	C.loop_start(l)
	return &Loop{l}
}

// SetHandle makes the readers read through handle from now on.
func (l *Loop) SetHandle(handle int64) { C.loop_set_handle(l.l, C.int64_t(handle)) }

// LoopCounts is what a Loop's readers saw.
type LoopCounts struct{ Reads, Misses, BadBytes, BadRC int64 }

// Stop stops the readers and returns their counts.
func (l *Loop) Stop() LoopCounts {
	C.loop_stop(l.l)
	c := LoopCounts{int64(l.l.reads), int64(l.l.misses), int64(l.l.bad_bytes), int64(l.l.bad_rc)}
	C.free(unsafe.Pointer(l.l))
	return c
}

// ForkWhileReading forks n times while the loop's threads read; each child reads and
// releases every file through the loop's handle and checks them. It returns how many
// children failed.
func (l *Loop) ForkWhileReading(n int) (int, error) {
	rc := C.fork_while_reading(l.l, C.int(n))
	if rc < 0 {
		return 0, fmt.Errorf("fork: %d", rc)
	}
	return int(rc), nil
}

// Churn runs threads threads of C one after another, each reading holds files (of the fifth
// file of SetFiles on) at once, releasing them and exiting; it returns how many shards of the
// hit path they used, and how many bytes the shards' pools kept more after them than before.
func Churn(handle int64, threads, holds int) (shards int, pooled int64, err error) {
	before := C.pooled_bytes()
	n := C.churn(C.int64_t(handle), C.int(threads), C.int(holds))
	if n < 0 {
		return 0, 0, errors.New("pthread_create failed")
	}
	return int(n), int64(C.pooled_bytes() - before), nil
}

// CloseWhileHeld closes handle while a thread holds a reference to its client for holdMS
// milliseconds: true if fcHitClose waited for the reference to be let go.
func CloseWhileHeld(handle int64, holdMS int) (bool, error) {
	switch C.close_while_held(C.int64_t(handle), C.int(holdMS)) {
	case 1:
		return true, nil
	case 0:
		return false, nil
	}
	return false, errors.New("no reference taken: the client is not open")
}
