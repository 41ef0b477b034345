// Finding a file's cached copy in FitCache tiers without Go: see fclookup.h for the contract
// and tiers/index.go for the index layout, which this file must match byte for byte
// (tests/c/capi_test.c and the Python tests read what the Go writer wrote through it).
#define _GNU_SOURCE
#include "fclookup.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// Index layout (tiers/index.go).
#define INDEX_NAME "fitcache.index"
#define INDEX_MAGIC "FCINDEX\x01"
#define INDEX_VERSION 5
#define INDEX_WAYS 8
#define INDEX_SLOT 80
#define INDEX_SLOTS 20480   // offset of the first slot
#define HDR_VERSION 8
#define HDR_WAYS 12
#define HDR_BUCKETS 16
#define HDR_SLOT_SIZE 20
#define HDR_RETIRED 24
#define COUNTERS 4096       // the counter lines, on pages of their own after the header page
#define COUNTER_LINE 64     // bytes per line: owner pid (uint32, 0 while free), then (uint64 each)
#define COUNTER_BYTES (FC_COUNTER_LINES * COUNTER_LINE) // hits, hit bytes, source ranges, bytes
#define CLAIM_PROBES 8      // lines of gone owners tried before sharing one (claim_line)
#define INDEX_MIN_BUCKETS (1u << 10) // tiers/index.go minIndexBuckets and maxIndexBuckets
#define INDEX_MAX_BUCKETS (1u << 20)

// A missing or unusable index is sought again after this long.
#define INDEX_RETRY_NS 1000000000LL

// The longest base name kept in a cached file's name (tiers/layout.go maxNameBytes).
#define MAX_NAME_BYTES 120

// Opens go to the kernel directly, not through libc's open functions: the preload shim
// interposes those, and its own opens must not come back into it.
static int sys_openat(int dirfd, const char *path, int flags) {
	return (int)syscall(SYS_openat, dirfd, path, flags, 0);
}

// fc_hashes computes both hashes of p in one pass: two independent multiply chains, which
// the CPU overlaps (each alone is one multiply's latency per byte).
void fc_hashes(const char *p, size_t n, uint64_t *key, uint64_t *check) {
	uint64_t h = 0xcbf29ce484222325ULL, c = 0xcbf29ce484222325ULL;
	for (size_t i = 0; i < n; i++) {
		h = (h ^ (unsigned char)p[i]) * 0x100000001b3ULL;
		c = (c ^ (unsigned char)p[n - 1 - i]) * 0x100000001b3ULL;
	}
	*key = h;
	*check = c;
}

// decimal writes v (>= 0) in decimal at out, without a terminator, and returns its length
// (at most 19).
static size_t decimal(int64_t v, char *out) {
	char digits[20];
	size_t nd = 0;
	do {
		digits[nd++] = (char)('0' + v % 10);
		v /= 10;
	} while (v > 0);
	for (size_t i = 0; i < nd; i++)
		out[i] = digits[nd - 1 - i];
	return nd;
}

size_t fc_block_name(char *name, size_t n, int64_t bb, int64_t block) {
	name[n++] = 0;
	n += decimal(bb, name + n);
	name[n++] = ':';
	return n + decimal(block, name + n);
}

int fc_clean_path(const char *in, char *out, size_t cap) {
	size_t n = strlen(in);
	if (n == 0 || in[0] != '/' || cap < 2)
		return -1;
	size_t w = 1, r = 1;
	out[0] = '/';
	while (r < n) {
		if (in[r] == '/') {
			r++;
		} else if (in[r] == '.' && (r + 1 == n || in[r + 1] == '/')) {
			r++;
		} else if (in[r] == '.' && in[r + 1] == '.' && (r + 2 == n || in[r + 2] == '/')) {
			r += 2;
			if (w > 1) { // back up to the previous slash; ".." at the root stays there
				w--;
				while (w > 1 && out[w] != '/')
					w--;
			}
		} else {
			if (w != 1) {
				if (w + 1 >= cap)
					return -1;
				out[w++] = '/';
			}
			for (; r < n && in[r] != '/'; r++) {
				if (w + 1 >= cap)
					return -1;
				out[w++] = in[r];
			}
		}
	}
	out[w] = '\0';
	return (int)w;
}

// Writes the data file's path relative to the tier, "ab/cd/<key>-<base name>", into rel.
static int rel_path(const char *path, size_t len, uint64_t key, char *rel, size_t cap) {
	const char *base = path + len;
	while (base > path && base[-1] != '/')
		base--;
	size_t blen = (size_t)(path + len - base);
	if (blen == 0) { // only "/" has no base name; Go's filepath.Base gives "/"
		base = "/";
		blen = 1;
	}
	while (blen > 0 && *base == '.') { // tiers/layout.go safeName
		base++;
		blen--;
	}
	if (blen > MAX_NAME_BYTES)
		blen = MAX_NAME_BYTES;
	// "%02x/%02x/%016llx-%.*s" of (key & 0xff, (key >> 8) & 0xff, key, base), without stdio.
	static const char hex[] = "0123456789abcdef";
	if (23 + blen + 1 > cap)
		return -1;
	rel[0] = hex[(key >> 4) & 15];
	rel[1] = hex[key & 15];
	rel[2] = '/';
	rel[3] = hex[(key >> 12) & 15];
	rel[4] = hex[(key >> 8) & 15];
	rel[5] = '/';
	for (int i = 0; i < 16; i++)
		rel[6 + i] = hex[(key >> (60 - 4 * i)) & 15];
	rel[22] = '-';
	for (size_t i = 0; i < blen; i++) // a block's NUL byte shows as '#' (tiers.BlockName)
		rel[23 + i] = base[i] ? base[i] : '#';
	rel[23 + blen] = 0;
	return (int)(23 + blen);
}

static uint32_t rd32(const uint8_t *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED); }
static uint64_t rd64(const uint8_t *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_RELAXED); }

static size_t index_len(uint32_t buckets) { return INDEX_SLOTS + (size_t)buckets * INDEX_WAYS * INDEX_SLOT; }

// claim_line returns the counter line of ix that process pid adds its counts to: the one it
// owns already (a pid used again), else a free one it claims with a compare-and-swap of the
// owner, else, every line claimed, one whose owner is gone (taken over with its counts, which
// stay in the server's sum), else one shared, chosen by the pid. A process claims one at its
// first count in a mapping (count), not when it maps it: short-lived programs under the
// preload shim that never hit take none. Lines are never freed: a
// count is never lost, and a node whose readers outnumber the lines has them share, with
// atomic adds, so that the sum stays right. (An owner in another pid namespace may look gone:
// its line is then shared too.) Only reads of the lines and at most CLAIM_PROBES kill(pid, 0),
// once per process and mapping.
static uint64_t *claim_line(uint8_t *counters, pid_t pid) {
	uint32_t me = (uint32_t)pid;
	int spare = -1;
	for (int i = 0; i < FC_COUNTER_LINES; i++) {
		uint32_t owner = __atomic_load_n((uint32_t *)(counters + i * COUNTER_LINE), __ATOMIC_RELAXED);
		if (owner == me)
			return (uint64_t *)(counters + i * COUNTER_LINE);
		if (owner == 0 && spare < 0)
			spare = i;
	}
	for (int i = spare; i >= 0 && i < FC_COUNTER_LINES; i++) {
		uint32_t *owner = (uint32_t *)(counters + i * COUNTER_LINE), was = 0;
		if (__atomic_compare_exchange_n(owner, &was, me, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED) || was == me)
			return (uint64_t *)owner; // claimed, or by another thread of this process meanwhile
	}
	int home = (int)(me % FC_COUNTER_LINES);
	for (int k = 0; k < CLAIM_PROBES; k++) {
		uint32_t *owner = (uint32_t *)(counters + ((home + k) % FC_COUNTER_LINES) * COUNTER_LINE);
		uint32_t was = __atomic_load_n(owner, __ATOMIC_RELAXED);
		if ((int32_t)was > 0 && syscall(SYS_kill, (pid_t)was, 0) != 0 && errno == ESRCH &&
		    __atomic_compare_exchange_n(owner, &was, me, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
			return (uint64_t *)owner;
	}
	return (uint64_t *)(counters + home * COUNTER_LINE);
}

// map_index maps the tier's index into *ix: all of it read-only, and its counter lines
// writable, after checking that it is a regular file of this user whose header matches its
// size. The geometry is read once, here: lookups use ix->buckets, never the header.
static int map_index(int dirfd, struct fc_index *ix) {
	int fd = sys_openat(dirfd, INDEX_NAME, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -1;
	struct stat st;
	uint8_t hdr[32];
	int ok = fc_sys_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && st.st_size >= INDEX_SLOTS &&
	         fc_sys_pread(fd, hdr, sizeof hdr, 0) == (ssize_t)sizeof hdr;
	uint32_t buckets = 0;
	if (ok) {
		uint32_t version, ways, slot;
		memcpy(&version, hdr + HDR_VERSION, 4);
		memcpy(&ways, hdr + HDR_WAYS, 4);
		memcpy(&buckets, hdr + HDR_BUCKETS, 4);
		memcpy(&slot, hdr + HDR_SLOT_SIZE, 4);
		ok = memcmp(hdr, INDEX_MAGIC, 8) == 0 && version == INDEX_VERSION && ways == INDEX_WAYS &&
		     slot == INDEX_SLOT && buckets >= INDEX_MIN_BUCKETS && buckets <= INDEX_MAX_BUCKETS &&
		     (buckets & (buckets - 1)) == 0 &&
		     (size_t)st.st_size == index_len(buckets);
	}
	void *m = MAP_FAILED, *c = MAP_FAILED;
	if (ok)
		m = mmap(NULL, index_len(buckets), PROT_READ, MAP_SHARED, fd, 0);
	if (m != MAP_FAILED)
		c = mmap(NULL, COUNTER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, COUNTERS);
	fc_sys_close(fd);
	if (c == MAP_FAILED) {
		if (m != MAP_FAILED)
			munmap(m, index_len(buckets));
		return -1;
	}
	ix->base = m;
	ix->len = index_len(buckets);
	ix->buckets = buckets;
	ix->counters = c;
	ix->line = NULL; // claimed at the first count
	ix->line_pid = 0;
	ix->ino = (uint64_t)st.st_ino;
	ix->intact_ns = 0;
	return 0;
}

// What index_state finds of a mapped index: still the tier's index and whole; replaced by
// another file under the index's name (a restarted or grown server's new index); or lost (no
// file under the name, or ours found shorter than the mapping).
enum { INDEX_INTACT, INDEX_REPLACED, INDEX_LOST };

// index_state reports whether the file ix maps is still the tier's index, at least as long as
// the mapping: one stat of the name (unless one found it so less than FC_INTACT_TRUST_NS ago).
// Another process of the user can truncate the index, and touching a page of the mapping past
// the new end of the file raises SIGBUS, which code running inside other programs cannot
// catch: every touch of a mapped index (lookups, hit counters) checks this first. A file found
// shorter is never touched again (INDEX_LOST). A replaced one was whole when it was mapped,
// and FitCache never shortens an index file: a server swaps the new one in, marks the old one
// retired, and a second later punches holes in its slots (which then read as zeros) and
// removes its name (tiers/index.go install, giveBack). So lookups go on with a replaced index
// while one thread maps the new one (current_index), and only then. What is left is the window
// after a check (see fclookup.h): a truncation that lands inside it still kills the reader, and
// for a replaced index (which another process of the user can still reach under its
// temporary name) that window lasts until the new index is published.
static int index_state_now(const struct fc_tier *t, struct fc_index *ix, int64_t now);

static int index_state(const struct fc_tier *t, struct fc_index *ix) {
	int64_t now = fc_monotonic_ns();
	if (now - __atomic_load_n(&ix->intact_ns, __ATOMIC_RELAXED) < FC_INTACT_TRUST_NS)
		return INDEX_INTACT;
	return index_state_now(t, ix, now);
}

// index_state_now is index_state without the trust window: the stat, made now.
static int index_state_now(const struct fc_tier *t, struct fc_index *ix, int64_t now) {
	struct stat st; // a system call, not libc's fstatat: the preload shim may interpose it
	if (syscall(SYS_newfstatat, t->dirfd, INDEX_NAME, &st, AT_SYMLINK_NOFOLLOW) != 0)
		return INDEX_LOST;
	if ((uint64_t)st.st_ino != ix->ino)
		return INDEX_REPLACED;
	if (st.st_size < 0 || (size_t)st.st_size < ix->len)
		return INDEX_LOST;
	// A forked child counts on its parent's line until here, then lets go of it and claims its
	// own at its next count: at most FC_INTACT_TRUST_NS after the fork (a getpid per check,
	// not per hit).
	pid_t owner = __atomic_load_n(&ix->line_pid, __ATOMIC_RELAXED);
	if (owner != 0 && owner != getpid()) {
		__atomic_store_n(&ix->line, NULL, __ATOMIC_RELAXED);
		__atomic_store_n(&ix->line_pid, 0, __ATOMIC_RELAXED);
	}
	__atomic_store_n(&ix->intact_ns, now, __ATOMIC_RELAXED);
	return INDEX_INTACT;
}

static void unmap_index(struct fc_index *ix) {
	if (!ix->base)
		return;
	munmap((void *)ix->base, ix->len);
	munmap(ix->counters, COUNTER_BYTES);
	ix->base = NULL;
	ix->counters = NULL;
	ix->line = NULL;
}

// A thread that maps a tier's index anew is the only one of its process doing so. t->remapping
// holds its process id (high 32 bits) and the CLOCK_MONOTONIC millisecond it began at (low 32
// bits, wrapping), in one word that a compare-and-swap takes, or 0. A mapping begun by
// another process (a parent's thread, in a forked child: that thread is not there to finish)
// is taken over at once, since meanwhile lookups go on with a replaced index, which nothing
// checks; one begun more than REMAP_STALE_MS ago is taken for gone too (a process id used
// again by a grandchild).
#define REMAP_STALE_MS 1000

// Attempts the mapping thread makes, one after the other, while the index it maps turns out
// replaced already (servers restarting back to back), before it waits INDEX_RETRY_NS / 100.
#define REMAP_TRIES 4

// begin_remap makes the calling thread the one that maps t's index anew, and returns 1; or
// returns 0 when another thread of this process is doing so.
static int begin_remap(struct fc_tier *t, int64_t now) {
	uint64_t me = (uint64_t)(uint32_t)getpid() << 32, ms = (uint32_t)(now / 1000000);
	uint64_t cur = __atomic_load_n(&t->remapping, __ATOMIC_RELAXED);
	if (cur != 0 && (cur >> 32 << 32) == me && (uint32_t)(ms - (uint32_t)cur) < REMAP_STALE_MS)
		return 0;
	return __atomic_compare_exchange_n(&t->remapping, &cur, me | ms, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}

// let_go makes the tier forget ix (kept mapped, untouched, until fc_tier_close) unless another
// thread published a newer index meanwhile, and returns NULL.
static struct fc_index *let_go(struct fc_tier *t, struct fc_index *ix) {
	if (ix)
		__atomic_compare_exchange_n(&t->index, &ix, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	return NULL;
}

// publish keeps the new mapping fresh in the next entry of t->maps (or, past them, a page of its
// own) and makes it the tier's index; it returns it, or NULL when there was no page for it.
static struct fc_index *publish(struct fc_tier *t, struct fc_index *fresh) {
	int slot = __atomic_load_n(&t->nmaps, __ATOMIC_RELAXED);
	struct fc_index *ix;
	if (slot < FC_TIER_MAPS) {
		t->maps[slot] = *fresh;
		__atomic_store_n(&t->nmaps, slot + 1, __ATOMIC_RELEASE);
		ix = &t->maps[slot];
	} else { // every entry taken: a page of its own for the record
		ix = mmap(NULL, sizeof *ix, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (ix == MAP_FAILED)
			return NULL;
		*ix = *fresh;
		ix->next = t->extra;
		t->extra = ix;
	}
	__atomic_store_n(&t->index, ix, __ATOMIC_RELEASE);
	return ix;
}

// map_current maps the tier's index anew (the calling thread is the only one doing so) and
// publishes it; it returns it, or NULL after setting when to try again.
static struct fc_index *map_current(struct fc_tier *t, int64_t now) {
	int64_t wait = INDEX_RETRY_NS / 100; // unless it fails: all REMAP_TRIES found replaced
	for (int try = 0; try < REMAP_TRIES; try++) {
		struct fc_index fresh;
		if (map_index(t->dirfd, &fresh) != 0) {
			wait = INDEX_RETRY_NS;
			break;
		}
		if (!rd32(fresh.base + HDR_RETIRED)) {
			struct fc_index *ix = publish(t, &fresh);
			if (ix)
				return ix;
			unmap_index(&fresh);
			wait = INDEX_RETRY_NS;
			break;
		}
		unmap_index(&fresh); // replaced again meanwhile: map the newer one
	}
	__atomic_store_n(&t->retry_ns, now + wait, __ATOMIC_RELAXED);
	return NULL;
}

// current_index returns the tier's index, mapping it anew when there was none (at most once
// per INDEX_RETRY_NS) or when its server replaced it or marked it retired. One thread at a
// time maps (begin_remap); the others meanwhile go on with the index
// there is, replaced or retired: it is still right about what it lists, since its server gives
// back its slots only a second after it retires it (tiers.retiredGrace), and lookups that found
// none would send every reader of the node to its server at each restart. A replaced index is
// let go when no new one could be mapped; replaced ones stay mapped until fc_tier_close.
static struct fc_index *current_index(struct fc_tier *t) {
	struct fc_index *ix = __atomic_load_n(&t->index, __ATOMIC_ACQUIRE);
	int state = ix ? index_state(t, ix) : INDEX_LOST;
	if (state == INDEX_INTACT && !rd32(ix->base + HDR_RETIRED))
		return ix;
	if (state == INDEX_LOST) // truncated, or no index: never touched again
		ix = let_go(t, ix);
	int64_t now = fc_monotonic_ns();
	if (now < __atomic_load_n(&t->retry_ns, __ATOMIC_RELAXED)) // the last mapping failed
		return state == INDEX_REPLACED ? let_go(t, ix) : ix;
	if (!begin_remap(t, now))
		return ix; // another thread is mapping the new one: go on with this one meanwhile
	struct fc_index *latest = __atomic_load_n(&t->index, __ATOMIC_ACQUIRE); // a thread before us may have mapped it
	if (!latest || latest == ix || index_state(t, latest) != INDEX_INTACT || rd32(latest->base + HDR_RETIRED))
		latest = map_current(t, now);
	if (latest)
		ix = latest;
	else if (state == INDEX_REPLACED)
		ix = let_go(t, ix);
	__atomic_store_n(&t->remapping, 0, __ATOMIC_RELEASE);
	return ix;
}

int fc_tier_open(struct fc_tier *t, const char *dir, int kind, uint32_t session) {
	int saved = errno;
	memset(t, 0, sizeof *t);
	t->dirfd = -1;
	int fd = sys_openat(AT_FDCWD, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		int err = errno;
		errno = saved;
		return -err;
	}
	struct stat st;
	if (fc_sys_fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
		fc_sys_close(fd);
		errno = saved;
		return -EPERM;
	}
	t->dirfd = fd;
	t->kind = kind;
	t->session = session;
	t->uid = st.st_uid; // == geteuid(), checked above: fc_lookup makes no system call for it
	t->dev = st.st_dev;
	current_index(t);
	errno = saved;
	return 0;
}

void fc_tier_close(struct fc_tier *t) {
	int saved = errno;
	__atomic_store_n(&t->index, NULL, __ATOMIC_RELEASE);
	int n = t->nmaps < FC_TIER_MAPS ? t->nmaps : FC_TIER_MAPS;
	for (int i = 0; i < n; i++)
		unmap_index(&t->maps[i]);
	t->nmaps = 0;
	while (t->extra) {
		struct fc_index *rec = t->extra;
		t->extra = rec->next;
		unmap_index(rec);
		munmap(rec, sizeof *rec);
	}
	if (t->dirfd >= 0)
		fc_sys_close(t->dirfd);
	t->dirfd = -1;
	errno = saved;
}

// A slot as index_find reads it.
struct slot {
	uint64_t size, ino;
	int64_t mtime;
	uint32_t checked; // the last validation session that found the copy matching its source
	uint64_t src_ino;  // the source's inode number and change time (0: unknown)
	int64_t src_ctime;
};

// index_find looks (key, check) up in a mapped index with the slot's seqlock.
static int index_find(const struct fc_index *ix, uint64_t key, uint64_t check, struct slot *out) {
	size_t first = (size_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - __builtin_ctz(ix->buckets))) * INDEX_WAYS;
	for (size_t i = first; i < first + INDEX_WAYS; i++) {
		const uint8_t *s = ix->base + INDEX_SLOTS + i * INDEX_SLOT;
		if (rd64(s + 8) != key)
			continue;
		for (int spin = 0; spin < 100; spin++) {
			uint32_t seq = __atomic_load_n((const uint32_t *)s, __ATOMIC_ACQUIRE);
			if (seq & 1)
				continue;
			uint32_t used = rd32(s + 4);
			uint64_t k = rd64(s + 8), c = rd64(s + 16);
			out->size = rd64(s + 24);
			out->mtime = (int64_t)rd64(s + 32);
			out->ino = rd64(s + 40);
			out->checked = rd32(s + 52);
			out->src_ino = rd64(s + 64);
			out->src_ctime = (int64_t)rd64(s + 72);
			__atomic_thread_fence(__ATOMIC_ACQUIRE);
			if (__atomic_load_n((const uint32_t *)s, __ATOMIC_RELAXED) != seq)
				continue;
			if (used == 1 && k == key && c == check)
				return 1;
			break;
		}
	}
	return 0;
}

// Whether the kernel has openat2 (0 unknown, 1 yes, -1 no); accessed atomically.
static int have_openat2;

int fc_openat2_beneath(int dirfd, const char *rel, int oflags) {
	if (__atomic_load_n(&have_openat2, __ATOMIC_RELAXED) >= 0) {
		struct open_how how = {
			.flags = (uint64_t)(O_RDONLY | O_NOFOLLOW | oflags),
			.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH,
		};
		int fd = (int)syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
		if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) {
			__atomic_store_n(&have_openat2, 1, __ATOMIC_RELAXED);
			return fd;
		}
		__atomic_store_n(&have_openat2, -1, __ATOMIC_RELAXED); // EPERM: a seccomp filter refuses it
	}
	errno = ENOSYS;
	return -1;
}

// open_beneath opens rel below dirfd read-only with the extra flags oflags, following no
// link at any level.
static int open_beneath(int dirfd, const char *rel, int oflags) {
	int fd = fc_openat2_beneath(dirfd, rel, oflags);
	if (fd >= 0 || errno != ENOSYS)
		return fd;
	// One level at a time: "ab", "cd", name.
	char part[3] = {rel[0], rel[1], 0};
	int a = sys_openat(dirfd, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (a < 0)
		return -1;
	part[0] = rel[3];
	part[1] = rel[4];
	int b = sys_openat(a, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	fc_sys_close(a);
	if (b < 0)
		return -1;
	fd = sys_openat(b, rel + 6, O_RDONLY | O_NOFOLLOW | oflags);
	fc_sys_close(b);
	return fd;
}

// is_listed reports whether the file whose kernel fstat is st is the copy of tier t's slot s:
// a regular file of this user with the slot's inode number and size.
static int is_listed(const struct fc_tier *t, const struct slot *s, const struct stat *st) {
	return S_ISREG(st->st_mode) && st->st_uid == t->uid && (uint64_t)st->st_ino == s->ino &&
	       (uint64_t)st->st_size == s->size;
}

// fill describes in *hit the copy open at fd: the slot s of tier number tier, whose fstat is st.
static void fill(struct fc_hit *hit, int fd, int tier, const struct slot *s, const struct stat *st) {
	hit->fd = fd;
	hit->tier = tier;
	hit->size = (int64_t)s->size;
	hit->mtime_ns = s->mtime;
	hit->ino = s->ino;
	hit->dev = (uint64_t)st->st_dev;
	hit->ctime = st->st_ctim;
	hit->src_ino = s->src_ino;
	hit->src_ctime_ns = s->src_ctime;
}

int fc_lookup(struct fc_tier *tiers, int n, const char *path, size_t len, int oflags, int require_session,
              struct fc_hit *hit) {
	int saved = errno;
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	char rel[MAX_NAME_BYTES + 32];
	int have_rel = 0;
	for (int i = 0; i < n; i++) {
		struct fc_tier *t = &tiers[i];
		const struct fc_index *ix = t->dirfd >= 0 ? current_index(t) : NULL;
		struct slot s;
		if (!ix || !index_find(ix, key, check, &s) || (require_session && s.checked < t->session))
			continue;
		if (!have_rel) {
			if (rel_path(path, len, key, rel, sizeof rel) < 0)
				break;
			have_rel = 1;
		}
		int fd = open_beneath(t->dirfd, rel, oflags);
		if (fd < 0 && errno == EINVAL && (oflags & O_DIRECT)) // a tier without direct I/O (tmpfs)
			fd = open_beneath(t->dirfd, rel, oflags & ~O_DIRECT);
		if (fd < 0)
			continue; // evicted since the lookup
		struct stat st;
		if (fc_sys_fstat(fd, &st) == 0 && is_listed(t, &s, &st)) {
			fill(hit, fd, i, &s, &st);
			errno = saved;
			return 0;
		}
		fc_sys_close(fd); // replaced behind the index's back: the server removes it when it meets it
	}
	errno = saved;
	return -ENOENT;
}

int fc_index_current(struct fc_tier *t) {
	if (t->dirfd < 0)
		return 0;
	int saved = errno;
	// One stat as a rule; a second only when the index was replaced and is mapped anew here.
	struct fc_index *ix = __atomic_load_n(&t->index, __ATOMIC_ACQUIRE);
	int current = ix && index_state_now(t, ix, fc_monotonic_ns()) == INDEX_INTACT && !rd32(ix->base + HDR_RETIRED);
	if (!current) {
		struct fc_index *mapped = current_index(t); // the replaced one while another thread maps
		current = mapped && mapped != ix && index_state_now(t, mapped, fc_monotonic_ns()) == INDEX_INTACT &&
		          !rd32(mapped->base + HDR_RETIRED);
	}
	errno = saved;
	return current;
}

int fc_copy_version(const struct fc_hit *hit, struct fc_version *v) {
	if (hit->src_ctime_ns == 0)
		return -1; // a copy whose source version its server did not know (a replica's)
	v->mtime_ns = hit->mtime_ns;
	v->ctime_ns = hit->src_ctime_ns;
	v->ino = hit->src_ino;
	return 0;
}

int fc_copy_intact(struct fc_tier *t, const char *path, size_t len, uint64_t ino, int64_t size, int64_t *intact_ns) {
	int64_t now = fc_monotonic_ns();
	if (now - __atomic_load_n(intact_ns, __ATOMIC_RELAXED) < FC_INTACT_TRUST_NS)
		return 1;
	int saved = errno;
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	char rel[MAX_NAME_BYTES + 32];
	struct stat st; // a system call, not libc's fstatat: the preload shim may interpose it
	int intact = t->dirfd >= 0 && rel_path(path, len, key, rel, sizeof rel) >= 0 &&
	             syscall(SYS_newfstatat, t->dirfd, rel, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
	             (uint64_t)st.st_ino == ino && (int64_t)st.st_size >= size;
	if (intact)
		__atomic_store_n(intact_ns, now, __ATOMIC_RELAXED);
	errno = saved;
	return intact;
}

int fc_lookup_fd(struct fc_tier *tiers, int n, const char *path, size_t len, int fd, struct fc_hit *hit) {
	int saved = errno;
	struct stat st;
	if (fc_sys_fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		errno = saved;
		return -ENOENT;
	}
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	for (int i = 0; i < n; i++) {
		struct fc_tier *t = &tiers[i];
		const struct fc_index *ix = t->dirfd >= 0 && t->dev == st.st_dev ? current_index(t) : NULL;
		struct slot s;
		if (ix && index_find(ix, key, check, &s) && is_listed(t, &s, &st)) {
			fill(hit, fd, i, &s, &st);
			errno = saved;
			return 0;
		}
	}
	errno = saved;
	return -ENOENT;
}

int fc_listed(struct fc_tier *t, uint64_t key, uint64_t check, uint64_t ino) {
	int saved = errno;
	const struct fc_index *ix = t->dirfd >= 0 ? current_index(t) : NULL;
	struct slot s;
	int listed = ix && index_find(ix, key, check, &s) && s.ino == ino;
	errno = saved;
	return listed;
}

// count adds one to word first of this process's counter line in t's index and bytes to the
// next word, claiming the line first if the process has none in this mapping yet.
static void count(struct fc_tier *t, int first, int64_t bytes) {
	int saved = errno;
	struct fc_index *ix = t->dirfd >= 0 ? current_index(t) : NULL;
	if (ix) {
		uint64_t *line = __atomic_load_n(&ix->line, __ATOMIC_RELAXED);
		if (!line) {
			pid_t pid = getpid();
			line = claim_line(ix->counters, pid);
			__atomic_store_n(&ix->line_pid, pid, __ATOMIC_RELAXED);
			__atomic_store_n(&ix->line, line, __ATOMIC_RELAXED);
		}
		__atomic_fetch_add(&line[first], 1, __ATOMIC_RELAXED);
		__atomic_fetch_add(&line[first + 1], (uint64_t)bytes, __ATOMIC_RELAXED);
	}
	errno = saved;
}

void fc_count_source(struct fc_tier *t, int64_t bytes) { count(t, 3, bytes); }

void fc_count_hit(struct fc_tier *t, int64_t bytes) { count(t, 1, bytes); }
