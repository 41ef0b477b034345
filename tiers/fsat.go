package tiers

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Everything a tier does below its directory goes through a descriptor of that directory
// and follows no symbolic link at any level, so a link planted as a bin or an entry can
// neither redirect a write nor serve another file's bytes.

const (
	dirFlags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	// entryMode is the mode of cached files and bins: this user only.
	entryMode = 0o600
	binMode   = 0o700
)

// openBin opens the bin directory of rel ("ab/cd/name") below dirfd, following no link,
// and returns its descriptor and the entry's name in it. With create, missing bins are made.
func openBin(dirfd int, rel string, create bool) (binfd int, name string, err error) {
	missing := false // the kernel said that a bin is missing
	if i := strings.LastIndexByte(rel, '/'); i > 0 {
		// Bins exist nearly always: one openat2 then, instead of a mkdirat and an openat per level.
		fd, err := openat2(dirfd, rel[:i], &unix.OpenHow{Flags: dirFlags,
			Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH})
		if err == nil {
			return fd, rel[i+1:], nil
		}
		missing = errors.Is(err, unix.ENOENT)
	}
	parts := strings.Split(rel, "/")
	fd := dirfd
	bins := parts[:len(parts)-1]
	for i, p := range bins {
		// A bin is opened, and made where missing. When one is missing it is nearly always
		// the innermost (65,536 of them, few made yet in a first epoch; 256 outer ones), so
		// that one is then made before it is opened: a system call fewer per new bin.
		makeFirst := create && missing && i == len(bins)-1
		var next int
		var err error
		if !makeFirst {
			next, err = unix.Openat(fd, p, dirFlags, 0)
		}
		if makeFirst || create && errors.Is(err, unix.ENOENT) {
			if err = unix.Mkdirat(fd, p, binMode); err == nil || errors.Is(err, unix.EEXIST) {
				next, err = unix.Openat(fd, p, dirFlags, 0)
			}
		}
		closeUnless(fd, dirfd)
		if err != nil {
			return -1, "", err
		}
		fd = next
	}
	if fd == dirfd { // rel has no bin: hand out a descriptor of our own
		if fd, err = unix.Dup(dirfd); err != nil {
			return -1, "", err
		}
	}
	return fd, parts[len(parts)-1], nil
}

func closeUnless(fd, keep int) {
	if fd != keep {
		unix.Close(fd)
	}
}

// openat2 is unix.Openat2; tests replace it to exercise the fallback for older kernels.
var openat2 = unix.Openat2

// openEntry opens rel below dirfd read-only, following no link at any level: with one
// openat2 (RESOLVE_NO_SYMLINKS) where the kernel has it, else one openat per level.
func openEntry(dirfd int, rel string) (*os.File, error) {
	fd, err := openat2(dirfd, rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH,
	})
	if err == nil {
		return os.NewFile(uintptr(fd), rel), nil
	}
	if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EPERM) { // EPERM: a seccomp filter
		return nil, err
	}
	binfd, name, err := openBin(dirfd, rel, false)
	if err != nil {
		return nil, err
	}
	defer unix.Close(binfd)
	fd, err = unix.Openat(binfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), rel), nil
}

// createTemp creates a new temporary file (0600, O_EXCL, not through a link) in the
// directory binfd and returns it and its name there.
func createTemp(binfd int, prefix string) (*os.File, string, error) {
	for range 10 {
		name := fmt.Sprintf("%s%016x", prefix, rand.Uint64())
		fd, err := unix.Openat(binfd, name,
			unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, entryMode)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return nil, "", err
		}
		return os.NewFile(uintptr(fd), name), name, nil
	}
	return nil, "", fmt.Errorf("create temporary file: %w", unix.EEXIST)
}

// withFd runs fn with the descriptor of f, which cannot be closed (and its number reused)
// while fn runs. It fails with os.ErrClosed once f is closed.
func withFd(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return fmt.Errorf("%s: %w", f.Name(), os.ErrClosed)
	}
	return ferr
}
