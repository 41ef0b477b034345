/*
 * fill.c -- the claim and the copy of a reader's fill (see fill.h and tiers/fill.go, whose
 * names these must match: tiers.FillName).
 */
#define _GNU_SOURCE
#include "fill.h"

#include "crc32c.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

// The tiers' modes (tiers/fsat.go entryMode, binMode).
#define ENTRY_MODE 0600
#define BIN_MODE 0700

// Calls go to the kernel, not through libc: the preload shim interposes libc's file calls in
// programs that may load this library too.
static int sys_openat(int dirfd, const char *path, int flags, mode_t mode) {
	return (int)syscall(SYS_openat, dirfd, path, flags, mode);
}

// open_bin opens (making it where missing) the bin "ab/cd" of key below the tier directory
// dirfd, following no link: a descriptor, or -1 with errno set. As tiers' openBin: a bin that
// exists is opened with one openat2, else one level at a time; when the kernel said that one is
// missing, it is nearly always the inner one (65,536 of them, 256 outer ones), which is then
// made before it is opened.
static int open_bin(int dirfd, uint64_t key) {
	static const char hex[] = "0123456789abcdef";
	char outer[3] = {hex[(key >> 4) & 15], hex[key & 15], 0};
	char inner[3] = {hex[(key >> 12) & 15], hex[(key >> 8) & 15], 0};
	const char both[6] = {outer[0], outer[1], '/', inner[0], inner[1], 0};
	const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
	int fd = fc_openat2_beneath(dirfd, both, O_DIRECTORY | O_CLOEXEC);
	if (fd >= 0)
		return fd;
	int missing = errno == ENOENT;
	if (!missing && errno != ENOSYS)
		return -1;
	fd = sys_openat(dirfd, outer, flags, 0);
	if (fd < 0 && errno == ENOENT && (syscall(SYS_mkdirat, dirfd, outer, BIN_MODE) == 0 || errno == EEXIST))
		fd = sys_openat(dirfd, outer, flags, 0);
	if (fd < 0)
		return -1;
	int bin = -1;
	errno = ENOENT;
	if (!missing)
		bin = sys_openat(fd, inner, flags, 0);
	if (bin < 0 && errno == ENOENT && (syscall(SYS_mkdirat, fd, inner, BIN_MODE) == 0 || errno == EEXIST))
		bin = sys_openat(fd, inner, flags, 0);
	int saved = errno;
	close(fd);
	errno = saved;
	return bin;
}

// data_perm returns the permission bits of the copy of a source of mode mode (tiers/tier.go
// dataPerm of the report's mode's permission bits): the source's, with read permission for
// its owner added; ENTRY_MODE for none.
static mode_t data_perm(uint32_t mode) { return (mode & 0777) == 0 ? ENTRY_MODE : (mode & 0777) | 0400; }

int fc_fill_claim(const struct fc_tier *t, const char *path, size_t len, uint32_t mode, struct fc_fill *f) {
	static const char hex[] = "0123456789abcdef";
	uint64_t key, check;
	fc_hashes(path, len, &key, &check);
	f->bin = f->fd = -1;
	f->crc = 0;
	memcpy(f->name, ".tmp-fill-", 10);
	for (int i = 0; i < 16; i++)
		f->name[10 + i] = hex[(key >> (60 - 4 * i)) & 15];
	f->name[26] = 0;
	if (t->dirfd < 0)
		return -EBADF;
	int bin = open_bin(t->dirfd, key);
	if (bin < 0)
		return -errno;
	// Made with O_EXCL: written here whatever its mode (the owner can read it: the server's
	// lock probe, tiers' locked, opens it for reading).
	int fd = sys_openat(bin, f->name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, data_perm(mode));
	struct stat st;
	// The lock says the claim's holder lives (tiers.Tier.ClaimState): the kernel drops it when
	// this descriptor is closed (after the report) or the process dies.
	struct flock lk = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
	if (fd < 0 || fc_sys_fstat(fd, &st) != 0 || syscall(SYS_fcntl, fd, F_OFD_SETLK, &lk) != 0) {
		int err = errno;
		if (fd >= 0) {
			syscall(SYS_unlinkat, bin, f->name, 0);
			close(fd);
		}
		close(bin);
		return -err;
	}
	f->bin = bin;
	f->fd = fd;
	f->ino = (uint64_t)st.st_ino;
	return 0;
}

int fc_fill_write(struct fc_fill *f, const void *p, size_t n) {
	const char *b = p;
	while (n > 0) {
		ssize_t k = write(f->fd, b, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return k < 0 ? -errno : -EIO;
		f->crc = fc_crc32c(f->crc, b, (size_t)k);
		b += k;
		n -= (size_t)k;
	}
	return 0;
}

void fc_fill_finish(struct fc_fill *f, struct timespec mtime) {
	struct timespec ts[2] = {mtime, mtime};
	syscall(SYS_utimensat, f->fd, NULL, ts, 0);
}

void fc_fill_keep(struct fc_fill *f) {
	close(f->fd);
	close(f->bin);
	f->fd = f->bin = -1;
}

void fc_fill_drop(struct fc_fill *f) {
	struct stat st;
	if (syscall(SYS_newfstatat, f->bin, f->name, &st, AT_SYMLINK_NOFOLLOW) == 0 && (uint64_t)st.st_ino == f->ino)
		syscall(SYS_unlinkat, f->bin, f->name, 0);
	fc_fill_keep(f);
}
