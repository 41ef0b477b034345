package core

import (
	"errors"
	"io/fs"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/tiers"
)

// BeginSession returns the validation session of job (see session.go), beginning one if the
// job has none: its clients serve a cached copy without asking only once the engine found it
// to match its source in that session or a later one. An empty job joins no session: it
// gets the current one.
func (e *Engine) BeginSession(job string) uint32 {
	if job == "" {
		return e.sessions.current()
	}
	return e.sessions.begin(job)
}

// Session returns the engine's current validation session: the copies checked in it may be
// served to every client.
func (e *Engine) Session() uint32 { return e.sessions.current() }

// validate makes sure that the tiers serve no stale copy of path: a copy not checked against
// its source in the current session is compared with the source's identity now (one stat,
// beneath the dataset root) and marked checked, or dropped when the source changed or is gone.
// It returns an error only for a request that fails anyway (a path outside the roots) or a
// source that cannot be looked at; a file no tier lists costs an index lookup per tier.
func (e *Engine) validate(root, path string) error {
	session := e.sessions.current()
	unchecked := false
	for _, t := range e.tiers {
		if listed, checked := t.Checked(path, session); listed && !checked {
			unchecked = true
		}
	}
	if !unchecked {
		return nil
	}
	e.stats.sourceChecks.Add(1)
	id, err := e.sourceIdentity(root, path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		// Gone from the source: the copies go too, and the read says so as for any file.
		for _, t := range e.tiers {
			if listed, _ := t.Checked(path, 0); listed {
				t.Forget(path)
				e.stats.staleCopies.Add(1)
			}
		}
		return nil
	}
	if err != nil {
		return err
	}
	for _, t := range e.tiers {
		if listed, checked := t.Checked(path, session); listed && !checked && !t.Validate(path, id, session) {
			e.stats.staleCopies.Add(1)
			e.log.Info("dropped a cached copy whose source changed", "path", path, "tier", t.Kind.String())
		}
	}
	return nil
}

// sourceIdentity returns the identity of the source file at path, inside root, now, without
// opening it for reading (see lookSource).
func (e *Engine) sourceIdentity(root, path string) (tiers.Identity, error) {
	realRoot, err := e.realRoot(root)
	if err != nil {
		return tiers.Identity{}, err
	}
	f, err := lookSource(root, realRoot, path)
	if err != nil {
		return tiers.Identity{}, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return tiers.Identity{}, pathError("stat", path, err)
	}
	return identityOf(&st), nil
}

// identityOf returns the identity of the source version a stat describes.
func identityOf(st *unix.Stat_t) tiers.Identity {
	return tiers.Identity{Size: st.Size, MTimeNanos: st.Mtim.Nano(), CTimeNanos: st.Ctim.Nano(), Ino: st.Ino}
}
