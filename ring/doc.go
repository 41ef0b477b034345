// Package ring is a consistent hash ring with virtual nodes: it maps each key (a file path)
// to one member (a cache server), so that every client computes the same owner with no
// coordination, and removing a member moves only that member's keys.
//
// Each member owns VirtualNodes points on a 64-bit circle, at the hashes of unambiguous keys
// (the member id, a NUL byte, the point's index as 4 big-endian bytes). A key belongs to the
// member of the first point at or after the key's hash, wrapping around. Points with equal
// hashes are ordered by member id and index, so the ring is the same whatever the order in
// which members were added.
//
// A Ring is not safe for concurrent use; the client package adds the locking.
//
//	r := ring.New(100, nil)
//	r.Add(ring.Member{ID: "gpu001:7070", Node: "gpu001"}, ring.Member{ID: "gpu002:7070", Node: "gpu002"})
//	owner, ok := r.Lookup("/data/train/0001.jpg")
//	backups := r.Successors("/data/train/0001.jpg", 2, true) // owner and a member on another node
//	live := ring.Choose(r, "/data/train/0001.jpg", 2, true, func(m ring.Member) (string, ring.Choice) {
//		if dead[m.ID] {
//			return "", ring.Pass // as if removed: the next node takes its place
//		}
//		return m.ID, ring.Take
//	})
package ring
