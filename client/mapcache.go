package client

import (
	"container/list"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/fitcache/fitcache/tiers"
)

// mapCache keeps the mappings of cached files this process has read, so that reading a file
// again (the next epoch) costs a map lookup: no open, no mmap, and no page fault, because the
// pages stay mapped. That is where zero copy beats read(): on tmpfs, mapping a file anew and
// faulting its pages in costs more than copying it.
//
// A kept mapping pins the file it maps even after the server evicts it, so the cache empties
// whenever the server's removal generation changes (tiers.Generation), and it holds at most
// max mappings, oldest dropped first: each mapping is one entry of the process's memory map,
// whose size the kernel limits (vm.max_map_count). It is safe for concurrent use.
type mapCache struct {
	mu     sync.Mutex // protects gen, byPath and fifo
	max    int
	gen    uint64
	byPath map[string]*list.Element // of *sharedMap, in fifo
	fifo   list.List                // oldest first
}

// sharedMap is one mapping, shared by the cache and the handles handed out for it.
type sharedMap struct {
	path string
	m    *tiers.Mapping
	refs int // handles not yet released, plus one while in the cache; guarded by mapCache.mu
}

// mapHandle is a Buffer over a shared mapping; releasing it drops one reference.
type mapHandle struct {
	s    *sharedMap
	c    *mapCache
	once sync.Once
}

func (h *mapHandle) Bytes() []byte { return h.s.m.Bytes() }

func (h *mapHandle) Release() error {
	h.once.Do(func() { h.c.unref(h.s) })
	return nil
}

func newMapCache(max int) *mapCache {
	return &mapCache{max: max, byPath: make(map[string]*list.Element)}
}

// defaultMaxMappings leaves three quarters of the process's memory-map entries to others.
func defaultMaxMappings() int {
	limit := 65530
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && n > 0 {
			limit = n
		}
	}
	return min(16384, limit/4)
}

// get returns a handle on the kept mapping of path, or nil. gen is the server's removal
// generation now. A mapping whose file changed under it (see tiers.Mapping.Unchanged) is
// dropped instead.
func (c *mapCache) get(path string, gen uint64) Buffer {
	c.mu.Lock()
	if gen != c.gen {
		drop := c.flushLocked(gen)
		c.mu.Unlock()
		releaseAll(drop)
		return nil
	}
	el, ok := c.byPath[path]
	if !ok {
		c.mu.Unlock()
		return nil
	}
	s := el.Value.(*sharedMap)
	s.refs++
	c.mu.Unlock()

	h := &mapHandle{s: s, c: c}
	if s.m.Unchanged() {
		return h
	}
	c.mu.Lock()
	var drop []*tiers.Mapping
	if cur, ok := c.byPath[path]; ok && cur == el {
		drop = c.removeLocked(el)
	}
	c.mu.Unlock()
	releaseAll(drop)
	h.Release()
	return nil
}

// put keeps m as the mapping of path and returns a handle on it. If another reader kept a
// mapping of path meanwhile, m is released and that one is used.
func (c *mapCache) put(path string, m *tiers.Mapping, gen uint64) Buffer {
	c.mu.Lock()
	var drop []*tiers.Mapping
	defer func() { c.mu.Unlock(); releaseAll(drop) }()
	if gen != c.gen {
		drop = c.flushLocked(gen)
	}
	if el, ok := c.byPath[path]; ok {
		drop = append(drop, m)
		s := el.Value.(*sharedMap)
		s.refs++
		return &mapHandle{s: s, c: c}
	}
	if c.max <= 0 {
		return m // keeping mappings is disabled
	}
	for c.fifo.Len() >= c.max {
		drop = append(drop, c.removeLocked(c.fifo.Front())...)
	}
	s := &sharedMap{path: path, m: m, refs: 2}
	c.byPath[path] = c.fifo.PushBack(s)
	return &mapHandle{s: s, c: c}
}

func (c *mapCache) unref(s *sharedMap) {
	c.mu.Lock()
	s.refs--
	last := s.refs == 0
	c.mu.Unlock()
	if last {
		s.m.Release()
	}
}

// removeLocked drops el from the cache and returns its mapping if nobody holds it any more.
func (c *mapCache) removeLocked(el *list.Element) []*tiers.Mapping {
	s := c.fifo.Remove(el).(*sharedMap)
	delete(c.byPath, s.path)
	s.refs--
	if s.refs == 0 {
		return []*tiers.Mapping{s.m}
	}
	return nil
}

// flushLocked empties the cache and records the new generation.
func (c *mapCache) flushLocked(gen uint64) []*tiers.Mapping {
	var drop []*tiers.Mapping
	for c.fifo.Len() > 0 {
		drop = append(drop, c.removeLocked(c.fifo.Front())...)
	}
	c.gen = gen
	return drop
}

// sync empties the cache if the server's removal generation changed: called periodically, so
// that kept mappings never pin removed files for long even when no read comes.
func (c *mapCache) sync(gen uint64) {
	c.mu.Lock()
	var drop []*tiers.Mapping
	if gen != c.gen {
		drop = c.flushLocked(gen)
	}
	c.mu.Unlock()
	releaseAll(drop)
}

// flush empties the cache (at close); handles already out stay valid until released.
func (c *mapCache) flush() {
	c.mu.Lock()
	drop := c.flushLocked(c.gen)
	c.mu.Unlock()
	releaseAll(drop)
}

func releaseAll(ms []*tiers.Mapping) {
	for _, m := range ms {
		m.Release()
	}
}

// IsMapped reports whether a buffer's bytes are a file mapping rather than memory of the Go
// heap (which C code must not keep).
func IsMapped(b Buffer) bool {
	switch b.(type) {
	case *mapHandle, *tiers.Mapping, *sourceMapping:
		return true
	}
	return false
}
