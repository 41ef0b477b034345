package core

import (
	"context"
	"fmt"

	"github.com/fitcache/fitcache/tiers"
)

// GuestCopy is a file another server of the job owns, as this server fetched it from the
// owner for a reader on its node (see StoreGuest).
type GuestCopy struct {
	Root, Path string
	// IsBlock says that Data holds block number Block of the file at Path (see ReadBlock),
	// not the whole file.
	IsBlock bool
	Block   int64
	Data    []byte
	// Source is the identity of the source version the owner's copy holds, from its reply
	// (for a block, the block's: its size is the block's length).
	Source tiers.Identity
	// Session is this engine's validation session when the owner was asked (Engine.Session,
	// taken before the request): the owner checked its copy in the caller's job, which began
	// there no later than here.
	Session uint32
}

// StoreGuest keeps a node-local copy of a file another server owns (a guest, see
// tiers/guest.go), so that the readers of this node read it from a tier of their own node from
// then on, while there is room the server's own files do not need: it is published only into
// room that guests can give, never evicting a file of the server's own. It returns nil once the
// file is in a tier (also when it was already), or an error wrapping ErrCacheFull when there
// is no such room (the caller then hands the reader the bytes otherwise). Like the server's own
// files, the guests of a dataset never make room for other guests of it (see
// tiers.Tier.MakeRoomForGuest).
func (e *Engine) StoreGuest(ctx context.Context, g GuestCopy) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if err := e.checkRoot(g.Root, g.Path); err != nil {
		return err
	}
	if int64(len(g.Data)) != g.Source.Size {
		return fmt.Errorf("%w: %s: %d bytes sent for a file of %d", ErrBadCopy, g.Path, len(g.Data), g.Source.Size)
	}
	name := g.Path
	if g.IsBlock {
		if len(g.Data) == 0 || int64(len(g.Data)) > e.blockBytes || g.Block < 0 {
			return fmt.Errorf("%w: %s: %d bytes sent for block %d", ErrBadCopy, g.Path, len(g.Data), g.Block)
		}
		if id, ok := e.blockFiles.known(e.sessions.current(), g.Path); ok && (id.MTimeNanos != g.Source.MTimeNanos ||
			id.CTimeNanos != g.Source.CTimeNanos || id.Ino != g.Source.Ino) {
			// This node's blocks of the file copy another version: never mix the two here.
			return fmt.Errorf("%w: %s: block %d of another version than this node's blocks", ErrChanged, g.Path, g.Block)
		}
		name = tiers.BlockName(g.Path, e.blockBytes, g.Block)
	}
	if _, ok := e.cachedSize(name); ok {
		return nil
	}
	f, leader := e.join(name)
	if !leader { // a read or another guest copy of the file is under way: wait for it
		select {
		case <-f.published:
		case <-ctx.Done():
			return ctx.Err()
		}
		if _, ok := e.cachedSize(name); ok {
			return nil
		}
		return fmt.Errorf("%w: %s is not in a tier", ErrCacheFull, name)
	}
	defer e.land(name, f)
	defer close(f.done)
	entry := tiers.Entry{SourcePath: name, Size: g.Source.Size, MTimeNanos: g.Source.MTimeNanos,
		SourceCTimeNanos: g.Source.CTimeNanos, SourceIno: g.Source.Ino, Session: g.Session,
		Group: tiers.GuestGroup(g.Root)}
	need := tiers.EntrySize(name, entry.Size)
	for _, t := range e.tiers {
		if !t.HasRoom(need) && t.MakeRoomForGuest(need, g.Root) != nil {
			continue
		}
		if err := t.Publish(entry, g.Data); err != nil {
			continue // room taken meanwhile by a file of the server's own: the next tier
		}
		f.inTier = true // readers that joined the flight read it from the tier
		e.stats.guests.Add(1)
		e.dropIfForgotten(f, name)
		return nil
	}
	f.err = fmt.Errorf("%w: no room for a node-local copy of %s", ErrCacheFull, g.Path)
	return f.err
}
