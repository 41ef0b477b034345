package client

import (
	"errors"
	"fmt"
	"github.com/fitcache/fitcache/routing"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/core"
	"github.com/fitcache/fitcache/tiers"
)

// deadTiers serves a reader the copies held in the tiers of its node's servers that do not
// answer. A server's tiers outlive it: its process died, its files did not, and a reader on
// its node that hit them before it died keeps hitting what its session validated. A reader
// that starts after the death (the DataLoader workers of the next epoch) cannot learn them
// from a hello, so it reads the record each server of the job keeps in its runtime directory
// (tiers.OpenServed), with the checks every tier gets: runtime directory, record and tiers
// private to this user.
//
// No session decides what may be served from them: a session says that the server checked a
// copy for the reader's job, and a dead server checks nothing. The reader checks instead:
// before it serves a copy it looks at the source (one stat, no read) and serves the copy
// only if its index slot holds that very version (size, modification and change times,
// inode: tiers.Dir.OpenVersion). It remembers what it saw for its life, so that a file is
// checked once per process, as a server checks it once per job.
//
// It is safe for concurrent use.
type deadTiers struct {
	runtimeDir string
	log        *slog.Logger

	mu    sync.Mutex             // protects dirs, tried and seen
	dirs  map[string][]tiers.Dir // server id -> its tiers, opened from its record
	tried map[string]time.Time   // server id -> when its record was last looked for, without success
	// seen holds the identity each source had when this client looked (at most seenMax).
	seen   map[string]tiers.Identity
	closed bool

	hits   atomic.Int64 // reads served from such tiers
	checks atomic.Int64 // sources looked at to check a copy
}

// deadTiersRetry is how often the record of a server whose tiers could not be opened is
// looked for again; seenMax bounds the sources a reader remembers having checked (past it,
// it forgets them all and checks again: a stat per read at worst).
const (
	deadTiersRetry = 5 * time.Second
	seenMax        = 1 << 17
)

func newDeadTiers(runtimeDir string, log *slog.Logger) *deadTiers {
	return &deadTiers{runtimeDir: runtimeDir, log: log, dirs: map[string][]tiers.Dir{},
		tried: map[string]time.Time{}, seen: map[string]tiers.Identity{}}
}

// of returns the tiers of the servers ids, opening those not opened yet.
func (t *deadTiers) of(ids []string) []tiers.Dir {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	var out []tiers.Dir
	for _, id := range ids {
		dirs, ok := t.dirs[id]
		if !ok && time.Since(t.tried[id]) >= deadTiersRetry {
			var err error
			dirs, err = tiers.OpenServed(t.runtimeDir, tiers.ServedName(id))
			if err != nil {
				t.tried[id] = time.Now()
				if !errors.Is(err, os.ErrNotExist) {
					t.log.Warn("the tiers of a fitcache server of this node that does not answer cannot be used",
						"server", id, "err", err)
				}
				continue
			}
			t.dirs[id] = dirs
			t.log.Info("a fitcache server of this node does not answer: its tiers serve the copies whose source is unchanged",
				"server", id, "tiers", len(dirs))
		}
		out = append(out, dirs...)
	}
	return out
}

// read returns the copy of path (clean, absolute, under c's root) held in the tiers of the
// servers ids, if one holds the version of the source there is now; nil otherwise.
func (t *deadTiers) read(c *Client, ids []string, path string) *tiers.Mapping {
	if len(ids) == 0 {
		return nil
	}
	dirs := t.of(ids)
	if !tiers.Listed(dirs, path) {
		return nil
	}
	cur, err := t.source(c, path)
	if err != nil {
		return nil // the read that follows reports what is wrong with the source
	}
	for _, d := range dirs {
		if m, err := d.OpenVersion(path, cur); err == nil {
			t.hits.Add(1)
			return m
		}
	}
	return nil
}

// unlisted returns the paths (clean, absolute) that the tiers of the servers ids do not list,
// all of them when there are no such tiers. A listed copy may still turn out stale at its
// read, which then goes to the file's owner.
func (t *deadTiers) unlisted(ids []string, paths []string) []string {
	if t == nil || len(ids) == 0 {
		return paths
	}
	dirs := t.of(ids)
	if len(dirs) == 0 {
		return paths
	}
	out := make([]string, 0, len(paths))
	for _, p := range paths {
		if !tiers.Listed(dirs, p) {
			out = append(out, p)
		}
	}
	return out
}

// source returns the identity of the source file at path: as this client saw it before, or
// from a stat now.
func (t *deadTiers) source(c *Client, path string) (tiers.Identity, error) {
	t.mu.Lock()
	cur, ok := t.seen[path]
	t.mu.Unlock()
	if ok {
		return cur, nil
	}
	cur, err := sourceIdentity(c.root, c.realRoot, path)
	if err != nil {
		return tiers.Identity{}, err
	}
	t.checks.Add(1)
	t.mu.Lock()
	if len(t.seen) >= seenMax {
		clear(t.seen)
	}
	t.seen[path] = cur
	t.mu.Unlock()
	return cur, nil
}

// sourceIdentity returns the identity of the source file at path, under root (realRoot once
// its links are resolved), with one stat. The stat follows links, also out of the root,
// where a read would be refused: the result is only compared with the version a copy holds,
// which a read beneath the root made, so a link to anything else is another version and no
// copy is served for it (as core.Engine checks its copies).
func sourceIdentity(root, realRoot, path string) (tiers.Identity, error) {
	rel, err := filepath.Rel(root, path)
	if err != nil || !filepath.IsLocal(rel) {
		return tiers.Identity{}, fmt.Errorf("%w: %s is not under %s", core.ErrOutsideRoot, path, root)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(realRoot, rel), &st); err != nil {
		return tiers.Identity{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return tiers.Identity{}, fmt.Errorf("%s is not a regular file", path)
	}
	return tiers.Identity{Size: st.Size, MTimeNanos: st.Mtim.Nano(), CTimeNanos: st.Ctim.Nano(), Ino: st.Ino}, nil
}

// fromDeadTiers serves path from the tiers of the servers ids of this node, which do not
// answer (see deadTiers); ok is false when they hold no copy of the source as it is now.
func (c *Client) fromDeadTiers(ids []string, path string) (buf Buffer, ok bool) {
	if c.deadTiers == nil {
		return nil, false
	}
	m := c.deadTiers.read(c, ids, path)
	if m == nil {
		return nil, false
	}
	c.hit(m)
	return m, true
}

// close closes the tiers opened; later reads find none.
func (t *deadTiers) close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	var errs []error
	for _, dirs := range t.dirs {
		errs = append(errs, routing.CloseDirs(dirs))
	}
	t.dirs = nil
	return errors.Join(errs...)
}
