package tiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrLocked reports a tier directory that another server holds (see Tier).
var ErrLocked = errors.New("tier directory in use by another fitcache server")

// lockWait is how long a server waits for the lock of a tier directory held by someone else.
const lockWait = 2 * time.Second

// lockName is the lock file in a tier directory: a server holds an exclusive flock on it for
// the Tier's life, and writes its pid and Config.Holder in it for others to name.
const lockName = "fitcache.lock"

// lockDir takes the lock of the tier directory open at dirfd, or fails with an error wrapping
// ErrLocked that names the holder.
func lockDir(dirfd int, dir, holder string) (*os.File, error) {
	fd, err := unix.Openat(dirfd, lockName, unix.O_RDWR|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_CLOEXEC, entryMode)
	if err != nil {
		return nil, fmt.Errorf("lock file: %w", err)
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, lockName))
	// Others hold the lock briefly (fitcache info reading the holder, a server exiting):
	// wait a little before deciding that another server owns the directory.
	deadline := time.Now().Add(lockWait)
	for {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
		}
		if time.Now().After(deadline) {
			defer f.Close()
			return nil, fmt.Errorf("%w: held by %s", ErrLocked, readHolder(f))
		}
		time.Sleep(20 * time.Millisecond)
	}
	text := fmt.Sprintf("pid %d", os.Getpid())
	if holder != "" {
		text += ", " + holder
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(text+"\n"), 0)
	}
	return f, nil
}

func readHolder(f *os.File) string {
	b := make([]byte, 1024)
	n, _ := f.ReadAt(b, 0)
	if s := strings.TrimSpace(string(b[:n])); s != "" {
		return "the fitcache server " + s
	}
	return "another fitcache server"
}

// Holder returns who holds the tier directory dir ("the fitcache server pid 42, ..."), or ""
// when no server holds it (or it cannot be told).
func Holder(dir string) string {
	fd, err := unix.Open(filepath.Join(dir, lockName), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return ""
	}
	f := os.NewFile(uintptr(fd), lockName)
	defer f.Close()
	if unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB) == nil {
		return ""
	}
	return readHolder(f)
}
