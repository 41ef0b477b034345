package tiers

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/edsrzf/mmap-go"
)

// Generation is a counter shared through a small memory-mapped file: the server owning a set
// of tiers bumps it whenever it removes a cached file (eviction, damage), and readers on the
// node load it without a system call to learn that mappings they kept may now pin removed
// files. It is safe for concurrent use, also with Close: a closed (or nil) Generation loads
// as 0 and ignores Bump.
type Generation struct {
	mu   sync.RWMutex // protects m and word against Close; held shared to use them
	m    mmap.MMap
	word *uint64 // the counter, in m; nil once closed
}

// CreateGeneration creates (or reuses) the counter file at path for the server, mapped
// writable. A reused file keeps counting upwards, so readers never see an old value again.
func CreateGeneration(path string) (*Generation, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(8); err != nil {
		return nil, err
	}
	m, err := mmap.Map(f, mmap.RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", path, err)
	}
	return &Generation{m: m, word: (*uint64)(unsafe.Pointer(&m[0]))}, nil
}

// OpenGeneration maps an existing counter file read-only, for readers.
func OpenGeneration(path string) (*Generation, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || fi.Size() < 8 {
		return nil, fmt.Errorf("generation file %s: too short or unreadable (%v)", path, err)
	}
	m, err := mmap.MapRegion(f, 8, mmap.RDONLY, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", path, err)
	}
	return &Generation{m: m, word: (*uint64)(unsafe.Pointer(&m[0]))}, nil
}

// Load returns the counter. A nil Generation is always 0.
func (g *Generation) Load() uint64 {
	if g == nil {
		return 0
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.word == nil {
		return 0
	}
	return atomic.LoadUint64(g.word)
}

// Bump increments the counter (server side only).
func (g *Generation) Bump() {
	if g == nil {
		return
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
	if g.word != nil {
		atomic.AddUint64(g.word, 1)
	}
}

// Close unmaps the counter. It is idempotent.
func (g *Generation) Close() error {
	if g == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.m == nil {
		return nil
	}
	err := g.m.Unmap()
	g.m, g.word = nil, nil
	return err
}
