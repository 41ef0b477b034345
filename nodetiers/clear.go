package nodetiers

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrOtherUser reports a Clear of another user's tiers by a user other than root.
var ErrOtherUser = errors.New("only root may clear another user's tiers")

// AnyUser asks Clear for the tiers of every user.
const AnyUser = -1

// What Clear did with a tier directory (Result.Action).
const (
	Removed     = "removed"
	WouldRemove = "would remove" // a dry run
	Skipped     = "skipped"      // left alone, with the reason (held by a live server, say)
	Failed      = "failed"       // not all removed, with the error
)

// Result is what Clear did with a tier directory: Files and Bytes are what it removed (or
// would remove), Reason why it skipped the directory or failed.
type Result struct {
	Tier
	Action string `json:"action"`
	Reason string `json:"reason,omitempty"`
}

// Clear removes the tier directories in o's directories that no live server holds and that
// belong to uid (AnyUser: to anyone), and returns what it did with each, by path. With dryRun
// it removes nothing and says what it would remove. A user other than root may clear only
// their own tiers: AnyUser means theirs, another uid fails with ErrOtherUser. The error joins
// what failed; a tier skipped because a live server holds it is no failure.
//
// Each directory is opened without following a link and locked (an exclusive flock on its
// fitcache.lock, as a server takes it) before anything in it is removed; one without a lock
// file is no tier and is skipped. Its contents go first, then the lock file, then the directory,
// and only then is the lock released, so a server starting meanwhile fails to lock it.
func Clear(o Options, uid int, dryRun bool) ([]Result, error) {
	if me := os.Geteuid(); me != 0 {
		if uid != AnyUser && uid != me {
			return nil, fmt.Errorf("%w (uid %d asked for uid %d)", ErrOtherUser, me, uid)
		}
		uid = me
	}
	var out []Result
	var errs []error
	for _, dir := range o.dirs() {
		err := eachTier(dir, o.maxEntries(), func(parent int, name string, st *unix.Stat_t) {
			if uid != AnyUser && int(st.Uid) != uid {
				return
			}
			r := clearOne(o, parent, dir, name, st, dryRun)
			if r.Action == Failed {
				errs = append(errs, fmt.Errorf("%s: %s", r.Path, r.Reason))
			}
			out = append(out, r)
		})
		if err != nil {
			errs = append(errs, err)
		}
	}
	return out, errors.Join(errs...)
}

// clearOne clears the tier directory name in dir (open at parent), lstat st.
func clearOne(o Options, parent int, dir, name string, st *unix.Stat_t, dryRun bool) Result {
	r := Result{Tier: Tier{Path: filepath.Join(dir, name), UID: int(st.Uid), User: o.userName(int(st.Uid)),
		Newest: time.Unix(0, st.Mtim.Nano()), Readable: true}}
	fail := func(err error) Result {
		r.Action, r.Reason = Failed, err.Error()
		return r
	}
	fd, err := openDir(parent, name, st)
	if err != nil {
		return fail(fmt.Errorf("open: %w", err))
	}
	defer unix.Close(fd)
	lock, err := unix.Openat(fd, lockName, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) || (err == nil && !regular(lock)) {
		if err == nil {
			unix.Close(lock)
		}
		r.Action, r.Reason = Skipped, "no "+lockName+" file in it: not a tier directory"
		return r
	}
	if err != nil {
		return fail(fmt.Errorf("open %s: %w", lockName, err))
	}
	defer unix.Close(lock) // releases the lock, after the directory is gone
	if err := unix.Flock(lock, unix.LOCK_EX|unix.LOCK_NB); errors.Is(err, unix.EWOULDBLOCK) {
		r.Held = true
		r.Holder, r.HolderPID = holder(lock)
		r.Action, r.Reason = Skipped, "held by a live fitcache server: "+r.Holder
		r.walk(o, fd, st, false) // what it holds, read only
		return r
	} else if err != nil {
		return fail(fmt.Errorf("lock %s: %w", lockName, err))
	}
	if err := r.walk(o, fd, st, !dryRun); err != nil {
		return fail(err)
	}
	if dryRun {
		r.Action = WouldRemove
		return r
	}
	if err := unix.Unlinkat(fd, lockName, 0); err != nil {
		return fail(fmt.Errorf("remove %s: %w", lockName, err))
	}
	// The name may have been swapped for another directory meanwhile: remove it only if it
	// is still the one emptied (rmdir removes nothing but an empty directory anyway).
	var now unix.Stat_t
	if err := unix.Fstatat(parent, name, &now, unix.AT_SYMLINK_NOFOLLOW); err != nil || now.Ino != st.Ino || now.Dev != st.Dev {
		return fail(errors.New("replaced while being removed: left"))
	}
	if err := unix.Unlinkat(parent, name, unix.AT_REMOVEDIR); err != nil {
		if errors.Is(err, unix.ENOTEMPTY) {
			err = errors.New("a server started using it meanwhile: left")
		}
		return fail(err)
	}
	r.Action = Removed
	return r
}

// Describe says in a few words what r is: "removed", "skipped: held by ...".
func (r Result) Describe() string {
	if r.Reason == "" {
		return r.Action
	}
	return r.Action + ": " + strings.TrimSpace(r.Reason)
}
