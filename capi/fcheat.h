/*
 * fcheat.h -- when a reader asks for a block of a large file to be cached: the heat of
 * blocks, shared by the hit path of libfitcache (capi/hitranges.c, in processes forked after
 * load) and the preload shim (preload/ranges.c). Header-only (static functions), as fcnode.h.
 *
 * A range of a block not cached is read from the source at once; the block is asked for
 * once a quarter of it was read from the source, or at once for a reader in sequence (as
 * client/ranges.go does for Go readers): a sparse random reader costs the source at most
 * four times the bytes it reads, a sequential one has the rest of its blocks cached ahead.
 * The bytes read of each block are counted in a table of FC_HEAT_PLACES places that all
 * files share (two blocks in one place only share a count), kept in memory shared by the
 * processes that read (see the callers): DataLoader workers, new each epoch, add up as one
 * reader. Anything in it only decides which blocks are asked for, never which bytes are read.
 */
#ifndef FITCACHE_HEAT_H
#define FITCACHE_HEAT_H

#include <stddef.h>
#include <stdint.h>

#include "fclookup.h"

#define FC_HEAT_PLACES 4096

struct fc_heat {
	uint64_t tag;     /* the block's name's check hash, odd (0: unused) (atomic) */
	int64_t bytes;    /* read from the source since the tag was set (atomic) */
	int64_t asked_ns; /* CLOCK_MONOTONIC time of the last ask, 0 for none (atomic) */
};

#define FC_HEAT_BYTES (FC_HEAT_PLACES * sizeof(struct fc_heat))

/* A block asked for is not asked again for this long: the server caches it meanwhile, or has
 * no room for it. */
#define FC_HEAT_ASK_AGAIN_NS (10 * 1000000000LL)

/* The place of the block named name (len bytes) in table, taken over (counts reset) if
 * another block had it. */
static inline struct fc_heat *fc_heat_of(struct fc_heat *table, const char *name, size_t len) {
	uint64_t key, check;
	fc_hashes(name, len, &key, &check);
	struct fc_heat *h = &table[(key * 0x9E3779B97F4A7C15ULL) >> 52];
	uint64_t tag = check | 1;
	if (__atomic_load_n(&h->tag, __ATOMIC_RELAXED) != tag) {
		__atomic_store_n(&h->tag, tag, __ATOMIC_RELAXED);
		__atomic_store_n(&h->bytes, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&h->asked_ns, 0, __ATOMIC_RELAXED);
	}
	return h;
}

/* Counts n bytes of the block of place h read from the source, and reports whether the caller
 * is to ask for the block now: the reader is in sequence, or a quarter of the block's
 * block_bytes was read, and nobody asked for it in the last FC_HEAT_ASK_AGAIN_NS (the place
 * is then stamped). A time ahead of now is from before the node restarted. */
static inline int fc_heat_read(struct fc_heat *h, int64_t n, int64_t block_bytes, int sequential) {
	int64_t hot = __atomic_add_fetch(&h->bytes, n, __ATOMIC_RELAXED);
	if (!sequential && hot * 4 < block_bytes)
		return 0;
	int64_t now = fc_monotonic_ns(), asked = __atomic_load_n(&h->asked_ns, __ATOMIC_RELAXED);
	if (asked != 0 && asked <= now && now - asked < FC_HEAT_ASK_AGAIN_NS)
		return 0;
	return __atomic_compare_exchange_n(&h->asked_ns, &asked, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

#endif /* FITCACHE_HEAT_H */
