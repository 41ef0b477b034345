package membership

// The readers' side of the membership: how a job's servers and the readers that talk to them
// directly share which servers are dead. Such readers are on nodes without a server of the
// job (a login node, a node of another job): they have no node server to read through, and
// they are not members (they neither probe nor are probed).
//
// The news rides on read requests and replies (ReadRequest and ReadReply in
// rpc/fitcache.thrift):
//
//   - A reader that declares a server dead (or sees it answer again) queues the news for every
//     other server ([Outbox.Tell]) and sends it with its next read to each ([Outbox.Take]:
//     the request's dead and alive lists, with the newest version it heard from that server).
//   - A server records the news ([DeadView.Apply]) and passes a death on to the servers'
//     membership ([Membership]), which spreads it to every server of the job. What the
//     membership finds itself is recorded in the same view (rpc.Handler.Learn).
//   - To a reader whose version is older than its own, a server answers with the servers its
//     view holds dead ([DeadView.Since]); the reader takes those as dead too when the version
//     is newer than the last it heard from that server ([Outbox.Heard]).

import (
	"sort"
	"sync"
)

// DeadView is a server's view of which servers of the job its readers found dead, with a version
// bumped at each change. It is safe for concurrent use.
type DeadView struct {
	mu      sync.Mutex // protects version and dead
	version int64
	dead    map[string]bool
}

// Apply records reported deaths and rejoins and returns the resulting version.
func (v *DeadView) Apply(dead, alive []string) int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.dead == nil {
		v.dead = map[string]bool{}
	}
	for _, id := range dead {
		if !v.dead[id] {
			v.dead[id] = true
			v.version++
		}
	}
	for _, id := range alive {
		if v.dead[id] {
			delete(v.dead, id)
			v.version++
		}
	}
	return v.version
}

// Since returns the version and, if the caller's version is older, the dead servers (sorted).
func (v *DeadView) Since(version int64) (int64, []string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if version >= v.version {
		return v.version, nil
	}
	out := make([]string, 0, len(v.dead))
	for id := range v.dead {
		out = append(out, id)
	}
	sort.Strings(out)
	return v.version, out
}

// Outbox is a client's side of the gossip with one server: the news about other servers not
// yet told to it, and the newest version of its view the client heard. It is safe for
// concurrent use.
type Outbox struct {
	mu          sync.Mutex // protects all below
	heard       int64
	dead, alive map[string]bool
}

// Tell queues news about another server: found dead, or answering again.
func (o *Outbox) Tell(id string, dead bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.dead == nil {
		o.dead, o.alive = map[string]bool{}, map[string]bool{}
	}
	if dead {
		o.dead[id] = true
		delete(o.alive, id)
	} else {
		o.alive[id] = true
		delete(o.dead, id)
	}
}

// Take returns what to send with the next request (the version heard, the news) and empties
// the queue; a request that does not get through gives its news back with Tell.
func (o *Outbox) Take() (version int64, dead, alive []string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for id := range o.dead {
		dead = append(dead, id)
	}
	for id := range o.alive {
		alive = append(alive, id)
	}
	o.dead, o.alive = nil, nil
	return o.heard, dead, alive
}

// Heard records the version of a reply and reports whether it is newer than the last one
// heard: only then is its list of dead servers news.
func (o *Outbox) Heard(version int64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if version <= o.heard {
		return false
	}
	o.heard = version
	return true
}
