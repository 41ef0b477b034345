package core

import (
	"fmt"
	"path/filepath"

	"github.com/fitcache/fitcache/tiers"
)

// CacheUsage is what one tier holds of one dataset root: the files cached for readers of
// that root (tiers.Entry.Group) and the room they take in the tier (see tiers.Usage).
type CacheUsage struct {
	Root  string `json:"root"`
	Kind  string `json:"tier"`
	Dir   string `json:"dir"`
	Files int    `json:"files"`
	Bytes int64  `json:"bytes"`
}

// Usage returns what the engine's tiers hold, per tier (fastest first) and dataset root.
func (e *Engine) Usage() []CacheUsage {
	var out []CacheUsage
	for _, t := range e.tiers {
		out = AppendUsage(out, t.Dir, t.Usage())
	}
	return out
}

// Clear removes the cached files of the dataset roots at or under root, or of every root
// when root is "", from every tier, and returns what it removed per tier and root; with
// dryRun it removes nothing and returns what it would remove. root must be absolute and
// clean (ErrBadPath). Files being read from the source meanwhile (readers' misses, prefetch)
// are cached after it; prefetch jobs of the roots that had ended are not joined again, so
// the same list sent again reads the files again.
func (e *Engine) Clear(root string, dryRun bool) ([]CacheUsage, error) {
	if e.closed.Load() {
		return nil, ErrClosed
	}
	var match func(string) bool
	if root != "" {
		if !filepath.IsAbs(root) || filepath.Clean(root) != root {
			return nil, fmt.Errorf("%w: %q is not an absolute clean path", ErrBadPath, root)
		}
		match = func(group string) bool { return Within(group, root) }
	}
	var out []CacheUsage
	for _, t := range e.tiers {
		out = AppendUsage(out, t.Dir, t.Clear(match, dryRun))
	}
	if !dryRun {
		e.pf.clearedRoots(match) // a warmup after the clear reads the files again
	}
	return out, nil
}

// AppendUsage appends a tier's usage per group (dataset root) to out, as CacheUsage rows.
func AppendUsage(out []CacheUsage, d tiers.Dir, us []tiers.Usage) []CacheUsage {
	for _, u := range us {
		out = append(out, CacheUsage{Root: u.Group, Kind: d.Kind.String(), Dir: d.Path, Files: u.Files, Bytes: u.Bytes})
	}
	return out
}

// DirUsage is Usage for tier directories no server holds, read from their records without
// changing them (see tiers.Dir.Usage).
func DirUsage(dirs []tiers.Dir) ([]CacheUsage, error) {
	var out []CacheUsage
	for _, d := range dirs {
		us, err := d.Usage()
		if err != nil {
			return out, fmt.Errorf("tier %s: %w", d.Path, err)
		}
		out = AppendUsage(out, d, us)
	}
	return out, nil
}
