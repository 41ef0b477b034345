package core

import (
	"context"
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// OpenForReader returns a read-only descriptor that a reader on this node reads in place of
// the source file at path (inside root): the preload shim's answer to an open it could not
// serve from the tiers itself (see package nodesock). That is the cached copy, brought into
// a tier first on a miss (the source is read once, as by Fetch); or the source itself,
// opened beneath the resolved root as every source read is, when no tier takes the file (too
// large, or no room left for its dataset) and when the file is large (ReadNowBytes): then
// the reader does not wait for the copy, which is made meanwhile from the same open of the
// source. The caller closes the file.
func (e *Engine) OpenForReader(ctx context.Context, root, path string) (*os.File, Origin, error) {
	// The copy may be evicted between its publication and the open here (a burst of other
	// misses): fetch once more, then read the source.
	for attempt := 0; attempt < 2; attempt++ {
		now, err := e.countedFetch(ctx, root, path, true)
		if now != nil && now.file != nil { // a large file, or one no tier takes: its source
			return now.file, now.origin, nil
		}
		if now != nil { // another reader's flight has it: the source, opened here
			f, _, err := e.openSourceForReader(root, path)
			return f, now.origin, err
		}
		if errors.Is(err, ErrTooLarge) || errors.Is(err, ErrCacheFull) {
			break
		}
		if err != nil {
			return nil, 0, err
		}
		for _, t := range e.tiers {
			if f, err := t.OpenFile(path); err == nil {
				return f, TierOrigin(t.Kind), nil
			}
		}
	}
	f, origin, err := e.openSourceForReader(root, path)
	if err == nil {
		e.stats.uncached.Add(1)
	}
	return f, origin, err
}

// openSourceForReader opens the source at path beneath its resolved root for a reader.
func (e *Engine) openSourceForReader(root, path string) (*os.File, Origin, error) {
	src, err := e.openSource(root, path)
	if err != nil {
		return nil, 0, err
	}
	f, err := src.ReaderFile()
	if err != nil {
		return nil, 0, err
	}
	return f, OriginSource, nil
}

// ReaderDup returns a second descriptor of the open source for a reader on this node, with
// the flags of a plain read-only open (see ReaderFile); the Source stays usable. Both share
// one open file, so the Source must be read at explicit offsets only, as it is.
func (s *Source) ReaderDup() (*os.File, error) {
	fd, err := unix.FcntlInt(s.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, pathError("dup", s.path, err)
	}
	if err := unix.SetNonblock(fd, false); err != nil { // the open file's flag: regular files ignore it
		unix.Close(fd)
		return nil, pathError("fcntl", s.path, err)
	}
	return os.NewFile(uintptr(fd), s.path), nil
}

// OpenCached opens the copy of the file at path (inside root) that a tier holds, checked
// against its source in the current session first (see validate), for a reader on this node;
// origin says which tier. False when no tier holds one (nothing is read from the source). The
// caller closes the file.
func (e *Engine) OpenCached(root, path string) (f *os.File, origin Origin, ok bool) {
	if e.closed.Load() || e.checkRoot(root, path) != nil || e.validate(root, path) != nil {
		return nil, OriginNone, false
	}
	for _, t := range e.tiers {
		if f, err := t.OpenFile(path); err == nil {
			return f, TierOrigin(t.Kind), true
		}
	}
	return nil, OriginNone, false
}

// ReaderFile hands the open source over as a descriptor for a reader on this node (see
// OpenForReader), with the flags of a plain read-only open: sources are opened O_NONBLOCK
// (a FIFO must not block the server). The Source must not be used afterwards; the caller
// closes the file. On error the Source is closed.
func (s *Source) ReaderFile() (*os.File, error) {
	if err := unix.SetNonblock(int(s.f.Fd()), false); err != nil {
		s.Close()
		return nil, err
	}
	return s.f, nil
}

// CheckRoot validates a request as every read does: root and path absolute and clean, path
// inside root, and root inside one of the engine's dataset roots, if it has some, once its
// symbolic links are resolved. A server checks it before it reads a file through other
// servers for a caller on its node.
func (e *Engine) CheckRoot(root, path string) error { return e.checkRoot(root, path) }

// Forget drops the cached copies of the file at path (inside root) from every tier: its
// source is being written, renamed, removed or truncated (through the preload shim), so a
// copy is stale or about to be. A fill of the file in progress, which may have read the old
// version, is not stopped, but what it publishes is dropped too (see forgotten).
func (e *Engine) Forget(root, path string) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if err := e.checkRoot(root, path); err != nil {
		return err
	}
	// The flight is marked before the tiers are cleared: a fill that publishes after the
	// mark sees it and drops its copy; one that published before has its copy cleared here.
	e.mu.Lock()
	e.forgetFlights(path)
	e.mu.Unlock()
	for _, t := range e.tiers {
		t.Forget(path)
		t.ForgetBlocks(path)
	}
	return nil
}

// dropIfForgotten drops the copy a flight just published if the file was forgotten while the
// flight was under way (see Forget): the copy may hold the version the source had before.
func (e *Engine) dropIfForgotten(f *flight, path string) {
	if f.forgotten.Load() {
		for _, t := range e.tiers {
			t.Forget(path)
		}
	}
}
