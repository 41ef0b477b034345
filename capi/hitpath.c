// The hit path of libfitcache: see hitpath.h.
#define _GNU_SOURCE
#include "hitpath.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fcheat.h"
#include "fclookup.h"
#include "fcnode.h"
#include "fill.h"

#define CLIENT_SLOTS 256 // clients open at once with a hit path; more go through Go
#define RANGE_SETS 1024 // cached copies a client keeps mapped for ranges: RANGE_SETS sets of
#define RANGE_WAYS 4    // RANGE_WAYS (see hit_pread): 4,096, 16 GiB of 4 MiB blocks

// The version of the source a piece of a range was read from (see hit_pread): known 0 for
// a copy whose record could not be read, which matches nothing.
struct piece_version {
	int known;
	struct fc_version v;
};

// same_version reports whether two pieces of a range may be of one version of the file: a
// field one of them does not know (0) is not compared.
static int same_version(const struct piece_version *a, const struct piece_version *b) {
	return a->known && b->known && a->v.mtime_ns == b->v.mtime_ns &&
	       (a->v.ctime_ns == 0 || b->v.ctime_ns == 0 || a->v.ctime_ns == b->v.ctime_ns) &&
	       (a->v.ino == 0 || b->v.ino == 0 || a->v.ino == b->v.ino);
}

// fd_version returns in *p the version of the open file fd now.
static int fd_version(int fd, struct piece_version *p) {
	struct stat st;
	if (fc_sys_fstat(fd, &st) != 0)
		return -1;
	*p = (struct piece_version){.known = 1,
	                           .v = {.mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
	                                 .ctime_ns = (int64_t)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec,
	                                 .ino = (uint64_t)st.st_ino}};
	return 0;
}

// A cached copy (a whole file or a block) kept mapped for ranges: a range of it is a copy
// from memory, without a system call (a page not yet touched by this process costs a fault,
// which maps the pages around it too). A copy never changes once published (a new copy is a
// new file), and one evicted meanwhile still holds the right bytes; each was checked for the
// client's session when it was opened. A mapping holds no descriptor: a program's descriptor
// limit is not spent on them.
struct range_map {
	uint64_t key, check; // the hashes of its name; 0, 0: the entry is free
	const char *data;
	int64_t size;
	uint64_t ino; // of the data file mapped, to tell whether the tier still lists it
	int tier;
	int refs; // readers copying from it: an entry is replaced only when it has none
	struct piece_version ver; // the version of the source the copy holds
	int64_t intact_ns;        // when the copy was last found intact (fc_copy_intact; atomic)
};

// The source of a large file whose blocks the server has no room for: the ranges of its
// blocks not cached are read from it here, without Go (see fcHitSetSource).
#define RANGE_SOURCES 16
struct range_source {
	uint64_t key, check; // the hashes of the file's clean path; 0, 0: free
	int fd;
	int64_t until_ns; // CLOCK_MONOTONIC ns after which Go is asked again
	int refs;         // readers using fd: replaced or closed only when it has none
	int64_t next;     // the offset after the last range read from it: a read there is in sequence
};

// The heat of blocks (capi/fcheat.h) of the processes forked after load, which decides when
// they ask for a block (see hit_pread): mapped shared by the first fcHitOpen, in the process
// that forks its DataLoader workers, so that they all, epoch after epoch, count as one reader.
static struct fc_heat *heat; // NULL until mapped (then never unmapped)
static pthread_once_t heat_once = PTHREAD_ONCE_INIT;
static struct fc_heat heat_here[FC_HEAT_PLACES]; // when no shared mapping could be made

static void map_heat(void) {
	void *m = mmap(NULL, FC_HEAT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	heat = m == MAP_FAILED ? heat_here : m;
}

// A copy the tiers no longer list is let go within this long (see range_sweep).
#define RANGE_SWEEP_NS 1000000000LL

// A client of the hit path. The references to it and its hits are counted per shard of the
// threads that read (see struct shard), not here, so that hits do not write it.
struct hit_client {
	int64_t handle;
	char root[FC_PATH_MAX];
	size_t rootlen;
	int real_root_fd;            // the root with its links resolved (O_PATH), opened once, checked
	                             // to be a directory reached through no link: sources are opened
	                             // beneath it, so a root swapped for a link later leads nowhere
	char node_socket[sizeof(((struct sockaddr_un *)0)->sun_path)]; // "" for none
	int64_t timeout_ms;
	int64_t node_down_until; // CLOCK_MONOTONIC ns before which the node socket is skipped (atomic):
	                         // set by fcHitServerState, and for a while after a timeout
	int64_t fetches;         // misses the server cached through the node socket (atomic)
	int64_t direct;          // files read from the source by read_source (atomic)
	bool fills;              // the server records this process's fills (fcHitSetFills; atomic)
	int64_t filled;          // files this process filled (hit_fill; atomic)
	int64_t full_until;      // CLOCK_MONOTONIC ns before which misses skip the server: it said
	                         // it has no room for this dataset (atomic)
	bool node_opens;         // a file no tier takes is opened by the node's server, not read
	                         // from the source here (cluster mode: the server reads it from its
	                         // owner, so the source is still read once for the job)
	int64_t batch_off_until; // CLOCK_MONOTONIC ns before which misses are not asked for in batches:
	                         // the server did not know FC_NODE_OP_OPEN_MANY (atomic)
	pthread_mutex_t node_mu; // protects node_fd and node_pid
	int node_fd;             // the connection kept to the node socket, or -1
	pid_t node_pid;          // the process that opened node_fd
	int closing_fd;          // an eventfd that fcHitClose makes readable, or -1: misses waiting
	                         // on the server in the process that opened the client stop then
	pid_t opener;            // that process (a child forked after load has its own copy of the
	                         // client, which its parent's close must not stop)
	struct fc_tier tiers[FC_MAX_TIERS];
	int ntiers;          // tiers in use (atomic: added under clients_lock, read without it)
	int64_t block_bytes; // the size of its server's blocks, 0 for none (atomic: see fcHitSetBlockBytes)
	pthread_mutex_t ranges_mu; // protects ranges and ranges_turn; never held across a copy
	struct range_map ranges[RANGE_SETS * RANGE_WAYS];
	unsigned ranges_turn; // picks the entry of a full set that a new mapping replaces
	int64_t ranges_swept; // CLOCK_MONOTONIC ns of the last range_sweep (atomic)
	struct range_source sources[RANGE_SOURCES]; // under ranges_mu
	int64_t source_ranges;                      // ranges read from them (atomic)
};

// clients_lock is held to add or remove a client or add a tier to one, and by fork; readers
// take no lock (see acquire). It is never held across I/O or a wait for the server, so that
// fc_close and fork get it at once. It prefers writers, so it must never be taken twice by
// one thread: no function here calls another that takes it while holding it.
// clients[h % CLIENT_SLOTS] holds the client of handle h (stored atomically: read without
// the lock).
static pthread_rwlock_t clients_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static struct hit_client *clients[CLIENT_SLOTS];

// A buffer handed out by the hit path.
enum { BUF_FREE, BUF_EMPTY, BUF_HEAP, BUF_MAPPED };
struct cbuf {
	void *ptr;
	size_t len;
	uint32_t gen; // bumped when the slot is freed, so a stale handle is EBADF
	uint8_t kind;
};

// Memory for copied hits comes from a small pool of freed buffers, by power-of-two size class:
// a batch (fc_read_many) holds 64 or so buffers of ~100 KiB at once, and when they were given
// back to malloc it returned the top of its heap to the kernel, so every batch faulted in (and
// the kernel zeroed) megabytes anew: __getitems__ through a DataLoader ran at half the speed of
// reading item by item. Each shard keeps a pool of its own, of at most POOL_KEEP buffers a
// class and POOL_MAX_BYTES; a buffer goes back to the pool of the shard it came from, so a
// pool never holds more than its shard's threads held at once.
#define POOL_MIN_SHIFT 12 // 4 KiB
#define POOL_CLASSES 8    // up to 512 KiB (FC_READ_MAX_BYTES)
#define POOL_KEEP 256
#define POOL_MAX_BYTES ((size_t)64 << 20)

// Threads scale: a hit takes no lock that the threads of other shards take, and writes no
// line that they write (but the process's line of hit counters in the tier's index, see
// fc_count_hit). Each thread belongs to one of SHARDS shards (see own_shard), which holds the
// table of the buffers it hands out, its pool of free memory, and its counts of the
// references to each client slot and of the hits on it.
// A buffer released by another thread goes back to the shard it came from (its handle says
// which), so that shard's lock is the only one a release takes.
#define SHARD_BITS 6
#define SHARDS (1 << SHARD_BITS)
#define SLOT_BITS 26
#define SHARD_BUFS ((uint32_t)1 << SLOT_BITS) // buffers of a shard handed out at once, at most
_Static_assert(SHARD_BITS + SLOT_BITS <= 32, "a handle's low 32 bits hold its shard and slot");
struct shard {
	pthread_mutex_t mu; // protects the buffers and the pool; never held across I/O
	struct cbuf *bufs;
	uint32_t nbufs, capbufs;
	uint32_t *free_slots, nfree;
	int64_t live; // buffers handed out and not released
	void *pool[POOL_CLASSES][POOL_KEEP];
	int pool_len[POOL_CLASSES];
	size_t pool_bytes;
	// Per client slot, written by the shard's threads with atomics (no lock): references
	// taken (see acquire), and hits counted (fcHitCounts sums them over the shards).
	int refs[CLIENT_SLOTS];
	int64_t hits[CLIENT_SLOTS];
} __attribute__((aligned(128))); // shards share no cache line, nor a pair the CPU fetches together

static struct shard shards[SHARDS] = {[0 ... SHARDS - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}};

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
static struct shard *own_shard(void) {
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

// A handle is FC_CBUF_BASE | gen << 32 | shard << SLOT_BITS | slot.
static int64_t buf_handle(const struct shard *s, uint32_t slot, uint32_t gen) {
	return FC_CBUF_BASE | ((int64_t)(gen & 0x3fffffff) << 32) | (int64_t)(s - shards) << SLOT_BITS | slot;
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
			pthread_mutex_init(&clients[i]->node_mu, NULL); // a parent's thread may have held it in a fetch
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

// add_buf registers a buffer in the calling thread's shard and returns its handle, or -ENOMEM.
static int64_t add_buf(void *ptr, size_t len, uint8_t kind) {
	struct shard *s = own_shard();
	pthread_mutex_lock(&s->mu);
	uint32_t slot;
	if (s->nfree > 0) {
		slot = s->free_slots[--s->nfree];
	} else {
		if (s->nbufs == s->capbufs) {
			uint32_t cap = s->capbufs ? 2 * s->capbufs : 64;
			struct cbuf *nb = cap <= SHARD_BUFS ? realloc(s->bufs, cap * sizeof *nb) : NULL;
			uint32_t *nf = nb ? realloc(s->free_slots, cap * sizeof *nf) : NULL;
			if (nb)
				s->bufs = nb;
			if (!nf) {
				pthread_mutex_unlock(&s->mu);
				return -ENOMEM;
			}
			s->free_slots = nf;
			s->capbufs = cap;
		}
		slot = s->nbufs++;
		s->bufs[slot].gen = 0;
	}
	s->bufs[slot].ptr = ptr;
	s->bufs[slot].len = len;
	s->bufs[slot].kind = kind;
	s->live++;
	int64_t h = buf_handle(s, slot, s->bufs[slot].gen);
	pthread_mutex_unlock(&s->mu);
	return h;
}

// size_class returns the class of a buffer of n bytes, or -1 for one the pool does not keep.
static int size_class(size_t n) {
	for (int c = 0; c < POOL_CLASSES; c++)
		if (n <= (size_t)1 << (POOL_MIN_SHIFT + c))
			return c;
	return -1;
}

// pool_keep keeps p, memory from buf_alloc of n bytes, in s's pool if it has room for it
// (s->mu held); it returns whether it did.
static bool pool_keep(struct shard *s, void *p, size_t n) {
	int c = size_class(n);
	if (c < 0)
		return false;
	size_t sz = (size_t)1 << (POOL_MIN_SHIFT + c);
	if (s->pool_len[c] == POOL_KEEP || s->pool_bytes + sz > POOL_MAX_BYTES)
		return false;
	s->pool[c][s->pool_len[c]++] = p;
	s->pool_bytes += sz;
	return true;
}

// buf_alloc returns memory for n bytes (n > 0).
static void *buf_alloc(size_t n) {
	int c = size_class(n);
	if (c < 0)
		return malloc(n);
	struct shard *s = own_shard();
	pthread_mutex_lock(&s->mu);
	void *p = NULL;
	if (s->pool_len[c] > 0) {
		p = s->pool[c][--s->pool_len[c]];
		s->pool_bytes -= (size_t)1 << (POOL_MIN_SHIFT + c);
	}
	pthread_mutex_unlock(&s->mu);
	return p ? p : malloc((size_t)1 << (POOL_MIN_SHIFT + c));
}

// buf_free gives back memory from buf_alloc of n bytes, taken by the calling thread.
static void buf_free(void *p, size_t n) {
	struct shard *s = own_shard();
	pthread_mutex_lock(&s->mu);
	bool kept = pool_keep(s, p, n);
	pthread_mutex_unlock(&s->mu);
	if (!kept)
		free(p);
}

static void free_mem(void *ptr, size_t len, uint8_t kind) {
	if (kind == BUF_HEAP)
		buf_free(ptr, len);
	else if (kind == BUF_MAPPED)
		munmap(ptr, len);
}

int hit_release(int64_t h) {
	if (h < FC_CBUF_BASE)
		return -EBADF;
	struct shard *s = &shards[((uint64_t)h >> SLOT_BITS) & (SHARDS - 1)];
	uint32_t slot = (uint32_t)h & (SHARD_BUFS - 1), gen = (uint32_t)((h >> 32) & 0x3fffffff);
	pthread_mutex_lock(&s->mu);
	if (slot >= s->nbufs || s->bufs[slot].kind == BUF_FREE || (s->bufs[slot].gen & 0x3fffffff) != gen) {
		pthread_mutex_unlock(&s->mu);
		return -EBADF;
	}
	struct cbuf b = s->bufs[slot];
	s->bufs[slot].kind = BUF_FREE;
	s->bufs[slot].ptr = NULL;
	s->bufs[slot].gen++;
	s->free_slots[s->nfree++] = slot;
	s->live--;
	bool kept = b.kind == BUF_HEAP && pool_keep(s, b.ptr, b.len); // the pool it came from
	pthread_mutex_unlock(&s->mu);
	if (b.kind == BUF_HEAP && !kept)
		free(b.ptr);
	else if (b.kind == BUF_MAPPED)
		munmap(b.ptr, b.len);
	return 0;
}

int64_t hit_buffers(void) {
	int64_t n = 0;
	for (int i = 0; i < SHARDS; i++) {
		pthread_mutex_lock(&shards[i].mu);
		n += shards[i].live;
		pthread_mutex_unlock(&shards[i].mu);
	}
	return n;
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
static struct hit_client *acquire(int64_t h) {
	int *refs = &own_shard()->refs[(uint64_t)h % CLIENT_SLOTS];
	__atomic_fetch_add(refs, 1, __ATOMIC_SEQ_CST);
	struct hit_client *c = __atomic_load_n(&clients[(uint64_t)h % CLIENT_SLOTS], __ATOMIC_SEQ_CST);
	if (c && c->handle == h)
		return c;
	__atomic_fetch_sub(refs, 1, __ATOMIC_RELEASE);
	return NULL;
}

// put gives back a reference from acquire (c may be NULL).
static void put(struct hit_client *c) {
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
static void count_hit(const struct hit_client *c) {
	__atomic_fetch_add(&own_shard()->hits[(uint64_t)c->handle % CLIENT_SLOTS], 1, __ATOMIC_RELAXED);
}

// tier_count returns the tiers of c that readers may use: fcHitAddTier fills a tier before it
// counts it.
static int tier_count(struct hit_client *c) { return __atomic_load_n(&c->ntiers, __ATOMIC_ACQUIRE); }

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
	c->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
	c->node_opens = node_opens;
	c->node_down_until = INT64_MAX; // until the Go client reports its server up
	c->node_fd = -1;
	c->closing_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK); // -1: misses are not stopped by close
	c->opener = getpid();
	pthread_mutex_init(&c->node_mu, NULL);
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
		pthread_mutex_destroy(&c->node_mu);
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
	if (c->node_fd >= 0)
		close(c->node_fd);
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
	pthread_mutex_destroy(&c->node_mu);
	pthread_mutex_destroy(&c->ranges_mu);
	free(c);
}

static void keep_source(struct hit_client *c, const char *path, size_t len, int fd, int64_t ms);

void fcHitSetSource(int64_t handle, const char *path, int fd, int64_t ms) {
	struct hit_client *c = acquire(handle);
	if (!c) {
		close(fd);
		return;
	}
	keep_source(c, path, strlen(path), fd, ms);
	put(c);
}

// keep_source keeps fd, the source of the large file at the clean absolute path path (len
// bytes), in c's sources for ms milliseconds (see fcHitSetSource); c owns fd from then on. An
// fd of -1 notes a file too small to be read by blocks (see open_source).
static void keep_source(struct hit_client *c, const char *path, size_t len, int fd, int64_t ms) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	int old = -1, kept = 0;
	int64_t now = fc_monotonic_ns();
	pthread_mutex_lock(&c->ranges_mu);
	// Its entry if it has one, else a free one, else an expired one, else the unused one that
	// expires first: the sources of files read in turn are all kept.
	int at = -1;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].key == key && c->sources[i].check == check)
			at = i;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].key == 0 && c->sources[i].check == 0)
			at = i;
	for (int i = 0; i < RANGE_SOURCES && at < 0; i++)
		if (c->sources[i].refs == 0 && c->sources[i].until_ns <= now)
			at = i;
	if (at < 0)
		for (int i = 0; i < RANGE_SOURCES; i++)
			if (c->sources[i].refs == 0 && (at < 0 || c->sources[i].until_ns < c->sources[at].until_ns))
				at = i;
	if (at >= 0 && c->sources[at].refs == 0) {
		struct range_source *s = &c->sources[at];
		old = s->key || s->check ? s->fd : -1;
		*s = (struct range_source){.key = key, .check = check, .fd = fd,
		                           .until_ns = fc_monotonic_ns() + ms * 1000000LL};
		kept = 1;
	} else if (at >= 0) { // in use: only its deadline moves
		c->sources[at].until_ns = fc_monotonic_ns() + ms * 1000000LL;
	}
	pthread_mutex_unlock(&c->ranges_mu);
	if (old >= 0)
		close(old);
	if (!kept && fd >= 0)
		close(fd);
}

void fcHitSetBlockBytes(int64_t handle, int64_t n) {
	struct hit_client *c = acquire(handle);
	if (c)
		__atomic_store_n(&c->block_bytes, n, __ATOMIC_RELAXED);
	put(c);
}

void fcHitCounts(int64_t handle, int64_t *hits, int64_t *fetches, int64_t *direct, int64_t *source_ranges) {
	struct hit_client *c = acquire(handle);
	*hits = 0;
	for (int k = 0; c && k < SHARDS; k++)
		*hits += __atomic_load_n(&shards[k].hits[(uint64_t)handle % CLIENT_SLOTS], __ATOMIC_RELAXED);
	*fetches = c ? __atomic_load_n(&c->fetches, __ATOMIC_RELAXED) : 0;
	*direct = c ? __atomic_load_n(&c->direct, __ATOMIC_RELAXED) : 0;
	*source_ranges = c ? __atomic_load_n(&c->source_ranges, __ATOMIC_RELAXED) : 0;
	put(c);
}

// source_path writes the clean absolute path of path (absolute, or relative to c's root) into
// out; it returns its length, or -1 when the path is too long or not under the root (Go then
// gives the error).
static int source_path(const struct hit_client *c, const char *path, char *out, size_t cap) {
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

// read_max is FC_READ_MAX_BYTES unless FITCACHE_READ_MAX_BYTES overrides it (for
// bench/bench_crossover.py, which measures where mapping starts to pay).
static int64_t read_max = FC_READ_MAX_BYTES;

__attribute__((constructor)) static void read_max_init(void) {
	const char *v = getenv("FITCACHE_READ_MAX_BYTES");
	char *end;
	long long n = v ? strtoll(v, &end, 10) : -1;
	if (v && *v && *end == 0 && n >= 0)
		read_max = n;
}

// take reads or maps the whole file of a hit; it returns 0, FC_MISS if the file did not give
// the bytes the index promised, or -ENOMEM.
static int take(const struct fc_hit *h, void **ptr, uint8_t *kind) {
	if (h->size == 0) {
		*ptr = NULL;
		*kind = BUF_EMPTY;
		return 0;
	}
	if (h->size > read_max) {
		void *m = mmap(NULL, (size_t)h->size, PROT_READ, MAP_SHARED, h->fd, 0);
		if (m == MAP_FAILED)
			return FC_MISS;
		*ptr = m;
		*kind = BUF_MAPPED;
		return 0;
	}
	char *p = buf_alloc((size_t)h->size);
	if (!p)
		return -ENOMEM;
	size_t done = 0;
	while (done < (size_t)h->size) {
		ssize_t k = pread(h->fd, p + done, (size_t)h->size - done, (off_t)done);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0) {
			buf_free(p, (size_t)h->size);
			return FC_MISS;
		}
		done += (size_t)k;
	}
	*ptr = p;
	*kind = BUF_HEAP;
	return 0;
}

static int hit_read_counted(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer,
                            int count);

// hand_out registers the memory take made and stores it as fc_read returns it; it returns 0,
// or -ENOMEM after freeing it.
static int hand_out(void *ptr, int64_t n, uint8_t kind, const void **data, int64_t *size, int64_t *buffer) {
	int64_t id = add_buf(ptr, (size_t)n, kind);
	if (id < 0) {
		free_mem(ptr, (size_t)n, kind);
		return (int)id;
	}
	*data = ptr;
	*size = n;
	*buffer = id;
	return 0;
}

int hit_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	return hit_read_counted(handle, path, data, size, buffer, 1);
}

int hit_read_fetched(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	return hit_read_counted(handle, path, data, size, buffer, 0);
}

// ts_ns returns a time as Unix nanoseconds, as the index records times.
static int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec; }

int hit_read_checked(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int saved = errno;
	struct hit_client *c = acquire(handle);
	char clean[FC_PATH_MAX];
	struct fc_hit h = {.fd = -1};
	int n, nt, rc = FC_MISS;
	if (!c || (nt = tier_count(c)) == 0 || c->real_root_fd < 0 ||
	    (n = source_path(c, path, clean, sizeof clean)) < 0 || (size_t)n <= c->rootlen ||
	    fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, 0, &h) != 0) {
		h.fd = -1;
		goto out;
	}
	// The source as Go's reader looks at it (client/deadtiers.go): one stat beneath the
	// resolved root, following links (a link to anything else is another version). A system
	// call, not libc's fstatat: the preload shim may interpose it.
	struct stat st;
	const char *rel = clean + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	if (syscall(SYS_newfstatat, c->real_root_fd, rel, &st, 0) != 0 || !S_ISREG(st.st_mode) ||
	    (int64_t)st.st_size != h.size || ts_ns(st.st_mtim) != h.mtime_ns ||
	    (h.src_ctime_ns != 0 && ts_ns(st.st_ctim) != h.src_ctime_ns) ||
	    (h.src_ino != 0 && (uint64_t)st.st_ino != h.src_ino))
		goto out; // another version: the copy is no hit
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0 || (rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	fc_count_hit(&c->tiers[h.tier], h.size);
	count_hit(c);
out:
	if (h.fd >= 0)
		close(h.fd);
	put(c);
	errno = saved;
	return rc;
}

// hit_read_counted is hit_read; it counts the read as a hit only with count. Without count
// (a file the server has just fetched, and checked against its source), a copy checked in an
// earlier session than the client's is served too: a restarted server numbers sessions anew.
static int hit_read_counted(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer,
                            int count) {
	int saved = errno;
	struct hit_client *c = acquire(handle);
	char clean[FC_PATH_MAX];
	struct fc_hit h;
	int n, nt, rc = FC_MISS;
	if (!c || (nt = tier_count(c)) == 0 || (n = source_path(c, path, clean, sizeof clean)) < 0 ||
	    fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, count, &h) != 0)
		goto out;
	void *ptr;
	uint8_t kind;
	rc = take(&h, &ptr, &kind);
	close(h.fd);
	if (rc != 0)
		goto out;
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0 || !count)
		goto out;
	fc_count_hit(&c->tiers[h.tier], h.size);
	count_hit(c);
out:
	put(c);
	errno = saved;
	return rc;
}

// range_set returns the set of entries where c keeps the copy whose name has hash key. The
// key's bits are mixed first (as the tiers' index does): names of blocks of one file differ
// in their last bytes only, which FNV-1a leaves in few of its bits.
static struct range_map *range_set(struct hit_client *c, uint64_t key) {
	_Static_assert((RANGE_SETS & (RANGE_SETS - 1)) == 0, "RANGE_SETS is a power of 2");
	return &c->ranges[((key * 0x9E3779B97F4A7C15ULL) >> (64 - __builtin_ctz(RANGE_SETS))) * RANGE_WAYS];
}

// range_take returns the mapping c keeps of the copy (key, check) with a reference taken
// (give it back with range_give), or NULL.
static struct range_map *range_take(struct hit_client *c, uint64_t key, uint64_t check) {
	struct range_map *set = range_set(c, key), *found = NULL;
	pthread_mutex_lock(&c->ranges_mu);
	for (int i = 0; i < RANGE_WAYS; i++) {
		if (set[i].data && set[i].key == key && set[i].check == check) {
			found = &set[i];
			found->refs++;
			break;
		}
	}
	pthread_mutex_unlock(&c->ranges_mu);
	return found;
}

static void range_give(struct hit_client *c, struct range_map *r) {
	pthread_mutex_lock(&c->ranges_mu);
	r->refs--;
	pthread_mutex_unlock(&c->ranges_mu);
}

// range_drop gives back a reference from range_take and lets go of the entry, unless
// another reader uses it (its last range_take then finds it not intact and drops it).
static void range_drop(struct hit_client *c, struct range_map *r) {
	struct range_map old = {0};
	pthread_mutex_lock(&c->ranges_mu);
	if (--r->refs == 0) {
		old = *r;
		*r = (struct range_map){0};
	}
	pthread_mutex_unlock(&c->ranges_mu);
	if (old.data)
		munmap((void *)old.data, (size_t)old.size);
}

// range_keep keeps data, a mapping of size bytes just made of the copy (key, check), in an
// entry of its set that no reader uses (unmapping the one it held), with a reference taken;
// it returns the entry, or NULL when every entry of the set is in use (the caller then
// unmaps data itself).
static struct range_map *range_keep(struct hit_client *c, uint64_t key, uint64_t check, const char *data,
                                    int64_t size, uint64_t ino, int tier, struct piece_version ver) {
	struct range_map *set = range_set(c, key), *r = NULL;
	struct range_map old = {0};
	pthread_mutex_lock(&c->ranges_mu);
	for (int i = 0; i < RANGE_WAYS && !r; i++)
		if (!set[i].data)
			r = &set[i];
	for (int k = 0; k < RANGE_WAYS && !r; k++) {
		struct range_map *e = &set[(c->ranges_turn + (unsigned)k) % RANGE_WAYS];
		if (e->refs == 0)
			r = e;
	}
	if (r) {
		old = *r;
		*r = (struct range_map){.key = key, .check = check, .data = data, .size = size, .ino = ino, .tier = tier,
		                        .refs = 1, .ver = ver};
		c->ranges_turn++;
	}
	pthread_mutex_unlock(&c->ranges_mu);
	if (old.data)
		munmap((void *)old.data, (size_t)old.size);
	return r;
}

static int node_fetch(struct hit_client *c, uint32_t op, const char *name, size_t len, char *msg);

// range_sweep lets go, at most once per RANGE_SWEEP_NS, of the mappings of copies the tiers
// no longer list: the server evicted or removed them, and a mapping would keep their pages
// in use (a tmpfs file's pages are freed only once nobody maps it).
static void range_sweep(struct hit_client *c) {
	int64_t now = fc_monotonic_ns(), last = __atomic_load_n(&c->ranges_swept, __ATOMIC_RELAXED);
	if (now - last < RANGE_SWEEP_NS ||
	    !__atomic_compare_exchange_n(&c->ranges_swept, &last, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		return;
	for (int i = 0; i < RANGE_SETS * RANGE_WAYS; i++) {
		struct range_map *r = &c->ranges[i], seen, old = {0};
		pthread_mutex_lock(&c->ranges_mu);
		seen = *r;
		pthread_mutex_unlock(&c->ranges_mu);
		if (!seen.data || fc_listed(&c->tiers[seen.tier], seen.key, seen.check, seen.ino))
			continue;
		pthread_mutex_lock(&c->ranges_mu); // the index was looked at without the lock: the
		if (r->data == seen.data && r->key == seen.key && r->check == seen.check && r->ino == seen.ino &&
		    r->refs == 0) { // entry may have changed meanwhile
			old = *r;
			*r = (struct range_map){0};
		}
		pthread_mutex_unlock(&c->ranges_mu);
		if (old.data)
			munmap((void *)old.data, (size_t)old.size);
	}
}

// read_copy copies n bytes at off of the cached copy named name (len bytes) into p, from a
// mapping kept (range_take) or made now, and adds them to served[its tier]; it returns the
// bytes copied (fewer than n at the end of the copy), -FC_MISS when no tier holds the copy
// (checked in the client's session, with require_session: without, a copy the server has
// just said it holds, as for hit_read_fetched), or -EIO. *ver (may be NULL) is set to the
// version of the source the copy holds, read from its record when it is mapped.
static ssize_t read_copy(struct hit_client *c, int nt, const char *name, size_t len, char *p, size_t n, off_t off,
                         int require_session, int64_t *served, struct piece_version *ver) {
	uint64_t key, check;
	fc_hashes(name, len, &key, &check);
	struct range_map *r = range_take(c, key, check), made;
	if (r && !fc_copy_intact(&c->tiers[r->tier], name, len, r->ino, r->size, &r->intact_ns)) {
		// Truncated in place by someone, or evicted: never touched again (SIGBUS), and
		// looked up anew.
		range_drop(c, r);
		r = NULL;
	}
	if (!r) {
		struct fc_hit h;
		if (fc_lookup(c->tiers, nt, name, len, O_CLOEXEC, require_session, &h) != 0)
			return -FC_MISS;
		made = (struct range_map){.size = h.size, .tier = h.tier};
		made.ver.known = fc_copy_version(&h, &made.ver.v) == 0;
		if (h.size > 0) {
			void *m = mmap(NULL, (size_t)h.size, PROT_READ, MAP_SHARED, h.fd, 0);
			close(h.fd);
			if (m == MAP_FAILED)
				return -EIO;
			made.data = m;
			r = range_keep(c, key, check, m, h.size, h.ino, h.tier, made.ver);
		} else {
			close(h.fd);
		}
	}
	const struct range_map *use = r ? r : &made;
	size_t k = off >= use->size ? 0 : (size_t)(use->size - off) < n ? (size_t)(use->size - off) : n;
	if (k > 0)
		memcpy(p, use->data + off, k);
	int tier = use->tier;
	if (ver)
		*ver = use->ver;
	if (r)
		range_give(c, r);
	else if (made.data)
		munmap((void *)made.data, (size_t)made.size);
	served[tier] += (int64_t)k;
	return (ssize_t)k;
}

// read_source_range reads n bytes at off of the file whose clean path is path (len bytes)
// from the source descriptor Go left for it (fcHitSetSource), or that open_source opened, if
// there is one still valid; it returns the bytes read, or -FC_MISS. *sequential (may be NULL)
// says whether the read this range is part of, which began at call_off, began where the last
// range read from the source ended: a range that spans two blocks is two ranges here, and the
// second is no sign of a reader in sequence. With ver (may be NULL: a range that is the
// read's only piece), it returns in *ver the version of the file the bytes are of, and
// -EAGAIN when the file changed while they were read (fstat before and after).
static ssize_t read_source_range(struct hit_client *c, const char *path, size_t len, char *p, size_t n, off_t off,
                                 off_t call_off, int *sequential, struct piece_version *ver) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	int64_t now = fc_monotonic_ns();
	struct range_source *s = NULL;
	pthread_mutex_lock(&c->ranges_mu);
	for (int i = 0; i < RANGE_SOURCES; i++)
		if (c->sources[i].key == key && c->sources[i].check == check && now < c->sources[i].until_ns &&
		    c->sources[i].fd >= 0) {
			s = &c->sources[i];
			s->refs++;
			break;
		}
	pthread_mutex_unlock(&c->ranges_mu);
	if (!s)
		return -FC_MISS;
	size_t done = 0;
	int failed = 0; // an error is no end of file: the range is left to the caller's fallback
	struct piece_version after;
	if (ver && fd_version(s->fd, ver) != 0)
		failed = 1;
	while (done < n && !failed) {
		ssize_t k = pread(s->fd, p + done, n - done, off + (off_t)done);
		if (k < 0 && errno == EINTR)
			continue;
		failed = k < 0;
		if (k <= 0)
			break;
		done += (size_t)k;
	}
	int changed = ver && !failed && (fd_version(s->fd, &after) != 0 || after.v.mtime_ns != ver->v.mtime_ns ||
	                                 after.v.ctime_ns != ver->v.ctime_ns || after.v.ino != ver->v.ino);
	pthread_mutex_lock(&c->ranges_mu);
	s->refs--;
	if (sequential)
		*sequential = call_off > 0 && s->next == call_off;
	s->next = off + (off_t)done;
	pthread_mutex_unlock(&c->ranges_mu);
	if (failed)
		return -FC_MISS;
	if (changed)
		return -EAGAIN;
	__atomic_fetch_add(&c->source_ranges, 1, __ATOMIC_RELAXED);
	if (c->ntiers > 0) // in the server's statistics too: a forked reader has no Go to report it
		fc_count_source(&c->tiers[0], (int64_t)done);
	return (ssize_t)done;
}

// source_open opens the source file at the clean path path (len bytes, under c's root) for
// reading, beneath the real root held open since the client opened (openat2 RESOLVE_BENEATH:
// no link leads out of it; O_NONBLOCK: a FIFO never blocks), as core.OpenSource does: the
// descriptor, or -1 (Go then reads the file, and says why).
static int source_open(struct hit_client *c, const char *path, size_t len) {
	if (c->real_root_fd < 0 || len <= c->rootlen)
		return -1;
	const char *rel = path + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	struct open_how how = {.flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC, .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
	return (int)syscall(SYS_openat2, c->real_root_fd, rel, &how, sizeof how);
}

// READ_NOW_BYTES is core.ReadNowBytes: the server cuts files of at least this size in
// blocks, and caches smaller ones whole.
#define READ_NOW_BYTES ((int64_t)8 << 20)

// How long open_source keeps a source it opened (as the Go client keeps one: sourceKeep).
#define SOURCE_KEEP_MS 5000

// open_source makes sure c has a source descriptor of the file at the clean path path (len
// bytes, under c's root) for read_source_range: one Go left, or one opened here, beneath the
// root as hit_read_source opens (no link out of it, a regular file). It returns 1 when there
// is one (of a file of READ_NOW_BYTES or more), 0 for a smaller file (not kept), -1 when the
// file cannot be opened here (Go's rules apply, or the server's).
static int open_source(struct hit_client *c, const char *path, size_t len) {
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	int64_t now = fc_monotonic_ns();
	int have = -1; // 1: a source kept, 0: a file noted small
	pthread_mutex_lock(&c->ranges_mu);
	for (int i = 0; i < RANGE_SOURCES && have < 0; i++)
		if (c->sources[i].key == key && c->sources[i].check == check && now < c->sources[i].until_ns)
			have = c->sources[i].fd >= 0;
	pthread_mutex_unlock(&c->ranges_mu);
	if (have >= 0)
		return have;
	int fd = source_open(c, path, len);
	struct stat st;
	if (fd < 0)
		return -1;
	if (fc_sys_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return -1;
	}
	if (st.st_size < READ_NOW_BYTES) { // noted, so that its next ranges do not open it again
		close(fd);
		keep_source(c, path, len, -1, SOURCE_KEEP_MS);
		return 0;
	}
	keep_source(c, path, len, fd, SOURCE_KEEP_MS);
	return 1;
}

static int node_tell(struct hit_client *c, uint32_t op, const char *name, size_t len);

// listed_here reports whether a tier of c lists the copy named name (len bytes), checked in
// c's session or not: a block a new job finds cached by an earlier one, which the server
// checks (once for the file) when asked for it.
static int listed_here(struct hit_client *c, int nt, const char *name, size_t len) {
	struct fc_hit hit;
	if (fc_lookup(c->tiers, nt, name, len, O_CLOEXEC, 0, &hit) != 0)
		return 0;
	close(hit.fd);
	return 1;
}

int hit_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off, int ask, int64_t *got) {
	int saved = errno;
	struct hit_client *c = acquire(handle);
	char name[FC_PATH_MAX + 48], msg[FC_FETCH_MESSAGE];
	int n, nt, rc = FC_MISS;
	if (!c || (nt = tier_count(c)) == 0 || (n = source_path(c, path, name, FC_PATH_MAX)) < 0)
		goto out;
	range_sweep(c);
	// Bytes served from copies that were cached, by tier, counted once the whole range is
	// served here; those of copies the server has just fetched for this read go to fetched,
	// which counts nothing: the server counted that miss (as hit_read_fetched does).
	int64_t served[FC_MAX_TIERS] = {0}, fetched[FC_MAX_TIERS] = {0};
	// Blocks first, when the server has them: a large file is read by ranges through its
	// blocks, and its whole copy is the exception. The range may span several blocks; a block
	// shorter than the rest of the range is the file's last. A first block not cached leaves
	// the range to the whole copy, if there is one; then, with ask, the server is asked for
	// the block (a file under 8 MiB, which the server refuses to cut in blocks, for the
	// whole file). A block still not cached is read from the file's source when Go left one
	// here (the server has no room for its blocks: fcHitSetSource); else Go serves the range.
	int64_t bb = __atomic_load_n(&c->block_bytes, __ATOMIC_RELAXED), done = 0;
	ssize_t k = -FC_MISS;
	// The pieces of a range that spans blocks must be of one version of the file: a block
	// cached before the source was rewritten in place (same size, even the same mtime: the
	// change time tells) is never followed by bytes of the new version read from the
	// source. Each piece's version is kept (a copy's from its record, a source range's from
	// fstat around its read), and a range of pieces of two versions is read again from the
	// source alone.
	int pieces = bb > 0 && len > 0 && (off + len - 1) / bb != off / bb, mixed = 0;
	struct piece_version first = {0}, v;
	while (bb > 0 && done < len) {
		int64_t at = off + done, block = at / bb, within = at % bb;
		int64_t want = len - done < bb - within ? len - done : bb - within;
		size_t namelen = fc_block_name(name, (size_t)n, bb, block);
		v = (struct piece_version){0};
		k = read_copy(c, nt, name, namelen, (char *)buf + done, (size_t)want, (off_t)within, 1, served, &v);
		if (k == -FC_MISS && ask && done == 0) {
			k = read_copy(c, nt, name, (size_t)n, buf, (size_t)len, (off_t)off, 1, served, NULL); // a whole copy
			if (k >= 0) {
				done = k;
				break;
			}
		}
		if (k == -FC_MISS && ask && !listed_here(c, nt, name, namelen) && open_source(c, name, (size_t)n) == 1) {
			// A block not cached, in a process forked after load (it cannot run Go): the range
			// of a large file is read from its source at once, and the block asked for in the
			// background once it is worth it (capi/fcheat.h): the reader never waits for a
			// block. A block the tiers list (unchecked for this job) and a smaller file (which
			// the server caches whole) are asked for below, and waited for.
			int sequential = 0;
			k = read_source_range(c, name, (size_t)n, (char *)buf + done, (size_t)want, (off_t)at, (off_t)off,
			                      &sequential, pieces ? &v : NULL);
			if (k > 0 && heat && fc_heat_read(fc_heat_of(heat, name, namelen), k, bb, sequential))
				node_tell(c, FC_NODE_OP_CACHE_BLOCK, name, namelen);
		}
		if (k == -FC_MISS && ask && done == 0) {
			int asked = node_fetch(c, FC_NODE_OP_FETCH_BLOCK, name, namelen, msg);
			if (asked == FC_DIRECT && node_fetch(c, FC_NODE_OP_FETCH, name, (size_t)n, msg) == 0) {
				// A file read whole: its copy serves the range.
				k = read_copy(c, nt, name, (size_t)n, buf, (size_t)len, (off_t)off, 0, fetched, NULL);
				if (k >= 0)
					done = k;
				break;
			}
			if (asked == 0)
				k = read_copy(c, nt, name, namelen, (char *)buf + done, (size_t)want, (off_t)within, 0, fetched,
				              &v);
		} else if (k == -FC_MISS && ask) {
			if (node_fetch(c, FC_NODE_OP_FETCH_BLOCK, name, namelen, msg) == 0)
				k = read_copy(c, nt, name, namelen, (char *)buf + done, (size_t)want, (off_t)within, 0, fetched,
				              &v);
		}
		if (k == -FC_MISS) // a block the server has no room for: from the source Go left here
			k = read_source_range(c, name, (size_t)n, (char *)buf + done, (size_t)want, (off_t)(at), (off_t)off, NULL,
			                      pieces ? &v : NULL);
		if (k < 0)
			break;
		if (done == 0)
			first = v;
		else if (!same_version(&first, &v))
			mixed = 1;
		done += k;
		if (k < want)
			break; // the end of the file
	}
	if (k == -EAGAIN) { // the source changed while a piece was read from it
		rc = -EAGAIN;
		goto out;
	}
	if (k < 0) {
		if (done > 0 || k != -FC_MISS || ask)
			goto out;
		if ((k = read_copy(c, nt, name, (size_t)n, buf, (size_t)len, (off_t)off, 1, served, NULL)) < 0) // a whole copy
			goto out;
		done = k;
	}
	if (mixed) {
		// Read again from the source alone, checked not to change meanwhile. Without ask (a
		// process that runs Go), Go does it, as it does for its own pieces.
		if (!ask || open_source(c, name, (size_t)n) != 1)
			goto out;
		k = read_source_range(c, name, (size_t)n, buf, (size_t)done, (off_t)off, (off_t)off, NULL, &v);
		if (k < 0) {
			rc = k == -EAGAIN ? -EAGAIN : rc;
			goto out;
		}
		done = k;
		memset(served, 0, sizeof served);
	}
	*got = done;
	rc = 0;
	int64_t hit = 0;
	for (int i = 0; i < nt; i++)
		if (served[i] > 0) {
			fc_count_hit(&c->tiers[i], served[i]);
			hit += served[i];
		}
	if (hit > 0)
		count_hit(c);
out:
	put(c);
	errno = saved;
	return rc;
}

// After the server said it has no room for a dataset, its misses are read from the source
// without asking for this long, then the server is asked again (room may have come).
#define FULL_RECHECK_NS (1000000000LL)

// After a node socket timed out, misses skip it for this long (and go through Go, which backs
// off from a server that does not answer in its own way).
#define NODE_BACKOFF_NS (5 * 1000000000LL)

// node_connect opens a connection to a node socket (see fc_node_connect).
static int node_connect(const char *socket_path, int64_t timeout_ms) {
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	strcpy(addr.sun_path, socket_path);
	return fc_node_connect(&addr, timeout_ms);
}

// node_take returns the connection to the node socket that c keeps for this process's misses
// when no other thread of it uses it (*kept then says so, and node_give must follow), or -1
// (a thread that finds it busy connects on its own). A connection inherited through fork is
// the parent's: it is closed, never used.
static int node_take(struct hit_client *c, int *kept) {
	*kept = pthread_mutex_trylock(&c->node_mu) == 0;
	if (!*kept)
		return -1;
	if (c->node_fd >= 0 && c->node_pid != getpid()) {
		close(c->node_fd);
		c->node_fd = -1;
	}
	return c->node_fd;
}

// node_give ends what node_take began: fd (a connection whose last exchange went through, or
// -1) is kept for the next miss, or closed when it was a thread's own.
static void node_give(struct hit_client *c, int fd, int kept) {
	if (kept) {
		c->node_fd = fd;
		c->node_pid = getpid();
		pthread_mutex_unlock(&c->node_mu);
	} else if (fd >= 0) {
		close(fd);
	}
}

// closing returns the descriptor that tells c's misses to stop waiting (see closing_fd), or
// -1 in a process that did not open c.
static int closing(const struct hit_client *c) { return c->opener == getpid() ? c->closing_fd : -1; }

// node_ask sends one fetch request (op FC_NODE_OP_FETCH or FC_NODE_OP_FETCH_BLOCK) on fd and
// reads the reply: 0 with the server's errno in *err and its message in msg, or -1 with errno
// set when the connection failed (EAGAIN: the server did not acknowledge within the probe
// time, stopped acknowledging, or did not answer within timeout_ms; ECANCELED: the client is
// being closed, cancel_fd).
static int node_ask(int fd, uint32_t op, const char *root, size_t rootlen, const char *path, size_t len,
                    int64_t timeout_ms, int cancel_fd, int32_t *err, char *msg) {
	uint8_t reply[12];
	if (fc_node_request(fd, op, root, rootlen, path, len, timeout_ms, cancel_fd) != 0 ||
	    fc_recv_all(fd, reply, sizeof reply) != 0)
		return -1;
	if (memcmp(reply, FC_NODE_MAGIC, 4) != 0 || fc_get32(reply + 8) > FC_NODE_MAX_MESSAGE ||
	    fc_recv_all(fd, msg, fc_get32(reply + 8)) != 0) {
		errno = EPROTO;
		return -1;
	}
	msg[fc_get32(reply + 8)] = 0;
	*err = (int32_t)fc_get32(reply + 4);
	return 0;
}

int hit_fetch(int64_t handle, const char *path, char *msg) {
	int saved = errno;
	msg[0] = 0;
	char clean[FC_PATH_MAX];
	int n = -1;
	// A reference is held through the fetch, so that the client cannot go meanwhile
	// (fcHitClose waits for it); no lock is held while the server is waited for.
	struct hit_client *c = acquire(handle);
	if (!c || !c->node_socket[0] || fc_monotonic_ns() < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED) ||
	    (n = source_path(c, path, clean, sizeof clean)) < 0) {
		put(c);
		errno = saved;
		return FC_MISS;
	}
	if (c->node_opens) {
		// The node's server answers a miss with a descriptor (OpOpen) in one round trip, its
		// tier's copy or the bytes another node sent: asking it to fetch first (OpFetch) and
		// then finding the file would cost a second round trip, and a second transfer of a
		// file it has no room to keep.
		put(c);
		errno = saved;
		return FC_DIRECT;
	}
	int rc = node_fetch(c, FC_NODE_OP_FETCH, clean, (size_t)n, msg);
	put(c);
	errno = saved;
	return rc;
}

// node_tell sends c's server a request it does not answer (FC_NODE_OP_CACHE_BLOCK,
// FC_NODE_OP_RECORD), on the connection kept for this process's misses, or on one of its own
// when another thread has that one: a request without a reply leaves the kept connection
// ready for the next. It returns 0 when the request was sent, else -1.
static int node_tell(struct hit_client *c, uint32_t op, const char *name, size_t len) {
	if (!c->node_socket[0] || fc_monotonic_ns() < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED))
		return -1;
	int kept, fd = node_take(c, &kept), sent = 0, timed_out = 0;
	// A kept connection the server closed (idle) fails: once more on a new one.
	for (int attempt = 0; attempt < 2 && !sent && !timed_out; attempt++) {
		if (fd < 0 && (fd = node_connect(c->node_socket, c->timeout_ms)) < 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			break;
		}
		sent = fc_node_send_request(fd, op, c->root, c->rootlen, name, len) == 0;
		if (!sent) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			close(fd);
			fd = -1;
		}
	}
	node_give(c, fd, kept);
	if (timed_out) // a hung server: skip it for a while
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
	return sent ? 0 : -1;
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

// same_file reports whether two fstat results of a source show one version of one file.
static int same_file(const struct stat *a, const struct stat *b) {
	return a->st_size == b->st_size && a->st_ino == b->st_ino && a->st_dev == b->st_dev &&
	       a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
	       a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

// record reports c's fill of the file at the clean path path (len bytes), read as st, to the
// server (FC_NODE_OP_RECORD): 0 when sent.
static int record(struct hit_client *c, const char *path, size_t len, const struct stat *st, uint64_t fill_ino) {
	char field[FC_PATH_MAX + 1 + FC_NODE_RECORD_BYTES];
	if (len + 1 + FC_NODE_RECORD_BYTES > sizeof field)
		return -1;
	memcpy(field, path, len);
	uint8_t *r = (uint8_t *)field + len + 1;
	field[len] = 0;
	uint64_t v[5] = {(uint64_t)st->st_size, (uint64_t)ts_ns(st->st_mtim), (uint64_t)ts_ns(st->st_ctim),
	                 (uint64_t)st->st_ino, fill_ino};
	for (int i = 0; i < 5; i++) {
		fc_put32(r + 8 * i, (uint32_t)v[i]);
		fc_put32(r + 8 * i + 4, (uint32_t)(v[i] >> 32));
	}
	fc_put32(r + 40, (uint32_t)(st->st_mode & 07777));
	fc_put32(r + 44, 0);
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

int hit_fill(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int saved = errno;
	char clean[FC_PATH_MAX];
	int n, nt, rc = FC_MISS, fd = -1, claimed = 0;
	struct fc_fill fill;
	struct hit_client *c = acquire(handle);
	if (!c || !__atomic_load_n(&c->fills, __ATOMIC_RELAXED) || c->node_opens || (nt = tier_count(c)) == 0 ||
	    fc_monotonic_ns() < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED) ||
	    fc_monotonic_ns() < __atomic_load_n(&c->full_until, __ATOMIC_RELAXED) || marked_full(c) ||
	    (n = source_path(c, path, clean, sizeof clean)) < 0)
		goto out;
	// Whatever fails here leaves the file to the server (FC_MISS), which reads it and says why.
	// A look, the tiers and the claim first: a file that is too large, cached already, or read
	// by another process is not opened here as well as there.
	struct stat look, before, after;
	const char *rel = clean + c->rootlen + (c->rootlen > 1 ? 1 : 0);
	struct fc_hit h;
	if ((size_t)n <= c->rootlen || c->real_root_fd < 0 ||
	    syscall(SYS_newfstatat, c->real_root_fd, rel, &look, 0) != 0 || !S_ISREG(look.st_mode) ||
	    look.st_size > read_max)
		goto out;
	// A copy the tiers list but this job has not had checked yet (hit_read's miss): the
	// server checks it (one stat), no fill.
	if (fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, 0, &h) == 0) {
		close(h.fd);
		goto out;
	}
	if (fc_fill_claim(&c->tiers[0], clean, (size_t)n, &fill) != 0)
		goto out; // another process reads it: the server waits for it
	claimed = 1;
	if (fc_lookup(c->tiers, nt, clean, (size_t)n, O_CLOEXEC, 0, &h) == 0) {
		close(h.fd); // recorded between the look above and the claim: the server serves it
		goto out;
	}
	fd = source_open(c, clean, (size_t)n);
	if (fd < 0 || fc_sys_fstat(fd, &before) != 0 || !S_ISREG(before.st_mode) || before.st_size > read_max)
		goto out;
	h = (struct fc_hit){.fd = fd, .size = before.st_size};
	void *ptr;
	uint8_t kind;
	if (take(&h, &ptr, &kind) != 0)
		goto out;
	if (fc_sys_fstat(fd, &after) != 0 || !same_file(&before, &after)) {
		free_mem(ptr, (size_t)h.size, kind); // changed while read: the server reads it, or says so
		goto out;
	}
	// The reader has the bytes: a copy that cannot be written or reported is only not cached.
	if (fc_fill_write(&fill, ptr, (size_t)h.size) == 0 && record(c, clean, (size_t)n, &before, fill.ino) == 0) {
		fc_fill_keep(&fill);
		claimed = 0;
	}
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->filled, 1, __ATOMIC_RELAXED);
out:
	if (claimed)
		fc_fill_drop(&fill);
	if (fd >= 0)
		close(fd);
	put(c);
	errno = saved;
	return rc;
}

// node_fetch asks c's server, over its node socket, to bring the file or block named name
// (len bytes) into its tiers (op FC_NODE_OP_FETCH or FC_NODE_OP_FETCH_BLOCK), and returns as
// hit_fetch does. The caller holds a reference to c.
static int node_fetch(struct hit_client *c, uint32_t op, const char *name, size_t len, char *msg) {
	if (!c->node_socket[0] || fc_monotonic_ns() < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED))
		return FC_MISS;
	if (fc_monotonic_ns() < __atomic_load_n(&c->full_until, __ATOMIC_RELAXED))
		return FC_DIRECT; // the server said it has no room for this dataset: do not ask again yet
	// One connection per client is kept for the misses of this process (node_take). A
	// connection that failed is never used again (a late reply would be taken for the next
	// request's); a broken kept one (the server restarted) is replaced once.
	int kept;
	int fd = node_take(c, &kept);
	int32_t err = 0;
	int asked = -1, timed_out = 0, canceled = 0;
	for (int attempt = 0; attempt < 2 && asked != 0 && !timed_out && !canceled; attempt++) {
		if (fd < 0 && (fd = node_connect(c->node_socket, c->timeout_ms)) < 0)
			break; // no server listening: Go starts one
		asked = node_ask(fd, op, c->root, c->rootlen, name, len, c->timeout_ms, closing(c), &err, msg);
		if (asked != 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			canceled = errno == ECANCELED; // closed: Go says so (the handle is gone)
			close(fd);
			fd = -1;
		}
	}
	node_give(c, fd, kept);
	int rc = FC_MISS; // for anything but a timeout: Go handles it (starts a server, say)
	if (timed_out) { // a hung server: skip it for a while
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
		rc = FC_UNAVAILABLE;
	} else if (asked == 0 && err == 0) {
		rc = 0;
		__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
	} else if (asked == 0 && (err == EFBIG || err == ENOSPC)) {
		rc = FC_DIRECT; // no tier takes it: read the source
		if (err == ENOSPC) // none takes any more file of this dataset (see tiers.Tier.MakeRoom)
			__atomic_store_n(&c->full_until, fc_monotonic_ns() + FULL_RECHECK_NS, __ATOMIC_RELAXED);
	} else if (asked == 0 && err != EBADF && err != ETIMEDOUT && err != EIO) {
		rc = -err; // the file's own error; for the others, Go reads it
	}
	return rc;
}

void fcHitServerState(int64_t handle, bool up, int64_t ms) {
	struct hit_client *c = acquire(handle);
	if (c)
		__atomic_store_n(&c->node_down_until, up ? 0 : fc_monotonic_ns() + ms * 1000000LL, __ATOMIC_RELAXED);
	put(c);
}

// hit_read_open asks the node socket to open path (FC_NODE_OP_OPEN) and reads what the
// descriptor it answers with holds, as fc_read hands files out; 0, FC_MISS when it cannot ask
// (Go reads the file and says why), FC_UNAVAILABLE when the server did not answer in time, or
// the file's own negated errno.
static int hit_read_open(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int saved = errno;
	char clean[FC_PATH_MAX];
	int n, rc = FC_MISS, sock = -1, fd = -1;
	struct hit_client *c = acquire(handle);
	if (!c || !c->node_socket[0] || (n = source_path(c, path, clean, sizeof clean)) < 0)
		goto out;
	// On the connection kept for this process's misses, as hit_fetch asks (a connection per
	// open cost the server an accepted connection and a new goroutine per file, and the
	// reader a connect): one that failed is closed, a broken kept one replaced once.
	int kept, asked = -1, timed_out = 0, canceled = 0;
	int32_t err = 0;
	uint32_t origin; // whatever the descriptor holds, its bytes are the file's
	sock = node_take(c, &kept);
	for (int attempt = 0; attempt < 2 && asked != 0 && !timed_out && !canceled; attempt++) {
		if (sock < 0 && (sock = node_connect(c->node_socket, c->timeout_ms)) < 0)
			break;
		asked = fc_node_request(sock, FC_NODE_OP_OPEN, c->root, c->rootlen, clean, (size_t)n, c->timeout_ms,
		                        closing(c)) == 0 &&
		                fc_node_recv_open(sock, &fd, &err, &origin) == 0
		            ? 0
		            : -1;
		if (asked != 0) {
			timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
			canceled = errno == ECANCELED;
			close(sock);
			sock = -1;
		}
	}
	node_give(c, sock, kept);
	sock = -1;
	if (asked != 0) {
		if (timed_out) {
			__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
			rc = FC_UNAVAILABLE;
		}
		goto out;
	}
	if (err != 0) {
		rc = err != EBADF && err != ETIMEDOUT && err != EIO ? -err : FC_MISS;
		goto out;
	}
	struct stat st;
	if (fc_sys_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
		goto out;
	struct fc_hit h = {.fd = fd, .size = st.st_size};
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0 || (rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
out:
	if (fd >= 0)
		close(fd);
	if (sock >= 0)
		close(sock);
	put(c);
	errno = saved;
	return rc;
}

int hit_read_direct(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	return hit_node_opens(handle) ? hit_read_open(handle, path, data, size, buffer)
	                              : hit_read_source(handle, path, data, size, buffer);
}

bool hit_node_opens(int64_t handle) {
	struct hit_client *c = acquire(handle);
	bool opens = c && c->node_opens && c->node_socket[0];
	put(c);
	return opens;
}

// Source reads without Go: for files no tier takes (the server said so), and in a process
// forked after load. They keep the guarantees of core.OpenSource, or leave the file to Go:
// the file is opened beneath the real root, held open since the client opened (openat2
// RESOLVE_BENEATH, so no link leads out),
// it must be a regular file (opened O_NONBLOCK: a FIFO never blocks), and it must not change
// while read. Anything unusual (an absolute link, a kernel without openat2, an error to
// report with its message) returns FC_MISS, and Go reads the file and says why.
int hit_read_source(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer) {
	int saved = errno;
	char clean[FC_PATH_MAX];
	int n, rc = FC_MISS, fd = -1;
	struct hit_client *c = acquire(handle);
	if (!c || (n = source_path(c, path, clean, sizeof clean)) < 0)
		goto out;
	fd = source_open(c, clean, (size_t)n);
	struct stat before, after;
	if (fd < 0 || fc_sys_fstat(fd, &before) != 0 || !S_ISREG(before.st_mode))
		goto out;
	struct fc_hit h = {.fd = fd, .size = before.st_size};
	void *ptr;
	uint8_t kind;
	if ((rc = take(&h, &ptr, &kind)) != 0)
		goto out;
	if (fc_sys_fstat(fd, &after) != 0 || after.st_size != before.st_size || after.st_ino != before.st_ino ||
	    after.st_mtim.tv_sec != before.st_mtim.tv_sec || after.st_mtim.tv_nsec != before.st_mtim.tv_nsec ||
	    after.st_ctim.tv_sec != before.st_ctim.tv_sec || after.st_ctim.tv_nsec != before.st_ctim.tv_nsec) {
		free_mem(ptr, (size_t)h.size, kind); // changed while read: Go reads it again, or says so
		rc = FC_MISS;
		goto out;
	}
	if ((rc = hand_out(ptr, h.size, kind, data, size, buffer)) != 0)
		goto out;
	__atomic_fetch_add(&c->direct, 1, __ATOMIC_RELAXED);
out:
	if (fd >= 0)
		close(fd);
	put(c);
	errno = saved;
	return rc;
}

// After the node's server closed a batch request unacknowledged (a server older than
// FC_NODE_OP_OPEN_MANY), a client asks for each file alone for this long, then tries a batch
// again (a newer server may have taken the older one's place).
#define BATCH_RECHECK_NS (60 * 1000000000LL)

// opened_read reads the file of one answer to an open request (fd, or the server's errno err)
// as fc_read hands files out, and closes fd; it returns as hit_read_open does (FC_MISS for
// what Go is to read and explain).
static int opened_read(struct hit_client *c, int fd, int32_t err, const void **data, int64_t *size, int64_t *buffer) {
	int rc = FC_MISS;
	struct stat st;
	if (err != 0) {
		rc = err != EBADF && err != ETIMEDOUT && err != EIO && err != ENOSYS ? -err : FC_MISS;
	} else if (fc_sys_fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
		struct fc_hit h = {.fd = fd, .size = st.st_size};
		void *ptr;
		uint8_t kind;
		if ((rc = take(&h, &ptr, &kind)) == 0 && (rc = hand_out(ptr, h.size, kind, data, size, buffer)) == 0)
			__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
	}
	if (fd >= 0)
		close(fd);
	return rc;
}

// recv_batch_reply reads the reply for one file of an FC_NODE_OP_OPEN_MANY request on sock:
// an open reply (see fc_node_recv_open) with the inline length after the message length, then
// the message and, unless that length is FC_NODE_INLINE_NONE, that many bytes of the file,
// read into memory the hit path hands out (*ptr, *kind; checked against FC_NODE_MAX_INLINE
// first). Returns 0 with the server's errno in *err and *fd (or -1 for inline bytes), or -1
// with errno set when the connection failed or the reply was malformed (nothing is held then).
static int recv_batch_reply(int sock, int *fd, int32_t *err, void **ptr, int64_t *n, uint8_t *kind) {
	uint8_t reply[20];
	*ptr = NULL;
	*n = 0;
	*kind = BUF_EMPTY;
	int ok = fc_node_recv_head(sock, reply, sizeof reply, fd) == 0;
	uint32_t inline_len = ok ? fc_get32(reply + 16) : 0;
	*err = ok ? (int32_t)fc_get32(reply + 4) : 0;
	if (ok && (memcmp(reply, FC_NODE_MAGIC, 4) != 0 || fc_get32(reply + 12) > FC_NODE_MAX_MESSAGE ||
	           (inline_len != FC_NODE_INLINE_NONE && (inline_len > FC_NODE_MAX_INLINE || *fd >= 0 || *err != 0)) ||
	           (inline_len == FC_NODE_INLINE_NONE && *fd < 0 && *err == 0))) { // no bytes at all
		errno = EPROTO;
		ok = 0;
	}
	char message[FC_NODE_MAX_MESSAGE];
	if (ok && fc_recv_all(sock, message, fc_get32(reply + 12)) != 0)
		ok = 0;
	if (ok && inline_len != FC_NODE_INLINE_NONE) {
		*n = inline_len;
		*kind = inline_len ? BUF_HEAP : BUF_EMPTY;
		if (inline_len && !(*ptr = buf_alloc(inline_len))) {
			errno = ENOMEM;
			ok = 0;
		} else if (inline_len && fc_recv_all(sock, *ptr, inline_len) != 0) {
			buf_free(*ptr, inline_len);
			*ptr = NULL;
			ok = 0;
		}
	}
	if ((!ok || *err != 0) && *fd >= 0) {
		close(*fd);
		*fd = -1;
	}
	return ok ? 0 : -1;
}

// open_batch sends one FC_NODE_OP_OPEN_MANY request for the m paths listed in list (len bytes)
// on *sock, the connection kept for c's misses or -1, and reads the answer for file asked[j]
// into its slot of data, sizes, buffers and results (see opened_read). A connection that fails
// is closed (*sock is -1 then), and a broken kept one replaced once. It returns 0 when the
// server answered, FC_DIRECT when it does not know the operation (it closed a connection of
// its own unacknowledged), FC_UNAVAILABLE when it did not answer in time, FC_MISS otherwise;
// the files without an answer then have that result.
static int open_batch(struct hit_client *c, int *sock, const char *list, size_t len, const int *asked, int m,
                      const void **data, int64_t *sizes, int64_t *buffers, int *results) {
	int sent = -1, err = 0, rc = 0, j = 0;
	for (int attempt = 0; attempt < 2 && sent != 0; attempt++) {
		int fresh = *sock < 0, acked = 0;
		if (*sock < 0 && (*sock = node_connect(c->node_socket, c->timeout_ms)) < 0) {
			err = errno;
			break;
		}
		uint8_t ack[4];
		fc_set_rcvtimeo(*sock, fc_node_probe_ms(c->timeout_ms));
		errno = EPROTO;
		if (fc_node_send_request(*sock, FC_NODE_OP_OPEN_MANY, c->root, c->rootlen, list, len) == 0 &&
		    fc_recv_all(*sock, ack, sizeof ack) == 0) {
			acked = memcmp(ack, FC_NODE_ACK, sizeof ack) == 0;
			errno = EPROTO;
			sent = acked ? fc_node_await_reply(*sock, c->timeout_ms, closing(c)) : -1;
		}
		if (sent == 0)
			break;
		err = errno;
		close(*sock);
		*sock = -1;
		if (fresh && !acked && (err == ECONNRESET || err == EPIPE)) {
			err = ENOSYS; // an unknown operation: a server older than batches
			break;
		}
		if (err == EAGAIN || err == EWOULDBLOCK || err == ECANCELED)
			break;
	}
	for (; sent == 0 && j < m; j++) {
		int i = asked[j], fd;
		int32_t ferr;
		void *ptr;
		int64_t n;
		uint8_t kind = BUF_EMPTY;
		if (recv_batch_reply(*sock, &fd, &ferr, &ptr, &n, &kind) != 0) {
			err = errno;
			close(*sock);
			*sock = -1;
			break;
		}
		if (ferr != 0 || fd >= 0) {
			results[i] = opened_read(c, fd, ferr, &data[i], &sizes[i], &buffers[i]);
		} else if ((results[i] = hand_out(ptr, n, kind, &data[i], &sizes[i], &buffers[i])) == 0) {
			__atomic_fetch_add(&c->fetches, 1, __ATOMIC_RELAXED);
		}
	}
	if (j < m)
		rc = err == ENOSYS ? FC_DIRECT : err == EAGAIN || err == EWOULDBLOCK ? FC_UNAVAILABLE : FC_MISS;
	for (; j < m; j++)
		results[asked[j]] = rc;
	return rc;
}

int hit_read_open_many(int64_t handle, const char *const *paths, const int *idx, int n, const void **data,
                       int64_t *sizes, int64_t *buffers, int *results) {
	int saved = errno;
	for (int j = 0; j < n; j++) {
		int i = idx[j];
		data[i] = NULL;
		sizes[i] = 0;
		buffers[i] = 0;
		results[i] = FC_DIRECT;
	}
	struct hit_client *c = acquire(handle);
	int64_t now = fc_monotonic_ns();
	// The paths of a request, each clean, under the root and followed by a NUL byte.
	size_t cap = (size_t)(n < FC_NODE_MAX_BATCH ? n : FC_NODE_MAX_BATCH) * (FC_PATH_MAX + 1);
	char *list = NULL;
	if (!c || !c->node_opens || !c->node_socket[0] || now < __atomic_load_n(&c->node_down_until, __ATOMIC_RELAXED) ||
	    now < __atomic_load_n(&c->batch_off_until, __ATOMIC_RELAXED) || !(list = malloc(cap))) {
		put(c);
		errno = saved;
		return n;
	}
	int asked[FC_NODE_MAX_BATCH];
	int kept, sock = node_take(c, &kept), rc = 0, j = 0;
	while (j < n && rc == 0) {
		size_t len = 0;
		int m = 0;
		for (; j < n && m < FC_NODE_MAX_BATCH; j++) {
			int i = idx[j];
			int k = source_path(c, paths[i], list + len, FC_PATH_MAX);
			if (k < 0) {
				results[i] = FC_MISS; // Go says why
				continue;
			}
			list[len + (size_t)k] = 0;
			len += (size_t)k + 1;
			asked[m++] = i;
		}
		if (m > 0)
			rc = open_batch(c, &sock, list, len, asked, m, data, sizes, buffers, results);
	}
	for (; j < n; j++) // after a failed request: as its files
		results[idx[j]] = rc;
	node_give(c, sock, kept);
	if (rc == FC_DIRECT)
		__atomic_store_n(&c->batch_off_until, fc_monotonic_ns() + BATCH_RECHECK_NS, __ATOMIC_RELAXED);
	if (rc == FC_UNAVAILABLE)
		__atomic_store_n(&c->node_down_until, fc_monotonic_ns() + NODE_BACKOFF_NS, __ATOMIC_RELAXED);
	free(list);
	put(c);
	errno = saved;
	int alone = 0;
	for (int j = 0; j < n; j++)
		alone += results[idx[j]] == FC_DIRECT;
	return alone;
}
