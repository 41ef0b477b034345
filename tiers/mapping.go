package tiers

import (
	"fmt"
	"os"
	"sync"

	"github.com/edsrzf/mmap-go"
)

// Mapping is a read-only memory mapping of a cached file's data. The mapping stays valid until
// Release, even if the file is evicted (unlinked) meanwhile. It is safe for concurrent use.
type Mapping struct {
	Entry        // what the tier recorded
	Tier  Kind   // the tier the file was mapped from
	Path  string // the cached file mapped

	mu       sync.Mutex // protects m, lazy and released
	m        mmap.MMap  // the whole file; nil for an empty file, before a lazy mapping is made, or once released
	lazy     *os.File   // the open file to map at the first Map (see Dir.OpenToSend); not this mapping's to close
	lazyErr  error      // why that mapping could not be made, returned by every later Map
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
// faults. It must not be used after Release. A mapping not made yet (see Map) is made now,
// and Bytes returns nil if that fails: a caller of such a mapping calls Map first.
func (m *Mapping) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mapLazy()
	return m.m
}

// Map makes the mapping of a file opened to be sent (Dir.OpenToSend), which maps it only
// when its bytes are asked for: a server that sends a file with sendfile needs no mapping of
// it, and each mapping of a many-threaded process costs an mmap and an munmap, whose TLB
// flush interrupts every core running one of its threads. The file it was opened with must
// still be open. Map is a no-op for any other mapping.
func (m *Mapping) Map() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mapLazy()
}

// mapLazy is Map with m.mu held.
func (m *Mapping) mapLazy() error {
	f := m.lazy
	if f == nil || m.released {
		return m.lazyErr
	}
	m.lazy = nil
	mm, err := mapFirst(f, m.Size)
	if err != nil {
		m.lazyErr = fmt.Errorf("%w: map %s: %w", ErrNotCached, m.Path, err)
		return m.lazyErr
	}
	m.m = mm
	return nil
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
	m.lazy = nil
	if m.released || m.m == nil {
		m.released = true
		return nil
	}
	err := m.m.Unmap()
	m.m, m.released = nil, true
	return err
}
