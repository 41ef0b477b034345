/*
 * hitclient.h -- private to the hit path (capi/hit*.c, clients.c, buffers.c, source.c, node*.c,
 * miss.c): a client of the hit path, the per-thread shards that count its references and hold
 * the buffers handed out, and the functions these files share. Nothing outside capi/ includes it.
 *
 * The files, by job:
 *   clients.c   the registry of clients (fcHitOpen ... fcHitClose), acquire/put, the shards,
 *               and fork handling
 *   buffers.c   the buffers handed out (hit_release) and reading a whole file into one (take)
 *   hitpath.c   hits: cached copies served whole (hit_read, hit_read_fetched, read_checked)
 *   hitranges.c ranges of cached copies and of kept sources (hit_pread)
 *   source.c    the dataset's source files opened and read without Go
 *   nodesock.c  requests to the node's server over its node socket (fetch, tell, open)
 *   openmany.c  batches of opens (FC_NODE_OP_OPEN_MANY)
 *   miss.c      the miss decision: one function decides how a miss is served, and serves it
 */
#ifndef FITCACHE_HITCLIENT_H
#define FITCACHE_HITCLIENT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>

#include "fcheat.h"
#include "fclimits.h"
#include "fclookup.h"
#include "hitpath.h"

/* These names are shared between the files of the hit path only: never exported from the
 * library, so that a program's own symbols cannot take their place. */
#pragma GCC visibility push(hidden)

#define CLIENT_SLOTS 256 // clients open at once with a hit path; more go through Go
#define RANGE_SETS 1024 // cached copies a client keeps mapped for ranges: RANGE_SETS sets of
#define RANGE_WAYS 4    // RANGE_WAYS (see hit_pread): 4,096, 16 GiB of 4 MiB blocks

// The version of the source a piece of a range was read from (see hit_pread): known 0 for
// a copy whose record could not be read, which matches nothing.
struct piece_version {
	int known;
	struct fc_version v;
};


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

// A connection to the node socket kept for the misses of a client's process: each request
// takes one no other thread uses (node_take), and threads that find them all taken connect on
// their own. Up to NODE_CONNS of them, opened as threads need them at once, so that the
// threads of a batch's misses (hit_miss_many) and of a thread-based loader do not connect,
// and the server accept, once per report (8 threads filling from a page cache: 887
// connections for 3,000 fills with one kept, 6 with several). The server serves 1,024
// connections at once (nodesock's maxConns): 4 for each of a GPU node's 128 readers and room.
#define NODE_CONNS 4
struct node_conn {
	pthread_mutex_t mu; // protects fd and pid
	int fd;             // the connection, or -1
	pid_t pid;          // the process that opened fd
};

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
	// standin_socket: the node socket that the process that opened the client serves while
	// the node's servers are dead (fcHitUseStandIn), written once; node_path points at the one
	// misses go to, node_socket or standin_socket (atomic; read it with node_path()).
	char standin_socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
	const char *node_path;
	int64_t timeout_ms;
	int64_t node_down_until; // CLOCK_MONOTONIC ns before which the node socket is skipped (atomic):
	                         // set by fcHitServerState, and for a while after a timeout
	int64_t fetches;         // misses the server cached through the node socket (atomic)
	int64_t source_files;    // files read from the source by read_source (atomic)
	bool fills;              // the server records this process's fills (fcHitSetFills; atomic)
	int64_t filled;          // files this process filled (fill_read in miss.c; atomic)
	int64_t source_waits_until; // CLOCK_MONOTONIC ns before which a batch's misses are served by
	                            // several threads: fills of this process waited on the source
	                            // (see judge_source in miss.c; atomic)
	int64_t source_wait_row;    // fills in a row that waited on the source (atomic)
	int64_t parallel_misses;    // misses of batches served so (atomic)
	int64_t full_until;      // CLOCK_MONOTONIC ns before which misses skip the server: it said
	                         // it has no room for this dataset (atomic)
	bool node_opens;         // a file no tier takes is opened by the node's server, not read
	                         // from the source here (cluster mode: the server reads it from its
	                         // owner, so the source is still read once for the job)
	int64_t batch_off_until; // CLOCK_MONOTONIC ns before which misses are not asked for in batches:
	                         // the server did not know FC_NODE_OP_OPEN_MANY (atomic)
	struct node_conn node_conns[NODE_CONNS]; // the connections kept to the node socket for this
	                                         // process's threads (node_take)
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

// A buffer handed out by the hit path.
enum { BUF_FREE, BUF_EMPTY, BUF_HEAP, BUF_MAPPED };
struct cbuf {
	void *ptr;
	size_t len;
	uint32_t gen; // bumped when the slot is freed, so a stale handle is EBADF
	uint8_t kind;
};


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

// clients[h % CLIENT_SLOTS] holds the client of handle h (see clients.c).
extern pthread_rwlock_t clients_lock;
extern struct hit_client *clients[CLIENT_SLOTS];
extern struct shard shards[SHARDS];

// The heat of blocks of the processes forked after load (see clients.c), or NULL.
extern struct fc_heat *heat;

// After the server said it has no room for a dataset, its misses are read from the source
// without asking for this long, then the server is asked again (room may have come).
#define FULL_RECHECK_NS (1000000000LL)

// After a node socket timed out, misses skip it for this long (and go through Go, which backs
// off from a server that does not answer in its own way).
#define NODE_BACKOFF_NS (5 * 1000000000LL)

// node_fetch's result when no tier takes the file (too large, or no room left for its
// dataset): it is read from the source, or its ranges from a kept source.
#define FC_NO_TIER 3

// node_open_many's result for a file it did not ask for: ask for it alone (node_open_read).
#define FC_ASK_ALONE 4

// ts_ns returns a time as Unix nanoseconds, as the index records times.
static inline int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec; }

/* clients.c */
struct shard *own_shard(void);
struct hit_client *acquire(int64_t h);
void put(struct hit_client *c);
void count_hit(const struct hit_client *c);
int tier_count(struct hit_client *c);
int source_path(const struct hit_client *c, const char *path, char *out, size_t cap);

/* buffers.c */
extern int64_t read_max;
void *buf_alloc(size_t n);
void buf_free(void *p, size_t n);
void free_mem(void *ptr, size_t len, uint8_t kind);
int take(const struct fc_hit *h, void **ptr, uint8_t *kind);
int hand_out(void *ptr, int64_t n, uint8_t kind, const void **data, int64_t *size, int64_t *buffer);

/* hitpath.c: hit_read of a clean path for a client held; count: count it as a hit (see
 * hit_read_fetched). */
int read_cached(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                int64_t *buffer, int count);
int read_checked(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                 int64_t *buffer);

/* source.c */
int open_beneath_root(struct hit_client *c, const char *path, size_t len);
void keep_source(struct hit_client *c, const char *path, size_t len, int fd, int64_t ms);
int keep_range_source(struct hit_client *c, const char *path, size_t len);
int read_source(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                int64_t *buffer);

/* nodesock.c */
bool node_up(const struct hit_client *c);
// node_path returns the node socket c's misses go to ("" for none): its node's server's, or
// the stand-in of fcHitUseStandIn.
static inline const char *node_path(const struct hit_client *c) {
	return __atomic_load_n(&c->node_path, __ATOMIC_ACQUIRE);
}
int node_take(struct hit_client *c, int *kept);
void node_give(struct hit_client *c, int fd, int kept);
int node_connect(const char *socket_path, int64_t timeout_ms);
int closing(const struct hit_client *c);
int node_fetch(struct hit_client *c, uint32_t op, const char *name, size_t len, char *msg);
int node_tell(struct hit_client *c, uint32_t op, const char *name, size_t len);
int node_open_read(struct hit_client *c, const char *clean, size_t n, const void **data, int64_t *size,
                   int64_t *buffer);

/* openmany.c */
int node_open_many(struct hit_client *c, const char *const *paths, const int *idx, int n, const void **data,
                   int64_t *sizes, int64_t *buffers, int *results);

#pragma GCC visibility pop

#endif /* FITCACHE_HITCLIENT_H */
