/*
 * hitpath.h -- the hit path of libfitcache: reads of cached files served in C, without Go.
 *
 * Go (capi/main.go) registers each client handle with its dataset root, the tier directories
 * of its server and its node socket; fc_read and fc_read_many (fitcache.c) then try hit_read first,
 * then hit_miss, and enter Go only for what that leaves. The files that implement it, by job, are
 * listed in hitclient.h. Buffers served here live in a C registry whose handles are
 * disjoint from Go's (FC_CBUF_BASE and up), so fc_release can tell them apart.
 *
 * Everything here also works in a process forked after the library was loaded: descriptors
 * and mappings are inherited, and the locks are taken around fork (pthread_atfork), so hits
 * need no Go runtime. Misses there cannot enter Go (see fitcache.c). No lock is held across a
 * read or a wait for the server (a reference to the client is), so fork and fcHitClose never
 * wait for misses in other threads to leave a gap.
 */
#ifndef FITCACHE_HITPATH_H
#define FITCACHE_HITPATH_H

#include <stdbool.h>
#include <stdint.h>

/* Buffer handles of the hit path are FC_CBUF_BASE and up (Go's are below). */
#define FC_CBUF_BASE ((int64_t)1 << 62)

/* hit_read's result when the file is not cached (or this handle has no hit path). */
#define FC_MISS 1

/* hit_miss's result when the node's server did not answer (in time): Go reads the file
 * (goServerUnavailable first). */
#define FC_UNAVAILABLE 2


/* Files up to this size are read into memory the caller owns (one copy, like read());
 * larger ones are mapped (no copy). Measured (bench/bench_crossover.py, docs/BENCHMARKS.md):
 * mapping a cached file and reading it once costs as much as copying it at 256-512 KiB, and
 * less from 1 MiB (1.13x the files/s at 1 MiB, 1.2-1.35x at 4-8 MiB). */
#define FC_READ_MAX_BYTES ((int64_t)512 << 10)

/* Serves path (absolute, or relative to the client's root) from a tier if it is cached there:
 * returns 0 with *data, *size and *buffer set as fc_read sets them, FC_MISS if it is not
 * cached (or the path is not one the hit path handles: outside the root, too long), or a
 * negated errno (out of memory). */
int hit_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer);

/* Says whether the server of a client records its readers' fills (see hit_miss). */
void fcHitSetFills(int64_t handle, bool on);

/* Returns the files the client's process filled (hit_miss). */
int64_t fcHitFilled(int64_t handle);

/* Returns the misses of batches the client's process served with several threads
 * (hit_miss_many, once its source made fills wait). */
int64_t fcHitParallelMisses(int64_t handle);

/* hit_read for a file the server just brought into a tier for this caller (a Go fetch): the
 * same read, not counted as a hit, since the server counted the miss. */
int hit_read_fetched(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer);

/* Serves a miss of path (hit_read said FC_MISS) without Go where it can, deciding once, with
 * the client held once, how (capi/miss.c): the reader's own fill of a small file where its
 * server records fills (fcHitSetFills); else the node's server over its node socket: an open
 * answered with a descriptor or the bytes (cluster mode, fcHitOpen's node_opens), or a fetch
 * into its tiers, then read there (a file no tier takes: read from the source). With forked
 * (a process forked after load, which cannot enter Go), what the server cannot serve is
 * served from a copy the tiers hold once one stat of the source shows the version the copy's
 * index slot names (no server checks copies while it is dead, so the reader does), and, when
 * the server did not answer, from the source. Returns 0 with *data, *size and *buffer set as
 * fc_read sets them, the file's own negated errno (with the server's message in msg, when it
 * gave one: FC_FETCH_MESSAGE bytes, always terminated), FC_MISS for Go to serve (it says
 * why), or FC_UNAVAILABLE when the server did not answer in time (the client then skips the
 * node socket for a while; Go serves it). */
int hit_miss(int64_t handle, const char *path, bool forked, const void **data, int64_t *size, int64_t *buffer,
             char *msg);

/* The size of the message buffer hit_miss fills (the server's message for an error). */
#define FC_FETCH_MESSAGE 1001

/* hit_miss for the misses paths[miss[j]] (j < nmiss) of a batch (fc_read_many), the client
 * held once for all of them: each file's slot of data, sizes, buffers and results is set for
 * the files served (results[i] 0 or the file's own negated errno). Without forked, only the
 * readers' fills are tried file by file, and, in cluster mode, the rest are asked of the
 * node's server in one round trip per FC_NODE_MAX_BATCH files (FC_NODE_OP_OPEN_MANY); Go
 * serves the others at once, concurrently. Returns how many are left to Go (results -EIO),
 * moved to the front of miss; *unavailable says whether the server did not answer in time
 * for one of them, msg as hit_miss. */
int hit_miss_many(int64_t handle, const char *const *paths, int *miss, int nmiss, bool forked, const void **data,
                  int64_t *sizes, int64_t *buffers, int *results, bool *unavailable, char *msg);

/* Reads up to len bytes of path (as hit_read takes it) at off into buf from cached copies in
 * the client's tiers, through mappings of them it keeps (let go once the tiers no longer
 * list them): the blocks the range covers (tiers.BlockName, of the size fcHitSetBlockBytes
 * gave), else a whole copy of the file. With ask (a process forked after load, which cannot
 * enter Go), the range of a block not cached is read from the file's source, opened here
 * beneath the root, and the block asked of the server over its node socket in the background
 * (FC_NODE_OP_CACHE_BLOCK) once worth it (capi/fcheat.h); a block the tiers list unchecked
 * for this job, and a file under 8 MiB (cached whole), are asked for and waited for
 * (FC_NODE_OP_FETCH_BLOCK). Returns 0
 * with the bytes read in *got (fewer than len only at the end of the file), FC_MISS when
 * a copy the range needs is not cached here (Go then serves the whole range), or -EAGAIN
 * when the source changed while a range of it was read. A range is never served from pieces
 * of two versions of the file: one that would be is read from the source alone (by Go
 * without ask). Like hit_read, it works in a process forked after load. */
int hit_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off, int ask, int64_t *got);

/* Gives the hit path fd, the source of the large file at the clean absolute path path whose
 * blocks the server has no room for, for ms milliseconds: hit_pread reads the ranges of its
 * blocks not cached from it, without Go. The hit path owns fd from then on. */
void fcHitSetSource(int64_t handle, const char *path, int fd, int64_t ms);

/* Tells the hit path the size of the blocks of a client's server (0: none). */
void fcHitSetBlockBytes(int64_t handle, int64_t n);

/* Releases a buffer of the hit path: 0, or -EBADF for an unknown or released one. */
int hit_release(int64_t buffer);

/* Unreleased buffers of the hit path. */
int64_t hit_buffers(void);

/* Whether the client of handle reads in cluster mode (node_opens, see fcHitOpen): 1 or 0, or
 * -EBADF for a handle the hit path does not serve. */
int hit_cluster(int64_t handle);

/* Called from Go. Registers a client handle with its dataset root (absolute, clean) and its
 * real path, the node socket of its server ("" for none), its read timeout, and whether that
 * server opens its misses (node_opens: cluster mode, see hit_miss); 0 or
 * -1 when the hit path cannot take it (the client still works, through Go). */
int fcHitOpen(int64_t handle, const char *root, const char *real_root, const char *node_socket, int64_t timeout_ms,
              bool node_opens);
/* Adds a tier directory (fastest first) of the client's server, of the given kind
 * (tiers.Kind), read for the client's validation session there (see fc_tier_open); returns 0
 * or a negated errno (the tier is then not used by the hit path). */
int fcHitAddTier(int64_t handle, const char *dir, int kind, uint32_t session);
/* Tells the hit path whether the Go client of a handle is connected to its server (up), or
 * is reading without it for ms milliseconds (it could not reach or start it, or it did not
 * answer). Misses use the node socket only while the client is up: a server that holds its
 * lock but is stopped still accepts connections, and would make every miss wait. */
void fcHitServerState(int64_t handle, bool up, int64_t ms);
/* Sends the misses of a handle to the node socket at path, which the process that opened it
 * serves while its node's servers are dead (client.StandIn), and back to the node's server's
 * with NULL; processes forked later inherit the choice. A handle has one stand-in: the first
 * path given. Returns 0, or -1 for an unknown handle or another path. */
int fcHitUseStandIn(int64_t handle, const char *path);
/* Number of tiers the hit path has for a handle. */
int fcHitTiers(int64_t handle);
/* Forgets a client handle, closing its tiers once the reads and misses in progress on it have
 * ended (each is bounded by the client's timeouts; a client still in use after twice the read
 * timeout and a few seconds is left allocated rather than freed under its user). */
void fcHitClose(int64_t handle);
/* Reads served by the hit path for a handle, the misses it had the server cache through the
 * node socket, and the files it read from the source. */
void fcHitCounts(int64_t handle, int64_t *hits, int64_t *fetches, int64_t *source_files, int64_t *source_ranges);

#endif /* FITCACHE_HITPATH_H */
