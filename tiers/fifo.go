package tiers

import "container/list"

// record is what a tier keeps in memory about an entry.
type record struct {
	rel   string  // path of the data file relative to the tier directory
	id    entryID // its index identity
	size  int64   // bytes it takes (see EntrySize)
	seq   uint64  // publication sequence number
	group string  // Entry.Group
	ino   uint64  // inode number of the data file, so that eviction never unlinks a newer copy
	// source is the identity of the source version the copy holds (see Tier.Validate).
	source Identity
	// blockOf is the cleaned source path of the file whose block this entry holds (see
	// BlockName), "" for a whole file: ForgetBlocks finds a file's blocks by it; blockBytes
	// is the size of the blocks it was cut in, block its number.
	blockOf    string
	blockBytes int64
	block      int64
}

// isBlockName reports whether name is a block's (see BlockName).
func isBlockName(name string) bool {
	_, _, _, ok := SplitBlockName(name)
	return ok
}

// setBlock fills in the block fields of r for an entry named sourcePath (none for a whole
// file's) and returns r.
func (r *record) setBlock(sourcePath string) *record {
	if path, bb, n, ok := SplitBlockName(sourcePath); ok {
		r.blockOf, r.blockBytes, r.block = path, bb, n
	}
	return r
}

// fifo holds a tier's entries in publication order, one list per group (dataset root), so
// that eviction can take the oldest entry outside a group. It is not safe for concurrent use
// (Tier.mu guards it).
type fifo struct {
	groups     map[string]*list.List     // group -> its records, oldest first
	byID       map[entryID]*list.Element // element of each entry in its group's list
	guestBytes int64                     // bytes of the guests' records (see guest.go)
	// blocks holds the cached blocks of each file (see BlockName), for ForgetBlocks.
	blocks map[string]map[entryID]struct{}
}

func newFIFO() fifo {
	return fifo{groups: make(map[string]*list.List), byID: make(map[entryID]*list.Element),
		blocks: make(map[string]map[entryID]struct{})}
}

// blocksOf returns the entries holding blocks of the file at the cleaned path.
func (f *fifo) blocksOf(path string) []entryID {
	var ids []entryID
	for id := range f.blocks[path] {
		ids = append(ids, id)
	}
	return ids
}

func (f *fifo) len() int { return len(f.byID) }

// push adds a record as the newest of its group; records must come in publication order.
func (f *fifo) push(r *record) {
	l := f.groups[r.group]
	if l == nil {
		l = list.New()
		f.groups[r.group] = l
	}
	f.byID[r.id] = l.PushBack(r)
	if _, guest := groupRoot(r.group); guest {
		f.guestBytes += r.size
	}
	if r.blockOf != "" {
		if f.blocks[r.blockOf] == nil {
			f.blocks[r.blockOf] = make(map[entryID]struct{})
		}
		f.blocks[r.blockOf][r.id] = struct{}{}
	}
}

// remove takes the entry id out, if present.
func (f *fifo) remove(id entryID) (*record, bool) {
	el, ok := f.byID[id]
	if !ok {
		return nil, false
	}
	delete(f.byID, id)
	r := el.Value.(*record)
	if _, guest := groupRoot(r.group); guest {
		f.guestBytes -= r.size
	}
	l := f.groups[r.group]
	l.Remove(el)
	if l.Len() == 0 {
		delete(f.groups, r.group)
	}
	if r.blockOf != "" {
		delete(f.blocks[r.blockOf], id)
		if len(f.blocks[r.blockOf]) == 0 {
			delete(f.blocks, r.blockOf)
		}
	}
	return r, true
}

// popOldest takes out and returns the oldest guest (see guest.go), if there is one, else the
// oldest entry outside group keep (any group when keep is ""), or nil if there is none.
func (f *fifo) popOldest(keep string) *record {
	if r := f.popOldestGuest(); r != nil {
		return r
	}
	return f.popOldestWhere(func(g string) bool { return keep == "" || g != keep })
}

// popOldestGuest takes out and returns the oldest guest, or nil if there is none.
func (f *fifo) popOldestGuest() *record { return f.popOldestGuestBut("") }

// popOldestGuestBut takes out and returns the oldest guest outside group keep, or nil.
func (f *fifo) popOldestGuestBut(keep string) *record {
	return f.popOldestWhere(func(g string) bool {
		_, guest := groupRoot(g)
		return guest && g != keep
	})
}

// popOldestWhere takes out and returns the oldest entry of the groups take accepts, or nil.
func (f *fifo) popOldestWhere(take func(group string) bool) *record {
	var oldest *record
	for g, l := range f.groups {
		if !take(g) {
			continue
		}
		if r := l.Front().Value.(*record); oldest == nil || r.seq < oldest.seq {
			oldest = r
		}
	}
	if oldest != nil {
		f.remove(oldest.id)
	}
	return oldest
}
