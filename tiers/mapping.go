package tiers

import (
	"fmt"
	"sync"

	"github.com/edsrzf/mmap-go"
)

// Mapping is a read-only memory mapping of a cached file's data. The mapping stays valid until
// Release, even if the file is evicted (unlinked) meanwhile. It is safe for concurrent use.
type Mapping struct {
	Entry        // what the tier recorded
	Tier  Kind   // the tier the file was mapped from
	Path  string // the cached file mapped

	mu       sync.Mutex // protects m and released
	m        mmap.MMap  // the whole file; nil for an empty file or once released
	released bool

	ino uint64 // inode of the file mapped, for Unchanged
}

// Unchanged reports whether Path still names the very file mapped, at its mapped size. A
// reader that keeps a mapping between reads checks it first: a cached file is never
// rewritten by FitCache, but a person could truncate it in place, and touching a page past
// the new end of file would kill the reader with SIGBUS.
func (m *Mapping) Unchanged() bool {
	ino, size, err := statFile(m.Path)
	m.mu.Lock()
	defer m.mu.Unlock()
	return err == nil && !m.released && ino == m.ino && size == m.Size
}

// Bytes returns the file's data: exactly Entry.Size bytes of read-only memory. Writing to it
// faults. It must not be used after Release.
func (m *Mapping) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.m
}

// CopyAt copies the file's bytes from off into p and returns how many it copied (0 at or
// past the end). The copy runs under debug.SetPanicOnFault: another process of the user can
// truncate a cached file in place (FitCache never does), and a read of a page past its new
// end raises SIGBUS, which would crash the program; it fails instead with ErrNotCached, and
// the caller lets go of the mapping. It must not be used after Release.
func (m *Mapping) CopyAt(p []byte, off int64) (int, error) {
	b := m.Bytes()
	if off >= int64(len(b)) {
		return 0, nil
	}
	n := 0
	if !readMapped(func() { n = copy(p, b[off:]) }) {
		return 0, fmt.Errorf("%w: %w: %s was truncated under its mapping", ErrNotCached, errDamaged, m.Path)
	}
	return n, nil
}

// Release unmaps the file. It is idempotent.
func (m *Mapping) Release() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.released || m.m == nil {
		m.released = true
		return nil
	}
	err := m.m.Unmap()
	m.m, m.released = nil, true
	return err
}
