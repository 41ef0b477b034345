package ring

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"
	"sort"
	"strings"
	"unsafe"
)

// DefaultVirtualNodes is the number of points per member when New is given 0, and the
// fewest VirtualNodesFor gives: the hash-ring paper's choice (Lee et al., "Fault-Tolerant Deep
// Learning Cache with Hash Ring for Load Balancing in HPC Systems"), the trade-off it found
// best in its setting between balance and the ring's size. A job's clients and servers use
// VirtualNodesFor, which balances a job's budget better.
const DefaultVirtualNodes = 100

// VirtualNodesFor is the number of virtual nodes per server that a job of n servers uses
// unless told otherwise: 1,000, fewer past 262 servers so that the ring keeps about
// maxAutoPoints points, and never fewer than DefaultVirtualNodes. A server's share of the
// files varies by about 1/sqrt(virtual nodes) around the mean, and the busiest server is the
// one whose tiers must hold more than an even share: with 100 virtual nodes the busiest of 4
// servers held 10% more than the mean (the median of 100 jobs; of 16 servers, 17%), with 1,000
// 3% (and 6%): bench/ringbalance. The cost is the ring's build, paid once per client and
// dataset: 2 ms for 16 servers, about 45 ms at the cap (BenchmarkBuild), and 10% more time
// per Lookup.
func VirtualNodesFor(n int) int {
	if n <= 0 {
		return maxAutoVirtualNodes
	}
	return max(DefaultVirtualNodes, min(maxAutoVirtualNodes, maxAutoPoints/n))
}

// Bounds of VirtualNodesFor.
const (
	maxAutoVirtualNodes = 1000
	maxAutoPoints       = 1 << 18
)

// Hash maps a key to a point on the ring.
type Hash func(string) uint64

// Member is a ring member: a server, and the node (host) it runs on, so that replicas can be
// placed on distinct nodes.
type Member struct {
	ID   string // unique; must not contain NUL
	Node string
	// Domain is the failure domain of the member's node above the node itself (its switch,
	// its rack), "" when unknown: with distinct nodes asked, Choose also puts the members it
	// chooses in distinct domains while there are domains left. It takes no part in the
	// ring's points, so a member's place does not depend on it.
	Domain string
}

type point struct {
	hash   uint64
	member int // index in Ring.members
	index  uint32
}

// Ring is a consistent hash ring. The zero value is not usable; call New.
type Ring struct {
	vnodes int
	hash   Hash
	// inPlace: the hash is DefaultHash, which keeps nothing of its key, so virtual-node keys
	// are hashed from a buffer reused for every point (see Add).
	inPlace bool
	members []Member       // by insertion; removed members are compacted away
	byID    map[string]int // member id -> index in members
	points  []point        // sorted by (hash, member id, index)
}

// New returns an empty ring with vnodes points per member (DefaultVirtualNodes if <= 0: not
// a job's default, which is VirtualNodesFor its size, see routing.VirtualNodes) and the given
// hash (nil: 64-bit FNV-1a followed by a mixing finalizer).
func New(vnodes int, hash Hash) *Ring {
	if vnodes <= 0 {
		vnodes = DefaultVirtualNodes
	}
	r := &Ring{vnodes: vnodes, hash: hash, byID: make(map[string]int)}
	if hash == nil {
		r.hash, r.inPlace = DefaultHash, true
	}
	return r
}

// DefaultHash is FNV-1a 64 with the MurmurHash3 finalizer: FNV alone spreads keys that
// differ in their last bytes (like virtual-node keys) poorly over the high bits.
func DefaultHash(s string) uint64 {
	const offset, prime = 14695981039346656037, 1099511628211
	x := uint64(offset)
	for i := 0; i < len(s); i++ { // FNV-1a, without allocating
		x ^= uint64(s[i])
		x *= prime
	}
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// VirtualNodeKey is the key hashed for point i of a member: unambiguous because ids contain
// no NUL and the index has a fixed width.
func VirtualNodeKey(id string, i uint32) string {
	b := make([]byte, 0, len(id)+5)
	b = append(b, id...)
	b = append(b, 0)
	return string(binary.BigEndian.AppendUint32(b, i))
}

// Add adds members (ignoring ids already present). It panics on an id with a NUL byte.
func (r *Ring) Add(ms ...Member) {
	added := false
	r.points = slices.Grow(r.points, len(ms)*r.vnodes)
	for _, m := range ms {
		if strings.IndexByte(m.ID, 0) >= 0 {
			panic(fmt.Sprintf("ring: member id %q contains NUL", m.ID))
		}
		if _, ok := r.byID[m.ID]; ok {
			continue
		}
		idx := len(r.members)
		r.members = append(r.members, m)
		r.byID[m.ID] = idx
		key := append(make([]byte, 0, len(m.ID)+5), m.ID...)
		key = append(key, 0)
		for i := 0; i < r.vnodes; i++ {
			// The key of VirtualNodeKey, built in place for the default hash: a ring of a
			// large job has a million points, and a string each was half of its build time.
			key = binary.BigEndian.AppendUint32(key[:len(m.ID)+1], uint32(i))
			k := unsafe.String(&key[0], len(key))
			if !r.inPlace {
				k = string(key) // a hash of the caller's may keep it
			}
			r.points = append(r.points, point{hash: r.hash(k), member: idx, index: uint32(i)})
		}
		added = true
	}
	if added {
		r.sortPoints()
	}
}

// Remove removes the member with the given id, if present.
func (r *Ring) Remove(id string) {
	idx, ok := r.byID[id]
	if !ok {
		return
	}
	last := len(r.members) - 1
	r.members[idx] = r.members[last] // move the last member into the hole
	r.members = r.members[:last]
	delete(r.byID, id)
	if idx != last {
		r.byID[r.members[idx].ID] = idx
	}
	kept := r.points[:0]
	for _, p := range r.points {
		switch p.member {
		case idx:
			continue
		case last:
			p.member = idx
		}
		kept = append(kept, p)
	}
	r.points = kept
}

func (r *Ring) sortPoints() {
	slices.SortFunc(r.points, r.compare)
}

func (r *Ring) compare(a, b point) int {
	if a.hash != b.hash {
		return cmp.Compare(a.hash, b.hash)
	}
	if c := strings.Compare(r.members[a.member].ID, r.members[b.member].ID); c != 0 {
		return c
	}
	return cmp.Compare(a.index, b.index)
}

// Len returns the number of members.
func (r *Ring) Len() int { return len(r.members) }

// Members returns the members sorted by id.
func (r *Ring) Members() []Member {
	out := append([]Member(nil), r.members...)
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Has reports whether a member with the given id is in the ring.
func (r *Ring) Has(id string) bool {
	_, ok := r.byID[id]
	return ok
}

// first returns the index of the first point at or after the key's hash, wrapping around.
func (r *Ring) first(key string) int {
	h := r.hash(key)
	i := sort.Search(len(r.points), func(i int) bool { return r.points[i].hash >= h })
	if i == len(r.points) {
		i = 0
	}
	return i
}

// Lookup returns the member owning key; false if the ring is empty. O(log points).
func (r *Ring) Lookup(key string) (Member, bool) {
	if len(r.points) == 0 {
		return Member{}, false
	}
	return r.members[r.points[r.first(key)].member], true
}

// Walk calls visit with each member once, walking clockwise from key's owner (which comes
// first), until visit returns false or every member was visited.
func (r *Ring) Walk(key string, visit func(Member) bool) {
	if len(r.points) == 0 {
		return
	}
	seen := make(map[int]bool)
	start := r.first(key)
	for k := 0; k < len(r.points) && len(seen) < len(r.members); k++ {
		p := r.points[(start+k)%len(r.points)]
		if seen[p.member] {
			continue
		}
		seen[p.member] = true
		if !visit(r.members[p.member]) {
			return
		}
	}
}

// Successors returns up to n distinct members for key, walking clockwise from its owner (which
// comes first). With distinctNodes, it skips members on a node already chosen, so replicas
// land on different nodes, and in a failure domain already chosen while other domains are
// left (see Member.Domain); it then returns fewer than n when there are fewer nodes.
func (r *Ring) Successors(key string, n int, distinctNodes bool) []Member {
	return Choose(r, key, n, distinctNodes, func(m Member) (Member, Choice) { return m, Take })
}

// Choice is what Choose does with a member it walks past.
type Choice int

const (
	// Take chooses the member.
	Take Choice = iota
	// Pass walks on as if the member were not in the ring (for example a dead server whose
	// files its successors cache in its place).
	Pass
	// Hold counts the member, and its node, as chosen without returning it (for example a
	// dead server whose files are read from the source: its slot is not given to another).
	Hold
)

// Choose is Successors with a say over each member: judge is asked about each member the walk
// reaches, in ring order, and gives the value to return for a member it takes (the caller's
// own record of it, so that the result needs no second pass). The walk stops as soon as n
// slots are taken or held, so a key's placement costs a few steps, not a pass over the ring.
// With distinctNodes, members in a failure domain already used are passed over first; when
// the domains run out before n slots are filled, a second walk fills them from the members
// on nodes not used yet (so losing a whole domain loses no key that had room elsewhere).
// It is a function, not a method, because Go methods take no type parameters.
func Choose[T any](r *Ring, key string, n int, distinctNodes bool, judge func(Member) (T, Choice)) []T {
	if n <= 0 {
		return nil
	}
	out := make([]T, 0, min(n, len(r.members)))
	var nodesBuf, domainsBuf [8]string // used; n is a replica count, so a scan beats a map
	nodes, domains := nodesBuf[:0], domainsBuf[:0]
	slots, passedForDomain := 0, false
	walk := func(byDomain bool) {
		r.Walk(key, func(m Member) bool {
			if distinctNodes && slices.Contains(nodes, m.Node) {
				return true
			}
			if byDomain && m.Domain != "" && slices.Contains(domains, m.Domain) {
				passedForDomain = true // a second walk may want it
				return true
			}
			v, choice := judge(m)
			switch choice {
			case Pass:
				return true
			case Take:
				out = append(out, v)
			}
			if distinctNodes {
				nodes = append(nodes, m.Node)
				if m.Domain != "" {
					domains = append(domains, m.Domain)
				}
			}
			slots++
			return slots < n
		})
	}
	walk(distinctNodes)
	if distinctNodes && slots < n && passedForDomain {
		walk(false)
	}
	return out
}

// Fingerprint names the ring that vnodes points per member and members make with the default
// hash, whatever their order: two rings with the same fingerprint give every key the same
// owner (replicas also depend on the members' nodes and domains, and on how many are asked,
// which it leaves out). Clients and servers of a job compare theirs (a server's hello
// carries it), since a client on another ring than its servers (another virtual_nodes,
// another list of servers) has files cached twice.
func Fingerprint(vnodes int, members []Member) string {
	if vnodes <= 0 {
		vnodes = DefaultVirtualNodes
	}
	ids := make([]string, len(members))
	for i, m := range members {
		ids[i] = m.ID
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)
	return fmt.Sprintf("virtual_nodes=%d servers=%d ids=%016x", vnodes, len(ids), DefaultHash(strings.Join(ids, "\x00")))
}
