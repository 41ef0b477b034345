/*
 * ranges.c -- the preload shim's reads of large files, served from cached blocks.
 *
 * A large file that no tier holds whole reaches the program as a descriptor of its source
 * (see shim_open): the server hands the source over at once rather than keep the program
 * waiting for a copy (core.ReadNowBytes), and a file larger than every tier, or than the room
 * its dataset has, is never copied whole (FC_ORIGIN_SOURCE). The server caches such a file by
 * blocks instead (core.Engine.ReadBlock), each a tier entry of its own named by
 * tiers.BlockName. The shim marks those descriptors (ranged_open) and serves the program's
 * reads of them -- read, pread, readv, preadv, their 64-bit, v2 and fortified forms -- from
 * the blocks the tiers hold, and from the whole copy once one is made; what no copy holds is
 * read from the program's own descriptor of the source, so every read is whole as it would
 * have been. Everything else on the descriptor stays the kernel's on the source: fstat,
 * lseek, mmap, sendfile, and stdio's reads (inside libc, not through read). A read without
 * an offset moves the file offset as the kernel would (lseek before and after).
 *
 * A block of a file no tier takes whole is asked of the server (FC_NODE_OP_CACHE_BLOCK)
 * once a quarter of it was read from the source, or at once for a reader in sequence (see
 * capi/fcheat.h). The shim waits for no answer: the server caches the block in the
 * background and later reads find it. A block the tiers list but have not checked in this
 * run's session is asked for too (FC_NODE_OP_FETCH_BLOCK), and waited for: the server only
 * compares the file with its source, once for all its blocks.
 *
 * Safety. A marked descriptor number may come to name another file behind the shim's back
 * (dup2, close_range, a raw close): each read checks that the descriptor is still the file
 * marked (fstat: device and inode) and that a copy matches the source's size,
 * modification time, change time and inode (the copy's record gives them once per mapping),
 * so a mismatch reads the source: a file rewritten in place, even with its modification time
 * put back, or replaced, is never served from blocks of another version. A read that took
 * pieces from copies and from the source is read again from the source alone if fstat finds
 * the file changed meanwhile. Like the rest of the shim, nothing
 * here allocates, locks or waits for another thread: shared entries are taken by an atomic
 * exchange or guarded by a sequence count, and a thread that finds one busy does without it.
 * A process forked while another thread held an entry does without that entry; the shim's
 * state is otherwise inherited as it is. Cached copies are kept mapped (at most KEPT of them,
 * none holding a descriptor) and let go once the tier's index no longer lists them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../capi/fcheat.h"
#include "../capi/fclimits.h"
#include "../capi/fcnode.h"
#include "shim.h"

#define EXPORT __attribute__((visibility("default")))

// Files of at least FC_READ_NOW_BYTES (capi/fclimits.h) are read through blocks: below it,
// the server copies a file whole before the open returns (and never hands over its source).

// The block sizes a server accepts (the option block_size: config's blockBytesMin and
// blockBytesMax).
#define BLOCK_MIN ((int64_t)64 << 10)
#define BLOCK_MAX ((int64_t)256 << 20)

// A read with more pieces than this (readv) is left to the kernel.
#define MAX_PIECES 64

// NOT_RANGED: the call is left to libc.
#define NOT_RANGED (-2)

// The size of the server's blocks; 0 leaves every descriptor to the kernel. Set at load.
static int64_t block_bytes;

// The file the heat of blocks is shared in (see heats); empty for none. Set at load.
static char heat_path[FC_PATH_MAX];

static int (*libc_close)(int);
static ssize_t (*libc_read)(int, void *, size_t);
static ssize_t (*libc_pread)(int, void *, size_t, off_t);
static ssize_t (*libc_pread64)(int, void *, size_t, off64_t);
static ssize_t (*libc_readv)(int, const struct iovec *, int);
static ssize_t (*libc_preadv)(int, const struct iovec *, int, off_t);
static ssize_t (*libc_preadv64)(int, const struct iovec *, int, off64_t);
static ssize_t (*libc_preadv2)(int, const struct iovec *, int, off_t, int);
static ssize_t (*libc_preadv64v2)(int, const struct iovec *, int, off64_t, int);
static ssize_t (*libc___read_chk)(int, void *, size_t, size_t);
static ssize_t (*libc___pread_chk)(int, void *, size_t, off_t, size_t);
static ssize_t (*libc___pread64_chk)(int, void *, size_t, off64_t, size_t);

void ranged_configure(const char *blocks, const char *heat) {
	if (heat && heat[0] == '/' && strlen(heat) < sizeof heat_path)
		strcpy(heat_path, heat);
	if (!blocks || !*blocks)
		return;
	char *end;
	long long n = strtoll(blocks, &end, 10);
	if (*end == 0 && n >= BLOCK_MIN && n <= BLOCK_MAX)
		block_bytes = n;
}

static struct fc_heat *heats(void);

// --- Marked descriptors --------------------------------------------------------------------

// The large files open for reading through blocks, at most RANGED_FILES at once (more are
// left to the kernel), and for each descriptor below RANGED_FDS the entry it reads through.
#define RANGED_FILES 64
#define RANGED_FDS 65536

struct ranged_file {
	int taken;     // 1 while the entry belongs to a descriptor (atomic: claimed by exchange)
	uint32_t seq;  // sequence count: odd while the fields below change (atomic)
	int fd;        // the program's descriptor
	int ask;       // ask the server for the blocks read from the source (FC_ORIGIN_SOURCE)
	dev_t dev;     // the source's identity: a read checks the descriptor still names it
	ino_t ino;
	const struct root *root;
	int64_t next;  // the offset after the last read: a read there is in sequence (atomic)
	size_t keylen; // the dataset path of the file, the key of its copies
	char key[FC_PATH_MAX];
};

static struct ranged_file files[RANGED_FILES];
static uint8_t file_of[RANGED_FDS]; // entry + 1, 0 for a descriptor of the kernel's (atomic)
static int marked_files;            // entries taken (atomic)

static void sweep_kept(void);

void ranged_open(int fd, int ask, const struct root *r, const char *key, size_t len, const struct stat *st) {
	if (block_bytes == 0 || fd < 0 || fd >= RANGED_FDS || st->st_size < FC_READ_NOW_BYTES || len >= FC_PATH_MAX)
		return;
	heats(); // mapped before the program forks its workers, which then share it
	for (int i = 0; i < RANGED_FILES; i++) {
		struct ranged_file *f = &files[i];
		if (__atomic_exchange_n(&f->taken, 1, __ATOMIC_ACQUIRE))
			continue;
		__atomic_fetch_add(&f->seq, 1, __ATOMIC_RELAXED); // odd
		__atomic_thread_fence(__ATOMIC_RELEASE);
		f->fd = fd;
		f->ask = ask;
		f->dev = st->st_dev;
		f->ino = st->st_ino;
		f->root = r;
		__atomic_store_n(&f->next, 0, __ATOMIC_RELAXED);
		f->keylen = len;
		memcpy(f->key, key, len);
		__atomic_fetch_add(&f->seq, 1, __ATOMIC_RELEASE); // even: readable
		__atomic_fetch_add(&marked_files, 1, __ATOMIC_RELAXED);
		__atomic_store_n(&file_of[fd], (uint8_t)(i + 1), __ATOMIC_RELEASE);
		return;
	}
}

void ranged_forget(int fd) {
	if (fd < 0 || fd >= RANGED_FDS || !__atomic_load_n(&file_of[fd], __ATOMIC_RELAXED))
		return;
	uint8_t i = __atomic_exchange_n(&file_of[fd], 0, __ATOMIC_ACQ_REL);
	if (i == 0 || i > RANGED_FILES)
		return;
	struct ranged_file *f = &files[i - 1];
	__atomic_fetch_add(&f->seq, 1, __ATOMIC_RELAXED); // odd: a reader's snapshot fails
	__atomic_thread_fence(__ATOMIC_RELEASE);
	f->fd = -1;
	__atomic_fetch_add(&f->seq, 1, __ATOMIC_RELEASE);
	__atomic_store_n(&f->taken, 0, __ATOMIC_RELEASE);
	if (__atomic_sub_fetch(&marked_files, 1, __ATOMIC_RELAXED) == 0)
		sweep_kept(); // the last large file closed: what it kept is let go once evicted
}

// What a read needs of a marked descriptor's entry, copied out under its sequence count.
struct marked {
	struct ranged_file *f;
	int ask;
	dev_t dev;
	ino_t ino;
	const struct root *root;
	size_t keylen;
	char name[FC_PATH_MAX + 48]; // the key, then a block's suffix (see fc_block_name)
};

// marked_file copies the entry of fd into m: 0, or -1 when fd is not marked (any more).
static int marked_file(int fd, struct marked *m) {
	uint8_t i = __atomic_load_n(&file_of[fd], __ATOMIC_ACQUIRE);
	if (i == 0 || i > RANGED_FILES)
		return -1;
	struct ranged_file *f = &files[i - 1];
	uint32_t seq = __atomic_load_n(&f->seq, __ATOMIC_ACQUIRE);
	if ((seq & 1) || f->fd != fd)
		return -1;
	m->f = f;
	m->ask = f->ask;
	m->dev = f->dev;
	m->ino = f->ino;
	m->root = f->root;
	m->keylen = f->keylen < FC_PATH_MAX ? f->keylen : 0;
	memcpy(m->name, f->key, m->keylen);
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	return __atomic_load_n(&f->seq, __ATOMIC_RELAXED) == seq && m->keylen > 0 ? 0 : -1;
}

// --- The program's buffers -----------------------------------------------------------------

// A position in the pieces of a read (one for read and pread, several for readv).
struct cursor {
	const struct iovec *iov;
	int n, i;    // pieces, and the current one
	size_t used; // bytes of the current piece filled
};

// put copies len bytes from src to the cursor and moves it on.
static void put(struct cursor *c, const uint8_t *src, size_t len) {
	while (len > 0 && c->i < c->n) {
		size_t room = c->iov[c->i].iov_len - c->used, k = len < room ? len : room;
		memcpy((uint8_t *)c->iov[c->i].iov_base + c->used, src, k);
		src += k;
		len -= k;
		c->used += k;
		if (c->used == c->iov[c->i].iov_len) {
			c->i++;
			c->used = 0;
		}
	}
}

// pieces writes into out the pieces of the next len bytes of the cursor, without moving
// it, and returns how many.
static int pieces(const struct cursor *c, size_t len, struct iovec *out) {
	int n = 0;
	size_t used = c->used;
	for (int i = c->i; len > 0 && i < c->n; i++, used = 0) {
		size_t room = c->iov[i].iov_len - used, k = len < room ? len : room;
		if (k == 0)
			continue;
		out[n].iov_base = (uint8_t *)c->iov[i].iov_base + used;
		out[n++].iov_len = k;
		len -= k;
	}
	return n;
}

// skip moves the cursor on by len bytes.
static void skip(struct cursor *c, size_t len) {
	while (len > 0 && c->i < c->n) {
		size_t room = c->iov[c->i].iov_len - c->used, k = len < room ? len : room;
		len -= k;
		c->used += k;
		if (c->used == c->iov[c->i].iov_len) {
			c->i++;
			c->used = 0;
		}
	}
}

// --- Cached copies kept mapped ------------------------------------------------------------

// Copies (blocks, or whole files) kept mapped for the reads that follow, at most KEPT (16 GiB
// of address space for 4 MiB blocks, no memory but the page tables of what was read), each
// in the place its name's key hashes to: a newer copy takes the place of an older one.
// Measured (bench/bench_large.py): with 256 places, a 2 GiB file read at random in 383
// cached blocks spent a third of its time in munmap and new mappings.
#define KEPT 4096
enum { KEPT_FREE, KEPT_BUSY, KEPT_FULL };

struct kept {
	int state;            // KEPT_FREE, KEPT_BUSY (a thread uses or changes it), KEPT_FULL (atomic)
	uint64_t key, check;  // the hashes of the copy's name (fc_hashes)
	uint64_t ino;         // its data file's inode number, for fc_listed
	int tier;
	struct fc_version ver; // the version of the source the copy was made of (its record)
	int64_t intact_ns;     // when the copy was last found intact (fc_copy_intact)
	const uint8_t *map;
	size_t len;
};

static struct kept kept[KEPT];

// Kept copies the tiers no longer list (evicted, removed, found stale) are let go within
// SWEEP_NS of reading on (see sweep_kept): their pages would stay in use, out of the
// tiers' budget, as long as they are mapped.
#define SWEEP_NS (1000000000LL)
static int64_t swept_ns;   // CLOCK_MONOTONIC time of the last sweep (atomic)
static int kept_count;     // entries KEPT_FULL or being let go (atomic): 0 needs no sweep

// sweep_kept lets go of the kept copies the tiers no longer list, once per SWEEP_NS: an
// index lookup each, no system call but for the copies let go. A copy in use by another
// thread is left for the next sweep.
static void sweep_kept(void) {
	if (__atomic_load_n(&kept_count, __ATOMIC_RELAXED) == 0)
		return;
	int64_t now = fc_monotonic_ns(), last = __atomic_load_n(&swept_ns, __ATOMIC_RELAXED);
	if (now - last < SWEEP_NS ||
	    !__atomic_compare_exchange_n(&swept_ns, &last, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		return;
	for (int i = 0; i < KEPT; i++) {
		struct kept *k = &kept[i];
		int expect = KEPT_FULL;
		if (!__atomic_compare_exchange_n(&k->state, &expect, KEPT_BUSY, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
			continue;
		if (fc_listed(&shim_tiers[k->tier], k->key, k->check, k->ino)) {
			__atomic_store_n(&k->state, KEPT_FULL, __ATOMIC_RELEASE);
			continue;
		}
		munmap((void *)k->map, k->len);
		__atomic_fetch_sub(&kept_count, 1, __ATOMIC_RELAXED);
		__atomic_store_n(&k->state, KEPT_FREE, __ATOMIC_RELEASE);
	}
}

void ranged_sweep(void) { sweep_kept(); }

// same_source reports whether a copy made of version v may serve the source whose version
// is now src: modification time, change time and inode number (a field the copy's record
// left 0 is unknown, and not compared). The change time tells a rewrite in place that kept
// the size and put the modification time back.
static int same_source(const struct fc_version *v, const struct fc_version *src) {
	return v->mtime_ns == src->mtime_ns && (v->ctime_ns == 0 || v->ctime_ns == src->ctime_ns) &&
	       (v->ino == 0 || v->ino == src->ino);
}

// from_copy copies n bytes at offset at of the cached copy named name (len bytes: a block's
// name, or the key of a whole file) to the cursor, if a tier holds that copy checked in this
// run's session, copy_len bytes long and made of the source version src (the one the
// program's descriptor reads, as fstat gave it). It returns n, or -1 (nothing copied) when
// there is no such copy; with *unchecked set when the tiers list one not checked in the
// session.
static ssize_t from_copy(const char *name, size_t len, int64_t copy_len, const struct fc_version *src, int64_t at,
                         struct cursor *c, int64_t n, int64_t *served, int *unchecked) {
	uint64_t key, check;
	fc_hashes(name, len, &key, &check);
	struct kept *k = &kept[(key * 0x9E3779B97F4A7C15ULL) >> 52];
	int expect = KEPT_FULL;
	if (__atomic_compare_exchange_n(&k->state, &expect, KEPT_BUSY, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
		int same = k->key == key && k->check == check;
		if (same && same_source(&k->ver, src) && (int64_t)k->len == copy_len &&
		    fc_listed(&shim_tiers[k->tier], key, check, k->ino) &&
		    fc_copy_intact(&shim_tiers[k->tier], name, len, k->ino, (int64_t)k->len, &k->intact_ns)) {
			put(c, k->map + at, (size_t)n);
			served[k->tier] += n;
			__atomic_store_n(&k->state, KEPT_FULL, __ATOMIC_RELEASE);
			return n;
		}
		if (same) { // evicted, removed or stale: let go of it
			munmap((void *)k->map, k->len);
			__atomic_fetch_sub(&kept_count, 1, __ATOMIC_RELAXED);
			__atomic_store_n(&k->state, KEPT_FREE, __ATOMIC_RELEASE);
		} else {
			__atomic_store_n(&k->state, KEPT_FULL, __ATOMIC_RELEASE);
		}
	}
	struct fc_hit hit;
	if (fc_lookup(shim_tiers, shim_ntiers, name, len, O_CLOEXEC, 1, &hit) != 0) {
		if (fc_lookup(shim_tiers, shim_ntiers, name, len, O_CLOEXEC, 0, &hit) == 0) {
			*unchecked = 1;
			CALL_NEXT(close, hit.fd);
		}
		return -1;
	}
	void *map = MAP_FAILED;
	struct fc_version ver;
	if (hit.size == copy_len && copy_len > 0 && fc_copy_version(&hit, &ver) == 0 &&
	    same_source(&ver, src))
		map = mmap(NULL, (size_t)copy_len, PROT_READ, MAP_SHARED, hit.fd, 0);
	CALL_NEXT(close, hit.fd);
	if (map == MAP_FAILED)
		return -1;
	put(c, (const uint8_t *)map + at, (size_t)n);
	served[hit.tier] += n;
	// Kept in the place of whatever held it; dropped if another thread uses the place.
	expect = __atomic_load_n(&k->state, __ATOMIC_RELAXED);
	if (expect != KEPT_BUSY &&
	    __atomic_compare_exchange_n(&k->state, &expect, KEPT_BUSY, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
		if (expect == KEPT_FULL)
			munmap((void *)k->map, k->len);
		else
			__atomic_fetch_add(&kept_count, 1, __ATOMIC_RELAXED);
		k->key = key;
		k->check = check;
		k->ino = hit.ino;
		k->tier = hit.tier;
		k->ver = ver;
		k->intact_ns = 0;
		k->map = map;
		k->len = (size_t)copy_len;
		__atomic_store_n(&k->state, KEPT_FULL, __ATOMIC_RELEASE);
	} else {
		munmap(map, (size_t)copy_len);
	}
	return n;
}

// --- Asking the server for blocks -----------------------------------------------------------

// The heat of blocks (capi/fcheat.h) is shared by the processes of the user that read through
// the shim, so that a block read a little by each of many processes (DataLoader workers, new
// ones each epoch; a program run again) is asked for as one reader's would be: the table lives
// in a file of the user's private runtime directory (FITCACHE_PRELOAD_HEAT, made by the first
// process that needs it), or, without one, in memory shared with the processes forked after
// the first large open.
static struct fc_heat *heat_table;              // see heats (atomic)
static struct fc_heat heat_here[FC_HEAT_PLACES]; // when no shared mapping could be made
static struct fc_heat *heat_of_file;            // heat_table when it maps the heat file (atomic)
static uint64_t heat_file_ino;                  // that file's inode number (set before heat_of_file)

// heat_file maps the heat file at heat_path, creating it if it is not there; NULL when there
// is none, or it is not a regular file of this user of the table's size (or empty: made so).
static struct fc_heat *heat_file(void) {
	if (!heat_path[0])
		return NULL;
	int fd = (int)syscall(SYS_openat, AT_FDCWD, heat_path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0)
		return NULL;
	struct stat st;
	void *map = MAP_FAILED;
	// Its pages allocated (fallocate), also those of a file made by another process: a write
	// to a page that cannot be allocated (a full file system, a quota) would kill the program
	// with SIGBUS.
	if (fc_sys_fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && st.st_nlink == 1 &&
	    (st.st_size == (off_t)FC_HEAT_BYTES || st.st_size == 0) && fallocate(fd, 0, 0, (off_t)FC_HEAT_BYTES) == 0)
		map = mmap(NULL, FC_HEAT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CALL_NEXT(close, fd);
	if (map == MAP_FAILED)
		return NULL;
	__atomic_store_n(&heat_file_ino, (uint64_t)st.st_ino, __ATOMIC_RELAXED);
	return map;
}

// heats returns the heat table, mapped on first use.
static struct fc_heat *heats(void) {
	struct fc_heat *h = __atomic_load_n(&heat_table, __ATOMIC_ACQUIRE);
	if (h)
		return h;
	int saved = errno, from_file = 1;
	if (!(h = heat_file())) {
		from_file = 0;
		h = mmap(NULL, FC_HEAT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
		if (h == MAP_FAILED)
			h = heat_here;
	}
	struct fc_heat *was = NULL;
	if (!__atomic_compare_exchange_n(&heat_table, &was, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		if (h != heat_here)
			munmap(h, FC_HEAT_BYTES); // another thread mapped it first
		h = was;
	} else if (from_file) {
		__atomic_store_n(&heat_of_file, h, __ATOMIC_RELEASE);
	}
	errno = saved;
	return h;
}

// heats_to_touch returns the heat table for a read or write of it. The heat file is the
// user's: another of their processes can truncate it, and touching a page of the mapping
// past the new end would kill the program with SIGBUS (a signal code inside other programs
// cannot catch). So a table mapped from the file is used only after one stat finds the file
// still under its name and whole; one found truncated or replaced is let go for good (kept
// mapped, never touched again), and the heat is shared in memory from then on, with the
// processes forked after. A truncation between the check and the touch (a few hundred
// nanoseconds) still kills the program.
static struct fc_heat *heats_to_touch(void) {
	struct fc_heat *h = heats();
	if (h != __atomic_load_n(&heat_of_file, __ATOMIC_ACQUIRE))
		return h;
	int saved = errno;
	struct stat st; // a system call: the shim's own stat wrappers are not for it
	if (syscall(SYS_newfstatat, AT_FDCWD, heat_path, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
	    (uint64_t)st.st_ino == __atomic_load_n(&heat_file_ino, __ATOMIC_RELAXED) && st.st_size >= (off_t)FC_HEAT_BYTES) {
		errno = saved;
		return h;
	}
	struct fc_heat *mem = mmap(NULL, FC_HEAT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED)
		mem = heat_here;
	struct fc_heat *was = h;
	if (__atomic_compare_exchange_n(&heat_table, &was, mem, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		__atomic_store_n(&heat_of_file, NULL, __ATOMIC_RELEASE);
		was = mem;
	} else if (mem != heat_here) {
		munmap(mem, FC_HEAT_BYTES); // another thread let go of the file first
	}
	errno = saved;
	return was;
}

// When this process last had the server check a block the tiers list but have not checked in
// its session, by place: again only after FC_HEAT_ASK_AGAIN_NS (a check that did not make the
// block servable, the server refusing it, say). Per process, unlike the heat: a new run
// has a session of its own, whose blocks all need a check however recently another had one.
static int64_t checked_ns[FC_HEAT_PLACES];

// check_turn reports whether this thread is to have the server check the block named name
// (len bytes) now, and stamps it if so.
static int check_turn(const char *name, size_t len) {
	uint64_t key, check;
	fc_hashes(name, len, &key, &check);
	int64_t *stamp = &checked_ns[(key * 0x9E3779B97F4A7C15ULL) >> 52], now = fc_monotonic_ns();
	int64_t was = __atomic_load_n(stamp, __ATOMIC_RELAXED);
	if (was != 0 && now - was < FC_HEAT_ASK_AGAIN_NS)
		return 0;
	return __atomic_compare_exchange_n(stamp, &was, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

// check_block has the server check the block named name (len bytes) of the file in m, which
// the tiers list unchecked, and waits for its answer: 0 when the server has the block now.
// The server compares it with its source (one look at the file checks all its blocks).
static int check_block(const struct marked *m, const char *name, size_t len) {
	// The probe time, not the read timeout: a check is a look at the file, and a server that
	// takes longer (it found the file changed and fills the block anew, or it is stuck) is
	// left to it while the program reads the source, and skipped a while if it timed out.
	int sock = shim_node_request(FC_NODE_OP_FETCH_BLOCK, m->root, name, len, fc_node_probe_ms(shim_node_timeout_ms()));
	if (sock < 0)
		return -1;
	uint8_t reply[12];
	int got = fc_recv_all(sock, reply, sizeof reply);
	if (got != 0)
		shim_node_timed_out();
	int ok = got == 0 && memcmp(reply, FC_NODE_MAGIC, 4) == 0 && fc_get32(reply + 4) == 0;
	CALL_NEXT(close, sock);
	return ok ? 0 : -1;
}

// ask_block asks the server to cache the block named name (len bytes) of the file in m, and
// waits for nothing: the server caches it in the background (FC_NODE_OP_CACHE_BLOCK). A
// reader waiting for acknowledgements of its asks while the server filled blocks ran a pass
// of random 64 KiB ranges at 0.04-0.07x plain reads (bench/bench_large.py).
static void ask_block(const struct marked *m, const char *name, size_t len) {
	shim_node_tell(FC_NODE_OP_CACHE_BLOCK, m->root, name, len);
}

// --- Reads ----------------------------------------------------------------------------------

// from_source reads n bytes at offset at of the program's descriptor of the source to the
// cursor, and moves the cursor on by what it read: the bytes read (fewer at the end of the
// file), or -1 with errno set.
static ssize_t from_source(int fd, struct cursor *c, int64_t n, int64_t at) {
	struct iovec piece[MAX_PIECES];
	int k = pieces(c, (size_t)n, piece);
	ssize_t got = k == 1 ? CALL_NEXT(pread64, fd, piece[0].iov_base, piece[0].iov_len, at)
	                     : CALL_NEXT(preadv64, fd, piece, k, at);
	if (got > 0)
		skip(c, (size_t)got);
	return got;
}

// ranged_read serves a read of cnt pieces at iov on the marked descriptor fd, at offset off
// (positioned), or at and moving the descriptor's offset: the bytes read, -1 with errno set,
// or NOT_RANGED to leave the call to libc (fd is not marked or no longer names its file, or
// the read is one the kernel answers as well: nothing to read, a bad offset).
static ssize_t ranged_read(int fd, const struct iovec *iov, int cnt, off_t off, int positioned) {
	struct marked m;
	struct stat st;
	if (cnt < 1 || cnt > MAX_PIECES || marked_file(fd, &m) != 0)
		return NOT_RANGED;
	int saved = errno;
	size_t total = 0;
	for (int i = 0; i < cnt; i++) {
		if (iov[i].iov_len > (size_t)SSIZE_MAX - total)
			return NOT_RANGED;
		total += iov[i].iov_len;
	}
	if (total == 0 || fc_sys_fstat(fd, &st) != 0) {
		errno = saved;
		return NOT_RANGED;
	}
	if (st.st_dev != m.dev || st.st_ino != m.ino) { // the number names another file now
		ranged_forget(fd);
		return NOT_RANGED;
	}
	if (positioned && (off < 0 || off >= st.st_size)) {
		errno = saved;
		return NOT_RANGED;
	}
	if (!positioned) {
		// The range is claimed at once, moving the offset past it, as the kernel's read
		// does: a thread or process sharing the open file reads after it, not the same
		// bytes. A short read gives back what it did not read (below).
		off_t end = lseek(fd, (off_t)total, SEEK_CUR);
		if (end < 0) {
			errno = saved;
			return NOT_RANGED; // past the largest offset: the kernel says so
		}
		off = end - (off_t)total;
		if (off >= st.st_size) {
			lseek(fd, off, SEEK_SET);
			errno = saved;
			return 0;
		}
	}
	sweep_kept();
	int64_t size = st.st_size;
	struct fc_version src = {.mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec,
	                         .ctime_ns = (int64_t)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec,
	                         .ino = (uint64_t)st.st_ino};
	int copied = 0, read_source = 0; // pieces of the read served from copies, read from the source
	int64_t end = (int64_t)total < size - off ? off + (int64_t)total : size, at = off;
	int sequential = off > 0 && off == __atomic_load_n(&m.f->next, __ATOMIC_RELAXED);
	int64_t served[FC_MAX_TIERS] = {0};
	struct cursor c = {.iov = iov, .n = cnt};
	ssize_t k = 0;
	while (at < end) {
		int64_t block = at / block_bytes, within = at % block_bytes;
		int64_t n = block_bytes - within < end - at ? block_bytes - within : end - at;
		int64_t block_len = size - block * block_bytes < block_bytes ? size - block * block_bytes : block_bytes;
		size_t namelen = fc_block_name(m.name, m.keylen, block_bytes, block);
		int unchecked = 0;
		k = from_copy(m.name, namelen, block_len, &src, within, &c, n, served, &unchecked);
		if (k < 0 && !m.ask) // a file being cached whole: its copy, once made
			k = from_copy(m.name, m.keylen, size, &src, at, &c, n, served, &unchecked);
		if (k < 0 && unchecked && check_turn(m.name, namelen) && check_block(&m, m.name, namelen) == 0)
			k = from_copy(m.name, namelen, block_len, &src, within, &c, n, served, &unchecked);
		copied |= k >= 0;
		if (k < 0) {
			read_source = 1;
			k = from_source(fd, &c, n, at);
			if (k > 0 && shim_ntiers > 0)
				fc_count_source(&shim_tiers[0], k);
			if (k > 0 && m.ask &&
			    fc_heat_read(fc_heat_of(heats_to_touch(), m.name, namelen), k, block_bytes, sequential))
				ask_block(&m, m.name, namelen);
		}
		if (k <= 0)
			break;
		at += k;
		if (k < n)
			break; // the end of the file, which moved
	}
	// Copies were checked against the source's version as fstat gave it when the read
	// began; a read that also read the source is checked again: a source rewritten in
	// place meanwhile would have given it pieces of two versions, so it is read again from
	// the source alone, as the kernel would have read it.
	struct stat now;
	if (copied && read_source && at > off &&
	    (fc_sys_fstat(fd, &now) != 0 || now.st_mtim.tv_sec != st.st_mtim.tv_sec || now.st_mtim.tv_nsec != st.st_mtim.tv_nsec ||
	     now.st_ctim.tv_sec != st.st_ctim.tv_sec || now.st_ctim.tv_nsec != st.st_ctim.tv_nsec)) {
		struct cursor again = {.iov = iov, .n = cnt};
		k = from_source(fd, &again, at - off, off);
		at = k < 0 ? off : off + k;
		memset(served, 0, sizeof served);
	}
	for (int i = 0; i < shim_ntiers; i++)
		if (served[i] > 0)
			fc_count_hit(&shim_tiers[i], served[i]);
	if (!positioned && at - off < (int64_t)total) {
		int err = errno;
		lseek(fd, at, SEEK_SET);
		errno = err;
	}
	if (at == off && k < 0)
		return -1; // the source's error, errno set
	__atomic_store_n(&m.f->next, at, __ATOMIC_RELAXED);
	errno = saved;
	return at - off;
}

// marked reports whether fd may read through blocks: a byte test, the whole cost of the
// wrappers below for every other descriptor.
static inline int marked(int fd) {
	return (unsigned)fd < RANGED_FDS && __atomic_load_n(&file_of[fd], __ATOMIC_RELAXED) != 0;
}

EXPORT ssize_t read(int fd, void *buf, size_t n) {
	if (marked(fd)) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, 0, 0);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(read, fd, buf, n);
}

EXPORT ssize_t pread(int fd, void *buf, size_t n, off_t off) {
	if (marked(fd)) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(pread, fd, buf, n, off);
}

EXPORT ssize_t pread64(int fd, void *buf, size_t n, off64_t off) {
	if (marked(fd)) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(pread64, fd, buf, n, off);
}

EXPORT ssize_t readv(int fd, const struct iovec *iov, int cnt) {
	if (marked(fd)) {
		ssize_t r = ranged_read(fd, iov, cnt, 0, 0);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(readv, fd, iov, cnt);
}

EXPORT ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off) {
	if (marked(fd)) {
		ssize_t r = ranged_read(fd, iov, cnt, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(preadv, fd, iov, cnt, off);
}

EXPORT ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off64_t off) {
	if (marked(fd)) {
		ssize_t r = ranged_read(fd, iov, cnt, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(preadv64, fd, iov, cnt, off);
}

// preadv2 with flags (RWF_NOWAIT, RWF_HIPRI...) is the kernel's; an offset of -1 reads at
// the file offset, as readv.
EXPORT ssize_t preadv2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
	if (marked(fd) && flags == 0 && off >= -1) {
		ssize_t r = ranged_read(fd, iov, cnt, off, off != -1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(preadv2, fd, iov, cnt, off, flags);
}

EXPORT ssize_t preadv64v2(int fd, const struct iovec *iov, int cnt, off64_t off, int flags) {
	if (marked(fd) && flags == 0 && off >= -1) {
		ssize_t r = ranged_read(fd, iov, cnt, off, off != -1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(preadv64v2, fd, iov, cnt, off, flags);
}

// The fortified forms (-D_FORTIFY_SOURCE): a read larger than the buffer is libc's to stop.
EXPORT ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen) {
	if (marked(fd) && n <= buflen) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, 0, 0);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(__read_chk, fd, buf, n, buflen);
}

EXPORT ssize_t __pread_chk(int fd, void *buf, size_t n, off_t off, size_t buflen) {
	if (marked(fd) && n <= buflen) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(__pread_chk, fd, buf, n, off, buflen);
}

EXPORT ssize_t __pread64_chk(int fd, void *buf, size_t n, off64_t off, size_t buflen) {
	if (marked(fd) && n <= buflen) {
		struct iovec v = {buf, n};
		ssize_t r = ranged_read(fd, &v, 1, off, 1);
		if (r != NOT_RANGED)
			return r;
	}
	return CALL_NEXT(__pread64_chk, fd, buf, n, off, buflen);
}
