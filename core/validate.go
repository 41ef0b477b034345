package core

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/fitcache/fitcache/tiers"
)

// BeginSession returns the validation session of job (see session.go), beginning one if the
// job has none: its clients serve a cached copy without asking only once the engine found it
// to match its source in that session or a later one. An empty job joins no session: it
// gets the current one.
func (e *Engine) BeginSession(job string) uint32 {
	session, _ := e.BeginJob(job)
	return session
}

// BeginJob is BeginSession, and also reports whether the job's session began now (the job
// was new to this engine).
func (e *Engine) BeginJob(job string) (session uint32, began bool) {
	if job == "" {
		return e.sessions.current(), false
	}
	session, began = e.sessions.begin(job)
	if began {
		e.noteSession(session)
	}
	return session, began
}

// noteSession records in the tiers that session began, for the next server (see session.go).
func (e *Engine) noteSession(session uint32) {
	for _, t := range e.tiers {
		t.NoteSession(session)
	}
}

// Session returns the engine's current validation session: the copies checked in it may be
// served to every client.
func (e *Engine) Session() uint32 { return e.sessions.current() }

// validate makes sure that the tiers serve no stale copy of path: a copy not checked against
// its source in the current session is compared with the source's identity now (one stat,
// beneath the dataset root) and marked checked, or dropped when the source changed or is gone.
// It returns an error only for a request that fails anyway (a path outside the roots) or a
// source that cannot be looked at; a file no tier lists costs an index lookup per tier.
func (e *Engine) validate(root, path string) error { return e.validateEntry(root, path, path, -1) }

// validateEntry is validate for the entry name: the whole file at path (block -1), or its
// block (name is tiers.BlockName(path, BlockBytes, block)), checked against the file's identity.
func (e *Engine) validateEntry(root, path, name string, block int64) error {
	if !e.uncheckedCopy(name) {
		return nil
	}
	// Readers of one file at once (a prefetch and a DataLoader worker, two workers) wait for
	// one check, which is looked at again inside: one that began after another's check ended
	// finds the copy checked.
	_, err, _ := e.checking.Do(name, func() (any, error) {
		if !e.uncheckedCopy(name) {
			return nil, nil
		}
		return nil, e.check(root, path, name, block)
	})
	return err
}

// uncheckedCopy reports whether a tier lists a copy of path not checked in the current session.
func (e *Engine) uncheckedCopy(path string) bool {
	session := e.sessions.current()
	for _, t := range e.tiers {
		if listed, checked := t.Checked(path, session); listed && !checked {
			return true
		}
	}
	return false
}

// check compares the copies of entry name (path, or its block: see validateEntry) with
// the source at path. The blocks of a file are checked against one look at the file per
// session (see blockFiles); when one is stale, or the file is gone, every block of the file
// goes, since they all copy the version that changed.
func (e *Engine) check(root, path, name string, block int64) error {
	session := e.sessions.current()
	var id tiers.Identity
	var err error
	if block >= 0 {
		id, err = e.blockFiles.identity(session, path, func() (tiers.Identity, error) {
			e.stats.sourceChecks.Add(1)
			return e.sourceIdentity(root, path, session)
		})
	} else {
		e.stats.sourceChecks.Add(1)
		id, err = e.sourceIdentity(root, path, session)
	}
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		// Gone from the source: the copies go too, and the read says so as for any file.
		for _, t := range e.tiers {
			if listed, _ := t.Checked(name, 0); listed {
				e.forgetCopies(t, path, name, block)
				e.stats.staleCopies.Add(1)
			}
		}
		return nil
	}
	if err != nil {
		return err
	}
	if block >= 0 {
		// The file's other blocks are checked against the same look (a reader then asks
		// once per file): any of them found stale drops them all, as the one asked for would.
		for _, t := range e.tiers {
			if t.ValidateBlocks(path, id, session) {
				e.stats.staleCopies.Add(1)
				e.forgetCopies(t, path, name, block)
				e.log.Info("dropped the cached blocks of a file whose source changed", "path", path, "tier", t.Kind.String())
			}
		}
		return nil
	}
	for _, t := range e.tiers {
		if listed, checked := t.Checked(name, session); listed && !checked && !t.Validate(name, id, session) {
			e.stats.staleCopies.Add(1)
			e.forgetCopies(t, path, name, block)
			e.log.Info("dropped a cached copy whose source changed", "path", path, "block", block, "tier", t.Kind.String())
		}
	}
	return nil
}

// forgetCopies removes the copy name from t (Validate removed a stale one already) and, for
// a block, every block of the file at path.
func (e *Engine) forgetCopies(t *tiers.Tier, path, name string, block int64) {
	t.Forget(name)
	if block >= 0 {
		t.ForgetBlocks(path)
	}
}

// sourceIdentity returns the identity of the source file at path, inside root, now, without
// opening it for reading: one stat, relative to the root directory opened once per session.
//
// The stat follows symbolic links, also ones that leave the root, where a read would be
// refused (see OpenSource): that is safe here, because the result is only compared with the
// identity of the version a copy was made from, which a read made beneath the root. A link
// to anything else gives another identity, and the copy is dropped; the read that follows
// then applies the root's rules. The root is opened anew at each session, so a dataset
// directory replaced between two jobs (moved away and made again) is looked at as it is now.
func (e *Engine) sourceIdentity(root, path string, session uint32) (tiers.Identity, error) {
	realRoot, err := e.realRoot(root)
	if err != nil {
		return tiers.Identity{}, err
	}
	rel, err := filepath.Rel(root, path)
	if err != nil || !filepath.IsLocal(rel) {
		return tiers.Identity{}, fmt.Errorf("%w: %s is not under %s", ErrOutsideRoot, path, root)
	}
	var st unix.Stat_t
	var serr error
	for try := 0; ; try++ {
		dir, err := e.checkRoots.get(realRoot, session)
		if errors.Is(err, unix.ENOSYS) { // a kernel without openat2: a look beneath the root
			return e.lookIdentity(root, realRoot, path)
		}
		if err != nil {
			return tiers.Identity{}, err
		}
		err = dir.Control(func(fd uintptr) { serr = unix.Fstatat(int(fd), rel, &st, 0) })
		if errors.Is(err, os.ErrClosed) && try == 0 {
			continue // a newer session closed it meanwhile: open the root for it
		}
		if err != nil {
			return tiers.Identity{}, err
		}
		break
	}
	if serr != nil {
		return tiers.Identity{}, pathError("stat", path, serr)
	}
	return identityOf(&st), nil
}

// lookIdentity is sourceIdentity through lookSource, for kernels without openat2.
func (e *Engine) lookIdentity(root, realRoot, path string) (tiers.Identity, error) {
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

// rootDirs holds the dataset roots opened for the checks of one session (see sourceIdentity):
// a new job's first epoch checks every cached file once, and opening the root for each cost
// as much as the stat itself. It is safe for concurrent use.
type rootDirs struct {
	mu      sync.Mutex // protects session and dirs
	session uint32
	dirs    map[string]syscall.RawConn // resolved root -> its directory, opened O_PATH
	files   []*os.File                 // the open directories, closed when the session changes
}

// close closes the open directories; later gets open them again.
func (r *rootDirs) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, f := range r.files {
		f.Close()
	}
	r.dirs, r.files = nil, nil
}

// get returns the directory of realRoot opened for session, opening it (without following
// a link: it was resolved) if this session has not yet.
func (r *rootDirs) get(realRoot string, session uint32) (syscall.RawConn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if session > r.session || r.dirs == nil || len(r.dirs) >= maxRealRoots { // a later session, or none yet
		// Closing waits for lookups still using a directory (os.File counts them).
		for _, f := range r.files {
			f.Close()
		}
		r.session, r.dirs, r.files = max(r.session, session), make(map[string]syscall.RawConn), nil
	}
	if rc, ok := r.dirs[realRoot]; ok {
		return rc, nil
	}
	fd, err := unix.Openat2(unix.AT_FDCWD, realRoot, &unix.OpenHow{
		Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS})
	switch {
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
		return nil, fmt.Errorf("%w: %s is no longer the directory it was (a link now)", ErrOutsideRoot, realRoot)
	case err != nil:
		return nil, pathError("open", realRoot, err)
	}
	f := os.NewFile(uintptr(fd), realRoot)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	r.dirs[realRoot] = rc
	r.files = append(r.files, f)
	return rc, nil
}

// identityOf returns the identity of the source version a stat describes.
func identityOf(st *unix.Stat_t) tiers.Identity {
	return tiers.Identity{Size: st.Size, MTimeNanos: st.Mtim.Nano(), CTimeNanos: st.Ctim.Nano(), Ino: st.Ino}
}
