package tiers

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"

	"github.com/edsrzf/mmap-go"
	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/privdir"
)

// ErrNotCached reports that a tier holds no valid copy of the requested file.
var ErrNotCached = errors.New("not cached")

// ErrDamaged reports a cached file that exists but is truncated or has a broken trailer. It
// is always returned together with ErrNotCached: a damaged file is a miss, never data.
var ErrDamaged = errDamaged

// Dir is the read side of a tier: a directory with the hash-bin layout. It is safe for
// concurrent use, and a client can open the files of a server's tier itself.
//
// A Dir made by OpenDir holds the directory open, checked once, and opens every file relative
// to it: a reader's hit then costs no more system calls than a plain read. A Dir literal
// opens and checks the directory by its path on every Open.
type Dir struct {
	Path string // the tier directory
	Kind Kind

	dir *os.File // the directory, opened and checked by OpenDir; nil: open Path each time
}

// OpenDir opens the tier directory at path for reading, following no symbolic link, and
// checks once that it is private to this user (see privdir). Close it when done; a Close
// while other goroutines Open files is safe (they get misses).
func OpenDir(path string, kind Kind) (Dir, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return Dir{}, &fs.PathError{Op: "open tier", Path: path, Err: err}
	}
	if err := privdir.Check(fd, path, false); err != nil {
		unix.Close(fd)
		return Dir{}, err
	}
	return Dir{Path: path, Kind: kind, dir: os.NewFile(uintptr(fd), path)}, nil
}

// Close closes a directory held by OpenDir; it does nothing for other Dirs.
func (d Dir) Close() error {
	if d.dir == nil {
		return nil
	}
	return d.dir.Close()
}

// CachedPath returns where the cached copy of sourcePath lives in d.
func (d Dir) CachedPath(sourcePath string) string {
	return filepath.Join(d.Path, RelPath(sourcePath))
}

// Open maps the cached copy of sourcePath. It returns an error wrapping ErrNotCached when d
// has no copy, when the copy belongs to another path with the same key (a hash collision), or
// when the copy is damaged (then the error wraps ErrDamaged too). It follows no symbolic
// link at any level and uses the directory only if it is private to this user (see
// privdir); otherwise the error wraps ErrNotCached and privdir.ErrNotPrivate. The caller
// must Release the mapping.
func (d Dir) Open(sourcePath string) (*Mapping, error) {
	sourcePath = filepath.Clean(sourcePath)
	if d.dir != nil {
		var m *Mapping
		err := withFd(d.dir, func(dirfd int) (err error) {
			m, err = openAt(dirfd, d, sourcePath)
			return err
		})
		if err != nil && !errors.Is(err, ErrNotCached) { // closed meanwhile
			return nil, fmt.Errorf("%w: %w", ErrNotCached, err)
		}
		return m, err
	}
	dirfd, err := unix.Open(d.Path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: tier %s: %w", ErrNotCached, d.Path, err)
	}
	defer unix.Close(dirfd)
	if err := privdir.Check(dirfd, d.Path, false); err != nil {
		return nil, fmt.Errorf("%w: tier %w", ErrNotCached, err)
	}
	return openAt(dirfd, d, sourcePath)
}

// openAt maps the cached copy of the clean sourcePath in the tier d open at dirfd.
func openAt(dirfd int, d Dir, sourcePath string) (*Mapping, error) {
	rel := RelPath(sourcePath)
	path := filepath.Join(d.Path, rel)
	f, err := openEntry(dirfd, rel)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotCached
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrNotCached, path, err)
	}
	defer f.Close()
	m, err := mapEntry(f, path, d.Kind)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotCached, err)
	}
	if m.SourcePath != sourcePath {
		m.Release()
		return nil, ErrNotCached // another file with the same key and base name
	}
	return m, nil
}

// mapEntry maps the cached file f, at path, and reads its trailer.
func mapEntry(f *os.File, path string, kind Kind) (*Mapping, error) {
	m, err := mapFile(f)
	if err != nil {
		// An empty file cannot be mapped; a real entry is never empty (it has a trailer).
		return nil, fmt.Errorf("map %s: %w: %w", path, ErrDamaged, err)
	}
	e, err := readTrailer(m)
	if err != nil {
		m.Unmap()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &Mapping{Entry: e, Tier: kind, Path: path, m: m, ino: inodeOf(f)}, nil
}

// readTrailer parses a mapped file's trailer. Reading mapped memory can fault if the file
// was truncated behind our back (never by FitCache, but a person can): the fault becomes a
// damaged entry instead of a crash.
func readTrailer(m mmap.MMap) (e Entry, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: fault while reading trailer: %v", errDamaged, r)
		}
	}()
	return parseTrailer(m)
}
