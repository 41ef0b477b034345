// The buffers the hit path hands out (fc_read's *buffer, released by hit_release): their
// handles, kept in the shard of the thread that took them, the pool of memory they come
// from, and take and hand_out, which read a whole file into one and register it.
#define _GNU_SOURCE
#include "hitclient.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

// A handle is FC_CBUF_BASE | gen << 32 | shard << SLOT_BITS | slot.
static int64_t buf_handle(const struct shard *s, uint32_t slot, uint32_t gen) {
	return FC_CBUF_BASE | ((int64_t)(gen & 0x3fffffff) << 32) | (int64_t)(s - shards) << SLOT_BITS | slot;
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
void *buf_alloc(size_t n) {
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
void buf_free(void *p, size_t n) {
	struct shard *s = own_shard();
	pthread_mutex_lock(&s->mu);
	bool kept = pool_keep(s, p, n);
	pthread_mutex_unlock(&s->mu);
	if (!kept)
		free(p);
}

void free_mem(void *ptr, size_t len, uint8_t kind) {
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

// read_max is FC_READ_MAX_BYTES unless FITCACHE_READ_MAX_BYTES overrides it (for
// bench/bench_crossover.py, which measures where mapping starts to pay).
int64_t read_max = FC_READ_MAX_BYTES;

__attribute__((constructor)) static void read_max_init(void) {
	const char *v = getenv("FITCACHE_READ_MAX_BYTES");
	char *end;
	long long n = v ? strtoll(v, &end, 10) : -1;
	if (v && *v && *end == 0 && n >= 0)
		read_max = n;
}

// take reads or maps the whole file of a hit; it returns 0, FC_MISS if the file did not give
// the bytes the index promised, or -ENOMEM.
int take(const struct fc_hit *h, void **ptr, uint8_t *kind) {
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

// hand_out registers the memory take made and stores it as fc_read returns it; it returns 0,
// or -ENOMEM after freeing it.
int hand_out(void *ptr, int64_t n, uint8_t kind, const void **data, int64_t *size, int64_t *buffer) {
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
