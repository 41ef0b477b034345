package routing

import (
	"errors"
	"fmt"
	"log/slog"
	"math"

	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb"
	"github.com/fitcache/fitcache/tiers"
)

// The tiers of the servers on a reader's node, as their hellos describe them.

// SessionOf returns the validation session a Hello reply gives the caller's job.
func SessionOf(hello *fitcachepb.HelloReply) uint32 {
	if hello.Session < 0 || hello.Session > math.MaxUint32 {
		return math.MaxUint32 // no copy is served without asking: safe, if slow
	}
	return uint32(hello.Session)
}

// TierDirs opens the tiers of a Hello reply as directories to read (held open and checked
// once, see tiers.OpenDir) for a reader of validation session, skipping with a log line a
// tier of an unknown kind or one that cannot be used. Close them with CloseDirs.
func TierDirs(infos []*fitcachepb.TierInfo, session uint32, log *slog.Logger) []tiers.Dir {
	var dirs []tiers.Dir
	for _, t := range infos {
		kind, err := tiers.ParseKind(t.Kind)
		var d tiers.Dir
		if err == nil {
			d, err = tiers.OpenDir(t.Dir, kind)
		}
		if err != nil {
			log.Warn("ignoring a tier of the server", "dir", t.Dir, "err", err)
			continue
		}
		dirs = append(dirs, d.WithSession(session))
	}
	return dirs
}

// AnySession returns dirs for reading a copy that a server has just said it holds: it checked
// the copy against its source before it said so, so the copy's mark need not be our
// session's (a restarted server numbers its sessions anew).
func AnySession(dirs []tiers.Dir) []tiers.Dir {
	out := make([]tiers.Dir, len(dirs))
	for i, d := range dirs {
		out[i] = d.WithSession(0)
	}
	return out
}

// CloseDirs closes directories from TierDirs; readers still using them get misses. It
// returns what the closes failed with.
func CloseDirs(dirs []tiers.Dir) error {
	var errs []error
	for _, d := range dirs {
		if err := d.Close(); err != nil {
			errs = append(errs, fmt.Errorf("tier %s: %w", d.Path, err))
		}
	}
	return errors.Join(errs...)
}
