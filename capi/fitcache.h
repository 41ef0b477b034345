/*
 * fitcache.h -- the C interface of libfitcache.
 *
 * Every function returns 0 (or a non-negative count) on success and a negated errno value on
 * failure: -ENOENT for a missing file, -EACCES for a path outside the dataset root, -EISDIR,
 * -EINVAL for bad arguments, -EBADF for an unknown handle, -ECHILD when called in a process
 * forked after the library was loaded (see below), -EIO otherwise. fc_errmsg() then gives the
 * detail for the calling thread.
 *
 * Handles are plain integers, never pointers; client handles and buffer handles come from
 * disjoint ranges, so passing one kind where the other is expected returns -EBADF and changes
 * nothing. All functions are thread-safe.
 *
 * Fork: a Go runtime does not survive fork(), so reads do not depend on it: cached files are
 * found and read in C, and misses are asked of the per-user server over its node socket,
 * also in C. In a process forked after loading libfitcache, fc_read, fc_read_many and
 * fc_release of the parent's clients keep working (a read that would need Go returns
 * -ECHILD), and every other call returns -ECHILD at once; nothing hangs.
 */
#ifndef FITCACHE_H
#define FITCACHE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opens a client for the dataset under root. options_json is NULL or a JSON object of string
 * options ({"tiers": "memory:/dev/shm/fc:4GiB", "read_timeout": "30s", ...}), which take
 * precedence over FITCACHE_* environment variables. With no servers configured the client
 * uses the per-user embedded server, starting it if needed. Stores the handle in *handle. */
int fc_open(const char *root, const char *options_json, int64_t *handle);

/* Closes a client (reporting its pending counters). Buffers already read stay valid until
 * released. Reads of the client in progress on other threads that wait for its server stop
 * waiting at once and fail with -EBADF. Closing an unknown or closed handle returns -EBADF. */
int fc_close(int64_t handle);

/* Reads the whole file at path (absolute, or relative to the root): *data points to size
 * read-only bytes (NULL when size is 0) that stay valid until fc_release(*buffer) is called
 * exactly once. A cached file up to 512 KiB is read into memory the library allocated (one
 * copy, as read() makes), a larger one is mapped (no copy). Writing to *data crashes. */
int fc_read(int64_t handle, const char *path, const void **data, int64_t *size, int64_t *buffer);

/* Reads count files in one call, as count calls of fc_read would (in cluster mode the files
 * that miss the node's tiers are asked of its server in one request; on one node the reader
 * copies each miss into the cache itself where it can, one after the other while the source
 * answers at once, up to 8 at a time on threads of its own once copies wait on the
 * source (a parallel file system's round trips), while the server's prefetch, when given a
 * list, reads ahead of it): for each i, results[i] is 0 and data[i], sizes[i] and buffers[i]
 * are set as by fc_read (each buffer to release with fc_release), or results[i] is the
 * negated errno for paths[i] and data[i] is NULL. Returns 0 when the call itself worked
 * (look at results), or a negated errno (bad handle or arguments), and then sets nothing. */
int fc_read_many(int64_t handle, int count, const char *const *paths, const void **data, int64_t *sizes,
                 int64_t *buffers, int *results);

/* Hands the server the list of files this client's readers are about to read, in the order
 * they will read them (paths absolute or relative to the root), so that the server reads them
 * from the source ahead of the readers, with bounded concurrency, giving way to their misses
 * and stopping when its tiers are full (it never evicts). In cluster mode each server is sent
 * the files it owns. A new list replaces the client's earlier one; the client keeps the job
 * alive while it is open (a job whose clients are gone stops within about 10 s). The paths
 * are copied: the caller keeps ownership of paths. Returns 0 once the servers took the list,
 * or when they do not prefetch (option prefetch 0); -EACCES for a path outside the root and
 * -EINVAL for a NULL path (then nothing is sent); -EIO when a server could not be reached
 * (reads work regardless). Progress is in the "prefetch" counters of fc_stats. */
int fc_prefetch(int64_t handle, int count, const char *const *paths);

/* fc_prefetch for the readers of a node in cluster mode whose list holds more than the files
 * they read in this epoch: the first this_epoch paths are read now, the others only in later
 * epochs (with a DistributedSampler, the other ranks' parts, which a node with room keeps).
 * The node's server brings those in after every file read now, a few at a time, so that a first
 * epoch is little slowed by files for the next ones.
 * this_epoch 0 (or count) is fc_prefetch. Returns as fc_prefetch, and -EINVAL for a negative
 * this_epoch. */
int fc_prefetch_epochs(int64_t handle, int count, const char *const *paths, int this_epoch);

/* Releases a buffer from fc_read. Returns -EBADF for an unknown or released buffer. */
int fc_release(int64_t buffer);

/* Copies up to len bytes of the file at path, from offset off, into the caller's buf.
 * Returns the number of bytes copied (0 at or past the end of the file). The bytes are of
 * one version of the file: a range that spans cached blocks of a source rewritten in place
 * since is read from the source; -EAGAIN when the source changed while it was read. */
int64_t fc_pread(int64_t handle, const char *path, void *buf, int64_t len, int64_t off);

/* Stores the size of the file at path in *size. */
int fc_size(int64_t handle, const char *path, int64_t *size);

/* Makes sure the client's server answers: asks it, and restarts an embedded server that died,
 * as a read would (one backing off after a failure is left alone). A process that forks
 * readers calls it before each fork, so that they, which cannot restart it (no Go after
 * fork), find it running. In cluster mode, when no server of the job on this node answers
 * (a node without one, or one whose servers died), this process starts serving a node socket
 * of its own (a stand-in, until the client closes) through which the readers it forks next
 * read as its client reads: the other nodes' files from their servers. Returns 0, or a
 * negated errno (-ECHILD in a process forked after load). */
int fc_check_server(int64_t handle);

/* 1 if the client reads in cluster mode (the job's servers on a ring: the files its node's
 * tiers lack come through its node's server, one request per fc_read_many), 0 if it reads
 * through the embedded server, or -EBADF for a handle the C hit path does not serve (its
 * reads go through Go). C only: it answers in a process forked after load too, where a
 * reader chooses how many files to ask for per fc_read_many. */
int fc_cluster(int64_t handle);

/* Writes the client's and its server's counters as a NUL-terminated JSON object into buf.
 * If len is too small, returns -ERANGE and stores the length needed (with the NUL) in
 * *needed (when needed is not NULL). */
int fc_stats(int64_t handle, char *buf, size_t len, size_t *needed);

/* Diagnostic, for tests that check for leaks: stores the number of open client handles in
 * *clients and of unreleased buffers in *buffers (either pointer may be NULL). Returns 0. */
int fc_debug_open_handles(int64_t *clients, int64_t *buffers);

/* Copies the calling thread's last error message into buf, always NUL-terminated. Returns 0,
 * or -ERANGE if the message was truncated. */
int fc_errmsg(char *buf, size_t len);

/* The library's version, a static string. */
/* The version of FitCache: its single source (setup.py reads it from here for the Python
 * package, whose fitcache.__version__ and fitcache.version() report it). */
#define FITCACHE_VERSION "0.1.0"
const char *fc_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FITCACHE_H */
