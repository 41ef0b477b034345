package tiers

import (
	"cmp"
	"os"
	"slices"

	"github.com/fitcache/fitcache/privdir"
)

// Usage is what a tier holds of one dataset root (see Entry.Group): the server's own files,
// or with Guest its node-local copies of other servers' files (see guest.go).
type Usage struct {
	Group string `json:"group"`
	Guest bool   `json:"guest,omitempty"`
	Files int    `json:"files"`
	// Bytes is the room the files take in the tier, as its budget counts it: data and
	// records in whole 4 KiB blocks (see EntrySize), what tmpfs takes from memory.
	Bytes int64 `json:"bytes"`
}

// Usage returns what the tier holds per group, sorted by group.
func (t *Tier) Usage() []Usage {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Usage
	for g, l := range t.fifo.groups {
		root, guest := groupRoot(g)
		u := Usage{Group: root, Guest: guest, Files: l.Len()}
		for el := l.Front(); el != nil; el = el.Next() {
			u.Bytes += el.Value.(*record).size
		}
		out = append(out, u)
	}
	return sortUsage(out)
}

// Clear removes every entry whose group (its dataset root, for a guest too) match accepts (a
// nil match accepts every group) and returns what it removed per group, sorted by group; with dryRun it removes nothing and
// returns what it would remove. Readers stop finding the entries in the index before their
// files go, and a reader that mapped one keeps a valid mapping. A file being written while
// Clear runs is published after it.
func (t *Tier) Clear(match func(group string) bool, dryRun bool) []Usage {
	t.mu.Lock()
	if t.shut {
		t.mu.Unlock()
		return nil
	}
	var victims []*record
	for g, l := range t.fifo.groups {
		if root, _ := groupRoot(g); match != nil && !match(root) {
			continue
		}
		for el := l.Front(); el != nil; el = el.Next() {
			victims = append(victims, el.Value.(*record))
		}
	}
	if !dryRun {
		for _, r := range victims {
			t.fifo.remove(r.id)
			t.ix.remove(r.id) // readers stop finding it before it goes
		}
	}
	t.mu.Unlock()

	var tally usageTally
	var freed int64
	for _, r := range victims {
		tally.add(r.group, r.size)
		freed += r.size
		if !dryRun {
			t.unlink(r.rel, r.ino) // spares a newer copy published meanwhile
		}
	}
	if !dryRun && len(victims) > 0 {
		t.mu.Lock()
		t.used -= freed
		t.mu.Unlock()
	}
	return tally.sorted()
}

// Usage reads the records of the tier directory d and returns what it holds per group,
// sorted by group, without changing anything and without taking the tier's lock: for a
// tier no server holds (a running server answers from its own accounting, Tier.Usage).
// Entries a scan finds damaged are not counted; a server starting on the tier removes them.
func (d Dir) Usage() ([]Usage, error) {
	dir, err := privdir.Open(d.Path)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	s := scan{root: d.Path}
	if err := s.run(int(dir.Fd())); err != nil {
		return nil, err
	}
	var tally usageTally
	for _, f := range s.found {
		tally.add(f.Group, f.size)
	}
	return tally.sorted(), nil
}

// usageTally adds up files and bytes per group (a dataset root, its own files and its
// guests apart).
type usageTally map[string]*Usage

func (t *usageTally) add(group string, bytes int64) {
	if *t == nil {
		*t = map[string]*Usage{}
	}
	u := (*t)[group]
	if u == nil {
		root, guest := groupRoot(group)
		u = &Usage{Group: root, Guest: guest}
		(*t)[group] = u
	}
	u.Files++
	u.Bytes += bytes
}

// sorted returns the tally sorted by group.
func (t usageTally) sorted() []Usage {
	out := make([]Usage, 0, len(t))
	for _, u := range t {
		out = append(out, *u)
	}
	return sortUsage(out)
}

func sortUsage(u []Usage) []Usage {
	slices.SortFunc(u, func(a, b Usage) int {
		if c := cmp.Compare(a.Group, b.Group); c != 0 {
			return c
		}
		return cmp.Compare(btoi(a.Guest), btoi(b.Guest)) // a root's own files first
	})
	return u
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Existing returns the directory a server would use for the tier cfg describes (its
// private stand-in, see Config.FallbackRecord, when the configured directory cannot be
// used) without creating it: the error wraps fs.ErrNotExist when there is none.
func Existing(cfg Config) (string, error) {
	if _, err := os.Lstat(cfg.Dir); err != nil {
		return cfg.Dir, err
	}
	cfg.CreateParents = false
	d, _, err := openDir(cfg.Dir, cfg)
	if err != nil {
		return cfg.Dir, err
	}
	defer d.Close()
	return d.Name(), nil
}
