package core

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"syscall"
)

// Errors callers branch on. Errors of the source file system pass through as the *fs.PathError
// the operating system gave, so errors.Is(err, fs.ErrNotExist) works.
var (
	// ErrOutsideRoot reports a path that is not inside the dataset root (after cleaning and
	// after following symbolic links), or a root outside the server's dataset roots.
	ErrOutsideRoot = errors.New("path outside the dataset root")
	// ErrBadPath reports a path that is not absolute or not clean.
	ErrBadPath = errors.New("bad path")
	// ErrChanged reports a source file that changed (size, times or identity) while it was
	// read: the bytes may mix two versions, so they are neither served nor cached.
	ErrChanged = errors.New("source file changed while being read")
	// ErrTooLarge reports a file that is not cached and too large to hold in memory or to
	// send in one reply: the caller reads it from the source itself (a client maps it).
	ErrTooLarge = errors.New("file not cached and too large to send")
	// ErrCacheFull reports a file that could be cached but finds no room: the tiers are full
	// of the dataset being read, whose files are never evicted for one another (see
	// tiers.Tier.MakeRoom). The caller reads it from the source itself. It wraps ErrTooLarge.
	ErrCacheFull = fmt.Errorf("%w: no room left in the cache for this dataset", ErrTooLarge)
	// ErrClosed reports use of a closed engine or client.
	ErrClosed = errors.New("closed")
)

// Errno maps an error to the Linux errno value that describes it best, for the C ABI and the
// wire protocol. nil maps to 0; errors without a better match map to EIO.
func Errno(err error) syscall.Errno {
	var errno syscall.Errno
	switch {
	case err == nil:
		return 0
	case errors.As(err, &errno):
		return errno
	case errors.Is(err, ErrOutsideRoot):
		return syscall.EACCES
	case errors.Is(err, ErrBadPath):
		return syscall.EINVAL
	case errors.Is(err, ErrClosed):
		return syscall.EBADF
	case errors.Is(err, ErrCacheFull):
		return syscall.ENOSPC
	case errors.Is(err, ErrTooLarge):
		return syscall.EFBIG
	case errors.Is(err, ErrChanged):
		return syscall.EAGAIN
	case errors.Is(err, fs.ErrNotExist):
		return syscall.ENOENT
	case errors.Is(err, fs.ErrPermission):
		return syscall.EACCES
	}
	return syscall.EIO
}

// ErrnoError rebuilds an error received as an errno value and a message (from the wire or the
// C ABI), so that errors.Is works on it like on the original: errors.Is(err, fs.ErrNotExist)
// for ENOENT, errors.Is(err, ErrOutsideRoot) for EACCES with that cause.
type ErrnoError struct {
	Errno   syscall.Errno
	Message string
}

func (e *ErrnoError) Error() string { return e.Message }

// Is matches the errno and, for the sentinels that travel as EACCES/EINVAL, the sentinel.
func (e *ErrnoError) Is(target error) bool {
	switch target {
	case ErrOutsideRoot:
		return e.Errno == syscall.EACCES && strings.Contains(e.Message, ErrOutsideRoot.Error())
	case ErrBadPath:
		return e.Errno == syscall.EINVAL && strings.Contains(e.Message, ErrBadPath.Error())
	case ErrTooLarge:
		return e.Errno == syscall.EFBIG || e.Errno == syscall.ENOSPC
	case ErrCacheFull:
		return e.Errno == syscall.ENOSPC
	case ErrChanged:
		return e.Errno == syscall.EAGAIN
	}
	return e.Errno.Is(target)
}

// Unwrap exposes the errno, so errors.As(err, &syscall.Errno) works.
func (e *ErrnoError) Unwrap() error { return e.Errno }

// NewErrnoError returns err as an ErrnoError (nil for 0).
func NewErrnoError(errno int32, message string) error {
	if errno == 0 {
		return nil
	}
	if message == "" {
		message = syscall.Errno(errno).Error()
	}
	return &ErrnoError{Errno: syscall.Errno(errno), Message: message}
}

func pathError(op, path string, err error) error { return &fs.PathError{Op: op, Path: path, Err: err} }
