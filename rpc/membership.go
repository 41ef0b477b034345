package rpc

import (
	"sort"
	"sync"
)

// membership is a server's view of which servers of the job its clients found dead. Clients
// report deaths and rejoins on their read requests; the server hands its view to clients whose
// version is older, so that one client's timeouts spare the others theirs. It is safe for
// concurrent use.
type membership struct {
	mu      sync.Mutex // protects version and dead
	version int64
	dead    map[string]bool
}

// apply records reported deaths and rejoins and returns the resulting version.
func (m *membership) apply(dead, alive []string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dead == nil {
		m.dead = map[string]bool{}
	}
	for _, id := range dead {
		if !m.dead[id] {
			m.dead[id] = true
			m.version++
		}
	}
	for _, id := range alive {
		if m.dead[id] {
			delete(m.dead, id)
			m.version++
		}
	}
	return m.version
}

// since returns the version and, if the caller's version is older, the dead servers.
func (m *membership) since(version int64) (int64, []string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if version >= m.version {
		return m.version, nil
	}
	out := make([]string, 0, len(m.dead))
	for id := range m.dead {
		out = append(out, id)
	}
	sort.Strings(out)
	return m.version, out
}

// Membership returns the version of the ring membership this server's clients reported
// (one per change: a server found dead or back) and the servers they report dead.
func (h *Handler) Membership() (version int64, dead []string) { return h.members.since(-1) }
