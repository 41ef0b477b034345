package tiers

import (
	"fmt"
	"strings"
)

// Node-local copies ("guests"). In cluster mode a server keeps, besides the files it owns on
// the hash ring, copies of files it fetched from other nodes' servers for the readers of its
// node, while it has room its own files do not need: a dataset that fits on each node is then
// read at local speed from its second epoch on. A guest is an ordinary entry (published,
// indexed, checked and evicted like any other) whose group (Entry.Group) is GuestGroup of its
// dataset root, which the records keep, so that a restarted server knows its guests:
//
//   - making room evicts guests first, oldest first, before any file of the server's own;
//   - a guest is published only into room that guests can make (MakeRoomForGuest): it never
//     pushes out a file of the server's own;
//   - an evicted guest is not spilled to a slower tier (its owner has the file);
//   - usage and clear report and match it under its dataset root (Usage.Guest).

// guestPrefix starts the group of a guest: a NUL, which no dataset root (an absolute path)
// holds, so that a guest group is never taken for a root.
const guestPrefix = "\x00guest:"

// GuestGroup returns the group of a guest copy of a file of the dataset root.
func GuestGroup(root string) string { return guestPrefix + root }

// groupRoot returns the dataset root of group and whether it is a guest group.
func groupRoot(group string) (root string, guest bool) {
	if r, ok := strings.CutPrefix(group, guestPrefix); ok {
		return r, true
	}
	return group, false
}

// MakeRoomForGuest evicts guests of other dataset roots than keep, oldest first, until n more
// bytes fit in the budget. It never evicts a file of the server's own, nor a guest of keep:
// readers read a dataset in a new order every epoch, so replacing its guests with others of
// it would only add transfers (see Tier.MakeRoom). When that gives too little room it returns
// ErrNoRoom (having evicted what it did).
func (t *Tier) MakeRoomForGuest(n int64, keep string) error {
	return t.evictGuestsBut(n, GuestGroup(keep))
}

// EvictGuests evicts guests of any dataset, oldest first, until n more bytes fit in the
// budget: room for a file of the server's own, which guests never hold back, also where no
// file of its own may be evicted for it (a prefetch, see core.Engine.Prefetch). When the
// guests give too little room it returns ErrNoRoom (having evicted what it did).
func (t *Tier) EvictGuests(n int64) error { return t.evictGuestsBut(n, "") }

// HasRoomForOwn reports whether n more bytes of the server's own fit in the budget once the
// guests are evicted (see EvictGuests).
func (t *Tier) HasRoomForOwn(n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.used-t.fifo.guestBytes+n <= t.budget
}

// evictGuestsBut evicts guests but those of group keep, oldest first, until n more bytes fit.
func (t *Tier) evictGuestsBut(n int64, keep string) error {
	for {
		t.mu.Lock()
		switch {
		case n > t.budget:
			t.mu.Unlock()
			return fmt.Errorf("%w: %s needed, budget %s", ErrNoRoom, FormatBytes(n), FormatBytes(t.budget))
		case t.used+n <= t.budget:
			t.mu.Unlock()
			return nil
		case t.shut:
			t.mu.Unlock()
			return fmt.Errorf("%w: tier closed", ErrNoRoom)
		}
		rec := t.fifo.popOldestGuestBut(keep)
		if rec == nil {
			t.mu.Unlock()
			return fmt.Errorf("%w: the rest is the server's own files and copies of the dataset read", ErrNoRoom)
		}
		t.ix.remove(rec.id) // readers stop finding it before it goes
		t.mu.Unlock()
		t.unlink(rec.rel, rec.ino)
		t.mu.Lock()
		t.used -= rec.size
		t.mu.Unlock()
	}
}
