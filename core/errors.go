package core

import (
	"errors"
	"fmt"
	"io/fs"
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
	// ErrNoTier reports an engine that had to open a tier (EngineConfig.RequireTier) and
	// could open none.
	ErrNoTier = errors.New("no usable tier")
	// ErrClosed reports use of a closed engine or client.
	ErrClosed = errors.New("closed")
	// ErrBadCopy reports bytes sent for a replica copy (Engine.Store) that do not match what
	// their owner vouched for: their checksum, the owner's stamp, or their size.
	ErrBadCopy = errors.New("replica copy does not match its owner's stamp")
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
	case errors.Is(err, ErrBadCopy):
		return syscall.EBADMSG
	case errors.Is(err, fs.ErrNotExist):
		return syscall.ENOENT
	case errors.Is(err, fs.ErrPermission):
		return syscall.EACCES
	}
	return syscall.EIO
}

// Reason names the cause of an error when its errno alone does not say it (EACCES is a path
// outside the roots or a file's own permissions, say); it travels on the wire beside the
// errno (Reason in rpc/fitcache.thrift, same values, as rpc's TestReasonsMatchTheIDL checks),
// so that errors.Is works on the client as on the server without reading the message.
type Reason int32

const (
	ReasonUnspecified Reason = iota
	ReasonOutsideRoot
	ReasonBadPath
	ReasonTooLarge
	ReasonCacheFull
	ReasonChanged
	ReasonClosed
	ReasonBadCopy
)

// reasons pairs each Reason with its sentinel, most specific first (ErrCacheFull wraps
// ErrTooLarge).
var reasons = []struct {
	reason Reason
	err    error
}{
	{ReasonOutsideRoot, ErrOutsideRoot},
	{ReasonBadPath, ErrBadPath},
	{ReasonCacheFull, ErrCacheFull},
	{ReasonTooLarge, ErrTooLarge},
	{ReasonChanged, ErrChanged},
	{ReasonClosed, ErrClosed},
	{ReasonBadCopy, ErrBadCopy},
}

// ReasonOf returns the Reason of err: the sentinel it wraps, or ReasonUnspecified.
func ReasonOf(err error) Reason {
	var e *ErrnoError
	if errors.As(err, &e) && e.Reason != ReasonUnspecified {
		return e.Reason
	}
	for _, r := range reasons {
		if errors.Is(err, r.err) {
			return r.reason
		}
	}
	return ReasonUnspecified
}

// ErrnoError rebuilds an error received as an errno value, a Reason and a message (from the
// wire or the C ABI), so that errors.Is works on it like on the original:
// errors.Is(err, fs.ErrNotExist) for ENOENT, errors.Is(err, ErrOutsideRoot) for the reason
// OUTSIDE_ROOT.
type ErrnoError struct {
	Errno   syscall.Errno
	Reason  Reason
	Message string
}

func (e *ErrnoError) Error() string { return e.Message }

// Is matches the sentinel of the error's Reason (and ErrTooLarge for ReasonCacheFull, which
// it wraps), or else the errno. Without a reason (a server of an earlier version, which the
// embedded server of a user may still be after an upgrade), the errnos that only those causes
// give stand for them, so that a file too large to send is still read from the source.
func (e *ErrnoError) Is(target error) bool {
	for _, r := range reasons {
		if target != r.err {
			continue
		}
		if e.Reason == ReasonUnspecified {
			switch target {
			case ErrTooLarge:
				return e.Errno == syscall.EFBIG || e.Errno == syscall.ENOSPC
			case ErrCacheFull:
				return e.Errno == syscall.ENOSPC
			case ErrChanged:
				return e.Errno == syscall.EAGAIN
			}
		}
		return e.Reason == r.reason || (target == ErrTooLarge && e.Reason == ReasonCacheFull)
	}
	return e.Errno.Is(target)
}

// Unwrap exposes the errno, so errors.As(err, &syscall.Errno) works.
func (e *ErrnoError) Unwrap() error { return e.Errno }

// NewErrnoError returns an error received as errno, reason and message as an ErrnoError (nil
// for errno 0).
func NewErrnoError(errno int32, reason Reason, message string) error {
	if errno == 0 {
		return nil
	}
	if message == "" {
		message = syscall.Errno(errno).Error()
	}
	return &ErrnoError{Errno: syscall.Errno(errno), Reason: reason, Message: message}
}

func pathError(op, path string, err error) error { return &fs.PathError{Op: op, Path: path, Err: err} }
