// The registry of the hit path's clients (see hitpath.h: fcHitOpen ... fcHitClose, the
// settings Go gives each), the references readers take to them without a lock (acquire,
// put), the per-thread shards those references and the buffers are counted in, and what
// happens to all of them across fork.
#define _GNU_SOURCE
#include "hitclient.h"

#include "fcnode.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

// The heat of blocks (capi/fcheat.h) of the processes forked after load, which decides when
// they ask for a block (see hit_pread): mapped shared by the first fcHitOpen, in the process
// that forks its DataLoader workers, so that they all, epoch after epoch, count as one reader.
struct fc_heat *heat; // NULL until mapped (then never unmapped)
static pthread_once_t heat_once = PTHREAD_ONCE_INIT;
static struct fc_heat heat_here[FC_HEAT_PLACES]; // when no shared mapping could be made

static void map_heat(void) {
	void *m = mmap(NULL, FC_HEAT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	heat = m == MAP_FAILED ? heat_here : m;
}

// clients_lock is held to add or remove a client or add a tier to one, and by fork; readers
// take no lock (see acquire). It is never held across I/O or a wait for the server, so that
// fc_close and fork get it at once. It prefers writers, so it must never be taken twice by
// one thread: no function here calls another that takes it while holding it.
// clients[h % CLIENT_SLOTS] holds the client of handle h (stored atomically: read without
// the lock).
pthread_rwlock_t clients_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
struct hit_client *clients[CLIENT_SLOTS];

struct shard shards[SHARDS] = {[0 ... SHARDS - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}};

// A thread takes a shard of its own while one is free (a bit of shards_used each), and gives it
// back when it exits (shard_key's destructor): the threads alive at once share no shard while
// they are SHARDS at most, and threads that come and go use the same few shards and pools.
// Past SHARDS threads, a thread shares the shard next_shard names.
_Static_assert(SHARDS == 64, "shards_used has a bit for each shard");
static uint64_t shards_used;     // atomic
static unsigned next_shard;      // atomic
static pthread_key_t shard_key;  // the shard + 1 of a thread that has it to itself
static bool shard_key_made;      // pthread_key_create gave shard_key (else shards are not given back)
static __thread int shard_plus1; // the calling thread's shard + 1; 0 until it has one

static void shard_exit(void *v) {
	__atomic_fetch_and(&shards_used, ~((uint64_t)1 << ((intptr_t)v - 1)), __ATOMIC_RELEASE);
}

// own_shard returns the shard of the calling thread.
struct shard *own_shard(void) {
	int i = shard_plus1 - 1;
	if (i >= 0)
		return &shards[i];
	uint64_t used = __atomic_load_n(&shards_used, __ATOMIC_RELAXED);
	while (~used != 0) {
		i = __builtin_ctzll(~used);
		if (__atomic_compare_exchange_n(&shards_used, &used, used | (uint64_t)1 << i, false, __ATOMIC_ACQUIRE,
		                                __ATOMIC_RELAXED)) {
			if (shard_key_made)
				pthread_setspecific(shard_key, (void *)(intptr_t)(i + 1)); // else kept for good
			shard_plus1 = i + 1;
			return &shards[i];
		}
	}
	i = (int)(__atomic_fetch_add(&next_shard, 1, __ATOMIC_RELAXED) % SHARDS);
	shard_plus1 = i + 1;
	return &shards[i];
}

static void lock_all(void) {
	pthread_rwlock_wrlock(&clients_lock);
	for (int i = 0; i < SHARDS; i++)
		pthread_mutex_lock(&shards[i].mu);
	for (int i = 0; i < CLIENT_SLOTS; i++)
		if (clients[i])
			pthread_mutex_lock(&clients[i]->ranges_mu);
}

static void unlock_all(void) {
	for (int i = 0; i < CLIENT_SLOTS; i++)
		if (clients[i])
			pthread_mutex_unlock(&clients[i]->ranges_mu);
	for (int i = SHARDS - 1; i >= 0; i--)
		pthread_mutex_unlock(&shards[i].mu);
	pthread_rwlock_unlock(&clients_lock);
}

// The child starts with fresh locks: glibc's rwlock unlock compares the writer's thread id,
// which is not the same in the child, so unlocking there would leave the lock taken. The
// references to clients held by the parent's other threads (in a read or a miss) are dropped:
// those threads do not exist in the child.
static void reset_in_child(void) {
	pthread_rwlock_t fresh_rw = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
	clients_lock = fresh_rw;
	if (shard_key_made) { // the shards of the parent's other threads are free
		intptr_t mine = (intptr_t)pthread_getspecific(shard_key);
		__atomic_store_n(&shards_used, mine ? (uint64_t)1 << (mine - 1) : 0, __ATOMIC_RELAXED);
	}
	for (int i = 0; i < SHARDS; i++) {
		pthread_mutex_init(&shards[i].mu, NULL); // held by the prepare handler
		for (int k = 0; k < CLIENT_SLOTS; k++)
			__atomic_store_n(&shards[i].refs[k], 0, __ATOMIC_RELAXED);
	}
	for (int i = 0; i < CLIENT_SLOTS; i++)
		if (clients[i]) {
			for (int k = 0; k < NODE_CONNS; k++) // a parent's thread may have held one in a fetch
				pthread_mutex_init(&clients[i]->node_conns[k].mu, NULL);
			pthread_mutex_init(&clients[i]->ranges_mu, NULL); // held by the prepare handler
			for (int r = 0; r < RANGE_SETS * RANGE_WAYS; r++)
				clients[i]->ranges[r].refs = 0; // the parent's readers are not here
			for (int r = 0; r < RANGE_SOURCES; r++)
				clients[i]->sources[r].refs = 0;
		}
}

// The locks are held across fork (each only briefly by anyone else, so fork waits for no
// read or miss), so that a child never inherits state that a thread it lacks was changing.
__attribute__((constructor)) static void hit_init(void) {
	shard_key_made = pthread_key_create(&shard_key, shard_exit) == 0;
	pthread_atfork(lock_all, unlock_all, reset_in_child);
}

// client returns the client of handle h (clients_lock held), or NULL.
static struct hit_client *client(int64_t h) {
	struct hit_client *c = clients[(uint64_t)h % CLIENT_SLOTS];
	return c && c->handle == h ? c : NULL;
}

// acquire returns the client of handle h with a reference taken, or NULL: the client is not
// freed (fcHitClose waits) until the caller gives the reference back with put, on the same
// thread. A reference is held across reads and misses. It takes no lock: the thread counts
// a reference to the client's slot in its shard, then looks the client up; fcHitClose takes
// the client out of its slot, then waits for the slot's references in every shard to reach
// zero. Both sides are sequentially consistent, so either the lookup here sees the client
// gone, or fcHitClose sees the reference (a slot's reference keeps whichever client is in it).
struct hit_client *acquire(int64_t h) {
	int *refs = &own_shard()->refs[(uint64_t)h % CLIENT_SLOTS];
	__atomic_fetch_add(refs, 1, __ATOMIC_SEQ_CST);
	struct hit_client *c = __atomic_load_n(&clients[(uint64_t)h % CLIENT_SLOTS], __ATOMIC_SEQ_CST);
	if (c && c->handle == h)
		return c;
	__atomic_fetch_sub(refs, 1, __ATOMIC_RELEASE);
	return NULL;
}

// put gives back a reference from acquire (c may be NULL).
void put(struct hit_client *c) {
	if (c)
		__atomic_fetch_sub(&own_shard()->refs[(uint64_t)c->handle % CLIENT_SLOTS], 1, __ATOMIC_RELEASE);
}

// slot_refs returns the references taken to client slot i, in all shards.
static int slot_refs(int i) {
	int n = 0;
	for (int k = 0; k < SHARDS; k++)
		n += __atomic_load_n(&shards[k].refs[i], __ATOMIC_SEQ_CST);
	return n;
}

// count_hit counts a hit on c for fcHitCounts, in the calling thread's shard.
void count_hit(const struct hit_client *c) {
	__atomic_fetch_add(&own_shard()->hits[(uint64_t)c->handle % CLIENT_SLOTS], 1, __ATOMIC_RELAXED);
}

int hit_cluster(int64_t handle) {
	struct hit_client *c = acquire(handle);
	int rc = c ? c->node_opens : -EBADF;
	put(c);
	return rc;
}

// tier_count returns the tiers of c that readers may use: fcHitAddTier fills a tier before it
// counts it.
int tier_count(struct hit_client *c) { return __atomic_load_n(&c->ntiers, __ATOMIC_ACQUIRE); }

int fcHitOpen(int64_t handle, const char *root, const char *real_root, const char *node_socket, int64_t timeout_ms,
              bool node_opens) {
	size_t n = strlen(root);
	if (n == 0 || n >= FC_PATH_MAX || root[0] != '/')
		return -1;
	struct hit_client *c = calloc(1, sizeof *c);
	if (!c)
		return -1;
	c->handle = handle;
	pthread_once(&heat_once, map_heat);
	struct open_how how_root = {.flags = O_PATH | O_DIRECTORY | O_CLOEXEC, .resolve = RESOLVE_NO_SYMLINKS};
	c->real_root_fd = (int)syscall(SYS_openat2, AT_FDCWD, real_root, &how_root, sizeof how_root); // -1: Go reads
	if (strlen(node_socket) < sizeof c->node_socket)
		strcpy(c->node_socket, node_socket);
	c->node_path = c->node_socket;
	c->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
	c->node_opens = node_opens;
	c->node_down_until = INT64_MAX; // until the Go client reports its server up
	c->closing_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); // -1: misses are not stopped by close
	c->opener = getpid();
	for (int k = 0; k < NODE_CONNS; k++) {
		c->node_conns[k].fd = -1;
		pthread_mutex_init(&c->node_conns[k].mu, NULL);
	}
	pthread_mutex_init(&c->ranges_mu, NULL);
	memcpy(c->root, root, n + 1);
	c->rootlen = n;
	pthread_rwlock_wrlock(&clients_lock);
	int i = (int)((uint64_t)handle % CLIENT_SLOTS);
	int ok = clients[i] == NULL;
	if (ok) {
		for (int k = 0; k < SHARDS; k++) // the hits of the slot's last client
			__atomic_store_n(&shards[k].hits[i], 0, __ATOMIC_RELAXED);
		__atomic_store_n(&clients[i], c, __ATOMIC_SEQ_CST);
	}
	pthread_rwlock_unlock(&clients_lock);
	if (!ok) {
		if (c->real_root_fd >= 0)
			close(c->real_root_fd);
		if (c->closing_fd >= 0)
			close(c->closing_fd);
		for (int k = 0; k < NODE_CONNS; k++)
			pthread_mutex_destroy(&c->node_conns[k].mu);
		pthread_mutex_destroy(&c->ranges_mu);
		free(c);
	}
	return ok ? 0 : -1;
}

int fcHitAddTier(int64_t handle, const char *dir, int kind, uint32_t session) {
	pthread_rwlock_wrlock(&clients_lock);
	struct hit_client *c = client(handle);
	int rc = -EBADF;
	if (c && c->ntiers == FC_MAX_TIERS)
		rc = -ENOSPC;
	else if (c && (rc = fc_tier_open(&c->tiers[c->ntiers], dir, kind, session)) == 0)
		__atomic_store_n(&c->ntiers, c->ntiers + 1, __ATOMIC_RELEASE); // readers take no lock
	pthread_rwlock_unlock(&clients_lock);
	return rc;
}

int fcHitTiers(int64_t handle) {
	struct hit_client *c = acquire(handle);
	int n = c ? tier_count(c) : 0;
	put(c);
	return n;
}

// A client being closed is freed once the reads and misses that hold references to it end.
// Misses waiting for the server's answer stop at once (closing_fd); what is left is bounded
// by the client's timeouts (a miss: two tries, each up to a probe for the connection, one for
// the request and its ack, and the read timeout for the answer of a server that keeps
// acknowledging), and a client still referenced after close_wait_ns is left allocated rather
// than freed under a thread that uses it (a source read stuck in the file system, say).
#define CLOSE_POLL_NS 1000000 // 1 ms
static int64_t close_wait_ns(const struct hit_client *c) {
	return (2 * (c->timeout_ms + 3 * FC_NODE_PROBE_MS) + 1000) * 1000000LL;
}

void fcHitClose(int64_t handle) {
	pthread_rwlock_wrlock(&clients_lock);
	struct hit_client *c = client(handle);
	if (c)
		__atomic_store_n(&clients[(uint64_t)handle % CLIENT_SLOTS], NULL, __ATOMIC_SEQ_CST);
	pthread_rwlock_unlock(&clients_lock);
	if (!c)
		return;
	if (c->closing_fd >= 0) { // misses in flight stop waiting for the server
		uint64_t one = 1;
		ssize_t k = write(c->closing_fd, &one, sizeof one);
		(void)k; // an eventfd's counter cannot overflow from one write
	}
	// No new reference can be taken now; wait for those held.
	int64_t deadline = fc_monotonic_ns() + close_wait_ns(c);
	while (slot_refs((int)((uint64_t)handle % CLIENT_SLOTS)) > 0) {
		if (fc_monotonic_ns() > deadline)
			return; // leaked, not freed under a thread still using it
		struct timespec pause = {.tv_nsec = CLOSE_POLL_NS};
		nanosleep(&pause, NULL);
	}
	for (int i = 0; i < c->ntiers; i++)
		fc_tier_close(&c->tiers[i]);
	for (int k = 0; k < NODE_CONNS; k++)
		if (c->node_conns[k].fd >= 0)
			close(c->node_conns[k].fd);
	if (c->real_root_fd >= 0)
		close(c->real_root_fd);
	if (c->closing_fd >= 0)
		close(c->closing_fd);
	for (int i = 0; i < RANGE_SETS * RANGE_WAYS; i++)
		if (c->ranges[i].data)
			munmap((void *)c->ranges[i].data, (size_t)c->ranges[i].size);
	for (int i = 0; i < RANGE_SOURCES; i++)
		if ((c->sources[i].key || c->sources[i].check) && c->sources[i].fd >= 0)
			close(c->sources[i].fd);
	for (int k = 0; k < NODE_CONNS; k++)
		pthread_mutex_destroy(&c->node_conns[k].mu);
	pthread_mutex_destroy(&c->ranges_mu);
	free(c);
}

void fcHitSetBlockBytes(int64_t handle, int64_t n) {
	struct hit_client *c = acquire(handle);
	if (c)
		__atomic_store_n(&c->block_bytes, n, __ATOMIC_RELAXED);
	put(c);
}

void fcHitCounts(int64_t handle, int64_t *hits, int64_t *fetches, int64_t *source_files, int64_t *source_ranges) {
	struct hit_client *c = acquire(handle);
	*hits = 0;
	for (int k = 0; c && k < SHARDS; k++)
		*hits += __atomic_load_n(&shards[k].hits[(uint64_t)handle % CLIENT_SLOTS], __ATOMIC_RELAXED);
	*fetches = c ? __atomic_load_n(&c->fetches, __ATOMIC_RELAXED) : 0;
	*source_files = c ? __atomic_load_n(&c->source_files, __ATOMIC_RELAXED) : 0;
	*source_ranges = c ? __atomic_load_n(&c->source_ranges, __ATOMIC_RELAXED) : 0;
	put(c);
}

void fcHitSetFills(int64_t handle, bool on) {
	struct hit_client *c = acquire(handle);
	if (c)
		__atomic_store_n(&c->fills, on, __ATOMIC_RELAXED);
	put(c);
}

int64_t fcHitFilled(int64_t handle) {
	struct hit_client *c = acquire(handle);
	int64_t n = c ? __atomic_load_n(&c->filled, __ATOMIC_RELAXED) : 0;
	put(c);
	return n;
}

int64_t fcHitParallelMisses(int64_t handle) {
	struct hit_client *c = acquire(handle);
	int64_t n = c ? __atomic_load_n(&c->parallel_misses, __ATOMIC_RELAXED) : 0;
	put(c);
	return n;
}

int fcHitUseStandIn(int64_t handle, const char *path) {
	struct hit_client *c = acquire(handle);
	int rc = -1;
	if (!c)
		goto out;
	for (int k = 0; k < NODE_CONNS; k++) // no miss of this process is on a kept connection
		pthread_mutex_lock(&c->node_conns[k].mu);
	if (path && !c->standin_socket[0] && strlen(path) < sizeof c->standin_socket)
		strcpy(c->standin_socket, path); // before it is published, never changed after
	if (!path || (c->standin_socket[0] && strcmp(path, c->standin_socket) == 0)) {
		__atomic_store_n(&c->node_path, path ? c->standin_socket : c->node_socket, __ATOMIC_RELEASE);
		for (int k = 0; k < NODE_CONNS; k++) {
			if (c->node_conns[k].fd >= 0) // a connection to the other socket
				close(c->node_conns[k].fd);
			c->node_conns[k].fd = -1;
		}
		__atomic_store_n(&c->node_down_until, 0, __ATOMIC_RELAXED);
		rc = 0;
	}
	for (int k = NODE_CONNS - 1; k >= 0; k--)
		pthread_mutex_unlock(&c->node_conns[k].mu);
out:
	put(c);
	return rc;
}

void fcHitServerState(int64_t handle, bool up, int64_t ms) {
	struct hit_client *c = acquire(handle);
	if (c)
		__atomic_store_n(&c->node_down_until, up ? 0 : fc_monotonic_ns() + ms * 1000000LL, __ATOMIC_RELAXED);
	put(c);
}

// source_path writes the clean absolute path of path (absolute, or relative to c's root) into
// out; it returns its length, or -1 when the path is too long or not under the root (Go then
// gives the error).
int source_path(const struct hit_client *c, const char *path, char *out, size_t cap) {
	char joined[FC_PATH_MAX];
	const char *abs = path;
	if (path[0] != '/') {
		size_t n = strlen(path);
		if (c->rootlen + 1 + n >= sizeof joined)
			return -1;
		memcpy(joined, c->root, c->rootlen);
		joined[c->rootlen] = '/';
		memcpy(joined + c->rootlen + 1, path, n + 1);
		abs = joined;
	}
	int n = fc_clean_path(abs, out, cap);
	if (n < 0)
		return -1;
	int inside = c->rootlen == 1 || ((size_t)n > c->rootlen && memcmp(out, c->root, c->rootlen) == 0 &&
	                                 out[c->rootlen] == '/');
	return inside ? n : -1;
}
