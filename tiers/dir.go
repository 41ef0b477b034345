package tiers

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"

	"github.com/edsrzf/mmap-go"
)

// ErrNotCached reports that a tier holds no valid copy of the requested file.
var ErrNotCached = errors.New("not cached")

// ErrDamaged reports a cached file that exists but is truncated or has a broken trailer. It
// is always returned together with ErrNotCached: a damaged file is a miss, never data.
var ErrDamaged = errDamaged

// Dir is the read side of a tier: a directory with the hash-bin layout. It has no state, so it
// is safe for concurrent use, and a client can open the files of a server's tier itself.
type Dir struct {
	Path string // the tier directory
	Kind Kind
}

// CachedPath returns where the cached copy of sourcePath lives in d.
func (d Dir) CachedPath(sourcePath string) string {
	return filepath.Join(d.Path, RelPath(sourcePath))
}

// Open maps the cached copy of sourcePath. It returns an error wrapping ErrNotCached when d
// has no copy, when the copy belongs to another path with the same key (a hash collision), or
// when the copy is damaged (then the error wraps ErrDamaged too). The caller must Release the
// mapping.
func (d Dir) Open(sourcePath string) (*Mapping, error) {
	sourcePath = filepath.Clean(sourcePath)
	path := d.CachedPath(sourcePath)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotCached
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotCached, err)
	}
	defer f.Close()
	m, err := mapFile(f)
	if err != nil {
		// An empty file cannot be mapped; a real entry is never empty (it has a trailer).
		return nil, fmt.Errorf("%w: map %s: %w: %w", ErrNotCached, path, ErrDamaged, err)
	}
	e, err := readTrailer(m)
	if err != nil {
		m.Unmap()
		return nil, fmt.Errorf("%w: %s: %w", ErrNotCached, path, err)
	}
	if e.SourcePath != sourcePath {
		m.Unmap()
		return nil, ErrNotCached // another file with the same key and base name
	}
	return &Mapping{Entry: e, Tier: d.Kind, Path: path, m: m, ino: inodeOf(f)}, nil
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
