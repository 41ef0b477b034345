/*
 * shim.h -- what the two parts of the preload shim share: fitcache_preload.c (opens, and the
 * calls that change what a path names) and ranges.c (reads of large files through cached
 * blocks). Nothing here is exported from the library (it is built -fvisibility=hidden).
 */
#ifndef FITCACHE_SHIM_H
#define FITCACHE_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "../capi/fclookup.h"

// A dataset root. Paths are keyed by their resolved form (real): the cache shares one copy
// whatever name a program uses, and paths made from the working directory or a directory
// descriptor (which the kernel gives resolved) match too.
struct root {
	const char *name, *real; // name: as the user gave it; equal to real when it has no link
	size_t namelen, reallen;
	uint64_t dev_plus1; // the device of real plus 1, 0 until copies.c needs it (atomic)
};

// shim_root_of returns the root the dataset key (len bytes, a clean absolute path with the
// root in its resolved form) is under, or NULL.
struct root *shim_root_of(const char *key, size_t len);

// The tier directories of the local server (in cluster mode, of the job's servers on this
// node), fastest first.
extern struct fc_tier shim_tiers[FC_MAX_TIERS];
extern int shim_ntiers;

// shim_debug writes a line, printf-style, to standard error when FITCACHE_PRELOAD_DEBUG is
// set; it allocates nothing and takes no lock.
void shim_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// shim_resolve returns the next definition of name after this library, found on first use
// and kept in *slot, or NULL when there is none (a C library older than the function). A
// program may call a wrapped function before this library's constructor ran (from another
// library's constructor), so each wrapper resolves what it calls.
void *shim_resolve(void **slot, const char *name);
#define NEXT(fn) ((__typeof__(libc_##fn))shim_resolve((void **)&libc_##fn, #fn))

// shim_missing fails a call of the function name, which the C library does not have: errno
// ENOSYS (as from a kernel without the call), noted under FITCACHE_PRELOAD_DEBUG, and -1.
int shim_missing(const char *name);

// CALL_NEXT(fn, args...) calls the next definition of fn with args, or fails with ENOSYS when
// there is none (shim_missing): never a call through NULL. CALL_NEXT_PTR is for the functions
// that return a pointer (NULL on failure). When fn is missing, args are not evaluated: pass
// no argument with a side effect.
#define CALL_NEXT(fn, ...) \
	({ __typeof__(libc_##fn) next_ = NEXT(fn); next_ ? next_(__VA_ARGS__) : shim_missing(#fn); })
#define CALL_NEXT_PTR(fn, ...) \
	({ __typeof__(libc_##fn) next_ = NEXT(fn); next_ ? next_(__VA_ARGS__) : (shim_missing(#fn), NULL); })

// shim_node_request sends one request of operation op for the dataset path key (len bytes)
// under root r to the local server's node socket and waits for its reply to begin, for at
// most reply_ms while the server keeps acknowledging: the connection, with the reply to read,
// or -1 (no server, or one that did not answer in time: it is then skipped a while).
int shim_node_request(uint32_t op, const struct root *r, const char *key, size_t len, int64_t reply_ms);

// shim_node_timed_out notes a server that did not answer in time (errno EAGAIN from the
// failed call): the node socket is skipped a while. shim_node_timeout_ms is the read timeout.
void shim_node_timed_out(void);
int64_t shim_node_timeout_ms(void);

// shim_node_tell sends one request of an operation the server does not answer
// (FC_NODE_OP_CACHE_BLOCK) and closes the connection: it waits for the connect and the send
// only, each bounded by the probe time.
void shim_node_tell(uint32_t op, const struct root *r, const char *key, size_t len);

// ranged_configure reads the size of the server's blocks (FITCACHE_PRELOAD_BLOCK_BYTES, may
// be NULL: no descriptor is then read through blocks) and the path of the file the heat of
// blocks is shared in (FITCACHE_PRELOAD_HEAT, may be NULL).
void ranged_configure(const char *block_bytes, const char *heat);

// ranged_open has the reads of fd, a descriptor of the source of the large dataset file key
// (len bytes) under root r whose fstat is st, served from cached blocks (see ranges.c); with
// ask, blocks the program reads from the source are asked of the server. A file under
// FC_RANGED_MIN bytes, or one past the descriptors the shim tracks, is left to the kernel.
void ranged_open(int fd, int ask, const struct root *r, const char *key, size_t len, const struct stat *st);

// ranged_forget stops serving fd through blocks, if it was: it is being closed, or it is a
// new descriptor whose number a closed one had.
void ranged_forget(int fd);

// ranged_sweep lets go of the kept mappings of copies the tiers no longer list, at most once
// a second (see ranges.c): called at reads through blocks and at opens of dataset files.
void ranged_sweep(void);

// copies_init resolves the functions copies.c wraps; copies_tier notes where tier i of
// shim_tiers (just opened) is, for telling descriptors of cached copies (copies.c).
void copies_init(void);
void copies_tier(int i);

// copies_opened notes that fd, just opened by the shim, is the cached copy of a dataset file
// under root r that hit describes (fc_lookup, fc_lookup_fd), so that fstat of fd reports the
// source's identity with no system call but the kernel's fstat (copies.c). errno may change.
void copies_opened(int fd, const struct root *r, const struct fc_hit *hit);

#endif /* FITCACHE_SHIM_H */
