package tiers

import (
	"errors"
	"path/filepath"
	"strings"
)

// Opener opens cached files: a [Dir] for readers, a [*Tier] for the server owning it.
type Opener interface {
	Open(sourcePath string) (*Mapping, error)
}

type probeResult struct {
	m   *Mapping
	err error
}

// Probe looks sourcePath up in all tiers at once and returns the first mapping that succeeds.
// Slower tiers are not waited for: a copy they find later is released as soon as it arrives.
// When no tier has a valid copy, the error wraps ErrNotCached and any unexpected errors met.
func Probe[T Opener](tiers []T, sourcePath string) (*Mapping, error) {
	switch len(tiers) {
	case 0:
		return nil, ErrNotCached
	case 1:
		return tiers[0].Open(sourcePath)
	}
	results := make(chan probeResult, len(tiers))
	for _, t := range tiers {
		go func() {
			m, err := t.Open(sourcePath)
			results <- probeResult{m, err}
		}()
	}
	var errs []error
	for i := range tiers {
		r := <-results
		if r.err == nil {
			go releaseLate(results, len(tiers)-i-1)
			return r.m, nil
		}
		if r.err != ErrNotCached {
			errs = append(errs, r.err)
		}
	}
	if len(errs) == 0 {
		return nil, ErrNotCached
	}
	return nil, errors.Join(append([]error{ErrNotCached}, errs...)...)
}

// releaseLate drains the n results still to come after a probe was won.
func releaseLate(results <-chan probeResult, n int) {
	for ; n > 0; n-- {
		if r := <-results; r.m != nil {
			r.m.Release()
		}
	}
}

// Listed reports whether the index of one of dirs lists sourcePath: a cheap hint that a
// reader opening the file will find it (it may have been evicted since).
func Listed(dirs []Dir, sourcePath string) bool {
	id := idOf(filepath.Clean(sourcePath))
	for _, d := range dirs {
		if d.listed(id) {
			return true
		}
	}
	return false
}

// listed reports whether d's index lists id; false for a closed Dir or one not opened.
func (d Dir) listed(id entryID) bool {
	_, ok := d.lookup(id)
	return ok
}

// lookup returns the size d's index gives for id, if it lists it with a copy d may serve
// (checked in d's session or later, see Dir.WithSession).
func (d Dir) lookup(id entryID) (int64, bool) {
	s, ok := d.lookupSlot(id)
	if !ok || s.checked < d.session {
		return 0, false
	}
	return s.size, true
}

// lookupSlot returns d's index slot for id, if it lists it.
func (d Dir) lookupSlot(id entryID) (slot, bool) {
	if d.dir == nil {
		return slot{}, false
	}
	var s slot
	found := false
	withFd(d.dir, func(dirfd int) error {
		s, found = d.view.lookup(dirfd, id)
		return nil
	})
	return s, found
}

// StillListed reports whether one of dirs still lists the very copy m maps (same entry, same
// data file), whatever its session: a reader that keeps mappings drops the others, whose
// pages an eviction or a removal freed for everyone else but the mapping keeps in use. It is
// an index lookup, no system call.
func StillListed(dirs []Dir, m *Mapping) bool {
	id := idOf(filepath.Clean(m.SourcePath))
	for _, d := range dirs {
		if !strings.HasPrefix(m.Path, d.Path+string(filepath.Separator)) {
			continue // inode numbers are only compared within the tier that mapped it
		}
		if s, ok := d.lookupSlot(id); ok && s.ino == m.ino {
			return true
		}
	}
	return false
}
