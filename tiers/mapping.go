package tiers

import (
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
