/*
 * fill.h -- a reader's fill of a file it missed (see tiers/fill.go): it claims the file in
 * the first tier of its server, with a fill file made with O_EXCL so that one process reads
 * each file from the source, writes the copy into that file (its CRC-32C computed on the
 * way, its mode and times made those of the copy), and reports it to the server
 * (nodesock.OpRecord), which records it as the cached copy without reading it again.
 */
#ifndef FITCACHE_FILL_H
#define FITCACHE_FILL_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "fclookup.h"

/* A claim held by this process (fc_fill_claim). */
struct fc_fill {
	int bin;       /* the bin directory of the fill file, or -1 */
	int fd;        /* the fill file, open for writing, or -1 */
	uint64_t ino;  /* its inode number */
	uint32_t crc;  /* the CRC-32C of the bytes written into it so far (fc_fill_write) */
	char name[32]; /* its name in bin: ".tmp-fill-" and the file's key in 16 hex digits */
};

/* Claims the source file at path (clean, len bytes) in tier t: creates its fill file (and its
 * bins where missing), locked (an open file description lock) until fc_fill_keep or
 * fc_fill_drop, with the permission bits the server gives the copy of a source of mode mode
 * (tiers' dataPerm; the umask may take some, which the server then sets). Returns 0, -EEXIST
 * when another process holds the claim, or another negated errno; on failure f holds
 * nothing. */
int fc_fill_claim(const struct fc_tier *t, const char *path, size_t len, uint32_t mode, struct fc_fill *f);

/* Writes the n bytes at p into a claimed fill file, and continues f->crc with them. Returns 0
 * or a negated errno. */
int fc_fill_write(struct fc_fill *f, const void *p, size_t n);

/* Sets a written fill file's access and modification times to mtime, the source's, as the
 * server sets a copy's (tiers' finishData): it only checks them then. A failure leaves them
 * to the server. */
void fc_fill_finish(struct fc_fill *f, struct timespec mtime);

/* Closes a claimed fill file and leaves it for the server to record (after the report). */
void fc_fill_keep(struct fc_fill *f);

/* Removes a claimed fill file (unless the server took it over meanwhile) and closes it. */
void fc_fill_drop(struct fc_fill *f);

#endif
