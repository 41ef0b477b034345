// Ranges (hit_pread): bytes of cached copies (whole files, or blocks) served through mappings
// a client keeps of them, and the ranges of blocks not cached read from a source the client
// keeps open (source.c), never a range of pieces of two versions of the file.
#define _GNU_SOURCE
#include "hitclient.h"

#include "fcnode.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

// A copy the tiers no longer list is let go within this long (see range_sweep).
#define RANGE_SWEEP_NS 1000000000LL

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
// from the source descriptor Go left for it (fcHitSetSource), or that keep_range_source opened, if
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
		if (k == -FC_MISS && ask && !listed_here(c, nt, name, namelen) && keep_range_source(c, name, (size_t)n) == 1) {
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
			if (asked == FC_NO_TIER && node_fetch(c, FC_NODE_OP_FETCH, name, (size_t)n, msg) == 0) {
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
		if (!ask || keep_range_source(c, name, (size_t)n) != 1)
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
